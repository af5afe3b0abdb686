// Index builders for megatron/data (GPT sample index, blending index), exposed to Python with pybind11.
//
// megatron/data/helpers.py wraps these with type checks and holds the NumPy implementations they must match
// exactly (tests compare the arrays element by element).

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

template <typename DocT>
py::array_t<int64_t> sample_index_impl(const py::array_t<int32_t, py::array::c_style>& sizes,
                                       const py::array_t<DocT, py::array::c_style>& doc_index, int64_t seq_length,
                                       int64_t num_samples) {
  // Row j = (position in doc_index, token offset inside that sequence) of token j * seq_length of the token
  // stream sizes[doc_index[0]], sizes[doc_index[1]], ...  Sequences of length 0 are stepped over.
  if (seq_length <= 0) throw std::invalid_argument("seq_length must be > 0");
  if (num_samples < 0) throw std::invalid_argument("num_samples must be >= 0");
  const int32_t* sz = sizes.data();
  const DocT* docs = doc_index.data();
  const int64_t num_sizes = sizes.shape(0);
  const int64_t num_docs = doc_index.shape(0);
  for (int64_t i = 0; i < num_docs; ++i) {
    if (docs[i] < 0 || static_cast<int64_t>(docs[i]) >= num_sizes)
      throw std::out_of_range("doc_index holds a sequence id outside sizes");
  }
  py::array_t<int64_t> out({num_samples + 1, static_cast<int64_t>(2)});
  int64_t* rows = out.mutable_data();
  bool ran_out = false;
  {
    py::gil_scoped_release release;
    int64_t pos = 0;        // position in doc_index
    int64_t doc_start = 0;  // stream offset of the first token of doc_index[pos]
    for (int64_t j = 0; j <= num_samples; ++j) {
      const int64_t target = j * seq_length;
      while (pos < num_docs && doc_start + sz[docs[pos]] <= target) {
        doc_start += sz[docs[pos]];
        ++pos;
      }
      if (pos >= num_docs) {
        ran_out = true;
        break;
      }
      rows[2 * j] = pos;
      rows[2 * j + 1] = target - doc_start;
    }
  }
  if (ran_out) throw std::invalid_argument("the token stream is shorter than num_samples * seq_length + 1");
  return out;
}

py::array_t<int64_t> build_sample_index(const py::array& sizes, const py::array& doc_index, int64_t seq_length,
                                        int64_t num_samples) {
  auto sizes32 = py::array_t<int32_t, py::array::c_style>::ensure(sizes);
  if (!sizes32) throw std::invalid_argument("sizes must be convertible to int32");
  if (py::isinstance<py::array_t<int32_t>>(doc_index)) {
    return sample_index_impl<int32_t>(sizes32, py::array_t<int32_t, py::array::c_style>::ensure(doc_index),
                                      seq_length, num_samples);
  }
  auto docs64 = py::array_t<int64_t, py::array::c_style>::ensure(doc_index);
  if (!docs64) throw std::invalid_argument("doc_index must be an integer array");
  return sample_index_impl<int64_t>(sizes32, docs64, seq_length, num_samples);
}

py::tuple build_blending_indices(const py::array_t<double, py::array::c_style | py::array::forcecast>& weights,
                                 int64_t size) {
  // Greedy: sample i goes to the dataset whose count lags its share weights[d] * (i + 1) the most (lowest d on
  // ties), so every prefix of the blend is within one sample of the exact proportions.
  const int64_t k = weights.shape(0);
  if (k <= 0 || k > 32767) throw std::invalid_argument("need 1..32767 weights");
  if (size < 0) throw std::invalid_argument("size must be >= 0");
  const double* w = weights.data();
  py::array_t<int16_t> dataset_index(size);
  py::array_t<int64_t> dataset_sample_index(size);
  int16_t* di = dataset_index.mutable_data();
  int64_t* dsi = dataset_sample_index.mutable_data();
  {
    py::gil_scoped_release release;
    std::vector<int64_t> counts(k, 0);
    for (int64_t i = 0; i < size; ++i) {
      const double target = static_cast<double>(i + 1);
      int64_t best = 0;
      double best_err = w[0] * target - static_cast<double>(counts[0]);
      for (int64_t d = 1; d < k; ++d) {
        const double err = w[d] * target - static_cast<double>(counts[d]);
        if (err > best_err) {
          best_err = err;
          best = d;
        }
      }
      di[i] = static_cast<int16_t>(best);
      dsi[i] = counts[best]++;
    }
  }
  return py::make_tuple(dataset_index, dataset_sample_index);
}

