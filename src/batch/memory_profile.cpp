// fit_memory_profile and MemoryProfile (batch_search.h): the linear memory model of the profiled estimator.
#include <algorithm>
#include <climits>
#include <cmath>

#include <c10/util/Exception.h>

#include "gpuops/batch_search.h"

namespace gpuops {

namespace {

// A double as int64, saturated (a cast past the range, or of NaN, is undefined behaviour); NaN gives `nan_as`.
int64_t saturated(double v, int64_t nan_as) {
  if (std::isnan(v)) return nan_as;
  if (v >= 9223372036854775807.0) return INT64_MAX;  // 2^63: the first double past the range
  if (v <= -9223372036854775808.0) return INT64_MIN;
  return static_cast<int64_t>(v);
}

}  // namespace

int64_t MemoryProfile::predict(int64_t batch) const {
  TORCH_CHECK_VALUE(batch >= 0, "MemoryProfile::predict: batch must be >= 0, got ", batch);
  // Unknown (NaN) predicts the most memory: nothing is thought to fit.
  return saturated(std::ceil(fixed_bytes + per_sample_bytes * static_cast<double>(batch)), INT64_MAX);
}

int64_t MemoryProfile::max_batch_for(int64_t bytes) const {
  if (!(per_sample_bytes > 0)) return 0;  // memory does not grow with the batch (or NaN): the fit cannot bound it
  const double room = static_cast<double>(bytes) - fixed_bytes;
  return room >= per_sample_bytes ? saturated(std::floor(room / per_sample_bytes), 0) : 0;  // NaN room: 0
}

MemoryProfile fit_memory_profile(const std::vector<std::pair<int64_t, int64_t>>& points, double tolerance) {
  TORCH_CHECK_VALUE(points.size() >= 2 && points[0].first != points[1].first,
                    "fit_memory_profile: needs at least two points with distinct batch sizes, got ", points.size());
  TORCH_CHECK_VALUE(tolerance >= 0, "fit_memory_profile: tolerance must be >= 0, got ", tolerance);
  for (const auto& [batch, peak] : points)
    TORCH_CHECK_VALUE(batch >= 1 && peak >= 0, "fit_memory_profile: batch must be >= 1 and peak >= 0, got (",
                      batch, ", ", peak, ")");
  MemoryProfile profile;
  profile.points = points;
  const auto [b0, p0] = points[0];
  const auto [b1, p1] = points[1];
  profile.per_sample_bytes = static_cast<double>(p1 - p0) / static_cast<double>(b1 - b0);
  profile.fixed_bytes = static_cast<double>(p0) - profile.per_sample_bytes * static_cast<double>(b0);
  for (size_t i = 2; i < points.size(); ++i) {
    const auto [batch, peak] = points[i];
    const double predicted = static_cast<double>(profile.predict(batch));
    if (std::abs(predicted - static_cast<double>(peak)) > tolerance * std::max<double>(static_cast<double>(peak), 1)) {
      profile.linear = false;
      profile.note = "memory is not linear in the batch: at batch " + std::to_string(batch) + " the fit predicts " +
                     std::to_string(static_cast<int64_t>(predicted)) + " bytes, measured " + std::to_string(peak);
      break;
    }
  }
  if (profile.per_sample_bytes <= 0 && profile.note.empty()) {
    profile.linear = false;
    profile.note = "the peak did not grow with the batch between the profiled sizes";
  }
  return profile;
}

}  // namespace gpuops
