// choose_for_budget (checkpoint_policy.h): the exact 0/1 knapsack behind the budget policy.
#include "gpuops/checkpoint_policy.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <c10/util/Exception.h>

namespace gpuops {

constexpr int64_t kMaxUnits = int64_t{1} << 24;

std::vector<size_t> choose_for_budget(const std::vector<LayerCost>& costs, int64_t budget_bytes, int64_t units) {
  TORCH_CHECK_VALUE(budget_bytes >= 0, "choose_for_budget: budget_bytes must be >= 0, got ", budget_bytes);
  // The table is layers x units entries: past 2^24 units it would take gigabytes for no useful precision.
  TORCH_CHECK_VALUE(units >= 1 && units <= kMaxUnits, "choose_for_budget: units must be in [1, ", kMaxUnits,
                    "], got ", units);
  int64_t total = 0, total_saving = 0;
  std::vector<int64_t> savings;
  for (const auto& c : costs) {
    TORCH_CHECK_VALUE(c.saved_bytes >= 0, "choose_for_budget: layer '", c.name, "' has saved_bytes ", c.saved_bytes,
                      "; accepted: >= 0");
    TORCH_CHECK_VALUE(c.checkpointed_bytes >= 0, "choose_for_budget: layer '", c.name, "' has checkpointed_bytes ",
                      c.checkpointed_bytes, "; accepted: >= 0");
    TORCH_CHECK_VALUE(std::isfinite(c.forward_seconds) && c.forward_seconds >= 0, "choose_for_budget: layer '",
                      c.name, "' has forward_seconds ", c.forward_seconds, "; accepted: a finite number >= 0");
    savings.push_back(std::max<int64_t>(c.saved_bytes - c.checkpointed_bytes, 0));
    TORCH_CHECK_VALUE(!__builtin_add_overflow(total, c.saved_bytes, &total) &&
                          !__builtin_add_overflow(total_saving, savings.back(), &total_saving),
                      "choose_for_budget: the layers' saved_bytes add up past 2^63 (overflow) at layer '", c.name, "'");
  }
  const int64_t need = total - budget_bytes;
  if (need <= 0) return {};
  TORCH_CHECK_VALUE(total_saving >= need, "choose_for_budget: budget_bytes ", budget_bytes, " is below what ",
                    "checkpointing every layer still holds; accepted: >= ", total - total_saving);
  const int64_t unit = std::max<int64_t>(1, (total_saving + units - 1) / units);
  const auto need_units = static_cast<size_t>((need + unit - 1) / unit);
  // best_time[s]: the least recomputation time reaching at least s units of savings with the layers seen so
  // far; took[i][s]: whether layer i is in that choice (the table the choice is read back from).
  constexpr double kNever = std::numeric_limits<double>::infinity();
  std::vector<double> best_time(need_units + 1, kNever);
  std::vector<std::vector<bool>> took(costs.size(), std::vector<bool>(need_units + 1, false));
  best_time[0] = 0;
  for (size_t i = 0; i < costs.size(); ++i) {
    const auto got = static_cast<size_t>(savings[i] / unit);
    if (got == 0) continue;
    for (size_t s = need_units; s > 0; --s) {
      const double time = best_time[s > got ? s - got : 0] + costs[i].forward_seconds;
      if (time < best_time[s]) {
        best_time[s] = time;
        took[i][s] = true;
      }
    }
  }
  if (best_time[need_units] != kNever) {
    std::vector<size_t> chosen;
    size_t s = need_units;
    for (size_t i = costs.size(); i-- > 0 && s > 0;) {
      if (!took[i][s]) continue;
      chosen.insert(chosen.begin(), i);
      const auto got = static_cast<size_t>(savings[i] / unit);
      s = s > got ? s - got : 0;
    }
    return chosen;
  }
  std::vector<size_t> every_saving_layer;  // rounding lost too much: every layer that saves anything
  for (size_t i = 0; i < costs.size(); ++i)
    if (savings[i] > 0) every_saving_layer.push_back(i);
  return every_saving_layer;
}

}  // namespace gpuops
