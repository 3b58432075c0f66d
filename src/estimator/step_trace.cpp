// Two training steps as the caching allocator sees them: the same byte terms as the analytic phases
// (persistent_memory, forward_saved, the phase transients), cut into tensors of the model's real shapes
// and allocated and freed in the order a step runs. Only the allocator's reserve comes out of this
// replay; the allocated bytes stay those of the analytic phases, which are validated tensor by tensor.
#include "step_trace.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "gpuops/estimator/activations.h"
#include "gpuops/estimator/estimate.h"
#include "gpuops/estimator/param_tensors.h"
#include "gpuops/estimator/state_layout.h"
#include "gpuops/estimator/step_phases.h"
#include "features/setup_feature.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;

// Element counts of `tensors` (param_tensors.h) one by one, in the order a model holds them: the root
// tensors listed before the blocks (embeddings), then layer by layer the tensors that every layer has,
// then the rest (final norm, head).
std::vector<int64_t> in_layer_order(const std::vector<ParamTensor>& tensors, int64_t layers) {
  std::vector<int64_t> front, back;
  std::vector<std::vector<int64_t>> per_layer(static_cast<size_t>(std::max<int64_t>(layers, 1)));
  bool blocks_seen = false;
  for (const ParamTensor& t : tensors) {
    const int64_t n = t.elements();
    if (!t.root && layers > 0 && t.count % layers == 0) {
      blocks_seen = true;
      for (auto& layer : per_layer) layer.insert(layer.end(), static_cast<size_t>(t.count / layers), n);
    } else {
      (blocks_seen ? back : front).insert((blocks_seen ? back : front).end(), static_cast<size_t>(t.count), n);
    }
  }
  for (const auto& layer : per_layer) front.insert(front.end(), layer.begin(), layer.end());
  front.insert(front.end(), back.begin(), back.end());
  return front;
}

// `bytes` spread over tensors in proportion to `elements` (the last one takes the rounding).
std::vector<int64_t> spread(int64_t bytes, const std::vector<int64_t>& elements) {
  std::vector<int64_t> out;
  if (bytes <= 0 || elements.empty()) return out;
  long double total = 0;
  for (int64_t e : elements) total += static_cast<long double>(e);
  int64_t given = 0;
  for (size_t i = 0; i + 1 < elements.size(); ++i) {
    const auto part = static_cast<int64_t>(static_cast<long double>(bytes) * static_cast<long double>(elements[i]) / total);
    out.push_back(part);
    given += part;
  }
  out.push_back(bytes - given);
  return out;
}

// `bytes` cut into pieces of `unit` bytes and one remainder; at most kMaxPieces (larger pieces then), so that
// a step is replayed in bounded time and memory whatever the sizes.
std::vector<int64_t> pieces(int64_t bytes, int64_t unit) {
  constexpr int64_t kMaxPieces = 4096;
  std::vector<int64_t> out;
  unit = std::max<int64_t>({unit, 512, bytes / kMaxPieces + 1});
  for (; bytes > 0; bytes -= std::min(bytes, unit)) out.push_back(std::min(bytes, unit));
  return out;
}

// torch's workspaces: per handle (two in a step) one cuBLAS workspace (32 MiB on sm_90, 8 MiB + 128 KiB
// elsewhere) and one 1 MiB cuBLASLt workspace. A measured total is cut the same way: up to two cuBLAS
// workspaces, the rest 1 MiB cuBLASLt ones (the H200 run's 65 MiB: 32 + 32 + 1), else one piece.
std::vector<int64_t> workspaces(const DeviceProfile& device) {
  constexpr int64_t kLt = int64_t{1} << 20;
  const int64_t cublas = device.compute_capability == 90 ? 32 * kLt : 8 * kLt + 128 * 1024;
  std::vector<int64_t> out;
  int64_t left = device.workspace_bytes;
  for (int i = 0; i < 2 && left >= cublas; ++i, left -= cublas) out.push_back(cublas);
  if (left % kLt == 0 && left <= 2 * kLt) {
    for (; left > 0; left -= kLt) out.push_back(kLt);
  } else if (left > 0) {
    out.push_back(left);
  }
  return out;
}

AllocatorPeaks peaks(const CachingAllocatorModel& a) {
  return {a.peak_requested(), a.peak_allocated(), a.peak_reserved()};
}

// The streams a step allocates on. FSDP1 all-gathers a unit into a buffer made on its unshard stream and
// reduce-scatters its gradient into a shard made on its post-backward stream (torch 2.11,
// distributed/fsdp/_runtime_utils.py: _init_streams, _unshard, _reduce_grad), so those blocks are cached for
// their own stream only.
enum Stream : int { kDefaultStream = 0, kUnshardStream = 1, kPostBackwardStream = 2 };