template <typename TokT>
py::array_t<int64_t> gather_impl(const py::array_t<TokT, py::array::c_style>& tokens,
                                 const py::array_t<int64_t, py::array::c_style>& offsets,
                                 const py::array_t<int32_t, py::array::c_style>& lengths,
                                 const py::array_t<int64_t, py::array::c_style>& doc_index,
                                 const py::array_t<int64_t, py::array::c_style>& starts, int64_t sample_tokens) {
  // starts[b] = (position in doc_index, offset): copy sample_tokens tokens from there into row b.
  const int64_t batch = starts.shape(0);
  py::array_t<int64_t> out({batch, sample_tokens});
  const TokT* tok = tokens.data();
  const int64_t* off = offsets.data();
  const int32_t* len = lengths.data();
  const int64_t* docs = doc_index.data();
  const int64_t* st = starts.data();
  const int64_t n_docs = doc_index.shape(0), n_seq = lengths.shape(0), n_tok = tokens.shape(0);
  int64_t* o = out.mutable_data();
  bool bad = false;
  {
    py::gil_scoped_release release;
    for (int64_t b = 0; b < batch && !bad; ++b) {
      int64_t pos = st[2 * b], within = st[2 * b + 1], filled = 0;
      int64_t* row = o + b * sample_tokens;
      while (filled < sample_tokens) {
        if (pos < 0 || pos >= n_docs || docs[pos] < 0 || docs[pos] >= n_seq) { bad = true; break; }
        const int64_t seq = docs[pos];
        int64_t take = static_cast<int64_t>(len[seq]) - within;
        if (take > sample_tokens - filled) take = sample_tokens - filled;
        if (take > 0) {
          const int64_t begin = off[seq] + within;
          if (begin < 0 || begin + take > n_tok) { bad = true; break; }
          for (int64_t i = 0; i < take; ++i) row[filled + i] = static_cast<int64_t>(tok[begin + i]);
          filled += take;
        }
        ++pos;
        within = 0;
      }
    }
  }
  if (bad) throw std::out_of_range("sample runs outside the dataset (inconsistent index arrays)");
  return out;
}

py::array_t<int64_t> gather_samples(const py::array& tokens, const py::array_t<int64_t, py::array::c_style>& offsets,
                                    const py::array_t<int32_t, py::array::c_style>& lengths,
                                    const py::array_t<int64_t, py::array::c_style>& doc_index,
                                    const py::array_t<int64_t, py::array::c_style>& starts, int64_t sample_tokens) {
  if (py::isinstance<py::array_t<uint16_t>>(tokens))
    return gather_impl<uint16_t>(py::array_t<uint16_t, py::array::c_style>::ensure(tokens), offsets, lengths, doc_index,
                                 starts, sample_tokens);
  if (py::isinstance<py::array_t<int32_t>>(tokens))
    return gather_impl<int32_t>(py::array_t<int32_t, py::array::c_style>::ensure(tokens), offsets, lengths, doc_index,
                                starts, sample_tokens);
  throw std::invalid_argument("gather_samples supports uint16 and int32 tokens");
}

