// The list scheduler of zb-auto (zb_pipeline/schedule/generators/zb_auto.py), compiled.
//
// It mirrors list_schedule_py operation for operation (same event order, same floating-point expressions), so
// both give identical plans; tests/test_zb_auto.py checks that.  Built as zb_pipeline.schedule._zb_auto_cpp.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <queue>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kEps = 1e-9;

struct Result {
  double makespan;
  std::vector<std::vector<int>> plans;
};

Result run(int m, const std::vector<double>& f, const std::vector<double>& b, const std::vector<double>& w, double c,
           const std::vector<double>& mf, const std::vector<double>& mb, const std::vector<double>& mw,
           const std::vector<double>& cap, const std::vector<int>& warm, const std::vector<int>& ahead,
           const std::vector<int>& lag, double theta_w, bool f_fits, bool guard, bool want_plan, double bound) {
  const int p = static_cast<int>(f.size());
  for (const auto* v : {&b, &w, &mf, &mb, &mw, &cap}) {
    if (static_cast<int>(v->size()) != p) throw std::invalid_argument("zb-auto: per-rank arrays differ in length");
  }
  if (static_cast<int>(warm.size()) != p || static_cast<int>(ahead.size()) != p || static_cast<int>(lag.size()) != p)
    throw std::invalid_argument("zb-auto: policy arrays must have one entry per rank");
  std::vector<double> f_end(static_cast<size_t>(p) * m, kInf), b_end(static_cast<size_t>(p) * m, kInf);
  std::vector<int> nf(p, 0), nb(p, 0), nw(p, 0);
  std::vector<double> mem(p, 0.0), free_at(p, 0.0), first(p, kInf), wake(p, kInf);
  Result res;
  if (want_plan) {
    res.plans.assign(p, {});
    for (auto& v : res.plans) v.reserve(3 * static_cast<size_t>(m));
  }
  using Item = std::pair<double, int>;  // (time, -rank): earliest first, then the higher rank
  std::priority_queue<Item, std::vector<Item>, std::greater<Item>> heap;
  heap.push({0.0, 0});
  wake[0] = 0.0;
  const int last = p - 1;
  auto FE = [&](int r, int j) -> double& { return f_end[static_cast<size_t>(r) * m + j]; };
  auto BE = [&](int r, int j) -> double& { return b_end[static_cast<size_t>(r) * m + j]; };
  while (!heap.empty()) {
    const double t = heap.top().first;
    const int r = -heap.top().second;
    heap.pop();
    if (t != wake[r]) continue;
    wake[r] = kInf;
    const int k = nb[r];
    double tb = kInf;
    if (k < nf[r]) tb = (r == last) ? FE(r, k) : std::max(FE(r, k), BE(r + 1, k) + c);
    const int j = nf[r];
    double tf = kInf;
    bool f_room = false;
    if (j < m) {
      tf = (r == 0) ? 0.0 : FE(r - 1, j) + c;
      f_room = mem[r] + mf[r] + std::max(0.0, mb[r]) <= cap[r] + kEps && (k > 0 || j < warm[r]);
    }
    const bool has_w = nw[r] < k;
    int act = -1;  // 0 F, 1 B, 2 W
    const bool f_now = f_room && tf <= t;
    if (tb <= t && !(f_now && j - k < ahead[r])) {
      act = (has_w && mem[r] + mb[r] > cap[r] + kEps) ? 2 : 1;
    } else if (has_w && k - nw[r] > lag[r]) {
      act = 2;
    } else if (f_now && (tb <= t || !f_fits || tb == kInf || t + f[r] <= tb)) {
      act = 0;
    } else if (has_w) {
      double due_b = tb;
      if (guard && due_b == kInf && k < j) due_b = std::max(t, free_at[r + 1]) + b[r + 1] + c;
      double due_f = kInf;
      if (f_room) {
        due_f = tf;
        if (guard && due_f == kInf) due_f = std::max(t, free_at[r - 1]) + f[r - 1] + c;
      }
      const double due = due_f < due_b ? due_f : due_b;
      if (due == kInf || t + w[r] <= due + theta_w * w[r]) act = 2;
    }
    if (act < 0) {
      double nxt = tb > t ? tb : kInf;
      if (f_room && t < tf && tf < nxt) nxt = tf;
      if (nxt < kInf) {
        wake[r] = nxt;
        heap.push({nxt, -r});
      }
      continue;
    }
    double end;
    if (act == 0) {
      end = t + f[r];
      FE(r, j) = end;
      nf[r] = j + 1;
      mem[r] += mf[r];
      if (want_plan) res.plans[r].push_back(j);
      if (first[r] == kInf) first[r] = t;
      const int q = r + 1;
      if (q < p && nf[q] == j) {
        const double at = std::max(end + c, free_at[q]);
        if (at < wake[q]) {
          wake[q] = at;
          heap.push({at, -q});
        }
      }
    } else if (act == 1) {
      end = t + b[r];
      BE(r, k) = end;
      nb[r] = k + 1;
      mem[r] += mb[r];
      if (want_plan) res.plans[r].push_back(m + k);
      const int q = r - 1;
      if (q >= 0 && nb[q] == k && nf[q] > k) {
        const double at = std::max(end + c, free_at[q]);
        if (at < wake[q]) {
          wake[q] = at;
          heap.push({at, -q});
        }
      }
    } else {
      end = t + w[r];
      const int i = nw[r];
      nw[r] = i + 1;
      mem[r] += mw[r];
      if (want_plan) res.plans[r].push_back(2 * m + i);
    }
    free_at[r] = end;
    if (end - first[r] > bound) {
      res.makespan = kInf;
      return res;
    }
    if (end < wake[r]) {
      wake[r] = end;
      heap.push({end, -r});
    }
  }
  double span = 0.0;
  for (int r = 0; r < p; ++r) {
    if (nw[r] != m)
      throw std::runtime_error("zb-auto list scheduler stalled on rank " + std::to_string(r));
    span = std::max(span, free_at[r] - first[r]);
  }
  res.makespan = span;
  return res;
}

}  // namespace

PYBIND11_MODULE(_zb_auto_cpp, mod) {
  mod.doc() = "zb-auto's list scheduler (mirrors zb_auto.list_schedule_py)";
  mod.def(
      "list_schedule",
      [](int m, const std::vector<double>& f, const std::vector<double>& b, const std::vector<double>& w, double c,
         const std::vector<double>& mf, const std::vector<double>& mb, const std::vector<double>& mw,
         const std::vector<double>& cap, const std::vector<int>& warm, const std::vector<int>& ahead,
         const std::vector<int>& lag, double theta_w, bool f_fits, bool guard, bool want_plan,
         double bound) -> py::object {
        Result res;
        {
          py::gil_scoped_release release;
          res = run(m, f, b, w, c, mf, mb, mw, cap, warm, ahead, lag, theta_w, f_fits, guard, want_plan, bound);
        }
        if (!want_plan) return py::make_tuple(py::none(), res.makespan);
        return py::make_tuple(py::cast(res.plans), res.makespan);
      },
      py::arg("m"), py::arg("f"), py::arg("b"), py::arg("w"), py::arg("c"), py::arg("mem_f"), py::arg("mem_b"),
      py::arg("mem_w"), py::arg("cap"), py::arg("warm"), py::arg("ahead"), py::arg("lag"), py::arg("theta_w"),
      py::arg("f_fits"), py::arg("guard"), py::arg("want_plan"), py::arg("bound") = kInf);
}
