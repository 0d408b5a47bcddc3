#include "controller/settings.h"

#include <stdexcept>
#include <string>

namespace lgreco::controller {

ControllerSettings settings_from_params(const config::Params& p, int rank) {
  ControllerSettings s;
  s.alpha = p.alpha;
  if (!parse_objective(p.objective, &s.objective))
    throw std::invalid_argument("LGRECO_OBJECTIVE=" + p.objective + ": not an objective");
  if (!parse_metric(p.error_metric, &s.metric))
    throw std::invalid_argument("LGRECO_ERROR_METRIC=" + p.error_metric + ": not a metric");
  s.schedule = ScheduleSettings{p.warmup, p.period, p.window, p.switch_lag, p.probe_lead};
  s.budget_loop = p.budget_loop;
  if (const std::string e = config::schedule_error(p); !e.empty()) throw std::invalid_argument(e);
  s.solver.tolerance = p.solver_tolerance;
  if (!p.decision_log.empty()) {
    std::string error;
    if (!config::expand_path_pattern(p.decision_log, "hpr", rank, &s.decision_log_path, &error))
      throw std::invalid_argument("LGRECO_DECISION_LOG=" + p.decision_log + ": " + error);
  }
  return s;
}

}  // namespace lgreco::controller
