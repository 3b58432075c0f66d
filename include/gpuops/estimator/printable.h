#pragma once
// Messages echo what the user typed (paths, names, JSON parser excerpts), which may be any bytes; a
// terminal, a JSON document or a Python str needs valid UTF-8 without control characters.

#include <string>
#include <string_view>

#include <fmt/format.h>

namespace gpuops::estimator {

/// `text` with each byte that is not part of valid UTF-8, and each control character, written as \xNN.
inline std::string printable(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  const auto continuation = [&](size_t i) { return i < text.size() && (byte(i) & 0xC0) == 0x80; };
  for (size_t i = 0; i < text.size();) {
    const unsigned char c = byte(i);
    size_t len = 0;  // length of a valid sequence starting at i, 0 if none
    if (c >= 0x20 && c < 0x7F) len = 1;
    else if (c >= 0xC2 && c <= 0xDF) len = continuation(i + 1) ? 2 : 0;
    else if (c >= 0xE0 && c <= 0xEF) {
      const unsigned char c1 = i + 1 < text.size() ? byte(i + 1) : 0;
      const bool ok1 = (c == 0xE0 ? c1 >= 0xA0 : c == 0xED ? c1 < 0xA0 : true);  // no overlong, no surrogate
      len = continuation(i + 1) && ok1 && continuation(i + 2) ? 3 : 0;
    } else if (c >= 0xF0 && c <= 0xF4) {
      const unsigned char c1 = i + 1 < text.size() ? byte(i + 1) : 0;
      const bool ok1 = (c == 0xF0 ? c1 >= 0x90 : c == 0xF4 ? c1 < 0x90 : true);  // no overlong, <= U+10FFFF
      len = continuation(i + 1) && ok1 && continuation(i + 2) && continuation(i + 3) ? 4 : 0;
    }
    if (len == 0) {
      out += fmt::format("\\x{:02x}", c);
      ++i;
    } else {
      out.append(text.substr(i, len));
      i += len;
    }
  }
  return out;
}

}  // namespace gpuops::estimator
