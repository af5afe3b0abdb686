// The V schedules' passes (zb_pipeline/schedule/generators/v_shape_alternate.py and v_shape_block.py), compiled.
//
// `alternate` mirrors v_shape_alternate._Pass, `block_order` / `order_floors` / `squeeze` mirror the functions of
// the same names in v_shape_block, and `makespan` mirrors simulate.py's timing of a plan: same event order, same
// floating-point expressions, so both give identical plans and numbers (tests/test_v_fast.py checks that).  Plans go
// in and out as per-rank lists of codes (stage * m + microbatch) * 3 + kind, kind 0 F, 1 B, 2 W.
// Built as zb_pipeline.schedule._v_shape_cpp.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <queue>
#include <stdexcept>
#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kEps = 1e-9;
using Vec = std::vector<double>;
using Plans = std::vector<std::vector<int>>;
using Heap = std::priority_queue<std::pair<double, int>, std::vector<std::pair<double, int>>,
                                 std::greater<std::pair<double, int>>>;

struct Costs {
  int p, m, S;
  Vec f, b, w, mf, mb, mw;
  double c;
  std::vector<int> place;
  Costs(int p_, int m_, Vec f_, Vec b_, Vec w_, double c_, Vec mf_, Vec mb_, Vec mw_)
      : p(p_), m(m_), S(2 * p_), f(std::move(f_)), b(std::move(b_)), w(std::move(w_)), mf(std::move(mf_)),
        mb(std::move(mb_)), mw(std::move(mw_)), c(c_) {
    if (p < 1 || m < 1) throw std::invalid_argument("v-shape: need p >= 1 and m >= 1");
    for (const Vec* v : {&f, &b, &w, &mf, &mb, &mw})
      if (static_cast<int>(v->size()) != S) throw std::invalid_argument("v-shape: per-stage arrays must have 2p entries");
    place.resize(S);
    for (int s = 0; s < S; ++s) place[s] = s < p ? s : S - 1 - s;
  }
  int code(int s, int kind, int k) const { return (s * m + k) * 3 + kind; }
};

// ------------------------------------------------------------------------------------------- the alternating pass

class AltPass {
 public:
  AltPass(const Costs& cs, const Vec& caps, const std::vector<int>& reserve, double approve, int early_f,
          bool f1_wait)
      : cs_(cs), caps_(caps), reserve_(reserve), approve_(approve), early_f_(early_f), f1_wait_(f1_wait) {
    const int p = cs.p, m = cs.m, S = cs.S;
    if (static_cast<int>(caps.size()) != p || static_cast<int>(reserve.size()) != p)
      throw std::invalid_argument("v-shape: caps and reserve need one entry per rank");
    fin_.assign(static_cast<size_t>(S) * m, kInf);
    gin_.assign(static_cast<size_t>(S) * m, kInf);
    for (int k = 0; k < m; ++k) fin_[k] = 0.0;
    nF0_.assign(p, 0);
    nF1_.assign(p, 0);
    nB1_.assign(p, 0);
    nB0_.assign(p, 0);
    wq_.assign(p, {});
    wh_.assign(p, 0);
    mem_.assign(p, 0.0);
    free_.assign(p, 0.0);
    steady_.assign(p, false);
    b_turn_.assign(p, true);
    plans_.assign(p, {});
    for (int r = 0; r < p; ++r) heap_.push({0.0, r});
  }

  bool run() {
    while (!heap_.empty()) {
      const auto [t, r] = heap_.top();
      heap_.pop();
      if (free_[r] <= t + kEps) step(r, t);
    }
    for (const auto& pl : plans_)
      if (static_cast<int>(pl.size()) != 6 * cs_.m) return false;
    return true;
  }
  Plans& plans() { return plans_; }

 private:
  double& fin(int s, int k) { return fin_[static_cast<size_t>(s) * cs_.m + k]; }
  double& gin(int s, int k) { return gin_[static_cast<size_t>(s) * cs_.m + k]; }

