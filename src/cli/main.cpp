// The native `gpuops` binary: everything is in run_cli (src/cli/cli.cpp).
#include <csignal>
#include <iostream>
#include <string>
#include <vector>

#include "gpuops/cli.h"

int main(int argc, char** argv) {
  // A closed pipe is an output error like a full disk (exit 1, one line), as from `python -m gpuops.cli`,
  // not a silent death by SIGPIPE.
  std::signal(SIGPIPE, SIG_IGN);
  return gpuops::run_cli(std::vector<std::string>(argv + 1, argv + argc), std::cout, std::cerr);
}
