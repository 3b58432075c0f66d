#pragma once
// Reading the optimizers' options from torch::save archives.
#include <ATen/core/ivalue.h>
#include <torch/serialize/input-archive.h>

namespace gpuops::optim::detail {

/// `capturable` came after the first saved optimizers: an archive without it means false.
template <typename Options>
void read_capturable(torch::serialize::InputArchive& archive, Options& options) {
  c10::IValue value;
  options.capturable(archive.try_read("capturable", value) && value.toBool());
}

}  // namespace gpuops::optim::detail