  void emit(int r, int s, int kind, int k, double t) {
    const Costs& c = cs_;
    double end;
    if (kind == 0) {
      end = t + c.f[s];
      mem_[r] += c.mf[s];
      if (s < c.S - 1) {
        const int q = c.place[s + 1];
        const double at = end + (q != r ? c.c : 0.0);
        fin(s + 1, k) = at;
        heap_.push({at, q});
      } else {
        gin(s, k) = end;
      }
    } else if (kind == 1) {
      end = t + c.b[s];
      mem_[r] += c.mb[s];
      wq_[r].push_back({s, k});
      if (s > 0) {
        const int q = c.place[s - 1];
        const double at = end + (q != r ? c.c : 0.0);
        gin(s - 1, k) = at;
        heap_.push({at, q});
      }
    } else {
      end = t + c.w[s];
      mem_[r] += c.mw[s];
    }
    plans_[r].push_back(c.code(s, kind, k));
    free_[r] = end;
    heap_.push({end, r});
  }
  void do_w(int r, double t) {
    const auto [s, k] = wq_[r][wh_[r]];
    ++wh_[r];
    emit(r, s, 2, k, t);
  }
  void f1(int r, double t) {
    ++nF1_[r];
    emit(r, cs_.S - 1 - r, 0, nF1_[r] - 1, t);
  }
  void f0(int r, double t) {
    ++nF0_[r];
    emit(r, r, 0, nF0_[r] - 1, t);
  }
  bool wait_fill(int r, double t, double due, int pend) {
    if (!pend) return false;
    const int s = wq_[r][wh_[r]].first;
    if (due == kInf || t + cs_.w[s] <= due + kEps || due - t > approve_ * cs_.f[s]) {
      do_w(r, t);
      return true;
    }
    return false;
  }

  struct BCand {
    double at;
    int k, s;
  };

  void step(int r, double t) {
    const Costs& c = cs_;
    const int m = c.m, S = c.S;
    const double cap = caps_[r];
    const int s0 = r, s1 = S - 1 - r;
    const double a0 = c.mf[s0], a1 = c.mf[s1];
    const double mem = mem_[r];
    const int pend = static_cast<int>(wq_[r].size()) - wh_[r];
    const int nF0 = nF0_[r], nF1 = nF1_[r], nB1 = nB1_[r], nB0 = nB0_[r];
    BCand bc[2];
    int nbc = 0;
    if (nB1 < nF1) bc[nbc++] = {gin(s1, nB1), nB1, s1};
    if (nB0 < nB1) bc[nbc++] = {gin(s0, nB0), nB0, s0};
    bool any_ready = false;
    BCand best{0.0, 0, 0};
    double due_b = kInf;
    for (int i = 0; i < nbc; ++i) {
      due_b = std::min(due_b, bc[i].at);
      if (bc[i].at <= t + kEps) {
        // older microbatch first, then chunk 1 (the larger stage): min of (k, -s)
        if (!any_ready || bc[i].k < best.k || (bc[i].k == best.k && -bc[i].s < -best.s)) best = bc[i];
        any_ready = true;
      }
    }
    const bool f1_ready = nF1 < nF0 && fin(s1, nF1) <= t + kEps;
    const bool f0_ready = nF0 < m && fin(s0, nF0) <= t + kEps;
    if (!steady_[r]) {
      if (!any_ready) {
        if (f1_ready) {
          if (mem + a1 <= cap + kEps) f1(r, t);
          return;
        }
        if (f0_ready) {
          bool fits, room;
          if (nF1 == 0) {
            const double due_f1 = nF0 > 0 ? fin(s1, 0) : kInf;
            fits = t + c.f[s0] <= due_f1 + kEps;
            room = nF0 == 0 || mem + a0 + reserve_[r] * a1 <= cap + kEps;
          } else {
            fits = true;
            room = mem + a0 + a1 <= cap + kEps;
          }
          if (fits && room) f0(r, t);
        }
        return;
      }
      steady_[r] = true;
      b_turn_[r] = true;
    }
    const bool f_left = nF0 < m || nF1 < nF0;
    if (b_turn_[r] && nbc == 0 && f_left) b_turn_[r] = false;
    if (!b_turn_[r] && !f_left) b_turn_[r] = true;
    if (b_turn_[r]) {
      if (any_ready) {
        const int k = best.k, s = best.s;
        if (mem + c.mb[s] > cap + kEps && pend) {
          do_w(r, t);
          return;
        }
        if (s == s1)
          ++nB1_[r];
        else
          ++nB0_[r];
        emit(r, s, 1, k, t);
        b_turn_[r] = !f_left;
        return;
      }
      if (early_f_ && (due_b == kInf || due_b > t + kEps)) {
        if (f1_ready && mem + a1 <= cap + kEps) {
          f1(r, t);
          return;
        }
        const bool long_wait = due_b == kInf || due_b - t > approve_ * c.f[s0];
        if (early_f_ > 1 && f0_ready && long_wait && mem + a0 + a1 <= cap + kEps) {
          f0(r, t);
          return;
        }
      }
      if (nbc || !f_left) wait_fill(r, t, due_b, pend);
      return;
    }
    const bool f1_coming = f1_wait_ && nF1 < nF0 && fin(s1, nF1) < kInf;
    if (f1_ready || (f0_ready && !f1_coming)) {
      const bool one = f1_ready;
      const double a = one ? a1 : a0;
      if (mem + a > cap + kEps) {
        if (pend) {
          do_w(r, t);
        } else if (nbc) {
          b_turn_[r] = true;
          heap_.push({t, r});
        }
        return;
      }
      if (one)
        f1(r, t);
      else
        f0(r, t);
      b_turn_[r] = true;
      return;
    }
    const double due_f = std::min(nF1 < nF0 ? fin(s1, nF1) : kInf, (f1_coming || nF0 >= m) ? kInf : fin(s0, nF0));
    if (!wait_fill(r, t, due_f, pend) && any_ready && due_f == kInf) {
      b_turn_[r] = true;
      heap_.push({t, r});
    }
  }

