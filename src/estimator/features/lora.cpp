// LoRA (TrainingSetup::lora, lora_dropout): its options, and what the forward saves with a frozen base and
// adapters. As PEFT runs it (docs/estimator.md, "What the forward saves"; FINDINGS.md, "LoRA (PEFT)"): the base
// is frozen, so a base linear saves no input (its weight gradient is never made) and a norm with a frozen weight
// keeps only what its input gradient needs; listed with saved_tensors_hooks on transformers 4.57 + PEFT 0.18
// Llama and GPT-2 blocks (fp32, bf16 base under autocast with fp32 adapters, pure bf16). Compiled, inductor's
// model of the block plus the adapters' low-rank intermediates. The adapters are the trainable tensors; the frozen
// base's bytes (16-bit, fp32 or quantised by bitsandbytes) and its dequantised weight in the backward.
#include <algorithm>
#include <cmath>
#include <memory>
#include <set>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gpuops/errors.h"
#include "gpuops/estimator/estimate.h"
#include "gpuops/estimator/param_tensors.h"
#include "gpuops/estimator/state_layout.h"
#include "setup_feature.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;

// PEFT's lora_dropout > 0: each block target's dropout(x) is a new N x in tensor that lora_A's matmul
// saves, plus its mask (the input dtype on the CPU, a 1-byte bool on CUDA).
C lora_dropout_bytes(const ModelSpec& m, const TrainingSetup& t, const Shape& x) {
  const auto names = projection_names(m);
  C bytes = 0;
  for (const auto& target : t.lora.targets)
    if (std::find(names.begin(), names.end(), target) != names.end())
      bytes += x.N * projection_shape(m, target).in_features * (x.e + x.mask);
  return bytes;
}

bool lora_targets(const TrainingSetup& t, std::string_view p) {
  return std::find(t.lora.targets.begin(), t.lora.targets.end(), p) != t.lora.targets.end();
}

// RMSNorm: its fp32 input (a copy when the stream is 16-bit) and rsqrt. LayerNorm: input, mean and rstd, in
// fp32 under autocast (which runs layer_norm in fp32).
C frozen_norm_bytes(const ModelSpec& m, const Shape& x) {
  if (m.norm == NormKind::RmsNorm) return x.N * x.h * 4 + x.N * 4;
  if (x.mode == Numerics::Half && !x.amp) return x.N * x.h * 2 + 2 * x.N * 2;
  return x.N * x.h * 4 + 2 * x.N * 4;
}

// The frozen MLP: SwiGLU keeps gate, up and silu(gate) (the product is down's input, saved only for an
// adapter); gelu_new keeps its input and 3 intermediates; a plain GELU its input.
C frozen_mlp_bytes(const ModelSpec& m, const Shape& x) {
  const C saved = m.mlp == MlpKind::SwiGlu ? 3 : (m.composite_gelu ? 4 : 1);
  return saved * x.N * x.i * x.e;
}

// Attention without eager's output-projection input (a frozen o saves none; an o adapter counts it).
C frozen_attention_bytes(const ForwardOps& inner, const ModelSpec& m, const TrainingSetup& t, const Shape& x) {
  const C full = inner.attention(m, t, x);
  return t.attention == AttentionKind::Eager ? full - x.Nq() * x.e : full;
}

// PEFT's dropout mask element: the adapter dtype on the CPU (fp32 adapters under autocast), a bool on CUDA.
C lora_dropout_mask_bytes(const Shape& x) { return x.cpu ? (x.amp ? C(4) : x.e) : C(1); }

