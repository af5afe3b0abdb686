// The list scheduler of zb-auto (zb_pipeline/schedule/generators/zb_auto.py), compiled.
//
// `Searcher` holds one cost view (per-rank costs, memory deltas, caps) and runs passes of the list scheduler over
// it; each pass also scores its plan with the as-soon-as-possible timing of the simulator (`evaluate`).  Both
// mirror list_schedule_py and evaluate_py operation for operation (same event order, same floating-point
// expressions), so they give identical plans, spans and scores; tests/test_zb_auto.py checks that.
// Built as zb_pipeline.schedule._zb_auto_cpp.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <queue>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kEps = 1e-9;
using Plans = std::vector<std::vector<int>>;

class Searcher {
 public:
  Searcher(int m, std::vector<double> f, std::vector<double> b, std::vector<double> w, double c,
           std::vector<double> mf, std::vector<double> mb, std::vector<double> mw, std::vector<double> cap)
      : m_(m), p_(static_cast<int>(f.size())), f_(std::move(f)), b_(std::move(b)), w_(std::move(w)), c_(c),
        mf_(std::move(mf)), mb_(std::move(mb)), mw_(std::move(mw)), cap_(std::move(cap)) {
    if (m_ < 1 || p_ < 1) throw std::invalid_argument("zb-auto: need m >= 1 and at least one rank");
    for (const auto* v : {&b_, &w_, &mf_, &mb_, &mw_, &cap_}) {
      if (static_cast<int>(v->size()) != p_) throw std::invalid_argument("zb-auto: per-rank arrays differ in length");
    }
    const size_t n = static_cast<size_t>(p_) * m_;
    f_end_.assign(n, kInf);
    b_end_.assign(n, kInf);
    plans_.assign(p_, {});
    for (auto& v : plans_) v.reserve(3 * static_cast<size_t>(m_));
  }

