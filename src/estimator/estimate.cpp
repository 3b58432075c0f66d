// Persistent state of a training step: weights, gradients, master weights, optimizer states, with ZeRO
// partitioning and LoRA/QLoRA; and the peak over the step's phases (step_phases.cpp), which add what
// autograd saves (activations.cpp) and the transients of each moment.
#include "gpuops/estimator/estimate.h"

#include <cmath>

#include <fmt/format.h>

#include "gpuops/errors.h"

#include "gpuops/estimator/step_phases.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;  // sizes: overflow throws SizeOverflow (see checked_int.h)

// Bytes per element of trainable weights and of gradients.
int64_t trainable_weight_bytes(const TrainingSetup& s) { return runs_in_16_bits(s) ? 2 : 4; }

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
      // bitsandbytes block-wise 8-bit: two 1-byte states plus one fp32 absmax per 2048-value block each.
      return (2 * C(n) + 2 * 4 * ceil_div(n, 2048)).get();
  }
  return 0;
}

// Quantised storage of one frozen linear weight (bias stays 16-bit).
int64_t quantised_linear_bytes(const LinearShape& l, BaseWeightDtype dtype) {
  const int64_t n = (C(l.in_features) * l.out_features).get();
  const C bias = l.bias ? 2 * C(l.out_features) : 0;
  if (dtype == BaseWeightDtype::Int8) return (n + 4 * C(l.out_features) + bias).get();  // LLM.int8: fp32 scale per row
  // NF4 with double quantisation (QLoRA): 4 bits per value, one 8-bit absmax per 64 values and one fp32
  // constant per 256 absmax values.
  return (ceil_div(n, 2) + C(ceil_div(n, 64)) + 4 * C(ceil_div(n, 64 * 256)) + bias).get();
}

}  // namespace

DeviceProfile cuda_device() {
  DeviceProfile d;
  d.kind = DeviceProfile::Cuda;
  // CUDA 12 with lazy module loading: the context, torch's kernels and the cuBLAS/cuDNN handles take
  // roughly 400-600 MiB outside the caching allocator on A100/H100 (nvidia-smi minus memory_reserved).
  d.cuda_context_bytes = int64_t{512} << 20;
  // The caching allocator's reserved/allocated ratio in transformer training is typically 1.05-1.15, and
  // the excess comes from transient tensors (activations, logits, workspaces) that split blocks every
  // step; persistent states are allocated once in large blocks. So 10% of the transient bytes.
  d.allocator_slack_fraction = 0.10;
  return d;
}

DeviceProfile cpu_device() { return DeviceProfile{}; }

int64_t lora_parameter_count(const ModelSpec& m, const LoraSetup& lora) {
  if (lora.rank == 0 || m.family == ModelFamily::ParamsOnly) return 0;
  C per_layer = 0;
  for (const auto& t : lora.targets) {
    const LinearShape l = projection_shape(m, t);
    per_layer += lora.rank * (C(l.in_features) + l.out_features);  // A: in x r, B: r x out, no bias
  }
  return (m.num_layers * per_layer).get();
}

int64_t trainable_parameter_count(const ModelSpec& m, const TrainingSetup& s) {
  return s.lora.rank > 0 ? lora_parameter_count(m, s.lora) : parameter_count(m);
}

int64_t frozen_weight_bytes(const ModelSpec& m, const TrainingSetup& s) {
  if (s.lora.rank == 0) return 0;
  const BaseWeightDtype base = s.lora.base;
  const int64_t total = parameter_count(m);
  if (base == BaseWeightDtype::Fp16 || base == BaseWeightDtype::Bf16) return (2 * C(total)).get();
  // bitsandbytes quantises the linears inside the blocks; embeddings, norms and the LM head stay 16-bit.
  C linear_params = 0, linear_bytes = 0;
  for (const auto& p : projection_names(m)) {
    const LinearShape l = projection_shape(m, p);
    linear_params += l.parameters();
    linear_bytes += quantised_linear_bytes(l, base);
  }
  return (m.num_layers * linear_bytes + 2 * (total - m.num_layers * linear_params)).get();
}