// The adapters of one block: B saves x·A (N x r); A saves its input. Without dropout and autocast the
// targets reading one tensor share it: the attention norm's output (q, k, v), the MLP norm's output (gate,
// up), the MLP product (down); o reads SDPA's output, which the kernel saves already (eager: its own copy).
// Under autocast every A casts its input to 16 bits itself (PEFT casts x to the fp32 adapter dtype first):
// one copy per target, plus autocast's cached 16-bit A and B (extras). With lora_dropout each target keeps
// the dropout mask (the adapter dtype on the CPU, a bool on CUDA) and A's own input. `base_saves_inputs`: the
// base linears save their inputs anyway (FSDP1's use_orig_params), so A's shared input adds nothing.
C lora_adapter_bytes(const ModelSpec& m, const TrainingSetup& t, const Shape& x, bool base_saves_inputs = false) {
  const C mask = lora_dropout_mask_bytes(x);
  C bytes = 0;
  bool attention_input = false, mlp_input = false;
  for (const auto& p : projection_names(m)) {
    if (!lora_targets(t, p)) continue;
    const C in = projection_shape(m, p).in_features;
    bytes += x.N * t.lora.rank * x.e;
    if (t.lora_dropout > 0) {
      bytes += x.N * in * (x.e + mask);
    } else if (x.amp) {
      bytes += x.N * in * 2;
    } else if (base_saves_inputs) {
      continue;
    } else if (p == "o") {
      if (t.attention == AttentionKind::Eager) bytes += x.N * in * x.e;
    } else if (p == "down") {
      bytes += x.N * in * x.e;
    } else {
      (p == "up" || p == "gate" ? mlp_input : attention_input) = true;
    }
  }
  if (attention_input) bytes += x.N * x.h * x.e;
  if (mlp_input) bytes += x.N * x.h * x.e;
  return bytes;
}

// What bitsandbytes keeps of a quantised base for its backward (BnbVersion, training_setup.h): the int8
// matmul keeps its input (every release) and before 0.45.0 an int8 transposed copy per linear; the 4-bit
// matmul keeps its input before 0.43.2; either only for an input that requires grad. Linears reading one
// tensor keep it once: the attention norm's output (q, k, v, MLA's q_a, kv_a), the MLP norm's output (gate,
// up). o reads the SDPA kernel's output, which the kernel saves already (eager: a copy of its own). An
// adapter without dropout or autocast saves the very tensor its base keeps (counted with the adapters). In
// the first block the block input does not require grad; the later inputs are counted as requiring it
// (they do once an attention adapter ran: the safe side).
struct BnbKeeps {
  bool input = false, int8_copy = false;
};
BnbKeeps bnb_keeps(const LoraSetup& lora) {
  const bool nf4 = lora.base == BaseWeightDtype::Nf4 || lora.base == BaseWeightDtype::Nf4NoDq;
  const bool int8 = lora.base == BaseWeightDtype::Int8;
  return {int8 || (nf4 && lora.bnb_version < BnbVersion{0, 43, 2}), int8 && lora.bnb_version < BnbVersion{0, 45, 0}};
}

C quantised_base_bytes(const ModelSpec& m, const TrainingSetup& t, const Shape& x, bool first_block) {
  const BnbKeeps keeps = bnb_keeps(t.lora);
  if (!keeps.input) return 0;
  C bytes = 0;
  bool attention_input = false, mlp_input = false;    // a shared input is kept
  bool attention_saved = false, mlp_saved = false;    // ... and an adapter saves it already
  for (const auto& p : projection_names(m)) {
    const bool reads_attention_input = p == "q" || p == "k" || p == "v" || p == "q_a" || p == "kv_a";
    const bool reads_mlp_input = p == "gate" || p == "up";
    if (first_block && reads_attention_input) continue;
    const C in = projection_shape(m, p).in_features;
    if (keeps.int8_copy) bytes += x.N * in;
    const bool adapter_saves_it = lora_targets(t, p) && t.lora_dropout == 0 && !x.amp;
    if (reads_attention_input) {
      attention_input = true, attention_saved = attention_saved || adapter_saves_it;
    } else if (reads_mlp_input) {
      mlp_input = true, mlp_saved = mlp_saved || adapter_saves_it;
    } else if (!adapter_saves_it && (p != "o" || t.attention == AttentionKind::Eager)) {
      bytes += x.N * in * x.e;
    }
  }
  if (attention_input && !attention_saved) bytes += x.N * x.h * x.e;
  if (mlp_input && !mlp_saved) bytes += x.N * x.h * x.e;
  return bytes;
}

