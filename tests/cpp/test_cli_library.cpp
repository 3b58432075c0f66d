// gpuops::run_cli is declared in the public gpuops/cli.h: this program links only the gpuops library
// (not the CLI's object files, as test_estimator does), so it fails to link if libgpuops does not export it.
#include <gtest/gtest.h>

#include <sstream>

#include "gpuops/cli.h"

TEST(CliLibrary, RunCliIsExportedByTheLibrary) {
  std::ostringstream out, err;
  EXPECT_EQ(gpuops::run_cli({"presets"}, out, err), 0) << err.str();
  EXPECT_NE(out.str().find("llama-2-7b"), std::string::npos);
  std::ostringstream out2, err2;
  EXPECT_EQ(gpuops::run_cli({"estimate", "--model", "nope"}, out2, err2), 2);
  EXPECT_EQ(err2.str().rfind("gpuops: error: ", 0), 0u) << err2.str();
}
