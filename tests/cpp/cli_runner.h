#pragma once
// Runs the `gpuops` command line in-process (gpuops::run_cli) for the CLI tests.
#include <sstream>
#include <string>
#include <vector>

#include "gpuops/cli.h"
#include "gpuops/estimator.h"

namespace gpuops::testing {

struct CliResult {
  int code;
  std::string out, err;
};

inline CliResult run_cli(const std::vector<std::string>& args) {
  std::ostringstream out, err;
  const int code = gpuops::run_cli(args, out, err);
  return {code, out.str(), err.str()};
}

/// The arguments on one line, undecodable bytes shown as \xNN (for failure messages).
inline std::string joined(const std::vector<std::string>& args) {
  std::string s;
  for (const auto& a : args) s += estimator::printable(a) + " ";
  return s;
}

}  // namespace gpuops::testing
