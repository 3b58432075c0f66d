// choose_for_budget and choose_placements (checkpoint_policy.h): the exact knapsack behind the budget policy,
// each layer kept, recomputed or (where measured) offloaded.
#include "gpuops/checkpoint_policy.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <c10/util/Exception.h>

namespace gpuops {
namespace {

constexpr int64_t kMaxUnits = int64_t{1} << 24;

// One way a layer gives back bytes: the saving and its time.
struct Option {
  LayerChoice choice;
  int64_t saving;
  double seconds;
};

std::vector<Option> options_of(const LayerCost& c, bool with_offload) {
  std::vector<Option> options{{LayerChoice::Recompute, std::max<int64_t>(c.saved_bytes - c.checkpointed_bytes, 0),
                               c.forward_seconds}};
  if (with_offload && c.offload_seconds >= 0)
    options.push_back(
        {LayerChoice::Offload, std::max<int64_t>(c.saved_bytes - c.offloaded_bytes, 0), c.offload_seconds});
  return options;
}

void check_layer(const LayerCost& c) {
  TORCH_CHECK_VALUE(c.saved_bytes >= 0, "choose_for_budget: layer '", c.name, "' has saved_bytes ", c.saved_bytes,
                    "; accepted: >= 0");
  TORCH_CHECK_VALUE(c.checkpointed_bytes >= 0, "choose_for_budget: layer '", c.name, "' has checkpointed_bytes ",
                    c.checkpointed_bytes, "; accepted: >= 0");
  TORCH_CHECK_VALUE(std::isfinite(c.forward_seconds) && c.forward_seconds >= 0, "choose_for_budget: layer '",
                    c.name, "' has forward_seconds ", c.forward_seconds, "; accepted: a finite number >= 0");
  TORCH_CHECK_VALUE(c.offloaded_bytes >= 0, "choose_for_budget: layer '", c.name, "' has offloaded_bytes ",
                    c.offloaded_bytes, "; accepted: >= 0");
  TORCH_CHECK_VALUE(std::isfinite(c.offload_seconds), "choose_for_budget: layer '", c.name, "' has offload_seconds ",
                    c.offload_seconds, "; accepted: a finite number (< 0: offload is not a choice)");
}

std::vector<LayerChoice> solve(const std::vector<LayerCost>& costs, int64_t budget_bytes, int64_t units,
                               bool with_offload) {
  TORCH_CHECK_VALUE(budget_bytes >= 0, "choose_for_budget: budget_bytes must be >= 0, got ", budget_bytes);
  // The table is layers x units entries: past 2^24 units it would take gigabytes for no useful precision.
  TORCH_CHECK_VALUE(units >= 1 && units <= kMaxUnits, "choose_for_budget: units must be in [1, ", kMaxUnits,
                    "], got ", units);
  int64_t total = 0, total_saving = 0;
  std::vector<std::vector<Option>> options;
  for (const auto& c : costs) {
    check_layer(c);
    options.push_back(options_of(c, with_offload));
    int64_t best = 0;
    for (const Option& o : options.back()) best = std::max(best, o.saving);
    TORCH_CHECK_VALUE(!__builtin_add_overflow(total, c.saved_bytes, &total) &&
                          !__builtin_add_overflow(total_saving, best, &total_saving),
                      "choose_for_budget: the layers' saved_bytes add up past 2^63 (overflow) at layer '", c.name, "'");
  }
  std::vector<LayerChoice> chosen(costs.size(), LayerChoice::Keep);
  const int64_t need = total - budget_bytes;
  if (need <= 0) return chosen;
  TORCH_CHECK_VALUE(total_saving >= need, "choose_for_budget: budget_bytes ", budget_bytes, " is below what ",
                    with_offload ? "checkpointing or offloading" : "checkpointing", " every layer still holds; "
                    "accepted: >= ", total - total_saving);
  const int64_t unit = std::max<int64_t>(1, (total_saving + units - 1) / units);
  const auto need_units = static_cast<size_t>((need + unit - 1) / unit);
  // best_time[s]: the least time reaching at least s units of savings with the layers seen so far; took[i][s]:
  // which option of layer i that choice takes (0: keep), the table the choice is read back from. Descending s
  // reads only entries below s, still the previous layer's: every option of a layer reads the same row.
  constexpr double kNever = std::numeric_limits<double>::infinity();
  std::vector<double> best_time(need_units + 1, kNever);
  std::vector<std::vector<uint8_t>> took(costs.size(), std::vector<uint8_t>(need_units + 1, 0));
  best_time[0] = 0;
  const auto units_of = [&](const Option& o) { return static_cast<size_t>(o.saving / unit); };
  for (size_t i = 0; i < costs.size(); ++i) {
    for (size_t s = need_units; s > 0; --s) {
      for (size_t k = 0; k < options[i].size(); ++k) {
        const size_t got = units_of(options[i][k]);
        if (got == 0) continue;
        const double time = best_time[s > got ? s - got : 0] + options[i][k].seconds;
        if (time < best_time[s]) {
          best_time[s] = time;
          took[i][s] = static_cast<uint8_t>(k + 1);
        }
      }
    }
  }
  if (best_time[need_units] != kNever) {
    size_t s = need_units;
    for (size_t i = costs.size(); i-- > 0 && s > 0;) {
      if (took[i][s] == 0) continue;
      const Option& o = options[i][took[i][s] - 1];
      chosen[i] = o.choice;
      const size_t got = units_of(o);
      s = s > got ? s - got : 0;
    }
    return chosen;
  }
  for (size_t i = 0; i < costs.size(); ++i) {  // rounding lost too much: every layer's largest saving
    const auto largest = std::max_element(options[i].begin(), options[i].end(),
                                          [](const Option& a, const Option& b) { return a.saving < b.saving; });
    if (largest->saving > 0) chosen[i] = largest->choice;
  }
  return chosen;
}

}  // namespace

std::vector<size_t> choose_for_budget(const std::vector<LayerCost>& costs, int64_t budget_bytes, int64_t units) {
  const std::vector<LayerChoice> choices = solve(costs, budget_bytes, units, /*with_offload=*/false);
  std::vector<size_t> recomputed;
  for (size_t i = 0; i < choices.size(); ++i)
    if (choices[i] == LayerChoice::Recompute) recomputed.push_back(i);
  return recomputed;
}

std::vector<LayerChoice> choose_placements(const std::vector<LayerCost>& costs, int64_t budget_bytes, int64_t units) {
  return solve(costs, budget_bytes, units, /*with_offload=*/true);
}

}  // namespace gpuops
