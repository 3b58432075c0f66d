// Persistent state of a training step: weights, gradients, master weights, optimizer states, with ZeRO
// partitioning and LoRA/QLoRA; and the peak over the step's phases (step_phases.cpp), which add what
// autograd saves (activations.cpp) and the transients of each moment.
#include "gpuops/estimator/estimate.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "gpuops/errors.h"

#include "gpuops/estimator/state_layout.h"
#include "gpuops/estimator/step_phases.h"
#include "features/setup_feature.h"
#include "step_trace.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;  // sizes: overflow throws SizeOverflow (see checked_int.h)

// Optimizer-state bytes for `n` trainable parameters (a local shard) in `tensors` parameter tensors.
int64_t optimizer_bytes(int64_t n, int64_t tensors, const TrainingSetup& s, const DeviceProfile& device) {
  const int64_t state = s.precision == Precision::Bf16Pure ? 2 : 4;  // pure bf16: states like the params
  switch (s.optimizer) {
    case OptimizerKind::Adam:
    case OptimizerKind::AdamW:
      // exp_avg, exp_avg_sq, and torch's fp32 'step' scalar per tensor (host memory on CUDA)
      return (2 * state * C(n) + (device.is_cpu() ? 4 * C(tensors) : 0)).get();
    case OptimizerKind::Sgd: return 0;
    case OptimizerKind::SgdMomentum: return (state * C(n)).get();  // momentum buffer
    case OptimizerKind::AdamW8bit:
    case OptimizerKind::PagedAdamW8bit:  // where the bytes live: features/paged_optimizer.cpp
      // bitsandbytes block-wise 8-bit: two 1-byte states plus one fp32 absmax per 2048-value block each.
      return eight_bit_adam_state_bytes(n);
    case OptimizerKind::PagedAdamW32bit: return (8 * C(n)).get();  // two fp32 states whatever the params' dtype
    case OptimizerKind::GpuopsAdamW8bit: return 0;  // per tensor shape: features/gpuops_adam8.cpp
    case OptimizerKind::Adafactor: return 0;  // per tensor shape: features/adafactor.cpp
  }
  return 0;
}

}  // namespace

// The adapters' (features/lora.cpp), or the model's.
int64_t trainable_parameter_count(const ModelSpec& m, const TrainingSetup& s) {
  const auto own = feature_trainable_tensors(m, s);
  if (!own) return parameter_count(m);
  C n = 0;
  for (const ParamTensor& t : *own) n += C(t.count) * t.elements();
  return n.get();
}

int64_t zero_shard(int64_t count, const TrainingSetup& s, int from_stage) {
  return s.zero_stage >= from_stage ? ceil_div(count, s.num_gpus) : count;
}

// Non-parameter state of the module: GPT-2's per-layer causal-mask buffer (and its masked_bias scalar),
// RoPE's inverse frequencies (an fp32 original is kept when the model is cast to bf16).
int64_t buffer_bytes(const ModelSpec& m, const TrainingSetup& s) {
  const int64_t pb = trainable_element_bytes(s);
  if (m.family == ModelFamily::ParamsOnly) return m.fixed_bytes;
  if (m.causal_mask_buffers) return (m.num_layers * (C(m.max_positions) * m.max_positions + pb)).get();
  if (m.family == ModelFamily::Decoder && !m.learned_positions) {
    const int64_t half = effective_head_dim(m) / 2;
    return (C(half) * 4 + (runs_in_16_bits(s) ? C(half) * 2 : 0)).get();
  }
  return 0;
}

int64_t trainable_tensor_count(const ModelSpec& m, const TrainingSetup& s) {
  const auto own = feature_trainable_tensors(m, s);
  if (!own) return parameter_tensor_count(m);
  C n = 0;
  for (const ParamTensor& t : *own) n += t.count;
  return n.get();
}

