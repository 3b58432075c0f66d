#pragma once
// The parameter tensors of a model, one entry per shape (with a multiplicity), and the trainable ones of a
// setup (the model's, or the LoRA adapters'). What per-tensor bookkeeping needs: Adafactor's factored
// states, FSDP2's per-tensor dim-0 padding, bitsandbytes' paged-state threshold.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "gpuops/estimator/model_spec.h"
#include "gpuops/estimator/training_setup.h"

namespace gpuops::estimator {

/// `count` tensors of `rows` x `cols` (cols == 0: a 1-D tensor of `rows` values).
struct ParamTensor {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t count = 1;
  bool root = false;       ///< outside the blocks (embeddings, final norm, LM head): FSDP2's root module
  bool quantisable = false;  ///< a linear weight bitsandbytes quantises in an int8/nf4 base (in a block)
  bool lm_head = false;    ///< the untied LM head weight (quantised only with quantize_lm_head)
  int64_t elements() const { return (CheckedInt(rows) * (cols == 0 ? 1 : cols)).get(); }
};

/// Every parameter tensor of the Hugging Face class (tied weights once); empty for ParamsOnly. The sum of
/// count x elements is parameter_count(model) and the sum of count is parameter_tensor_count(model).
std::vector<ParamTensor> model_tensor_shapes(const ModelSpec& model);

/// LoRA target names outside the blocks: "lm_head" (the LM head) and "embed" (the token embedding).
bool is_outer_lora_target(std::string_view target);

/// Number of targets inside each block (setup.lora.targets minus lm_head and embed).
int64_t block_lora_target_count(const LoraSetup& lora);

/// Shape (in_features -> out_features) of an outer target: lm_head h -> V, embed V -> h.
LinearShape outer_lora_shape(const ModelSpec& model, std::string_view target);

/// The tensors that get gradients and optimizer states: model_tensor_shapes, or with LoRA the adapters as
/// PEFT makes them: lora_A r x in and lora_B out x r per block target and layer; the LM head's A r x h
/// and B V x r; the embedding's lora_embedding_A r x V and lora_embedding_B h x r.
std::vector<ParamTensor> trainable_tensor_shapes(const ModelSpec& model, const TrainingSetup& setup);

/// Elements of one shard of `t` under FSDP2 on `num_gpus` GPUs: torch.chunk on dim 0, every rank padded to
/// the first chunk, ceil(rows / num_gpus) x cols.
int64_t fsdp2_shard_elements(const ParamTensor& t, int64_t num_gpus);

}  // namespace gpuops::estimator
