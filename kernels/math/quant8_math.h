#pragma once
// Block-wise 8-bit optimizer states (issue 32): each block of kQuantBlock consecutive elements keeps one float32
// scale (its largest magnitude) and one byte per element, the index of the nearest value in a 256-entry code
// book of [-1, 1] (first moments) or [0, 1] (second moments). The element math is shared by the CPU loop and
// the CUDA kernel, which then give the same bits: a division, comparisons and a NaN-propagating maximum, each
// rounded as IEEE says on both. docs/architecture.md, "8-bit optimizer states", says why the dynamic code book.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "hd.h"

namespace gpuops::math {

inline constexpr int kQuantBlock = 256;  ///< elements per scale, as bitsandbytes' and torchao's 8-bit optimizers
inline constexpr int kCodes = 256;

/// Buckets of normalised values by their float32 bits: sign, exponent and 5 mantissa bits, for |x| from 2^-23
/// to 1 (the normalised range: x = value / the block's largest magnitude), one bucket per sign for anything
/// smaller (no threshold lies below 2^-23 in magnitude), and one for NaN.
inline constexpr int kMinExponent = 104;  ///< 2^(104 - 127) = 2^-23
inline constexpr int kMantissaBits = 5;
inline constexpr int kBucketsPerSign = (127 - kMinExponent + 2) << kMantissaBits;
inline constexpr int kNanBucket = 2 * kBucketsPerSign;
inline constexpr int kBucketSpan = 4;  ///< thresholds inside one bucket, at most (checked when a book is made)

/// A code book: the values (ascending); the 255 decision thresholds between neighbours, each the float32
/// rounding of their exact midpoint, padded with +inf; and per bucket of normalised values, the count of
/// thresholds below the bucket. An element's code is the number of thresholds below its normalised value: the
/// nearest value, a tie going to the lower one.
struct CodeBook {
  float value[kCodes];
  float threshold[kCodes + kBucketSpan];
  int32_t below_bucket[kNanBucket + 1];  ///< (+1 for NaN; int32: the CPU loop gathers it 8 at a time)
};

GPUOPS_HD uint32_t bits_of(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  return __builtin_bit_cast(uint32_t, x);  // (a memcpy here kept GCC from vectorising the encode loop)
#endif
}

/// The bucket of a normalised value (|x| <= 1, or NaN).
GPUOPS_HD int bucket_of(float x) {
  const uint32_t bits = bits_of(x);
  const int sign = static_cast<int>(bits >> 31), exponent = static_cast<int>((bits >> 23) & 0xFF);
  if (exponent > 127) return kNanBucket;  // NaN (inf cannot be a normalised value)
  const int row = exponent < kMinExponent ? 0 : exponent - kMinExponent + 1;
  const int mantissa = exponent < kMinExponent ? 0 : static_cast<int>((bits >> (23 - kMantissaBits)) & 31);
  return sign * kBucketsPerSign + (row << kMantissaBits) + mantissa;
}

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
  for (int i = kCodes - 1; i < kCodes + kBucketSpan; ++i) book.threshold[i] = INFINITY;
  // Each bucket's count of thresholds below its lowest value; every value of a bucket then has its code within
  // the next kBucketSpan thresholds (a bucket holding more would throw here, not encode wrongly).
  std::vector<float> lowest(kNanBucket, INFINITY), highest(kNanBucket, -INFINITY);
  for (uint32_t bits = 0;; bits += 1u << (23 - kMantissaBits)) {  // the first float of every mantissa step
    for (uint32_t last : {bits, bits | ((1u << (23 - kMantissaBits)) - 1)}) {
      float x;
      std::memcpy(&x, &last, sizeof x);
      for (float v : {x, -x}) {
        if (std::fabs(v) > 1.0f) continue;
        const int b = bucket_of(v);
        lowest[b] = std::min(lowest[b], v);
        highest[b] = std::max(highest[b], v);
      }
    }
    if (bits >= 0x3F800000u) break;  // 1.0
  }
  for (int b = 0; b < kNanBucket; ++b) {
    const float* t = book.threshold;
    const int below = static_cast<int>(std::lower_bound(t, t + kCodes - 1, lowest[b]) - t);
    const int inside = static_cast<int>(std::upper_bound(t, t + kCodes - 1, highest[b]) - t) - below;
    if (inside > kBucketSpan) throw std::logic_error("quant8_math.h: a bucket holds more than kBucketSpan thresholds");
    book.below_bucket[b] = lowest[b] <= highest[b] ? below : 0;
  }
  book.below_bucket[kNanBucket] = 0;  // NaN: no threshold is below it
  return book;
}

/// The larger of two magnitudes, NaN when either is: a block holding a NaN keeps it (as a float32 state does).
GPUOPS_HD float magnitude_max(float a, float b) { return (a > b || a != a) ? a : b; }

/// The code of `x` (a value, not yet normalised) in a block of scale `scale`: the count of thresholds below
/// x / scale, as its bucket's count plus those of the next kBucketSpan thresholds below it (a table load and
/// four comparisons, no search). A zero scale (an all-zero block) gives the code of 0; NaN gives code 0.
GPUOPS_HD uint8_t encode(const CodeBook& book, float x, float scale) {
  x = scale == 0.0f ? 0.0f : x / scale;
  const int first = book.below_bucket[bucket_of(x)];
  int below = first;
  for (int j = 0; j < kBucketSpan; ++j) below += book.threshold[first + j] < x ? 1 : 0;
  return static_cast<uint8_t>(below);
}

GPUOPS_HD float decode(const float* value, uint8_t code, float scale) { return value[code] * scale; }

}  // namespace gpuops::math
