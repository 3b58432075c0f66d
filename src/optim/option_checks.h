#pragma once
// How the option checks of the optimizers, the scaler and the accumulator word a refusal. The Python classes
// call the same checks through gpuops._C, so both languages say the same thing; values print as Python's
// repr does, so that where torch checks an option our message contains torch's ("Invalid learning rate: -1.0").
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <c10/util/Exception.h>

namespace gpuops::detail {

/// A double as Python's repr prints it: the shortest digits that read back to it, in positional notation
/// for exponents in [-4, 16) (with ".0" when integral), else as "1e-05" / "1.5e+16"; "inf", "nan".
inline std::string py_repr(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  int digits = 1;
  for (; digits < 17; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*e", digits - 1, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::snprintf(buf, sizeof buf, "%.*e", digits - 1, v);
  const int exponent = std::atoi(std::strchr(buf, 'e') + 1);
  if (exponent < -4 || exponent >= 16) return buf;
  std::snprintf(buf, sizeof buf, "%.*f", std::max(digits - 1 - exponent, 0), v);
  std::string s = buf;
  if (s.find('.') == std::string::npos) s += ".0";
  return s;
}

inline std::string py_repr(int64_t v) { return std::to_string(v); }

/// Throws c10::ValueError "<where>: <invalid>: <value> (<rule>)" unless ok, e.g.
/// "AdamW: Invalid learning rate: nan (lr must be a finite number >= 0)".
template <typename T>
void check_option(bool ok, const std::string& where, const char* invalid, T value, const std::string& rule) {
  TORCH_CHECK_VALUE(ok, where, ": ", invalid, ": ", py_repr(value), " (", rule, ")");
}

/// Whether v is a whole number in [low, high] (doubles from a checkpoint that must be counters).
inline bool is_integer_in(double v, double low, double high) {
  return std::isfinite(v) && v == std::floor(v) && v >= low && v <= high;
}

}  // namespace gpuops::detail
