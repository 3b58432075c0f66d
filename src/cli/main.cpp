// The native `gpuops` binary: everything is in run_cli (src/cli/cli.cpp).
#include <iostream>
#include <string>
#include <vector>

#include "gpuops/cli.h"

int main(int argc, char** argv) {
  return gpuops::run_cli(std::vector<std::string>(argv + 1, argv + argc), std::cout, std::cerr);
}
