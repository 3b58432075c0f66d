// The `gpuops` command line embedded in a C++ program: gpuops::run_cli takes the arguments and two
// streams, and returns the exit status (0, 2 for bad input, 1 when the output cannot be written).
// Built by tests/python/test_find_package.py, which so checks that libgpuops exports run_cli.
#include <iostream>
#include <string>
#include <vector>

#include <gpuops/cli.h>

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) args = {"estimate", "--model", "gpt2", "--seq", "1024", "--recommend"};
  return gpuops::run_cli(args, std::cout, std::cerr);
}
