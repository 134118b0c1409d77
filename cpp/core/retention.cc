// Retention: the rule (retention.h). A pure decision: no I/O (run_dir_actions.cc acts on it).
#include "retention.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>


namespace alpsck {

namespace {

std::string Num(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

void Add(std::string* rules, const std::string& rule) {
  if (!rules->empty()) *rules += ", ";
  *rules += rule;
}

}  // namespace

Status ParseKeepBest(const std::string& text, RetentionPolicy* p) {
  p->best_metric.clear();
  p->best_max = false;
  p->keep_best = 0;
  if (text.empty()) return Status::Ok();
  const std::string form = "keep_best is '" + text + "': it must read METRIC:min:K or METRIC:max:K (K >= 1)";
  const size_t b = text.rfind(':');
  if (b == std::string::npos || b == 0) return Status::Invalid(form);
  const size_t a = text.rfind(':', b - 1);
  if (a == std::string::npos || a == 0) return Status::Invalid(form);
  const std::string metric = text.substr(0, a), mode = text.substr(a + 1, b - a - 1), k = text.substr(b + 1);
  if (mode != "min" && mode != "max") return Status::Invalid(form + " (the mode is '" + mode + "')");
  if (k.empty() || k.size() > 9 || k.find_first_not_of("0123456789") != std::string::npos || std::atol(k.c_str()) < 1)
    return Status::Invalid(form + " (K is '" + k + "')");
  Status s = CheckMetrics({{metric, 0.0}});  // the names a save may record
  if (!s.ok()) return Status::Invalid("keep_best names metric '" + metric + "': " + s.message());
  p->best_metric = metric;
  p->best_max = mode == "max";
  p->keep_best = static_cast<uint32_t>(std::atol(k.c_str()));
  return Status::Ok();
}

Status CheckRetention(const RetentionPolicy& p) {
  if (!(p.keep_every_seconds >= 0) || std::isinf(p.keep_every_seconds))
    return Status::Invalid("keep_every_seconds is " + Num(p.keep_every_seconds) + ": it must be a finite number >= 0");
  if (p.keep_last == 0) {
    const char* moot = p.keep_every_steps ? "keep_every_steps" : p.keep_every_seconds > 0 ? "keep_every_seconds"
                       : p.keep_best ? "keep_best" : nullptr;
    if (moot)
      return Status::Invalid(std::string(moot) + " is set, but keep_last is 0, which keeps every checkpoint: "
                             "give keep_last >= 1 for " + moot + " to keep anything beyond it");
  }
  return Status::Ok();
}

std::string Unhealthy(const Metrics& metrics, const std::string& flagged) {
  std::string why = NonFiniteMetrics(metrics);
  if (!flagged.empty()) why = why.empty() ? flagged : why + "; " + flagged;
  return why;
}

std::vector<std::string> DecideRetention(const RetentionPolicy& p, const std::vector<RetainedStep>& steps) {
  const size_t n = steps.size();
  std::vector<std::string> rules(n);
  if (p.keep_last == 0) {
    for (std::string& r : rules) r = "keep_last 0 (keep all)";
    return rules;
  }
  // Rule by rule, in the order they are printed.
  for (size_t i = 0; i < n; ++i)
    if (steps[i].pinned) Add(&rules[i], "pinned");
  for (size_t i = n; i-- > 0;)
    if (Unhealthy(steps[i].metrics, steps[i].flagged).empty()) {
      Add(&rules[i], "newest healthy");
      break;
    }
  for (size_t i = n > p.keep_last ? n - p.keep_last : 0; i < n; ++i) Add(&rules[i], "keep_last " + std::to_string(p.keep_last));
  if (p.keep_every_steps)
    for (size_t i = 0; i < n; ++i)
      if (steps[i].step % p.keep_every_steps == 0) Add(&rules[i], "keep_every_steps " + std::to_string(p.keep_every_steps));
  if (p.keep_every_seconds > 0) {
    bool any = false;
    double last = 0;
    for (size_t i = 0; i < n; ++i)
      if (!any || steps[i].created >= last + p.keep_every_seconds) {
        Add(&rules[i], "keep_every_seconds " + Num(p.keep_every_seconds));
        any = true;
        last = steps[i].created;
      }
  }
  if (p.keep_best) {
    std::vector<std::pair<double, size_t>> ranked;  // (value, index) of those with a finite value
    for (size_t i = 0; i < n; ++i)
      for (const auto& m : steps[i].metrics)
        if (m.first == p.best_metric) {
          if (std::isfinite(m.second)) ranked.emplace_back(m.second, i);
          break;
        }
    std::sort(ranked.begin(), ranked.end(), [&](const auto& a, const auto& b) {
      if (a.first != b.first) return p.best_max ? a.first > b.first : a.first < b.first;
      return a.second > b.second;  // a tie: the newer step
    });
    for (size_t r = 0; r < ranked.size() && r < p.keep_best; ++r)
      Add(&rules[ranked[r].second], "keep_best " + p.best_metric + " " + (p.best_max ? "max" : "min") + " " +
                                        std::to_string(p.keep_best) + " (#" + std::to_string(r + 1) + ")");
  }
  return rules;
}

}  // namespace alpsck
