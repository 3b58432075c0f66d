#pragma once
// Overflow-checked 64-bit arithmetic for the estimator's sizes. Element and byte counts are products of
// user input (batch x seq x heads x seq ...); a wrapped product would print a negative or tiny estimate
// with exit 0, so every size multiplies and adds through these, and estimate_memory turns the error into
// one naming the argument that is too large.

#include <cstdint>
#include <string>

#include "gpuops/errors.h"

namespace gpuops::estimator {

/// A size left the int64 range (more than 2^63 - 1 bytes or elements).
class SizeOverflow : public ArgumentError {
 public:
  SizeOverflow() : ArgumentError("size arithmetic overflows 64 bits (more than 2^63 - 1 bytes or elements)") {}
  explicit SizeOverflow(const std::string& message) : ArgumentError(message) {}
};

inline int64_t checked_add(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) throw SizeOverflow();
  return r;
}

inline int64_t checked_sub(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_sub_overflow(a, b, &r)) throw SizeOverflow();
  return r;
}

inline int64_t checked_mul(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) throw SizeOverflow();
  return r;
}

/// An int64 whose +, -, * throw SizeOverflow instead of wrapping. Built implicitly from an int64, so one
/// CheckedInt operand makes a whole expression checked; read back with get().
class CheckedInt {
 public:
  constexpr CheckedInt(int64_t v = 0) noexcept : v_(v) {}  // NOLINT(google-explicit-constructor)
  constexpr int64_t get() const noexcept { return v_; }

  friend CheckedInt operator+(CheckedInt a, CheckedInt b) { return checked_add(a.v_, b.v_); }
  friend CheckedInt operator-(CheckedInt a, CheckedInt b) { return checked_sub(a.v_, b.v_); }
  friend CheckedInt operator*(CheckedInt a, CheckedInt b) { return checked_mul(a.v_, b.v_); }
  friend CheckedInt operator/(CheckedInt a, CheckedInt b) { return a.v_ / b.v_; }  // sizes: b > 0
  CheckedInt& operator+=(CheckedInt b) { return *this = *this + b; }
  CheckedInt& operator*=(CheckedInt b) { return *this = *this * b; }

  friend bool operator==(CheckedInt a, CheckedInt b) { return a.v_ == b.v_; }
  friend bool operator!=(CheckedInt a, CheckedInt b) { return a.v_ != b.v_; }
  friend bool operator<(CheckedInt a, CheckedInt b) { return a.v_ < b.v_; }
  friend bool operator>(CheckedInt a, CheckedInt b) { return a.v_ > b.v_; }
  friend bool operator<=(CheckedInt a, CheckedInt b) { return a.v_ <= b.v_; }
  friend bool operator>=(CheckedInt a, CheckedInt b) { return a.v_ >= b.v_; }

 private:
  int64_t v_;
};

/// ceil(a / b) for a >= 0, b > 0, without the overflow of a + b - 1.
inline int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

}  // namespace gpuops::estimator
