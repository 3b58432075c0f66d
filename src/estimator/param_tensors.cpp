// The parameter tensors of a model and the trainable tensors of a setup, by shape (see param_tensors.h).
#include "gpuops/estimator/param_tensors.h"

#include <algorithm>

#include <fmt/format.h>

#include "gpuops/errors.h"
#include "features/setup_feature.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;

ParamTensor vector_of(int64_t n, int64_t count, bool root = false) {
  ParamTensor t;
  t.rows = n;
  t.count = count;
  t.root = root;
  return t;
}

ParamTensor matrix_of(int64_t rows, int64_t cols, int64_t count, bool root = false) {
  ParamTensor t = vector_of(rows, count, root);
  t.cols = cols;
  return t;
}

int64_t sum_elements(const std::vector<ParamTensor>& ts) {
  C n = 0;
  for (const auto& t : ts) n += C(t.count) * t.elements();
  return n.get();
}

}  // namespace

std::vector<ParamTensor> model_tensor_shapes(const ModelSpec& m) {
  std::vector<ParamTensor> out;
  if (m.family == ModelFamily::ParamsOnly) return out;
  const int64_t h = m.hidden_size, L = m.num_layers;
  const bool layer_norm = m.norm == NormKind::LayerNorm;
  const auto add_norm = [&](int64_t count, bool root) {  // weight, and LayerNorm's bias
    out.push_back(vector_of(h, count, root));
    if (layer_norm) out.push_back(vector_of(h, count, root));
  };
  // Embeddings: nn.Embedding weights are num_embeddings x h.
  out.push_back(matrix_of(m.vocab_size, h, 1, true));
  if (m.learned_positions) out.push_back(matrix_of(m.max_positions, h, 1, true));
  if (m.type_vocab_size > 0) out.push_back(matrix_of(m.type_vocab_size, h, 1, true));
  if (m.family == ModelFamily::Encoder) add_norm(1, true);  // BERT's embedding LayerNorm (weight and bias)
  // Block linears: nn.Linear weights are out x in, GPT-2's Conv1D in x out. Fused linears are one tensor:
  // GPT-2's c_attn and Phi-3's qkv_proj (q, k, v), Phi-3's gate_up_proj (gate, up).
  const bool conv1d = m.fused_qkv && m.learned_positions;  // GPT-2
  const auto add_linear = [&](int64_t in, int64_t out_features, bool bias, int64_t count) {
    ParamTensor w = conv1d ? matrix_of(in, out_features, count) : matrix_of(out_features, in, count);
    w.quantisable = true;
    out.push_back(w);
    if (bias) out.push_back(vector_of(out_features, count));
  };
  struct Fused {
    C out = 0;
    int64_t in = 0, count = 0;
    bool bias = false;
  } qkv, gate_up;
  for (const auto& g : block_linears(m)) {
    const LinearShape& l = g.shape;
    Fused* fused = m.fused_qkv && (g.name == "q" || g.name == "k" || g.name == "v")  ? &qkv
                   : m.fused_gate_up && (g.name == "gate" || g.name == "up")         ? &gate_up
                                                                                    : nullptr;
    if (fused == nullptr) {
      add_linear(l.in_features, l.out_features, l.bias, g.count);
      continue;
    }
    fused->out += l.out_features;
    fused->in = l.in_features;
    fused->count = g.count;
    fused->bias = fused->bias || l.bias;
  }
  for (const Fused* f : {&qkv, &gate_up})
    if (f->count > 0) add_linear(f->in, f->out.get(), f->bias, f->count);
  if (m.norms_per_layer > 0) add_norm((C(L) * m.norms_per_layer).get(), false);
  // Outside the blocks.
  if (m.family == ModelFamily::Decoder) {
    add_norm(1, true);
    if (!m.tied_embeddings) {
      ParamTensor head = matrix_of(m.vocab_size, h, 1, true);
      head.lm_head = true;
      out.push_back(head);
    }
  } else if (m.masked_lm_head) {  // transform dense + bias, LayerNorm, the (tied) decoder's bias
    out.push_back(matrix_of(h, h, 1, true));
    out.push_back(vector_of(h, 1, true));
    add_norm(1, true);
    out.push_back(vector_of(m.vocab_size, 1, true));
  } else {  // BertModel's pooler
    out.push_back(matrix_of(h, h, 1, true));
    out.push_back(vector_of(h, 1, true));
  }
  // Vectors this list does not name (norms inside MLA attention, routers' biases...): one per layer.
  const int64_t rest = (C(parameter_count(m)) - sum_elements(out)).get();
  if (rest > 0) {
    if (rest % L == 0) out.push_back(vector_of(rest / L, L));
    else out.push_back(vector_of(rest, 1));
  }
  return out;
}

bool is_outer_lora_target(std::string_view t) { return t == "lm_head" || t == "embed"; }

int64_t block_lora_target_count(const LoraSetup& lora) {
  return static_cast<int64_t>(
      std::count_if(lora.targets.begin(), lora.targets.end(), [](const auto& t) { return !is_outer_lora_target(t); }));
}

LinearShape outer_lora_shape(const ModelSpec& m, std::string_view t) {
  if (t == "lm_head") return {m.hidden_size, m.vocab_size, false};
  if (t == "embed") return {m.vocab_size, m.hidden_size, false};
  throw ArgumentError(fmt::format("lora-targets '{}' is not a target outside the blocks; accepted: lm_head, embed", t));
}

std::vector<ParamTensor> trainable_tensor_shapes(const ModelSpec& m, const TrainingSetup& s) {
  if (auto own = feature_trainable_tensors(m, s)) return *own;  // LoRA's adapters (features/lora.cpp)
  return model_tensor_shapes(m);
}

int64_t fsdp2_shard_elements(const ParamTensor& t, int64_t num_gpus) {
  return (C(ceil_div(t.rows, num_gpus)) * (t.cols == 0 ? 1 : t.cols)).get();
}

}  // namespace gpuops::estimator
