// bitsandbytes' paged optimizers (OptimizerKind::PagedAdamW8bit / PagedAdamW32bit): the states of tensors of at
// least kPagedMinElements values live in CUDA unified memory (the host), paged in for their step.
#include <algorithm>

#include "gpuops/errors.h"
#include "gpuops/estimator/param_tensors.h"
#include "gpuops/estimator/state_layout.h"
#include "setup_feature.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;

// A bitsandbytes Adam's states of one tensor of `n` values: 8-bit block-wise, or two fp32 states (the 32-bit
// optimizers allocate fp32 states whatever the parameter's dtype).
int64_t bnb_state_bytes(int64_t n, OptimizerKind o) {
  return o == OptimizerKind::PagedAdamW8bit ? eight_bit_adam_state_bytes(n) : (8 * C(n)).get();
}

class PagedOptimizerFeature final : public SetupFeature {
 public:
  void validate(const TrainingSetup& s, const ModelSpec& m) const override {
    if (!on(s)) return;
    GPUOPS_CHECK_ARG(m.family != ModelFamily::ParamsOnly, "optimizer {} needs an architecture (bitsandbytes pages "
                     "the states of tensors of >= {} values only), not a bare parameter count", to_string(s.optimizer),
                     kPagedMinElements);
    GPUOPS_CHECK_ARG(s.zero_stage == 0, "optimizer {} is modelled without ZeRO (a flat ZeRO partition or an FSDP2 "
                     "DTensor is not what bitsandbytes pages tensor by tensor); accepted: zero 0, got zero {}",
                     to_string(s.optimizer), s.zero_stage);
  }
  bool on(const TrainingSetup& s) const override {
    return s.optimizer == OptimizerKind::PagedAdamW8bit || s.optimizer == OptimizerKind::PagedAdamW32bit;
  }
  void place(const StepContext& c, MemoryBreakdown& b) const override {
    if (c.device.is_cpu()) return;  // bitsandbytes does not page CPU tensors
    C on_device = 0, on_host = 0;
    for (const auto& t : trainable_tensor_shapes(c.model, c.setup)) {
      const int64_t n = t.elements();
      (n >= kPagedMinElements ? on_host : on_device) += C(t.count) * bnb_state_bytes(n, c.setup.optimizer);
    }
    b.optimizer_states = on_device.get();
    b.host_memory = (C(b.host_memory) + on_host).get();
  }
  // Unified memory: the driver migrates the pages of the tensor being stepped back to the device; at most the
  // largest paged tensor's states are resident at once when the device is under pressure.
  std::optional<int64_t> step_temporaries(const StepContext& c) const override {
    if (c.device.is_cpu()) return 0;
    int64_t largest = 0;
    for (const auto& t : trainable_tensor_shapes(c.model, c.setup))
      if (t.elements() >= kPagedMinElements)
        largest = std::max(largest, bnb_state_bytes(t.elements(), c.setup.optimizer));
    return largest;
  }
};

}  // namespace

const SetupFeature& paged_optimizer_feature() {
  static const PagedOptimizerFeature feature;
  return feature;
}

}  // namespace gpuops::estimator