  const Costs& cs_;
  const Vec& caps_;
  const std::vector<int>& reserve_;
  double approve_;
  int early_f_;
  bool f1_wait_;
  Vec fin_, gin_, mem_, free_;
  std::vector<int> nF0_, nF1_, nB1_, nB0_, wh_;
  std::vector<std::vector<std::pair<int, int>>> wq_;
  std::vector<bool> steady_, b_turn_;
  Plans plans_;
  Heap heap_;
};

// ------------------------------------------------------------------------------------------------ the block

// Each rank's F/B passes of m copies in start-time order: (stage, kind, microbatch) as a code without W.
std::vector<std::vector<std::tuple<int, int, int>>> block_order(const Costs& c, int m, const Vec& o_f, const Vec& o_b,
                                                                double period) {
  std::vector<std::vector<std::tuple<double, int, int, int, int>>> timed(c.p);
  for (int s = 0; s < c.S; ++s) {
    auto& lst = timed[c.place[s]];
    for (int k = 0; k < m; ++k) {
      lst.emplace_back(o_f[s] + k * period, k, 0, s, k);
      lst.emplace_back(o_b[s] + k * period, k, 1, s, k);
    }
  }
  std::vector<std::vector<std::tuple<int, int, int>>> out(c.p);
  for (int r = 0; r < c.p; ++r) {
    auto& lst = timed[r];
    std::sort(lst.begin(), lst.end());
    out[r].reserve(lst.size());
    for (const auto& e : lst) out[r].emplace_back(std::get<3>(e), std::get<2>(e), std::get<4>(e));
  }
  return out;
}

Vec order_floors(const Costs& c, int m, const Vec& o_f, const Vec& o_b, double period) {
  const auto orders = block_order(c, m, o_f, o_b, period);
  Vec out(c.p, 0.0);
  for (int r = 0; r < c.p; ++r) {
    double cur = 0.0, peak = 0.0;
    for (const auto& [s, kind, k] : orders[r]) {
      (void)k;
      if (kind == 0) {
        cur += c.mf[s];
        peak = std::max(peak, cur);
      } else {
        peak = std::max(peak, cur + c.mb[s]);
        cur += c.mb[s] + c.mw[s];
      }
    }
    out[r] = peak;
  }
  return out;
}

