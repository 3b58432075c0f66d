#pragma once
// Built-in architectures with the values of their Hugging Face config.json files.

#include <string>
#include <string_view>
#include <vector>

#include "gpuops/estimator/model_spec.h"

namespace gpuops::estimator {

/// The preset called `name` (case-insensitive); ArgumentError listing the accepted names otherwise.
ModelSpec preset(std::string_view name);

/// Names of every preset, in catalog order.
std::vector<std::string> preset_names();

}  // namespace gpuops::estimator
