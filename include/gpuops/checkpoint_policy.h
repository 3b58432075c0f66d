#pragma once
// Which layers of a stack to checkpoint so that its activations fit a memory budget with the least
// recomputation (the budget policy of CheckpointedSequential and of gpuops.apply_checkpointing).

#include <cstdint>
#include <string>
#include <vector>

namespace gpuops {

/// What checkpointing one layer trades: activation bytes given back against forward time recomputed.
struct LayerCost {
  std::string name;
  int64_t saved_bytes = 0;         ///< activation bytes the layer holds for the backward when run plainly
  int64_t checkpointed_bytes = 0;  ///< what it holds when checkpointed (the tensors it keeps to recompute)
  double forward_seconds = 0;      ///< the recomputation it costs
};

/// Indices (ascending) of the layers to checkpoint so that the held activations, sum of saved_bytes of the
/// plain layers plus checkpointed_bytes of the others, fit in budget_bytes with the least total
/// forward_seconds: a 0/1 knapsack, exact when the total saving is at most `units` bytes; above, savings are
/// rounded down to total/units steps, so the choice never exceeds the budget and recomputes at most what the
/// optimum for a budget tighter by (layers x step) would. Empty when everything fits already.
/// c10::ValueError naming budget_bytes and the smallest feasible budget when even checkpointing every layer
/// does not fit; naming the layer and field for a negative byte count or a forward_seconds that is not a finite
/// number >= 0, and for byte totals past 2^63; for units outside [1, 2^24].
std::vector<size_t> choose_for_budget(const std::vector<LayerCost>& costs, int64_t budget_bytes,
                                      int64_t units = 1 << 16);

}  // namespace gpuops