bool squeeze(const Costs& c, const std::vector<std::vector<std::tuple<int, int, int>>>& orders, const Vec& caps,
             bool fill, Plans& plans) {
  const int p = c.p, m = c.m, S = c.S;
  Vec f_end(static_cast<size_t>(S) * m, kInf), b_end(static_cast<size_t>(S) * m, kInf);
  std::vector<int> ptr(p, 0), wh(p, 0);
  Vec free(p, 0.0), mem(p, 0.0);
  std::vector<std::vector<std::pair<int, int>>> wq(p);
  plans.assign(p, {});
  Heap heap;
  for (int r = 0; r < p; ++r) heap.push({0.0, r});
  auto emit_w = [&](int r, double t) {
    const auto [s, k] = wq[r][wh[r]];
    ++wh[r];
    mem[r] += c.mw[s];
    plans[r].push_back(c.code(s, 2, k));
    free[r] = t + c.w[s];
    heap.push({free[r], r});
  };
  while (!heap.empty()) {
    const auto [t, r] = heap.top();
    heap.pop();
    if (free[r] > t + kEps) continue;
    const int pend = static_cast<int>(wq[r].size()) - wh[r];
    const auto& order = orders[r];
    if (ptr[r] == static_cast<int>(order.size())) {
      if (pend) emit_w(r, t);
      continue;
    }
    const auto [s, kind, k] = order[ptr[r]];
    double ready, dm;
    if (kind == 0) {
      ready = s == 0 ? 0.0 : f_end[static_cast<size_t>(s - 1) * m + k] + (c.place[s - 1] != r ? c.c : 0.0);
      dm = c.mf[s];
    } else {
      ready = f_end[static_cast<size_t>(s) * m + k];
      if (s < S - 1)
        ready = std::max(ready, b_end[static_cast<size_t>(s + 1) * m + k] + (c.place[s + 1] != r ? c.c : 0.0));
      dm = c.mb[s];
    }
    if (mem[r] + dm > caps[r] + kEps) {
      if (pend) {
        emit_w(r, t);
        continue;
      }
      return false;
    }
    if (ready <= t + kEps) {
      ++ptr[r];
      mem[r] += dm;
      const double end = t + (kind == 0 ? c.f[s] : c.b[s]);
      free[r] = end;
      heap.push({end, r});
      int q;
      if (kind == 0) {
        f_end[static_cast<size_t>(s) * m + k] = end;
        plans[r].push_back(c.code(s, 0, k));
        q = c.place[s < S - 1 ? s + 1 : s];
      } else {
        b_end[static_cast<size_t>(s) * m + k] = end;
        plans[r].push_back(c.code(s, 1, k));
        wq[r].push_back({s, k});
        if (s == 0) continue;
        q = c.place[s - 1];
      }
      heap.push({end + (q != r ? c.c : 0.0), q});
      continue;
    }
    if (pend && (fill || ready == kInf || t + c.w[wq[r][wh[r]].first] <= ready + kEps)) emit_w(r, t);
  }
  for (const auto& pl : plans)
    if (static_cast<int>(pl.size()) != 6 * m) return false;
  return true;
}

// ------------------------------------------------------------------------------------------------ timing

// What a timed run of a plan leaves: when each event happened (F ended, input gradient ready, W ended; -1: never),
// on which rank, each rank's first start and last end, and the end of each action of rank 0 (by plan position).
struct Timing {
  Vec done_time;
  std::vector<int> done_rank;
  Vec first, clock, ends0;
};

// simulate.py's timing of a plan of F/B/W codes; throws if it can never finish.
void run_plan(const Costs& c, const Plans& plans, Timing& tm) {
  const int p = c.p, m = c.m, S = c.S;
  if (static_cast<int>(plans.size()) != p) throw std::invalid_argument("v-shape: one plan per rank expected");
  const size_t n = static_cast<size_t>(S) * m * 3;
  Vec& done_time = tm.done_time;
  std::vector<int>& done_rank = tm.done_rank;
  done_time.assign(n, -1.0);
  done_rank.assign(n, 0);
  tm.first.assign(p, -1.0);
  tm.clock.assign(p, 0.0);
  tm.ends0.assign(plans[0].size(), 0.0);
  std::vector<std::vector<int>> waiting(n);
  std::vector<int> pos(p, 0), blocked(p, -1);
  Vec& clock = tm.clock;
  Vec& first = tm.first;
  std::vector<int> ready;
  for (int r = p - 1; r >= 0; --r) ready.push_back(r);
  const int step = 3 * m;
  while (!ready.empty()) {
    const int r = ready.back();
    ready.pop_back();
    blocked[r] = -1;
    const auto& acts = plans[r];
    int i = pos[r];
    double t_rank = clock[r];
    const int na = static_cast<int>(acts.size());
    while (i < na) {
      const int code = acts[i];
      const int kind = code % 3, sk = code / 3, s = sk / m;
      const int base = sk * 3;
      int dep1, dep2 = -1;
      double dur;
      if (kind == 0) {
        dep1 = s > 0 ? base - step : -1;
        dur = c.f[s];
      } else if (kind == 2) {
        dep1 = base + 1;
        dur = c.w[s];
      } else {
        dep1 = base;
        dep2 = s < S - 1 ? base + step + 1 : -1;
        dur = c.b[s];
      }
      double start = t_rank;
      bool stuck = false;
      for (int dep : {dep1, dep2}) {
        if (dep < 0) continue;
        double tt = done_time[dep];
        if (tt < 0) {
          waiting[dep].push_back(r);
          blocked[r] = dep;
          stuck = true;
          break;
        }
        if (done_rank[dep] != r) tt += c.c;
        if (tt > start) start = tt;
      }
      if (stuck) break;
      if (first[r] < 0) first[r] = start;
      const double end = start + dur;
      t_rank = end;
      if (r == 0) tm.ends0[i] = end;
      const int key = base + (kind == 0 ? 0 : kind == 1 ? 1 : 2);
      done_time[key] = end;
      done_rank[key] = r;
      if (!waiting[key].empty()) {
        for (int q : waiting[key]) ready.push_back(q);
        waiting[key].clear();
      }
      ++i;
    }
    pos[r] = i;
    clock[r] = t_rank;
  }
  for (int r = 0; r < p; ++r)
    if (blocked[r] >= 0) throw std::invalid_argument("v-shape: plan can never finish");
}

