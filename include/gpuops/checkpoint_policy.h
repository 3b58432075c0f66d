#pragma once
// Which layers of a stack to checkpoint (or to offload) so that its activations fit a memory budget with the
// least recomputation and copying (the budget policy of CheckpointedSequential, gpuops.apply_checkpointing and
// gpuops.apply_activation_policy).

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
  /// Offloading its activations instead (Python's offload_activations): what it still holds on the device (the
  /// tensors too small to copy) and the seconds its copies to the host and back take, measured without overlap
  /// (an upper bound: beside a GPU they overlap the compute). offload_seconds < 0: not a choice for this layer.
  int64_t offloaded_bytes = 0;
  double offload_seconds = -1;
};

/// What a layer does with its activations between its forward and its backward.
enum class LayerChoice { Keep, Offload, Recompute };

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

/// The same choice among three per layer: keep (saved_bytes, no time), recompute (checkpointed_bytes,
/// forward_seconds) or offload (offloaded_bytes, offload_seconds; where offload_seconds >= 0): the held bytes
/// fit in budget_bytes with the least total time (a multiple-choice knapsack, rounded as above). One choice
/// per layer, in order. The same errors, also for offloaded_bytes < 0 or an offload_seconds that is not
/// finite.
std::vector<LayerChoice> choose_placements(const std::vector<LayerCost>& costs, int64_t budget_bytes,
                                           int64_t units = 1 << 16);

}  // namespace gpuops