// The first block's input does not require grad (frozen embedding): nothing before its first adapter is
// saved. With checkpointing PEFT's enable_input_require_grads makes it require grad. Eager's q·kᵀ saves q
// only when k requires grad (a k adapter) and kᵀ only when q does (SDPA's kernel saves all three anyway).
// lora_dropout on the block's input (q, k, v adapters) saves no mask there, and under autocast A's 16-bit
// weight is not saved either (only x's gradient would need it).
C lora_first_block_unsaved(const ForwardOps& inner, const ModelSpec& m, const TrainingSetup& t, const Shape& x) {
  C unsaved = frozen_norm_bytes(m, x) + quantised_base_bytes(m, t, x, false) - quantised_base_bytes(m, t, x, true);
  for (const char* p : {"q", "k", "v"}) {
    if (!lora_targets(t, p)) continue;
    const C in = projection_shape(m, p).in_features;
    if (t.lora_dropout > 0) unsaved += x.N * in * lora_dropout_mask_bytes(x);
    if (x.amp) unsaved += 2 * C(t.lora.rank) * in;
  }
  if (!lora_targets(t, "q") && !lora_targets(t, "k") && !lora_targets(t, "v")) {  // attention out of the graph
    unsaved += frozen_attention_bytes(inner, m, t, x);
    return lora_targets(t, "o") ? unsaved : unsaved + frozen_norm_bytes(m, x);
  }
  if (t.attention == AttentionKind::Eager && !m.fused_qkv) {
    if (!lora_targets(t, "k")) unsaved += x.Nq() * x.e;
    if (!lora_targets(t, "q")) unsaved += x.Nq() * x.e;
  }
  return unsaved;
}

// 16-bit copies autocast caches of the adapters of one block (A and B, r x (in + out) per target).
C lora_autocast_weights(const ModelSpec& m, const TrainingSetup& t) {
  C n = 0;
  for (const auto& p : projection_names(m))
    if (lora_targets(t, p)) n += C(t.lora.rank) * (C(projection_shape(m, p).in_features) + projection_shape(m, p).out_features);
  return 2 * n;
}

// LoRA on lm_head / embed: B's matmul saves A's output, N x r (x·A; the embedding adapter's gather of
// lora_embedding_A saves the ids, which are the inputs already counted).
C outer_adapter_bytes(const TrainingSetup& t, const Shape& x) {
  return (static_cast<int64_t>(t.lora.targets.size()) - block_lora_target_count(t.lora)) * x.N * t.lora.rank * x.e;
}

