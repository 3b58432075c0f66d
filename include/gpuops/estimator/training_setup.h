#pragma once
// How a model is trained: precision, optimizer, ZeRO, checkpointing, attention kernel, LoRA, sizes.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "gpuops/estimator/model_spec.h"

namespace gpuops::estimator {

/// fp32: everything fp32. fp16-mixed / bf16-mixed: 16-bit matmuls, weights kept as AmpLayout says.
/// bf16: pure bf16 weights, gradients, optimizer states and activations.
enum class Precision { Fp32, Fp16Mixed, Bf16Mixed, Bf16Pure };
/// Where mixed precision keeps its weights. Autocast (torch.autocast, HF Trainer, Lightning): fp32 weights
/// and gradients, 16-bit copies of the matmul weights cached per forward. MasterCopy (ZeRO, Megatron,
/// gpuops §4): 16-bit weights and gradients, an fp32 master copy, the model run in 16 bits.
enum class AmpLayout { Autocast, MasterCopy };
enum class OptimizerKind { AdamW, Adam, Sgd, SgdMomentum, AdamW8bit };
/// How the optimizer step is computed. Default: torch's default for the device (for-loop on the CPU,
/// foreach on CUDA). ForLoop: one parameter at a time. Foreach: whole-list temporaries. Fused: none.
enum class OptimizerImpl { Default, ForLoop, Foreach, Fused };
/// None: keep every activation. Full: checkpoint every layer. EveryK: checkpoint every k-th layer.
enum class CheckpointKind { None, Full, EveryK };
/// Eager keeps the s x s attention matrices. Sdpa: torch's scaled_dot_product_attention as Hugging Face
/// calls it (the default); on CUDA that is a flash / memory-efficient kernel, on the CPU a flash kernel
/// given a materialised causal mask. Flash: FlashAttention, no s x s tensor anywhere.
enum class AttentionKind { Eager, Sdpa, Flash };
/// Storage of the frozen base weights of a LoRA fine-tune (int8: LLM.int8, nf4: QLoRA).
enum class BaseWeightDtype { Fp16, Bf16, Int8, Nf4 };

/// LoRA adapters; rank 0 means a full fine-tune.
struct LoraSetup {
  int64_t rank = 0;                                 ///< 0 = LoRA off
  std::vector<std::string> targets = {"q", "v"};    ///< projections of each block: q,k,v,o,gate,up,down
  BaseWeightDtype base = BaseWeightDtype::Bf16;     ///< frozen base weights
};

/// One training configuration, per GPU where it matters (micro_batch is per GPU).
struct TrainingSetup {
  Precision precision = Precision::Bf16Mixed;
  AmpLayout amp = AmpLayout::Autocast;  ///< mixed precision only
  OptimizerKind optimizer = OptimizerKind::AdamW;
  OptimizerImpl optimizer_impl = OptimizerImpl::Default;
  int zero_stage = 0;          ///< 0-3; states are divided by num_gpus from stage 1 (see estimate.h)
  int64_t num_gpus = 1;        ///< data-parallel world size
  CheckpointKind checkpoint = CheckpointKind::None;
  int64_t checkpoint_every_k = 1;  ///< EveryK only
  AttentionKind attention = AttentionKind::Sdpa;
  LoraSetup lora;
  int64_t micro_batch = 1;     ///< sequences per GPU per forward/backward
  int64_t seq_len = 512;       ///< tokens per sequence
  int64_t grad_accum = 1;      ///< micro-batches per optimizer step (> 1 keeps gradients alive in backward)
};

/// Throws ArgumentError naming the first setting that is out of range or inconsistent with `model`.
void validate(const TrainingSetup& setup, const ModelSpec& model);

/// Parsers accept the names below (case-insensitive) and throw ArgumentError listing them otherwise.
Precision parse_precision(std::string_view text);              ///< fp32, fp16-mixed, bf16-mixed, bf16
AmpLayout parse_amp_layout(std::string_view text);             ///< autocast, master-copy
OptimizerKind parse_optimizer(std::string_view text);          ///< adamw, adam, sgd, sgd-momentum, adamw-8bit
OptimizerImpl parse_optimizer_impl(std::string_view text);     ///< default, for-loop, foreach, fused
AttentionKind parse_attention(std::string_view text);          ///< eager, sdpa, flash
BaseWeightDtype parse_base_dtype(std::string_view text);       ///< fp16, bf16, int8, nf4
/// none, full, every:K (K >= 1); sets setup.checkpoint and setup.checkpoint_every_k.
void parse_checkpointing(std::string_view text, TrainingSetup& setup);

std::string_view to_string(Precision p);
std::string_view to_string(AmpLayout a);
std::string_view to_string(OptimizerKind o);
std::string_view to_string(OptimizerImpl o);
std::string_view to_string(AttentionKind a);
std::string_view to_string(BaseWeightDtype b);
/// none, full or every:K.
std::string checkpointing_to_string(const TrainingSetup& setup);

/// Bytes of one element of the 16-bit-or-fp32 compute dtype (activations, logits): 4 for fp32, else 2.
int64_t compute_dtype_bytes(Precision p);

/// True for fp16-mixed and bf16-mixed.
bool is_mixed(Precision p);

/// True when the model itself runs in 16 bits: pure bf16, or mixed precision with a master copy.
bool runs_in_16_bits(const TrainingSetup& setup);

}  // namespace gpuops::estimator