double span_of(const Plans& plans, const Timing& tm, int skip = -1) {
  double span = 0.0;
  for (int r = 0; r < static_cast<int>(plans.size()); ++r)
    if (r != skip && !plans[r].empty()) span = std::max(span, tm.clock[r] - tm.first[r]);
  return span;
}

// simulate.py's makespan (largest rank span) of a plan of F/B/W codes; throws if it can never finish.
double makespan(const Costs& c, const Plans& plans) {
  Timing tm;
  run_plan(c, plans, tm);
  return span_of(plans, tm);
}

// first_stage_tail.fill_first_stage_tail's re-ordering of rank 0's tail (stage 0 is on rank 0): the new makespan
// and rank 0's new plan in `out`, or -1 where that is not strictly shorter (then `out` is left as it was).
double tail_fill(const Costs& c, const Plans& plans, std::vector<int>& out) {
  const int m = c.m;
  const auto& acts = plans[0];
  const int na = static_cast<int>(acts.size());
  int cut = 0;
  for (int i = na - 1; i >= 0; --i) {
    const int kind = acts[i] % 3, s = acts[i] / 3 / m;
    if (kind == 0 || (kind == 1 && s > 0)) {
      cut = i + 1;
      break;
    }
  }
  if (cut == 0 || cut >= na - 1) return -1.0;
  Timing tm;
  run_plan(c, plans, tm);
  const double old = span_of(plans, tm);
  Vec bt = tm.done_time;  // input-gradient ready times; the suffix's own B's are not run yet
  std::vector<int> bs, ws;
  for (int i = cut; i < na; ++i) {
    if (acts[i] % 3 == 1) {
      bs.push_back(acts[i]);
      bt[acts[i]] = kInf;
    } else {
      ws.push_back(acts[i]);
    }
  }
  const double hop = c.place[1] != 0 ? c.c : 0.0;
  double t = tm.ends0[cut - 1];
  std::vector<int> tail;
  size_t ib = 0, iw = 0;
  while (ib < bs.size() || iw < ws.size()) {
    const int k = ib < bs.size() ? (bs[ib] / 3) % m : 0;
    const double rel_b = ib < bs.size() ? tm.done_time[(1 * m + k) * 3 + 1] + hop : kInf;
    const double rel_w = iw < ws.size() ? bt[ws[iw] - 1] : kInf;
    int a;
    double dur;
    if (ib < bs.size() && rel_b <= t + kEps) {
      a = bs[ib++];
      dur = c.b[0];
      bt[a] = t + dur;
    } else if (rel_w <= t + kEps) {
      a = ws[iw++];
      dur = c.w[a / 3 / m];
    } else {
      t = std::min(rel_b, rel_w);
      continue;
    }
    tail.push_back(a);
    t += dur;
  }
  const double fresh = std::max(span_of(plans, tm, 0), t - tm.first[0]);
  if (fresh >= old - kEps) return -1.0;
  out.assign(acts.begin(), acts.begin() + cut);
  out.insert(out.end(), tail.begin(), tail.end());
  return fresh;
}