// PEFT's eager LoRA: frozen norms, MLP and attention, the adapters, a quantised base's kept inputs. Under FSDP1
// with use_orig_params=True (`blocks_require_grad`) a block's weights, frozen ones too, are views of a flat
// parameter that requires grad: the block saves what a trainable one does, plus the adapters, and autocast caches
// nothing (views are not cached); the root unit (embeddings, final norm, head) stays frozen.
class PeftOps final : public WrappedOps {
 public:
  PeftOps(const ForwardOps& inner, bool blocks_require_grad) : WrappedOps(inner), trained_(blocks_require_grad) {}
  C attention(const ModelSpec& m, const TrainingSetup& t, const Shape& x) const override {
    return trained_ ? inner_.attention(m, t, x) : frozen_attention_bytes(inner_, m, t, x);
  }
  C mlp(const ModelSpec& m, const Shape& x) const override {
    return trained_ ? inner_.mlp(m, x) : frozen_mlp_bytes(m, x);
  }
  // Frozen norms (Gemma-2's post-norms too), the adapters, a quantised base's kept inputs, residual dropout.
  C block_other(const ModelSpec& m, const TrainingSetup& t, const Shape& x) const override {
    if (trained_) return inner_.block_other(m, t, x) + lora_adapter_bytes(m, t, x, true);
    C bytes = C(std::max<int64_t>(m.norms_per_layer, 2)) * frozen_norm_bytes(m, x) + lora_adapter_bytes(m, t, x) +
              quantised_base_bytes(m, t, x, false);
    if (m.dropout) bytes += 2 * x.N * x.h * x.mask;
    return bytes;
  }
  C first_block_unsaved(const ModelSpec& m, const TrainingSetup& t, const Shape& x) const override {
    return trained_ ? inner_.first_block_unsaved(m, t, x) : lora_first_block_unsaved(inner_, m, t, x);
  }
  // Only the adapters are cached (a frozen weight's cast is not: it does not require grad).
  C autocast_copies(const ModelSpec& m, const TrainingSetup& t, const Shape& x, int64_t layers) const override {
    return x.amp && !trained_ ? C(layers) * lora_autocast_weights(m, t) : C(0);
  }
  // The outer adapters, and a quantised LM head's kept input (like the block linears').
  C outer_extras(const ModelSpec& m, const TrainingSetup& t, const Shape& x) const override {
    C bytes = inner_.outer_extras(m, t, x) + outer_adapter_bytes(t, x);
    if (t.lora.quantize_lm_head) {
      const BnbKeeps keeps = bnb_keeps(t.lora);
      const C Nh = x.N * x.h;
      bytes += (keeps.input ? Nh * x.e : C(0)) + (keeps.int8_copy ? Nh : C(0));
    }
    return bytes;
  }
  C final_norm(const ModelSpec& m, const Shape& x) const override { return frozen_norm_bytes(m, x); }

 private:
  bool trained_;
};

// Compiled LoRA: inductor's block, each adapter's x·A for B's gradient (frozen linears counted as saving their
// inputs: conservative) and its dropout's tensors; no autocast copies.
class CompiledLoraOps final : public WrappedOps {
 public:
  using WrappedOps::WrappedOps;
  C block_other(const ModelSpec& m, const TrainingSetup& t, const Shape& x) const override {
    C bytes = inner_.block_other(m, t, x) + block_lora_target_count(t.lora) * x.N * t.lora.rank * x.e;
    if (t.lora_dropout > 0) bytes += lora_dropout_bytes(m, t, x);
    return bytes;
  }
  C autocast_copies(const ModelSpec&, const TrainingSetup&, const Shape&, int64_t) const override { return 0; }
  C outer_extras(const ModelSpec& m, const TrainingSetup& t, const Shape& x) const override {
    return inner_.outer_extras(m, t, x) + outer_adapter_bytes(t, x);
  }
};

// Quantised storage of one frozen linear weight (bias stays 16-bit).
int64_t quantised_linear_bytes(const LinearShape& l, BaseWeightDtype dtype) {
  const C bias = l.bias ? 2 * C(l.out_features) : 0;
  return (quantised_weight_bytes(l.in_features, l.out_features, dtype) + bias).get();  // see state_layout.h
}

// PEFT's adapters: lora_A r x in and lora_B out x r per block target and layer; the LM head's A r x h and B V x r;
// the embedding's lora_embedding_A r x V and lora_embedding_B h x r.
std::vector<ParamTensor> adapter_tensors(const ModelSpec& m, const LoraSetup& lora) {
  std::vector<ParamTensor> out;
  const auto matrix = [&](int64_t rows, int64_t cols, int64_t count, bool root) {
    ParamTensor t;
    t.rows = rows, t.cols = cols, t.count = count, t.root = root;
    out.push_back(t);
  };
  for (const auto& t : lora.targets) {
    if (t == "embed") {
      matrix(lora.rank, m.vocab_size, 1, true);
      matrix(m.hidden_size, lora.rank, 1, true);
      continue;
    }
    const bool outer = is_outer_lora_target(t);
    const LinearShape l = outer ? outer_lora_shape(m, t) : projection_shape(m, t);
    const int64_t count = outer ? 1 : m.num_layers;
    matrix(lora.rank, l.in_features, count, outer);
    matrix(l.out_features, lora.rank, count, outer);
  }
  return out;
}