// Reads GPT samples one at a time (or a batch) for GPTDataset.tokens: holds the dataset's arrays, so a call costs
// one index lookup and one copy instead of the several NumPy scalar reads and slices of the Python loop.
// Sample k = sample_tokens tokens of the stream doc_index[...], from row shuffle_index[k] of sample_index.
class SampleReader {
 public:
  SampleReader(py::array tokens, py::array_t<int64_t, py::array::c_style> offsets,
               py::array_t<int32_t, py::array::c_style> lengths, py::array doc_index,
               py::array_t<int64_t, py::array::c_style> sample_index,
               py::array_t<int64_t, py::array::c_style> shuffle_index, int64_t sample_tokens)
      : tokens_(tokens), offsets_(offsets), lengths_(lengths), sample_index_(sample_index),
        shuffle_index_(shuffle_index), sample_tokens_(sample_tokens) {
    if (sample_tokens <= 0) throw std::invalid_argument("sample_tokens must be > 0");
    if (!(tokens.flags() & py::array::c_style) || tokens.ndim() != 1)
      throw std::invalid_argument("tokens must be a contiguous 1-d array");
    if (sample_index.ndim() != 2 || sample_index.shape(1) != 2)
      throw std::invalid_argument("sample_index must have shape [rows, 2]");
    if (offsets.shape(0) != lengths.shape(0)) throw std::invalid_argument("offsets and lengths differ in size");
    const auto kind = tokens.dtype().kind();
    const auto size = tokens.dtype().itemsize();
    if (kind == 'u' && size == 1) tok_type_ = U8;
    else if (kind == 'u' && size == 2) tok_type_ = U16;
    else if (kind == 'i' && size == 1) tok_type_ = I8;
    else if (kind == 'i' && size == 2) tok_type_ = I16;
    else if (kind == 'i' && size == 4) tok_type_ = I32;
    else if (kind == 'i' && size == 8) tok_type_ = I64;
    else throw std::invalid_argument("tokens must be an integer array of 1, 2, 4 or 8 bytes");
    if (py::isinstance<py::array_t<int32_t>>(doc_index)) {
      docs32_ = py::array_t<int32_t, py::array::c_style>::ensure(doc_index);
      doc32_ = true;
    } else {
      docs64_ = py::array_t<int64_t, py::array::c_style>::ensure(doc_index);
      if (!docs64_) throw std::invalid_argument("doc_index must be an int32 or int64 array");
    }
    n_docs_ = doc_index.shape(0);
    n_tok_ = tokens.shape(0);
  }

  int64_t num_samples() const { return shuffle_index_.shape(0); }

  py::array_t<int64_t> get(int64_t k) const {
    py::array_t<int64_t> out(sample_tokens_);
    if (!fill(k, out.mutable_data())) throw std::out_of_range("sample index out of range (or inconsistent index arrays)");
    return out;
  }

  py::array_t<int64_t> get_batch(const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& ks) const {
    const int64_t batch = ks.size();
    py::array_t<int64_t> out({batch, sample_tokens_});
    const int64_t* kp = ks.data();
    int64_t* o = out.mutable_data();
    bool ok = true;
    {
      py::gil_scoped_release release;
      for (int64_t b = 0; b < batch && ok; ++b) ok = fill(kp[b], o + b * sample_tokens_);
    }
    if (!ok) throw std::out_of_range("sample index out of range (or inconsistent index arrays)");
    return out;
  }

 private:
  enum TokType { U8, U16, I8, I16, I32, I64 };

  template <typename T>
  static void copy(const void* base, int64_t begin, int64_t n, int64_t* dst) {
    const T* src = static_cast<const T*>(base) + begin;
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<int64_t>(src[i]);
  }

  int64_t doc_at(int64_t pos) const { return doc32_ ? docs32_.data()[pos] : docs64_.data()[pos]; }