MemoryBreakdown persistent_memory(const ModelSpec& m, const TrainingSetup& s, const DeviceProfile& device) {
  const int64_t wbytes = trainable_element_bytes(s);
  // Local shares: the flat layout divides totals (zero_shard), FSDP2 pads every tensor (state_layout.cpp).
  const int64_t local_weights = sharded_trainable_elements(m, s, 3), local_grads = sharded_trainable_elements(m, s, 2),
                local_states = sharded_trainable_elements(m, s, 1);
  MemoryBreakdown b;
  b.weights = (C(local_weights) * wbytes + sharded_frozen_bytes(m, s) + buffer_bytes(m, s)).get();
  b.gradients = (C(local_grads) * wbytes).get();
  b.master_weights = is_mixed(s.precision) && s.amp == AmpLayout::MasterCopy ? (C(local_states) * 4).get() : 0;
  b.optimizer_states = optimizer_bytes(local_states, trainable_tensor_count(m, s), s, device);
  // The setup's features: their own sizes first, then where the state lives (offloaded, paged).
  const StepContext context{m, s, device};
  const std::vector<const SetupFeature*> features = features_of(s);
  for (const SetupFeature* f : features) f->persistent(context, b);
  for (const SetupFeature* f : features) f->place(context, b);
  return b;
}

namespace {

void validate(const DeviceProfile& d) {
  GPUOPS_CHECK_ARG(d.kind == DeviceProfile::Cpu || d.kind == DeviceProfile::Cuda,
                   "device kind {} is not a DeviceProfile::Kind; accepted: Cpu, Cuda", static_cast<int>(d.kind));
  GPUOPS_CHECK_ARG(d.cuda_context_bytes >= 0, "device cuda_context_bytes must be >= 0, got {}", d.cuda_context_bytes);
  GPUOPS_CHECK_ARG(d.cuda_context_low >= 0 && d.cuda_context_low <= d.cuda_context_bytes &&
                       d.cuda_context_high >= d.cuda_context_bytes,
                   "device cuda_context_low/high ({}, {}) must enclose cuda_context_bytes {}", d.cuda_context_low,
                   d.cuda_context_high, d.cuda_context_bytes);
  GPUOPS_CHECK_ARG(d.workspace_bytes >= 0, "device workspace_bytes must be >= 0, got {}", d.workspace_bytes);
  GPUOPS_CHECK_ARG(d.runtime.allocator == AllocatorMode::Default || d.runtime.allocator == AllocatorMode::ExpandableSegments,
                   "device allocator mode {} is not an AllocatorMode; accepted: Default, ExpandableSegments",
                   static_cast<int>(d.runtime.allocator));
}


int64_t fraction_of(int64_t bytes, double f) {
  const double v = static_cast<double>(bytes) * f;
  if (v >= 9223372036854775808.0) throw SizeOverflow();  // 2^63: llround would overflow
  return static_cast<int64_t>(std::llround(v));
}

// Every phase with the device's own terms, in StepPhase order. On CUDA: the workspaces, the blocks' rounding
// and the allocator's reserve (the replayed step's allocated minus requested, reserved minus allocated
// peaks), the context, NCCL, and the band around them. SizeOverflow escapes when a size leaves int64.
std::vector<MemoryBreakdown> device_phases(const ModelSpec& m, const TrainingSetup& s, const DeviceProfile& device) {
  const MemoryBreakdown persistent = persistent_memory(m, s, device);
  std::vector<MemoryBreakdown> phases = phase_breakdowns(m, s, device, persistent);
  if (device.is_cpu()) return phases;
  const AllocatorPeaks replay = replay_training_steps(m, s, device, persistent, device.runtime.allocator);
  const int64_t rounding = std::max<int64_t>(0, replay.allocated - replay.requested);
  const int64_t slack = std::max<int64_t>(0, replay.reserved - replay.allocated);
  for (MemoryBreakdown& phase : phases) {
    phase.workspaces = device.workspace_bytes;
    phase.block_rounding = rounding;
    phase.allocator_slack = slack;
    phase.cuda_context = device.cuda_context_bytes;
    phase.nccl_buffers = nccl_buffer_bytes(s.num_gpus, device.nvlink);
    // The allocator's reserve and NCCL's buffers are known to +-50%, the context to its measured range.
    const C common = C(slack / 2) + phase.nccl_buffers / 2;
    phase.band_below = (common + fraction_of(phase.allocated_peak(), kAllocatedBandBelow) +
                        (device.cuda_context_bytes - device.cuda_context_low)).get();
    phase.band_above = (common + fraction_of(phase.allocated_peak(), kAllocatedBandAbove) +
                        (device.cuda_context_high - device.cuda_context_bytes)).get();
    phase.total_high();  // every figure must fit in int64
  }
  return phases;
}

// The phase with the most allocated bytes (ties: the earlier phase).
MemoryBreakdown peak_of(const ModelSpec& m, const TrainingSetup& s, const DeviceProfile& device) {
  MemoryBreakdown peak;
  bool first = true;
  for (const MemoryBreakdown& phase : device_phases(m, s, device)) {
    if (first || phase.allocated_peak() > peak.allocated_peak()) peak = phase;
    first = false;
  }
  return peak;
}

bool overflows(const ModelSpec& m, const TrainingSetup& s, const DeviceProfile& device) {
  try {
    peak_of(m, s, device);
    return false;
  } catch (const SizeOverflow&) {
    return true;
  }
}

// Largest v in [1, hi) with overflows_at(v) false, given overflows_at(1) false and overflows_at(hi) true.
template <typename F>
int64_t largest_without_overflow(int64_t hi, F overflows_at) {
  int64_t lo = 1;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (overflows_at(mid) ? hi : lo) = mid;
  }
  return lo;
}