class LoraFeature final : public SetupFeature {
 public:
  void validate(const TrainingSetup& s, const ModelSpec& m) const override {
    const LoraSetup& lora = s.lora;
    GPUOPS_CHECK_ARG(std::isfinite(s.lora_dropout) && s.lora_dropout >= 0.0 && s.lora_dropout < 1.0,
                     "lora-dropout {} is not accepted; accepted: a probability 0 <= p < 1", s.lora_dropout);
    GPUOPS_CHECK_ARG(s.lora_dropout == 0.0 || lora.rank > 0,
                     "lora-dropout {} needs LoRA; accepted: lora-dropout 0 without lora-rank, or lora-rank >= 1",
                     s.lora_dropout);
    if (lora.quantize_lm_head) {
      GPUOPS_CHECK_ARG(lora.rank > 0 && is_quantised_base(lora.base),
                       "quantize-lm-head needs a quantised LoRA base; accepted with lora-rank >= 1 and base-dtype "
                       "int8, nf4 or nf4-nodq, got lora-rank {} and base-dtype {}", lora.rank, to_string(lora.base));
      GPUOPS_CHECK_ARG(m.family == ModelFamily::Decoder && !m.tied_embeddings,
                       "quantize-lm-head needs an untied LM head; model '{}' has {}; accepted: a decoder with "
                       "tie_word_embeddings false", m.name,
                       m.family == ModelFamily::Decoder ? "its LM head tied to the embeddings" : "no separate LM head");
    }
    GPUOPS_CHECK_ARG(lora.rank >= 0, "lora-rank must be >= 0 (0 = no LoRA), got {}", lora.rank);
    if (lora.rank == 0) {
      GPUOPS_CHECK_ARG(!is_quantised_base(lora.base),
                       "base-dtype {} needs LoRA (a quantised base cannot be trained); give lora-rank >= 1 or "
                       "base-dtype fp16/bf16", to_string(lora.base));
      return;
    }
    GPUOPS_CHECK_ARG(m.family != ModelFamily::ParamsOnly,
                     "lora-rank needs an architecture (a preset or a config.json), not a bare parameter count");
    GPUOPS_CHECK_ARG(lora.rank <= m.hidden_size, "lora-rank {} exceeds hidden_size {} of model '{}'; accepted: 1 to "
                     "{}", lora.rank, m.hidden_size, m.name, m.hidden_size);
    GPUOPS_CHECK_ARG(!lora.targets.empty(), "lora-targets is empty; accepted: a comma list of {}",
                     fmt::join(projection_names(m), ","));
    auto names = projection_names(m);
    // Outside the blocks: PEFT's "lm_head" (a model with an LM head) and "embed_tokens" / word embeddings.
    const bool lm_head = has_lm_head(m);
    if (lm_head) names.push_back("lm_head");
    names.push_back("embed");
    std::set<std::string> seen;
    for (const auto& t : lora.targets) {
      GPUOPS_CHECK_ARG(t != "lm_head" || lm_head, "lora-targets 'lm_head': model '{}' has no LM head; accepted: {}",
                       m.name, fmt::join(names, ","));
      GPUOPS_CHECK_ARG(std::find(names.begin(), names.end(), t) != names.end(),
                       "lora-targets '{}' is not a projection of model '{}'; accepted: {}", t, m.name,
                       fmt::join(names, ","));
      GPUOPS_CHECK_ARG(seen.insert(t).second, "lora-targets lists '{}' twice; accepted: each of {} at most once", t,
                       fmt::join(names, ","));
    }
  }
  bool on(const TrainingSetup& s) const override { return s.lora.rank > 0; }
  std::optional<std::vector<ParamTensor>> trainable_tensors(const ModelSpec& m,
                                                            const TrainingSetup& s) const override {
    return adapter_tensors(m, s.lora);
  }
  bool freezes_model() const override { return true; }
  // A 16-bit base makes the residual stream 16-bit even under autocast.
  bool stream_in_16_bits(const TrainingSetup& s) const override { return s.lora.base != BaseWeightDtype::Fp32; }
  // A quantised base weight is dequantised for its matmul, in 16 bits.
  int64_t backward_transients(const ModelSpec& m, const TrainingSetup& s) const override {
    return (2 * C(largest_quantised_weight_elements(m, s))).get();
  }
  std::unique_ptr<ForwardOps> forward_ops(const TrainingSetup& s, const ForwardOps& inner) const override {
    if (s.compile) return std::make_unique<CompiledLoraOps>(inner);
    return std::make_unique<PeftOps>(inner, fsdp1_blocks_require_grad(s));
  }
};

}  // namespace

