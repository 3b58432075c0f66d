#pragma once
// gpuops::optim::ZeroOptimizer (issue 13, part 2): ZeRO stages 1 and 2 over our fused AdamW and a
// Communicator. The parameters are gathered into FlatParams padded to a multiple of the world size; every
// rank owns the contiguous shard [rank * S, (rank + 1) * S) of each flat buffer and keeps the AdamW state of
// that shard only (float32 parameters; 16-bit ones with fp32 masters are not built yet): the optimizer
// underneath is our AdamW over one "shard parameter" per buffer (a leaf aliasing the shard of the flat
// parameters, whose .grad is the reduced shard of the flat gradient), so the step is AdamW's own fused
// step, on 1/N of the elements.
//
// One step: (1) reduce-scatter every flat gradient (average over ranks), buffers in a fixed order, once per
// step (after all micro-batches of an accumulation window); (2) with a GradScaler: one all-reduce of the
// overflow flag (max) and, with clip_grad_norm_, one of the squared norm (sum), so every rank sees the same
// flag and the same global norm; (3) the fused AdamW step on the shard (scale and flag on the device, as a
// GradScaler hands them to every fused optimizer); (4) all-gather every flat parameter buffer. Traffic per
// step: reduce-scatter + all-gather = one all-reduce of the parameters, plus two one-element all-reduces.
//
// Stage 2: the flat gradient is reduce-scattered out of place into a shard-sized gradient kept by the
// optimizer, and the full flat gradient is freed; zero_grad() allocates it again for the next backward.
// Stage 1 reduces in place: afterwards the parameters' .grad hold the average over ranks in this rank's shard
// only, elsewhere unspecified. Gradients accumulate locally over a window in both stages (reduced once at its
// end). Results do not depend on timing: the collectives run in a fixed order and are waited in that order.

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "gpuops/communicator.h"
#include "gpuops/flat_params.h"
#include "gpuops/optimizers.h"

namespace gpuops::optim {

class ZeroOptimizer : public AdamW {
 public:
  /// Collective: every rank of `communicator` must construct it with the same parameter list (count, shapes,
  /// dtypes; checked with one all-gather of a hash of them). c10::ValueError, with the parameters unchanged, for
  /// a stage other than 1 or 2, an AdamW option out of range, a parameter that is not float32 (16-bit ones with
  /// fp32 masters are not built yet), parameters that differ across ranks, or what
  /// FlatParams refuses (an empty list, a parameter given twice, not a contiguous leaf requiring grad).
  ZeroOptimizer(std::vector<at::Tensor> params, dist::Communicator communicator, int stage = 1,
                AdamWOptions options = {});

  int stage() const { return stage_; }
  const dist::Communicator& communicator() const { return comm_; }
  const FlatParams& flat_params() const { return *flat_; }
  /// The shard parameters the AdamW underneath steps (one per flat buffer): param_groups()[0].params().
  const std::vector<at::Tensor>& shard_params() const { return shards_; }

  /// Zeroes the gradients for the next backward (stage 2: allocates the flat gradient again) and points every
  /// parameter's .grad back at the flat buffer. Call this one, not torch::optim::Optimizer::zero_grad (which is
  /// not virtual: it would drop the shard gradients; the next step then raises).
  void zero_grad(bool set_to_none = true);

  /// Reduce-scatters the flat gradients (average over ranks), once per step: the GradScaler calls it before
  /// it reads the gradients, step() when it was not called yet. Collective.
  void prepare_gradients() override;
  /// The overflow flag, max over ranks (collective).
  at::Tensor global_found_inf(const at::Tensor& found_inf) override;
  /// The global L2 norm from this rank's shard norm: sqrt(sum over ranks of norm^2), summed in float64.
  at::Tensor global_grad_norm(const at::Tensor& norm) override;

  at::Tensor step(LossClosure closure = nullptr) override;

  /// Bytes of this rank's optimizer state tensors (moments, step counters, masters), measured from the tensors.
  int64_t state_bytes() const;
  /// Bytes of gradient buffers this rank holds now: the flat gradients (while allocated) and, in stage 2, the
  /// gradient shards.
  int64_t gradient_bytes() const;

 protected:
  const char* name() const override;
  void step_group(size_t index, std::vector<at::Tensor>& params, const std::optional<at::Tensor>& grad_scale,
                  const std::optional<at::Tensor>& found_inf) override;

 private:
  struct Parts {
    std::unique_ptr<FlatParams> flat;
    std::vector<at::Tensor> shards;
    std::vector<at::Tensor> shard_grads;  ///< stage 2
  };
  static Parts build(const std::vector<at::Tensor>& params, const dist::Communicator& comm, int stage,
                     const AdamWOptions& options);
  ZeroOptimizer(Parts parts, dist::Communicator communicator, int stage, AdamWOptions options);
  void install_shard_grads();

  dist::Communicator comm_;
  int stage_;
  std::unique_ptr<FlatParams> flat_;
  std::vector<at::Tensor> shards_;
  std::vector<at::Tensor> shard_grads_;
  bool reduced_ = false;  ///< the gradients of this step are reduced
  bool stepped_ = false;  ///< stepped since the last zero_grad: the gradients are spent
};

}  // namespace gpuops::optim
