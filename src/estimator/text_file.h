#pragma once
// Reading a small text file given by the user (a config.json, a device profile) without hanging or
// swallowing a device: opened without blocking, checked to be a regular file of at most `max_bytes`.

#include <cstdint>
#include <string>

namespace gpuops::estimator {

/// How errors name the file: "<label> '<path>' cannot be read (...); <hint>", "... a <kind> of at most N bytes".
struct TextFileKind {
  const char* label;  ///< the argument, e.g. "config" or "--device-profile"
  const char* kind;   ///< the file expected, e.g. "config.json"
  const char* hint;   ///< what to give instead, e.g. "give the path of a Hugging Face config.json"
  int64_t max_bytes;
};

/// The whole file; gpuops::ArgumentError naming `kind.label` and the path when it cannot be read as one.
std::string read_text_file(const std::string& path, const TextFileKind& kind);

}  // namespace gpuops::estimator
