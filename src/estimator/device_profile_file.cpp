// The device profile file that bench/estimator_validation/calibrate_device.py writes on a GPU: the CUDA
// context and workspaces measured there, read back by `gpuops estimate --device-profile FILE`.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "gpuops/errors.h"
#include "gpuops/estimator/device_profile.h"
#include "text_file.h"

namespace gpuops::estimator {
namespace {

using nlohmann::json;

constexpr int64_t kMaxBytes = int64_t{1} << 40;  // 1 TiB: no GPU holds more

// Reads the fields of one profile; every error names the option, the file and the field.
class ProfileFields {
 public:
  ProfileFields(const json& j, std::string where) : j_(j), where_(std::move(where)) {}

  int64_t integer(const char* key, int64_t low, int64_t high) const {
    GPUOPS_CHECK_ARG(j_.contains(key), "{}: field '{}' is missing; accepted: an integer {} to {}", where_, key, low,
                     high);
    const json& v = j_.at(key);
    GPUOPS_CHECK_ARG(v.is_number_integer(), "{}: field '{}' is {}; accepted: an integer {} to {}", where_, key,
                     v.dump(), low, high);
    const int64_t x = v.get<int64_t>();  // past INT64_MAX this wraps negative: below every low bound (all >= 0)
    GPUOPS_CHECK_ARG(x >= low && x <= high, "{}: field '{}' is {}; accepted: an integer {} to {}", where_, key,
                     v.dump(), low, high);
    return x;
  }

  std::string text(const char* key, const std::string& fallback) const {
    if (!j_.contains(key)) return fallback;
    GPUOPS_CHECK_ARG(j_.at(key).is_string(), "{}: field '{}' is {}; accepted: a string", where_, key,
                     j_.at(key).dump());
    return j_.at(key).get<std::string>();
  }

 private:
  const json& j_;
  std::string where_;
};

}  // namespace

MeasuredCuda read_device_profile(const std::string& path, const std::string& label) {
  const std::string hint = "give the device-profile.json that bench/estimator_validation/calibrate_device.py writes";
  const std::string text = read_text_file(path, {label.c_str(), "device-profile.json", hint.c_str(), 1 << 20});
  const std::string where = fmt::format("{} '{}'", label, path);
  const json j = json::parse(text, nullptr, false);
  GPUOPS_CHECK_ARG(!j.is_discarded() && j.is_object(), "{} is not a JSON object; {}", where, hint);
  GPUOPS_CHECK_ARG(j.value("format", "") == "gpuops-device-profile", "{}: field 'format' is {}; accepted: "
                   "\"gpuops-device-profile\" ({})", where, j.contains("format") ? j.at("format").dump() : "missing",
                   hint);
  const ProfileFields f(j, where);
  f.integer("version", 1, 1);  // the only version so far
  GPUOPS_CHECK_ARG(!j.value("rehearsal", false), "{} was written by a rehearsal without a GPU and holds no "
                   "measurement; {}", where, hint);
  MeasuredCuda m;
  m.compute_capability = static_cast<int>(f.integer("compute_capability", 50, 130));
  m.context_bytes = f.integer("context_bytes", 0, kMaxBytes);
  m.context_low = f.integer("context_low_bytes", 0, m.context_bytes);
  m.context_high = f.integer("context_high_bytes", m.context_bytes, kMaxBytes);
  m.workspace_bytes = f.integer("workspace_bytes", 0, kMaxBytes);
  m.source = fmt::format("{} (sm_{}, driver {}, torch {}, {})", f.text("gpu", "a GPU"), m.compute_capability,
                         f.text("driver", "?"), f.text("torch", "?"), f.text("date", "undated"));
  return m;
}

}  // namespace gpuops::estimator