  // One pass: (span, score, work); the plan stays in plans_.  span = inf when the pass was cut (its lower bound on
  // some rank's span went above `cut`); score = the ASAP makespan of the plan (inf when cut).
  std::tuple<double, double, long> run(const std::vector<int>& warm, const std::vector<int>& ahead,
                                       const std::vector<int>& lag, double theta_w, bool f_fits, bool guard,
                                       bool is_static, double cut) {
    const int p = p_, m = m_;
    if (static_cast<int>(warm.size()) != p || static_cast<int>(ahead.size()) != p ||
        static_cast<int>(lag.size()) != p)
      throw std::invalid_argument("zb-auto: policy arrays must have one entry per rank");
    const auto& f = f_;
    const auto& b = b_;
    const auto& w = w_;
    const double c = c_;
    std::fill(f_end_.begin(), f_end_.end(), kInf);
    std::fill(b_end_.begin(), b_end_.end(), kInf);
    for (auto& v : plans_) v.clear();
    std::vector<int> nf(p, 0), nb(p, 0), nw(p, 0);
    std::vector<double> mem(p, 0.0), free_at(p, 0.0), first(p, kInf), wake(p, kInf), rem(p);
    for (int r = 0; r < p; ++r) rem[r] = m * (f[r] + b[r] + w[r]);
    long work = 0;
    using Item = std::pair<double, int>;  // (time, -rank): earliest first, then the higher rank
    std::priority_queue<Item, std::vector<Item>, std::greater<Item>> heap;
    heap.push({0.0, 0});
    wake[0] = 0.0;
    const int last = p - 1;
    auto FE = [&](int r, int j) -> double& { return f_end_[static_cast<size_t>(r) * m + j]; };
    auto BE = [&](int r, int j) -> double& { return b_end_[static_cast<size_t>(r) * m + j]; };
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
        f_room = mem[r] + mf_[r] + std::max(0.0, mb_[r]) <= cap_[r] + kEps && (k > 0 || j < warm[r]);
      }
      const bool has_w = nw[r] < k;
      int act = -1;  // 0 F, 1 B, 2 W
      double nxt = kInf;
      if (is_static) {
        const bool want_f = j < m && j - k < warm[r];
        const bool fits = mem[r] + mf_[r] + std::max(0.0, mb_[r]) <= cap_[r] + kEps;
        if (has_w && (k - nw[r] > lag[r] || (want_f && !fits))) {
          act = 2;
        } else if (want_f && fits) {
          if (tf <= t) act = 0;
          else nxt = tf;
        } else if (k < j) {
          if (tb <= t) act = (has_w && mem[r] + mb_[r] > cap_[r] + kEps) ? 2 : 1;
          else nxt = tb;
        } else if (has_w) {
          act = 2;
        }
      } else {
        const bool f_now = f_room && tf <= t;
        if (tb <= t && !(f_now && j - k < ahead[r])) {
          act = (has_w && mem[r] + mb_[r] > cap_[r] + kEps) ? 2 : 1;
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
          nxt = tb > t ? tb : kInf;
          if (f_room && t < tf && tf < nxt) nxt = tf;
        }
      }
      if (act < 0) {  // wait for the next arrival we know of; others notify us when they are decided
        if (nxt < kInf) {
          wake[r] = nxt;
          heap.push({nxt, -r});
        }
        continue;
      }
      ++work;
      double end;
      if (act == 0) {
        end = t + f[r];
        FE(r, j) = end;
        nf[r] = j + 1;
        mem[r] += mf_[r];
        rem[r] -= f[r];
        plans_[r].push_back(j);
        if (first[r] == kInf) first[r] = t;
        const int q = r + 1;
        if (q < p && nf[q] == j) {  // the next rank may be waiting for this activation
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
        mem[r] += mb_[r];
        rem[r] -= b[r];
        plans_[r].push_back(m + k);
        const int q = r - 1;
        if (q >= 0 && nb[q] == k && nf[q] > k) {  // the previous rank may be waiting for this gradient
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
        mem[r] += mw_[r];
        rem[r] -= w[r];
        plans_[r].push_back(2 * m + i);
      }
      free_at[r] = end;
      if (end - first[r] + rem[r] > cut) return {kInf, kInf, work};
      if (end < wake[r]) {
        wake[r] = end;
        heap.push({end, -r});
      }
    }
    double span = 0.0;
    for (int r = 0; r < p; ++r) {
      if (nw[r] != m) {
        if (is_static) return {kInf, kInf, work};  // a fixed order that deadlocks cannot serve
        throw std::runtime_error("zb-auto list scheduler stalled on rank " + std::to_string(r));
      }
      span = std::max(span, free_at[r] - first[r]);
    }
    return {span, evaluate(plans_), work};
  }

  // ASAP makespan of fixed per-rank plans under this view's costs (mirrors evaluate_py).
  double evaluate(const Plans& plans) {
    double span = 0.0;
    for (double s : spans(plans)) span = std::max(span, s);
    return span;
  }