Costs make_costs(int p, int m, Vec f, Vec b, Vec w, double comm, Vec mf, Vec mb, Vec mw) {
  return Costs(p, m, std::move(f), std::move(b), std::move(w), comm, std::move(mf), std::move(mb), std::move(mw));
}

// Costs for timing only (tail_fill, makespan, end_times): no memory deltas, so zeros per stage.
Costs timing_costs(int p, int m, Vec f, Vec b, Vec w, double comm) {
  const Vec zero(2 * static_cast<std::size_t>(std::max(p, 0)), 0.0);
  return make_costs(p, m, std::move(f), std::move(b), std::move(w), comm, zero, zero, zero);
}

}  // namespace

PYBIND11_MODULE(_v_shape_cpp, mod) {
  mod.doc() = "The V schedules' passes (mirror v_shape_alternate._Pass and v_shape_block's order, floor, squeeze)";
  mod.def(
      "alternate",
      [](int p, int m, Vec f, Vec b, Vec w, double comm, Vec mf, Vec mb, Vec mw, Vec caps, std::vector<int> reserve,
         double approve, int early_f, bool f1_wait) -> py::object {
        const Costs c = make_costs(p, m, std::move(f), std::move(b), std::move(w), comm, std::move(mf), std::move(mb),
                                   std::move(mw));
        AltPass pass(c, caps, reserve, approve, early_f, f1_wait);
        bool ok;
        {
          py::gil_scoped_release release;
          ok = pass.run();
        }
        if (!ok) return py::none();
        return py::cast(pass.plans());
      });
  mod.def("order_floors", [](int p, int m, Vec f, Vec b, Vec w, double comm, Vec mf, Vec mb, Vec mw, Vec o_f, Vec o_b,
                             double period) {
    const Costs c = make_costs(p, m, std::move(f), std::move(b), std::move(w), comm, std::move(mf), std::move(mb),
                               std::move(mw));
    return order_floors(c, m, o_f, o_b, period);
  });
  mod.def(
      "squeeze",
      [](int p, int m, Vec f, Vec b, Vec w, double comm, Vec mf, Vec mb, Vec mw, Vec caps, Vec o_f, Vec o_b,
         double period, bool fill) -> py::object {
        const Costs c = make_costs(p, m, std::move(f), std::move(b), std::move(w), comm, std::move(mf), std::move(mb),
                                   std::move(mw));
        Plans plans;
        bool ok;
        {
          py::gil_scoped_release release;
          ok = squeeze(c, block_order(c, m, o_f, o_b, period), caps, fill, plans);
        }
        if (!ok) return py::none();
        return py::cast(plans);
      });
  mod.def("squeeze_span", [](int p, int m, Vec f, Vec b, Vec w, double comm, Vec mf, Vec mb, Vec mw, Vec caps, Vec o_f,
                             Vec o_b, double period, bool fill) {
    const Costs c = make_costs(p, m, std::move(f), std::move(b), std::move(w), comm, std::move(mf), std::move(mb),
                               std::move(mw));
    py::gil_scoped_release release;
    Plans plans;
    if (!squeeze(c, block_order(c, m, o_f, o_b, period), caps, fill, plans)) return kInf;
    return makespan(c, plans);
  });
  mod.def("tail_fill", [](int p, int m, Vec f, Vec b, Vec w, double comm, const Plans& plans) -> py::object {
    const Costs c = timing_costs(p, m, std::move(f), std::move(b), std::move(w), comm);
    std::vector<int> out;
    double span;
    {
      py::gil_scoped_release release;
      span = tail_fill(c, plans, out);
    }
    if (span < 0) return py::none();
    return py::make_tuple(span, out);
  });
  mod.def("makespan", [](int p, int m, Vec f, Vec b, Vec w, double comm, const Plans& plans) {
    const Costs c = timing_costs(p, m, std::move(f), std::move(b), std::move(w), comm);
    py::gil_scoped_release release;
    return makespan(c, plans);
  });
  // (makespan, end time of every action by code): tip_hold's arrival times without a Python simulate.
  mod.def("end_times", [](int p, int m, Vec f, Vec b, Vec w, double comm, const Plans& plans) {
    const Costs c = timing_costs(p, m, std::move(f), std::move(b), std::move(w), comm);
    Timing tm;
    double span;
    {
      py::gil_scoped_release release;
      run_plan(c, plans, tm);
      span = span_of(plans, tm);
    }
    return py::make_tuple(span, tm.done_time);
  });
}
