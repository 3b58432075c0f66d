#pragma once
// Block-wise 8-bit optimizer states (issue 32): each block of kQuantBlock consecutive elements keeps one float32
// scale (its largest magnitude) and one byte per element, the index of the nearest value in a 256-entry code
// book of [-1, 1] (first moments) or [0, 1] (second moments). The element math is shared by the CPU loop and
// the CUDA kernel, which then give the same bits: a division, comparisons and a NaN-propagating maximum, each
// rounded as IEEE says on both. docs/architecture.md, "8-bit optimizer states", says why the dynamic code book.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include "hd.h"

namespace gpuops::math {

inline constexpr int kQuantBlock = 256;  ///< elements per scale, as bitsandbytes' and torchao's 8-bit optimizers
inline constexpr int kCodes = 256;

/// A code book: the values (ascending) and the 255 decision thresholds between neighbours, each the float32
/// rounding of their exact midpoint, then +inf (so that a search of 256 entries needs no bound check). An
/// element's code is the number of thresholds below its normalised value: the nearest value, a tie going to
/// the lower one.
struct CodeBook {
  float value[kCodes];
  float threshold[kCodes];
};

/// The dynamic ("tree") code book of Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (ICLR
/// 2022): 0, 1 and, for each decade e = 0..6, values 10^(e-6) x the midpoints of equal steps from 0.1 to 1:
/// 2^e steps per sign when signed (127 per sign), 2^(e+1) when not (254). Seven decades of range, with the
/// most codes near the block's largest magnitude, where a linear code book has them all.
inline CodeBook dynamic_code_book(bool is_signed) {
  std::vector<double> values{0.0, 1.0};
  for (int e = 0; e < 7; ++e) {
    const int steps = is_signed ? (1 << e) : (2 << e);
    const double decade = std::pow(10.0, e - 6);
    for (int k = 0; k < steps; ++k) {
      const double lo = 0.1 + 0.9 * k / steps, hi = 0.1 + 0.9 * (k + 1) / steps;
      values.push_back(decade * (lo + hi) / 2);
      if (is_signed) values.push_back(-decade * (lo + hi) / 2);
    }
  }
  std::sort(values.begin(), values.end());
  CodeBook book{};
  for (int i = 0; i < kCodes; ++i) book.value[i] = static_cast<float>(values[i]);
  for (int i = 0; i + 1 < kCodes; ++i)
    book.threshold[i] = static_cast<float>((static_cast<double>(book.value[i]) + book.value[i + 1]) / 2);
  book.threshold[kCodes - 1] = INFINITY;
  return book;
}

/// The larger of two magnitudes, NaN when either is: a block holding a NaN keeps it (as a float32 state does).
GPUOPS_HD float magnitude_max(float a, float b) { return (a > b || a != a) ? a : b; }

/// The code of `x` (a value, not yet normalised) in a block of scale `scale`: the count of thresholds below
/// x / scale, by a branch-free binary search of eight steps (no mispredicted branches on the CPU, no divergent
/// ones on the GPU). A zero scale (an all-zero block) gives the code of 0; NaN gives code 0.
GPUOPS_HD uint8_t encode(const float* threshold, float x, float scale) {
  x = scale == 0.0f ? 0.0f : x / scale;
  int below = 0;  // thresholds [0, below) are < x
  for (int step = kCodes / 2; step > 0; step /= 2) below += threshold[below + step - 1] < x ? step : 0;
  return static_cast<uint8_t>(below);
}

GPUOPS_HD float decode(const float* value, uint8_t code, float scale) { return value[code] * scale; }

}  // namespace gpuops::math