class Replay {
 public:
  explicit Replay(AllocatorMode mode) : allocator_(mode) {}
  // Allocates every size (zeros skipped); returns the handles.
  std::vector<int64_t> alloc(const std::vector<int64_t>& sizes, int stream = kDefaultStream) {
    std::vector<int64_t> handles;
    for (int64_t b : sizes)
      if (b > 0) handles.push_back(allocator_.malloc(b, stream));
    return handles;
  }
  int64_t alloc(int64_t bytes, int stream = kDefaultStream) { return bytes > 0 ? allocator_.malloc(bytes, stream) : -1; }
  void release(std::vector<int64_t>& handles) {
    for (int64_t h : handles) allocator_.free(h);
    handles.clear();
  }
  void release(int64_t& handle) {
    if (handle >= 0) allocator_.free(handle);
    handle = -1;
  }
  CachingAllocatorModel& allocator() { return allocator_; }

 private:
  CachingAllocatorModel allocator_;
};

}  // namespace

AllocatorPeaks replay_training_steps(const ModelSpec& m, const TrainingSetup& s, const DeviceProfile& device,
                                     const MemoryBreakdown& persistent, AllocatorMode mode) {
  Replay r(mode);
  if (m.family == ModelFamily::ParamsOnly) {  // no shapes: the persistent state as one tensor per category
    r.alloc(workspaces(device));
    for (int64_t b : {persistent.weights, persistent.master_weights}) r.alloc(b);
    std::vector<int64_t> grads = r.alloc(std::vector<int64_t>{persistent.gradients});
    r.alloc(persistent.optimizer_states);
    r.allocator().reset_peaks();
    r.release(grads);
    r.alloc(std::vector<int64_t>{persistent.gradients});
    return peaks(r.allocator());
  }

  const std::vector<int64_t> trainable = in_layer_order(trainable_tensor_shapes(m, s), m.num_layers);
  const std::vector<int64_t> model_tensors = in_layer_order(model_tensor_shapes(m), m.num_layers);
  const std::vector<MemoryBreakdown> phases = phase_breakdowns(m, s, device, persistent);
  const ForwardSaved f = forward_saved(m, s, device);
  const int64_t L = std::max<int64_t>(m.num_layers, 1);
  const C tokens = C(s.micro_batch) * s.seq_len;
  const int64_t hidden_unit = (tokens * m.hidden_size * compute_dtype_bytes(s.precision)).get();
  const int64_t mlp_unit = (tokens * std::max<int64_t>(m.intermediate_size, 1) * compute_dtype_bytes(s.precision)).get();

  // Before the first step: the model, the master copy, torch's cuBLAS workspace.
  r.alloc(workspaces(device));
  if (model_frozen(s)) r.alloc(spread(persistent.weights, model_tensors));  // a frozen base and adapters
  else r.alloc(spread(persistent.weights, trainable));
  r.alloc(spread(persistent.master_weights, trainable));
  {  // what the features keep from the first forward on (the loop's logits)
    const StepContext context{m, s, device};
    for (const SetupFeature* f : features_of(s)) r.alloc(f->held_through_steps(context));
  }

  // One layer's saved tensors: attention and MLP tensors of their real widths, the rest hidden-sized.
  const int64_t per_layer = f.layers / L;
  std::vector<int64_t> layer_tensors;
  if (per_layer >= f.block_attention + f.block_mlp) {
    layer_tensors = pieces(f.block_attention, f.block_attention / 4);
    for (int64_t p : pieces(f.block_mlp, mlp_unit)) layer_tensors.push_back(p);
    for (int64_t p : pieces(per_layer - f.block_attention - f.block_mlp, hidden_unit)) layer_tensors.push_back(p);
  } else {
    layer_tensors = pieces(per_layer, hidden_unit);  // checkpointed layers keep their inputs
  }
  const std::vector<int64_t> grads = spread(persistent.gradients, trainable);
  const std::vector<int64_t> states = spread(persistent.optimizer_states, trainable);
  const MemoryBreakdown& loss = phases[static_cast<int>(StepPhase::LossBackward)];
  const MemoryBreakdown& attn = phases[static_cast<int>(StepPhase::AttentionBackward)];
  const MemoryBreakdown& step = phases[static_cast<int>(StepPhase::OptimizerStep)];
  const MemoryBreakdown& end = phases[static_cast<int>(StepPhase::BackwardEnd)];
  const bool accumulate = gradients_alive_in_forward(s);
  const bool foreach_temporaries = step.temporaries > 0 && s.optimizer_impl != OptimizerImpl::ForLoop && !device.is_cpu();
  int64_t held_in_backward = 0;  // gathered from the forward's start to the backward's end (FSDP1's root)
  for (const SetupFeature* feature : features_of(s)) held_in_backward += feature->gathered_through_backward(m, s);
  if (attn.temporaries < held_in_backward || end.temporaries < held_in_backward)  // a feature's two answers disagree
    throw std::logic_error("replay_training_steps: a backward moment's temporaries leave out what stays gathered");
  // FSDP1 on several GPUs: its gathers and gradient shards on their own streams; in a block's backward the block
  // and the prefetched one are gathered, the rest of the transient is the default stream's.
  const std::vector<const SetupFeature*> on = features_of(s);
  const bool side_streams =
      std::any_of(on.begin(), on.end(), [&](const SetupFeature* f) { return f->gathers_on_side_streams(s); });
  const int gather_stream = side_streams ? kUnshardStream : kDefaultStream;
  const int grad_stream = side_streams ? kPostBackwardStream : kDefaultStream;
  const int64_t blocks_gathered =
      side_streams ? std::max<int64_t>(0, unsharded_bytes(m, s, StepPhase::AttentionBackward) - held_in_backward) : 0;
  // FSDP1 use_orig_params under LoRA: each block's unsharded gradient in its backward, then its kept shard.
  const Fsdp1OrigGradients orig = fsdp1_orig_gradients(m, s);
  const std::vector<int64_t> gathered_units = blocks_gathered > 0 ? std::vector<int64_t>{blocks_gathered / 2,
                                                                                         blocks_gathered - blocks_gathered / 2}
                                                                  : std::vector<int64_t>{};

  std::vector<int64_t> state_handles, grad_handles, kept_shards;
  bool shards_alive = false;  // FSDP1 use_orig_params: the blocks' kept gradient shards exist
  for (int step_index = 0; step_index < 2; ++step_index) {
    if (step_index == 1) r.allocator().reset_peaks();  // the steady state: states exist, grads were freed
    if (accumulate && grad_handles.empty()) grad_handles = r.alloc(grads, grad_stream);
    if (!accumulate) {  // FSDP1 resets flat_param.grad at the forward
      r.release(kept_shards);
      shards_alive = false;
    }
    // Forward: what stays gathered, inputs, extras (autocast weight copies, RoPE tables), each layer, the head and
    // the loss.
    int64_t gathered = r.alloc(held_in_backward, gather_stream);
    int64_t inputs = r.alloc(f.inputs);
    std::vector<int64_t> extras = r.alloc(spread(f.extras, trainable));
    std::vector<std::vector<int64_t>> layers;
    for (int64_t l = 0; l < L; ++l) layers.push_back(r.alloc(layer_tensors));
    std::vector<int64_t> head = r.alloc(std::vector<int64_t>{f.final_norm, f.loss});
    // Loss backward: the logit gradients, then the head's tensors go.
    std::vector<int64_t> logit_grads = r.alloc(pieces(loss.logits - f.loss, loss.logits - f.loss));
    r.release(logit_grads);
    r.release(head);
    // Backward, last layer first: its gradients arrive, its transients come and go, its tensors are freed.
    const int64_t per_layer_grads = static_cast<int64_t>(grads.size()) / L;
    size_t next_grad = grads.size();
    for (int64_t l = L - 1; l >= 0; --l) {
      std::vector<int64_t> units = r.alloc(gathered_units, gather_stream);
      int64_t unit_grad = r.alloc(orig.unit);
      int64_t transient = r.alloc(attn.temporaries - held_in_backward - blocks_gathered);
      r.release(transient);
      r.release(units);
      if (!shards_alive)  // one layer's share (none when the shard is smaller than a byte per layer)
        for (int64_t h : r.alloc(std::vector<int64_t>{orig.kept / L}, grad_stream)) kept_shards.push_back(h);
      r.release(unit_grad);
      r.release(layers[static_cast<size_t>(l)]);
      if (!accumulate) {  // gradients appear as their layer's backward runs
        const size_t first = l == 0 ? 0 : next_grad - std::min<size_t>(next_grad, static_cast<size_t>(per_layer_grads));
        for (size_t i = first; i < next_grad; ++i)
          if (const int64_t h = r.alloc(grads[i], grad_stream); h >= 0) grad_handles.push_back(h);  // (0 bytes: none)
        next_grad = first;
      }
    }
    shards_alive = orig.kept > 0;
    int64_t tied = r.alloc(end.temporaries - held_in_backward);
    r.release(tied);
    r.release(gathered);
    r.release(extras);
    r.release(inputs);
    // Optimizer step: states once, then the step's own temporaries.
    if (state_handles.empty()) state_handles = r.alloc(states);
    if (foreach_temporaries) {
      std::vector<int64_t> temporaries = r.alloc(spread(step.temporaries, trainable));
      r.release(temporaries);
    } else {
      int64_t temporary = r.alloc(step.temporaries);
      r.release(temporary);
    }
    r.release(grad_handles);  // zero_grad(set_to_none=True)
  }
  return peaks(r.allocator());
}

}  // namespace gpuops::estimator
