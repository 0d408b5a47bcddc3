// ControllerSettings from the LGRECO_* parameters (config/params.h).
#pragma once

#include "config/params.h"
#include "controller/controller.h"

namespace lgreco::controller {

// Maps the parameters to settings and checks the rules between them (the schedule's).
// `rank` fills %r in LGRECO_DECISION_LOG. Throws std::invalid_argument naming the
// LGRECO_* parameters at fault; the cost model stays empty (the engine measures it).
ControllerSettings settings_from_params(const config::Params& params, int rank);

}  // namespace lgreco::controller
