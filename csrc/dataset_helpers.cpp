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

}  // namespace

PYBIND11_MODULE(_helpers_cpp, m) {
  m.doc() = "C++ index builders for megatron.data (use megatron.data.helpers, which falls back to NumPy)";
  m.def("build_sample_index", &build_sample_index, py::arg("sizes"), py::arg("doc_index"), py::arg("seq_length"),
        py::arg("num_samples"),
        "[(doc_index position, token offset)] of tokens 0, S, 2S, ..., num_samples*S; int64 [num_samples + 1, 2]");
  m.def("build_blending_indices", &build_blending_indices, py::arg("weights"), py::arg("size"),
        "(dataset_index int16 [size], dataset_sample_index int64 [size]) by greedy largest deficit");
}