int64_t zero_shard(int64_t count, const TrainingSetup& s, int from_stage) {
  return s.zero_stage >= from_stage ? ceil_div(count, s.num_gpus) : count;
}

// Non-parameter state of the module: GPT-2's per-layer causal-mask buffer (and its masked_bias scalar),
// RoPE's inverse frequencies (an fp32 original is kept when the model is cast to bf16).
int64_t buffer_bytes(const ModelSpec& m, const TrainingSetup& s) {
  const int64_t pb = trainable_weight_bytes(s);
  if (m.causal_mask_buffers) return (m.num_layers * (C(m.max_positions) * m.max_positions + pb)).get();
  if (m.family == ModelFamily::Decoder && !m.learned_positions) {
    const int64_t half = effective_head_dim(m) / 2;
    return (C(half) * 4 + (runs_in_16_bits(s) ? C(half) * 2 : 0)).get();
  }
  return 0;
}

int64_t trainable_tensor_count(const ModelSpec& m, const TrainingSetup& s) {
  if (s.lora.rank > 0) return (2 * C(m.num_layers) * static_cast<int64_t>(s.lora.targets.size())).get();  // A and B
  return parameter_tensor_count(m);
}

MemoryBreakdown persistent_memory(const ModelSpec& m, const TrainingSetup& s, const DeviceProfile& device) {
  const int64_t trainable = trainable_parameter_count(m, s);
  const int64_t wbytes = trainable_weight_bytes(s);
  MemoryBreakdown b;
  b.weights = (C(zero_shard(trainable, s, 3)) * wbytes + zero_shard(frozen_weight_bytes(m, s), s, 3) +
               buffer_bytes(m, s)).get();
  b.gradients = (C(zero_shard(trainable, s, 2)) * wbytes).get();
  b.master_weights =
      is_mixed(s.precision) && s.amp == AmpLayout::MasterCopy ? (C(zero_shard(trainable, s, 1)) * 4).get() : 0;
  b.optimizer_states = optimizer_bytes(zero_shard(trainable, s, 1), trainable_tensor_count(m, s), s, device);
  return b;
}

namespace {

void validate(const DeviceProfile& d) {
  GPUOPS_CHECK_ARG(d.kind == DeviceProfile::Cpu || d.kind == DeviceProfile::Cuda,
                   "device kind {} is not a DeviceProfile::Kind; accepted: Cpu, Cuda", static_cast<int>(d.kind));
  GPUOPS_CHECK_ARG(d.cuda_context_bytes >= 0, "device cuda_context_bytes must be >= 0, got {}", d.cuda_context_bytes);
  GPUOPS_CHECK_ARG(d.allocator_slack_fraction >= 0 && d.allocator_slack_fraction <= 1,
                   "device allocator_slack_fraction must be in [0, 1], got {}", d.allocator_slack_fraction);
}

// The largest phase; SizeOverflow escapes when a size leaves int64.
MemoryBreakdown peak_of(const ModelSpec& m, const TrainingSetup& s, const DeviceProfile& device) {
  MemoryBreakdown peak;
  bool first = true;
  for (MemoryBreakdown phase : phase_breakdowns(m, s, device, persistent_memory(m, s, device))) {
    if (device.kind == DeviceProfile::Cuda) {
      phase.cuda_context = device.cuda_context_bytes;
      const double slack = device.allocator_slack_fraction *
                           static_cast<double>((C(phase.activations) + phase.logits + phase.temporaries).get());
      if (slack >= 9223372036854775808.0) throw SizeOverflow();  // 2^63: llround would overflow
      phase.allocator_slack = static_cast<int64_t>(std::llround(slack));
    }
    if (first || phase.total() > peak.total()) peak = phase;  // ties: the earlier phase
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

}  // namespace

MemoryBreakdown estimate_memory(const ModelSpec& m, const TrainingSetup& s, const DeviceProfile& device) {
  validate(m);
  validate(s, m);
  validate(device);
  try {
    return peak_of(m, s, device);
  } catch (const SizeOverflow&) {
    throw_overflow(m, s, device);
  }
}

}  // namespace gpuops::estimator
