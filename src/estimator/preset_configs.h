#pragma once
// Presets read from config.json text (the model families of docs/estimator.md "Model families").

#include <string_view>

#include "gpuops/estimator/model_spec.h"

namespace gpuops::estimator {

/// The preset `name` (one of the names in preset_configs.cpp), parsed from its config.json values.
ModelSpec preset_from_config(std::string_view name);

}  // namespace gpuops::estimator
