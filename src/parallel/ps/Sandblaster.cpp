#include "dtrain/parallel/ps/Sandblaster.h"

#include <cmath>
#include <deque>

#include "dtrain/common/Error.h"

namespace dtrain::parallel::ps {

namespace {

VectorOp zero(const std::string& v) { return {VectorOp::Zero, v, "", 0.0}; }
VectorOp copy(const std::string& dst, const std::string& src) {
  return {VectorOp::Copy, dst, src, 0.0};
}
VectorOp scale(const std::string& v, double alpha) { return {VectorOp::Scale, v, "", alpha}; }
VectorOp axpy(const std::string& dst, double alpha, const std::string& src) {
  return {VectorOp::Axpy, dst, src, alpha};
}
VectorOp dot(const std::string& a, const std::string& b) { return {VectorOp::Dot, a, b, 0.0}; }

struct Pair {
  std::string s, y;
  double rho = 0.0;
};

}  // namespace

LbfgsCoordinator::LbfgsCoordinator(PsClient& client, LbfgsOptions options)
    : client_(client), options_(options) {
  DTRAIN_CHECK_INPUT(options_.history >= 1 && options_.history <= 100,
                     "L-BFGS history must be 1 to 100 pairs, got ", options_.history);
  DTRAIN_CHECK_INPUT(options_.max_iterations >= 1, "L-BFGS needs at least one iteration");
}

std::vector<double> LbfgsCoordinator::ops(const std::vector<VectorOp>& batch) {
  ++commands_;
  return client_.vector_ops(batch);
}

LbfgsResult LbfgsCoordinator::run(const LossEvaluation& evaluate,
                                  const IterationCallback& on_iteration) {
  LbfgsResult result;
  auto evaluate_at_x = [&] {
    ++result.evaluations;
    VectorOp open = zero("g");
    open.round = ++rounds_;
    ops({open});
    double f = evaluate(open.round);
    if (options_.weight_decay > 0) {
      f += 0.5 * options_.weight_decay *
           ops({axpy("g", options_.weight_decay, "x"), dot("x", "x")})[0];
    }
    DTRAIN_CHECK(std::isfinite(f), "Sandblaster: the loss is not finite (", f, ")");
    return f;
  };
  double f = evaluate_at_x();
  double gg = ops({dot("g", "g")})[0];
  std::deque<Pair> history;  // oldest first
  std::vector<std::string> free_slots;
  // One slot more than the history: a new pair is computed into a free slot and the oldest
  // pair is dropped only once the new one is kept.
  for (int i = options_.history; i >= 0; --i) free_slots.push_back(concat(i));
  double gamma = 1.0;
  result.loss = f;
  result.grad_norm = std::sqrt(gg);
  if (result.grad_norm <= options_.tolerance_grad) {
    result.stop_reason = "gradient below tolerance";
    return result;
  }
  for (int iteration = 0; iteration < options_.max_iterations; ++iteration) {
    // The direction d = -H g by the two-loop recursion, on the shards.
    std::vector<double> alpha(history.size());
    if (history.empty()) {
      ops({copy("d", "g"), scale("d", -1.0)});
    } else {
      std::vector<VectorOp> batch{copy("d", "g")};
      for (size_t k = history.size(); k-- > 0;) {  // newest to oldest
        batch.push_back(dot(history[k].s, "d"));
        alpha[k] = history[k].rho * ops(batch)[0];
        batch = {axpy("d", -alpha[k], history[k].y)};
      }
      batch.push_back(scale("d", gamma));
      for (size_t k = 0; k < history.size(); ++k) {  // oldest to newest
        batch.push_back(dot(history[k].y, "d"));
        const double beta = history[k].rho * ops(batch)[0];
        batch = {axpy("d", alpha[k] - beta, history[k].s)};
      }
      batch.push_back(scale("d", -1.0));
      ops(batch);
    }
    double gd = ops({dot("g", "d")})[0];
    if (!(gd < 0)) {  // not a descent direction (curvature went wrong): start over from -g
      for (const auto& pair : history) free_slots.push_back(pair.s.substr(1));
      history.clear();
      ops({copy("d", "g"), scale("d", -1.0)});
      gd = -gg;
    }
    // Backtracking line search along d from x, Armijo's condition; the first step is
    // scaled to the gradient (as torch.optim.LBFGS does), later ones start at 1.
    double t = iteration == 0 ? std::min(1.0, 1.0 / std::sqrt(gg)) : 1.0;
    ops({copy("xp", "x"), copy("gp", "g")});
    const double f_previous = f;
    bool accepted = false;
    for (int trial = 0; trial < options_.max_line_search; ++trial) {
      ops({copy("x", "xp"), axpy("x", t, "d")});
      f = evaluate_at_x();
      if (f <= f_previous + options_.armijo * t * gd) {
        accepted = true;
        break;
      }
      t *= 0.5;
    }
    if (!accepted) {
      ops({copy("x", "xp"), copy("g", "gp")});
      f = f_previous;
      result.stop_reason = "the line search found no decrease";
      break;
    }
    // The new pair s = x - xp, y = g - gp, kept when its curvature y.s is positive.
    const std::string slot = free_slots.back();
    const std::string s = "s" + slot, y = "y" + slot;
    const std::vector<double> dots =
        ops({copy(s, "x"), axpy(s, -1.0, "xp"), copy(y, "g"), axpy(y, -1.0, "gp"), dot(y, s),
             dot(y, y), dot("g", "g")});
    const double ys = dots[0], yy = dots[1];
    gg = dots[2];
    if (ys > 1e-10 * std::max(1.0, yy)) {
      free_slots.pop_back();
      history.push_back({s, y, 1.0 / ys});
      if (static_cast<int>(history.size()) > options_.history) {
        free_slots.push_back(history.front().s.substr(1));
        history.pop_front();
      }
      gamma = ys / yy;
    }
    result.iterations = iteration + 1;
    result.losses.push_back(f);
    result.loss = f;
    result.grad_norm = std::sqrt(gg);
    if (on_iteration) on_iteration(result);
    if (result.grad_norm <= options_.tolerance_grad) {
      result.stop_reason = "gradient below tolerance";
      break;
    }
    if (std::abs(f - f_previous) <= options_.tolerance_change * std::max(1.0, std::abs(f))) {
      result.stop_reason = "loss change below tolerance";
      break;
    }
  }
  if (result.stop_reason.empty()) result.stop_reason = "iteration limit";
  result.loss = f;
  return result;
}

}  // namespace dtrain::parallel::ps