int64_t lora_parameter_count(const ModelSpec& m, const LoraSetup& lora) {
  if (lora.rank == 0 || m.family == ModelFamily::ParamsOnly) return 0;
  C n = 0;
  for (const ParamTensor& t : adapter_tensors(m, lora)) n += C(t.count) * t.elements();
  return n.get();
}

int64_t frozen_weight_bytes(const ModelSpec& m, const TrainingSetup& s) {
  if (s.lora.rank == 0) return 0;
  const BaseWeightDtype base = s.lora.base;
  const int64_t total = parameter_count(m);
  if (base == BaseWeightDtype::Fp16 || base == BaseWeightDtype::Bf16) return (2 * C(total)).get();
  if (base == BaseWeightDtype::Fp32) return (4 * C(total)).get();
  // bitsandbytes quantises the linears inside the blocks; embeddings, norms and the LM head stay 16-bit.
  C linear_params = 0, linear_bytes = 0;
  for (const auto& g : block_linears(m)) {  // every block linear, MoE experts and routers included
    linear_params += C(g.count) * g.shape.parameters();
    linear_bytes += C(g.count) * quantised_linear_bytes(g.shape, base);
  }
  C bytes = linear_bytes + 2 * (total - linear_params);
  if (s.lora.quantize_lm_head)  // the untied V x h LM head stored like the base linears
    bytes = bytes - 2 * C(m.vocab_size) * m.hidden_size + quantised_weight_bytes(m.hidden_size, m.vocab_size, base);
  return bytes.get();
}

int64_t largest_quantised_weight_elements(const ModelSpec& m, const TrainingSetup& s) {
  if (s.lora.rank == 0 || m.family == ModelFamily::ParamsOnly || !is_quantised_base(s.lora.base)) return 0;
  C largest = s.lora.quantize_lm_head ? C(m.vocab_size) * m.hidden_size : C(0);
  for (const auto& g : block_linears(m))  // experts included
    largest = std::max(largest, C(g.shape.in_features) * g.shape.out_features);
  return largest.get();
}

int64_t quantisation_statistics_bytes(const ModelSpec& m, const TrainingSetup& s) {
  if (s.lora.rank == 0 || !is_quantised_base(s.lora.base)) return 0;
  const auto statistics = [&](int64_t in, int64_t out) {  // all but the packed values
    const C n = C(in) * out;
    const C packed = s.lora.base == BaseWeightDtype::Int8 ? n : C(ceil_div(n.get(), 2));
    return C(quantised_weight_bytes(in, out, s.lora.base)) - packed;
  };
  C bytes = 0;
  for (const auto& g : block_linears(m)) bytes += C(g.count) * statistics(g.shape.in_features, g.shape.out_features);
  if (s.lora.quantize_lm_head) bytes += statistics(m.hidden_size, m.vocab_size);
  return bytes.get();
}

const SetupFeature& lora_feature() {
  static const LoraFeature feature;
  return feature;
}

}  // namespace gpuops::estimator
