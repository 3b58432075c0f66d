#pragma once
// Error reporting shared by every layer.
//
// Two families, one per dependency level:
//  - GPUOPS_CHECK_ARG: throws gpuops::ArgumentError (a std::invalid_argument). Used by the torch-free
//    parts (estimator, CLI), so they build and run without LibTorch; pybind11 maps it to ValueError.
//  - Code that links LibTorch uses the TORCH_CHECK family directly (TORCH_CHECK_VALUE -> ValueError).
// Either way the message names the argument, the value received and what is accepted.

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace gpuops {

/// Bad user input: the message names the argument, the value and the accepted range.
class ArgumentError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace gpuops

/// Throws gpuops::ArgumentError with an fmt-formatted message when `cond` is false.
#define GPUOPS_CHECK_ARG(cond, ...)                                  \
  do {                                                               \
    if (!(cond)) throw ::gpuops::ArgumentError(fmt::format(__VA_ARGS__)); \
  } while (0)
