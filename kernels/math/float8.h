#pragma once
// Float8: eight floats as one value (GCC/Clang vector extension) for the CPU loops: one AVX register, two
// SSE ones in the baseline clone. The loops are written with it because GCC's own vectorization of them
// was 2-4x slower than torch's kernels. Host-only: nvcc never sees it.
#include <cmath>
#include <cstring>

namespace gpuops::math {

using Float8 = float __attribute__((vector_size(32)));

inline Float8 load8(const float* p) {
  Float8 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

inline void store8(float* p, Float8 x) { std::memcpy(p, &x, sizeof x); }

/// Lane by lane: with -fno-math-errno this compiles to one vector square root.
inline Float8 sqrt_of(Float8 x) {
  Float8 r;
  for (int k = 0; k < 8; ++k) r[k] = std::sqrt(x[k]);
  return r;
}

}  // namespace gpuops::math