  bool fill(int64_t k, int64_t* row) const {
    if (k < 0 || k >= shuffle_index_.shape(0)) return false;
    const int64_t r = shuffle_index_.data()[k];
    if (r < 0 || r >= sample_index_.shape(0)) return false;
    int64_t pos = sample_index_.data()[2 * r], within = sample_index_.data()[2 * r + 1], filled = 0;
    const int64_t* off = offsets_.data();
    const int32_t* len = lengths_.data();
    const int64_t n_seq = lengths_.shape(0);
    const void* tok = tokens_.data();
    while (filled < sample_tokens_) {
      if (pos < 0 || pos >= n_docs_) return false;
      const int64_t seq = doc_at(pos);
      if (seq < 0 || seq >= n_seq) return false;
      int64_t take = static_cast<int64_t>(len[seq]) - within;
      if (take > sample_tokens_ - filled) take = sample_tokens_ - filled;
      if (take > 0) {
        const int64_t begin = off[seq] + within;
        if (within < 0 || begin < 0 || begin + take > n_tok_) return false;
        int64_t* dst = row + filled;
        switch (tok_type_) {
          case U8: copy<uint8_t>(tok, begin, take, dst); break;
          case U16: copy<uint16_t>(tok, begin, take, dst); break;
          case I8: copy<int8_t>(tok, begin, take, dst); break;
          case I16: copy<int16_t>(tok, begin, take, dst); break;
          case I32: copy<int32_t>(tok, begin, take, dst); break;
          case I64: copy<int64_t>(tok, begin, take, dst); break;
        }
        filled += take;
      }
      ++pos;
      within = 0;
    }
    return true;
  }

  py::array tokens_;
  py::array_t<int64_t, py::array::c_style> offsets_;
  py::array_t<int32_t, py::array::c_style> lengths_;
  py::array_t<int32_t, py::array::c_style> docs32_;  // the one of docs32_/docs64_ that doc32_ names
  py::array_t<int64_t, py::array::c_style> docs64_;
  bool doc32_ = false;
  py::array_t<int64_t, py::array::c_style> sample_index_;
  py::array_t<int64_t, py::array::c_style> shuffle_index_;
  int64_t sample_tokens_;
  int64_t n_docs_ = 0, n_tok_ = 0;
  TokType tok_type_ = U16;
};

}  // namespace

PYBIND11_MODULE(_helpers_cpp, m) {
  m.doc() = "C++ index builders for megatron.data (use megatron.data.helpers, which falls back to NumPy)";
  m.def("build_sample_index", &build_sample_index, py::arg("sizes"), py::arg("doc_index"), py::arg("seq_length"),
        py::arg("num_samples"),
        "[(doc_index position, token offset)] of tokens 0, S, 2S, ..., num_samples*S; int64 [num_samples + 1, 2]");
  m.def("build_blending_indices", &build_blending_indices, py::arg("weights"), py::arg("size"),
        "(dataset_index int16 [size], dataset_sample_index int64 [size]) by greedy largest deficit");
  m.def("gather_samples", &gather_samples, py::arg("tokens"), py::arg("offsets"), py::arg("lengths"),
        py::arg("doc_index"), py::arg("starts"), py::arg("sample_tokens"),
        "int64 [len(starts), sample_tokens]: the tokens of each sample start (doc_index position, offset)");
  py::class_<SampleReader>(m, "SampleReader",
                           "GPT samples by index: get(k) -> int64 [sample_tokens], get_batch(ks) -> [len(ks), ...]")
      .def(py::init<py::array, py::array_t<int64_t, py::array::c_style>, py::array_t<int32_t, py::array::c_style>,
                    py::array, py::array_t<int64_t, py::array::c_style>, py::array_t<int64_t, py::array::c_style>,
                    int64_t>(),
           py::arg("tokens"), py::arg("offsets"), py::arg("lengths"), py::arg("doc_index"), py::arg("sample_index"),
           py::arg("shuffle_index"), py::arg("sample_tokens"))
      .def("get", &SampleReader::get, py::arg("k"))
      .def("get_batch", &SampleReader::get_batch, py::arg("ks"))
      .def_property_readonly("num_samples", &SampleReader::num_samples);
}