// A size overflowed: find which argument is too large (the model itself, else seq, else batch) and
// the largest value of it that can be estimated.
[[noreturn]] void throw_overflow(const ModelSpec& m, const TrainingSetup& s, const DeviceProfile& device) {
  TrainingSetup t = s;
  t.micro_batch = 1;
  t.seq_len = 1;
  if (overflows(m, t, device)) {
    if (m.family == ModelFamily::ParamsOnly) {
      ModelSpec smaller = m;
      const int64_t max = largest_without_overflow(m.explicit_param_count, [&](int64_t n) {
        smaller.explicit_param_count = n;
        return overflows(smaller, t, device);
      });
      throw SizeOverflow(fmt::format("params '{}' ({} parameters) is too large: its memory overflows 64 bits "
                                     "(2^63 - 1 bytes) in this setup; accepted: 1 to {} parameters",
                                     m.name, m.explicit_param_count, max));
    }
    throw SizeOverflow(fmt::format("model '{}' ({} parameters, vocab_size {}, hidden_size {}, num_layers {}) is "
                                   "too large: its memory overflows 64 bits (2^63 - 1 bytes) even at batch 1 and "
                                   "seq 1; accepted: a model whose memory is below 2^63 bytes", m.name,
                                   parameter_count(m), m.vocab_size, m.hidden_size, m.num_layers));
  }
  t.seq_len = s.seq_len;
  if (overflows(m, t, device)) {
    const int64_t max = largest_without_overflow(s.seq_len, [&](int64_t v) {
      t.seq_len = v;
      return overflows(m, t, device);
    });
    throw SizeOverflow(fmt::format("seq (sequence length) {} is too large for model '{}': the estimate overflows "
                                   "64 bits (2^63 - 1 bytes); accepted: 1 to {} at batch 1", s.seq_len, m.name, max));
  }
  const int64_t max = largest_without_overflow(s.micro_batch, [&](int64_t v) {
    t.micro_batch = v;
    return overflows(m, t, device);
  });
  throw SizeOverflow(fmt::format("batch (micro-batch per GPU) {} is too large for model '{}' at seq {}: the "
                                 "estimate overflows 64 bits (2^63 - 1 bytes); accepted: 1 to {}", s.micro_batch,
                                 m.name, s.seq_len, max));
}

// The model as the setup runs it (LitGPT's code fuses q, k and v on every architecture: features/model_code.cpp).
ModelSpec as_run(const ModelSpec& m, const TrainingSetup& s) {
  ModelSpec run = m;
  for (const SetupFeature* f : features_of(s)) f->run_model(run);
  return run;
}

// `compute()` on validated arguments, a size overflow turned into the error naming what is too large.
template <typename F>
auto checked_estimate(const ModelSpec& m, const TrainingSetup& s, const DeviceProfile& device, F compute) {
  validate(m);
  validate(s, m);
  validate(device);
  try {
    return compute();
  } catch (const SizeOverflow&) {
    throw_overflow(m, s, device);
  }
}

}  // namespace

MemoryBreakdown estimate_memory(const ModelSpec& m, const TrainingSetup& s, const DeviceProfile& device) {
  return checked_estimate(m, s, device, [&] { return peak_of(as_run(m, s), s, device); });
}

std::vector<MemoryBreakdown> estimate_phases(const ModelSpec& m, const TrainingSetup& s, const DeviceProfile& device) {
  return checked_estimate(m, s, device, [&] { return device_phases(as_run(m, s), s, device); });
}

}  // namespace gpuops::estimator