  // Per-rank spans of fixed plans under the ASAP timing (mirrors spans_py).
  std::vector<double> spans(const Plans& plans) {
    const int p = p_, m = m_;
    if (static_cast<int>(plans.size()) != p) throw std::invalid_argument("zb-auto: one plan per rank expected");
    std::fill(f_end_.begin(), f_end_.end(), kInf);
    std::fill(b_end_.begin(), b_end_.end(), kInf);
    auto FE = [&](int r, int j) -> double& { return f_end_[static_cast<size_t>(r) * m + j]; };
    auto BE = [&](int r, int j) -> double& { return b_end_[static_cast<size_t>(r) * m + j]; };
    std::vector<size_t> pos(p, 0);
    std::vector<double> clock(p, 0.0), first(p, kInf);
    int remaining = p;
    while (remaining) {
      bool progressed = false;
      remaining = 0;
      for (int r = 0; r < p; ++r) {
        const auto& plan = plans[r];
        size_t i = pos[r];
        double t = clock[r];
        while (i < plan.size()) {
          const int code = plan[i];
          const int kind = code / m, j = code % m;
          if (code < 0 || kind > 2) throw std::invalid_argument("zb-auto: bad action code in plan");
          double dep, s;
          if (kind == 0) {
            dep = (r == 0) ? 0.0 : FE(r - 1, j) + c_;
            if (dep == kInf) break;
            s = std::max(t, dep);
            t = s + f_[r];
            FE(r, j) = t;
          } else if (kind == 1) {
            dep = (r == p - 1) ? FE(r, j) : std::max(FE(r, j), BE(r + 1, j) + c_);
            if (dep == kInf) break;
            s = std::max(t, dep);
            t = s + b_[r];
            BE(r, j) = t;
          } else {
            dep = BE(r, j);
            if (dep == kInf) break;
            s = std::max(t, dep);
            t = s + w_[r];
          }
          if (first[r] == kInf) first[r] = s;
          ++i;
        }
        if (i != pos[r]) progressed = true;
        pos[r] = i;
        clock[r] = t;
        if (i < plan.size()) ++remaining;
      }
      if (remaining && !progressed)
        throw std::invalid_argument("plan can never finish: every unfinished rank waits on another");
    }
    std::vector<double> out(p);
    for (int r = 0; r < p; ++r) out[r] = clock[r] - first[r];
    return out;
  }

  const Plans& plans() const { return plans_; }

 private:
  int m_, p_;
  std::vector<double> f_, b_, w_;
  double c_;
  std::vector<double> mf_, mb_, mw_, cap_;
  std::vector<double> f_end_, b_end_;
  Plans plans_;
};

}  // namespace

PYBIND11_MODULE(_zb_auto_cpp, mod) {
  mod.doc() = "zb-auto's list scheduler and plan scorer (mirror zb_auto.list_schedule_py and zb_auto.evaluate_py)";
  py::class_<Searcher>(mod, "Searcher")
      .def(py::init<int, std::vector<double>, std::vector<double>, std::vector<double>, double, std::vector<double>,
                    std::vector<double>, std::vector<double>, std::vector<double>>(),
           py::arg("m"), py::arg("f"), py::arg("b"), py::arg("w"), py::arg("c"), py::arg("mem_f"), py::arg("mem_b"),
           py::arg("mem_w"), py::arg("cap"))
      .def(
          "run",
          [](Searcher& s, const std::vector<int>& warm, const std::vector<int>& ahead, const std::vector<int>& lag,
             double theta_w, bool f_fits, bool guard, bool is_static, bool want_plan, double cut) -> py::object {
            std::tuple<double, double, long> res;
            {
              py::gil_scoped_release release;
              res = s.run(warm, ahead, lag, theta_w, f_fits, guard, is_static, cut);
            }
            const auto [span, score, work] = res;
            py::object plans = py::none();
            if (want_plan && span < kInf) plans = py::cast(s.plans());
            return py::make_tuple(plans, span, score, work);
          },
          "One pass: (plans or None, span, ASAP score, actions simulated); span = score = inf when cut.",
          py::arg("warm"), py::arg("ahead"), py::arg("lag"), py::arg("theta_w"), py::arg("f_fits"), py::arg("guard"),
          py::arg("is_static"), py::arg("want_plan"), py::arg("cut"))
      .def(
          "evaluate",
          [](Searcher& s, const Plans& plans) {
            py::gil_scoped_release release;
            return s.evaluate(plans);
          },
          "ASAP makespan of fixed per-rank plans (codes kind * m + microbatch) under this view's costs.",
          py::arg("plans"))
      .def(
          "spans",
          [](Searcher& s, const Plans& plans) {
            py::gil_scoped_release release;
            return s.spans(plans);
          },
          "Per-rank ASAP spans of fixed plans; ValueError when they deadlock.", py::arg("plans"));
}
