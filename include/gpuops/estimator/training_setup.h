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
/// Adafactor: transformers.optimization.Adafactor's defaults (factored fp32 second moment, no first moment).
/// PagedAdamW8bit / PagedAdamW32bit: bitsandbytes' paged optimizers (states in CUDA unified memory).
/// GpuopsAdamW8bit: gpuops.optim.AdamW(state_bits=8), block-wise 8-bit moments (features/gpuops_adam8.cpp).
enum class OptimizerKind {
  AdamW, Adam, Sgd, SgdMomentum, AdamW8bit, Adafactor, PagedAdamW8bit, PagedAdamW32bit, GpuopsAdamW8bit
};
/// How the optimizer step is computed. Default: torch's default for the device (for-loop on the CPU,
/// foreach on CUDA). ForLoop: one parameter at a time. Foreach: whole-list temporaries. Fused: none.
enum class OptimizerImpl { Default, ForLoop, Foreach, Fused };
/// None: keep every activation. Full: checkpoint every layer. EveryK: checkpoint every k-th layer.
/// Selective: op-level selective checkpointing of every block (torch.utils.checkpoint, non-reentrant, with
/// torchtitan's "op" policy: every other aten.mm output and the CUDA SDPA outputs are kept, the rest recomputed).
enum class CheckpointKind { None, Full, EveryK, Selective };
/// Eager keeps the s x s attention matrices. Sdpa: torch's scaled_dot_product_attention as Hugging Face
/// calls it (the default); on CUDA that is a flash / memory-efficient kernel, on the CPU a flash kernel
/// given a materialised causal mask. Flash: FlashAttention, no s x s tensor anywhere.
enum class AttentionKind { Eager, Sdpa, Flash };
/// Storage of the frozen base weights of a LoRA fine-tune (int8: LLM.int8, nf4: QLoRA).
/// Nf4 has QLoRA's double quantisation (8-bit absmax); Nf4NoDq keeps one fp32 absmax per 64 values.
/// Fp32: an fp32 base (the model left in fp32, PEFT's adapters fp32 too).
enum class BaseWeightDtype { Fp16, Bf16, Int8, Nf4, Nf4NoDq, Fp32 };
/// How ZeRO stage 3 shards: Flat (DeepSpeed's flat partitions, one ceil over all parameters), Fsdp2 (torch's
/// fully_shard: every tensor chunked on dim 0, padded to ceil(rows / num_gpus) rows), Gpuops (gpuops'
/// ZeroOptimizer(stage=3): one flat buffer per unit, the rest of the model unit 0 and each block one unit, fp32
/// gradient shards, zero_prefetch units gathered ahead) or Fsdp1 (torch's FullyShardedDataParallel, FULL_SHARD:
/// DeepSpeed's flat partitions without its gradient bucket; the root unit, the model outside the wrapped blocks,
/// stays gathered from its forward to the end of the backward).
enum class ShardingLayout { Flat, Fsdp2, Gpuops, Fsdp1 };

/// How the loss is computed from the last hidden state. Standard: Hugging Face's LM head and cross-entropy
/// (log-softmax of all logits). Chunked: torchtune's CEWithChunkedOutputLoss / litgpt's chunked_cross_entropy,
/// the logits in `loss_chunks` token chunks. Both upcast the logits to fp32 before the log-softmax unless
/// TrainingSetup::loss_upcast is false. FusedLinearCe: Liger's fused linear cross-entropy (no logits;
/// gradients computed in the forward).
enum class LossKind { Standard, Chunked, FusedLinearCe };

/// A bitsandbytes release, major.minor.patch. Which one runs an int8/nf4 base changes what the base's matmuls
/// keep for the backward (bitsandbytes/autograd/_functions.py, read in each wheel): MatMul4Bit keeps its
/// input until 0.43.1 and nothing from 0.43.2 on; MatMul8bitLt keeps its input in every release, and before
/// 0.45.0 an int8 transposed copy of it too. The default is the behaviour of 0.45.0 and every later release.
struct BnbVersion {
  int major = 0, minor = 45, patch = 0;
  friend bool operator<(const BnbVersion& a, const BnbVersion& b) {
    return a.major != b.major ? a.major < b.major : a.minor != b.minor ? a.minor < b.minor : a.patch < b.patch;
  }
};

/// What the training loop keeps of the model's output through the backward (and, until the next forward
/// replaces it, the step). None: only the loss (Hugging Face's Trainer). Model: the logits in the LM head's
/// output dtype (`out = model(**batch); out.loss.backward()`, as transformers' no_trainer examples and most
/// hand-written loops do: out.logits stays alive). Fp32: fp32 logits (torchtune before 0.3 upcasts them in
/// the model, `self.output(h).float()`, and its recipe keeps `logits` through `loss.backward()`).
enum class HeldLogits { None, Model, Fp32 };

/// The code the model runs. HuggingFace: the transformers class of the architecture. LitGpt: LitGPT's own model
/// (`litgpt.model.GPT`), which projects q, k and v with one fused linear on every architecture; with RoPE the v
/// attention saves is a view of that linear's output and keeps its q and k parts alive too.
enum class ModelCode { HuggingFace, LitGpt };

/// FSDP2's MixedPrecisionPolicy(reduce_dtype=...): Grad (None, the default) reduce-scatters the gradients in
/// their own dtype; Fp32 in float32 (torchtitan's default with bf16 parameters).
enum class ReduceDtype { Grad, Fp32 };

/// LoRA adapters; rank 0 means a full fine-tune.
struct LoraSetup {
  int64_t rank = 0;                                 ///< 0 = LoRA off
  std::vector<std::string> targets = {"q", "v"};    ///< projections of each block: q,k,v,o,gate,up,down;
                                                    ///< and outside the blocks: lm_head, embed
  BaseWeightDtype base = BaseWeightDtype::Bf16;     ///< frozen base weights
  bool quantize_lm_head = false;  ///< int8/nf4 base: the (untied) LM head is stored like the base linears
  BnbVersion bnb_version;         ///< int8/nf4 base: the bitsandbytes release it runs on
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
  int64_t seq_len = 512;       ///< tokens per sequence (gpuops estimate and gpuops.estimate(): default_seq_len)
  int64_t grad_accum = 1;      ///< micro-batches per optimizer step (> 1 keeps gradients alive in backward)
  /// zero_grad(set_to_none=...): true (torch >= 2.0's default) frees the gradients between steps; false
  /// (torch < 2.0's default, and the Hugging Face Trainer on it) keeps them allocated, zeroed.
  bool grads_set_to_none = true;
  /// ZeRO stages 1-2: where the gradients are reduced. false ("backward"): from gradient hooks in buckets
  /// while backward runs (DeepSpeed, Megatron): stage 2 holds 1/N of them. true ("step"): gpuops'
  /// ZeroOptimizer, which keeps the full flat gradient from zero_grad() and reduce-scatters it at the step;
  /// stage 2 (and 16-bit parameters) add the fp32 gradient shard.
  bool zero_reduce_at_step = false;
  /// ZeRO stages 1-2 reduced in the backward (zero_reduce_at_step false): 0 models DeepSpeed and Megatron
  /// (their own bucket buffers are not counted); B > 0 models gpuops' ZeroOptimizer(reduce_in_backward=true,
  /// bucket_bytes=B): an fp32 gradient shard from construction on (stage 1 also keeps the flat gradient),
  /// and in the backward each bucket's whole buffer from its first gradient to its reduction, at most three
  /// buckets (two reducing, one filling) with their reduced shards.
  int64_t zero_bucket_bytes = 0;
  // Activation-side setups (docs/estimator.md, "Checkpointing policies, chunked loss, LoRA dropout,
  // torch.compile").
  LossKind loss = LossKind::Standard;
  int64_t loss_chunks = 8;     ///< Chunked only: token chunks (torchtune's num_output_chunks)
  /// Standard and Chunked: the logits are cast to fp32 before the log-softmax (Hugging Face, torchtune,
  /// torchtitan; also any loss run inside torch.autocast, which runs cross_entropy in fp32). false: cross_entropy
  /// on the compute-dtype logits outside autocast (lightning-thunder's benchmark; LitGPT's loss function too, but
  /// Fabric hands it fp32 logits); docs/estimator.md lists which frameworks do which.
  bool loss_upcast = true;
  double lora_dropout = 0.0;   ///< PEFT lora_dropout, 0 <= p < 1 (LoRA only)
  bool compile = false;        ///< torch.compile (inductor's min-cut partition of the joint graph)
  HeldLogits held_logits = HeldLogits::None;  ///< logits the loop keeps alive (an LM head only)
  ModelCode model_code = ModelCode::HuggingFace;  ///< the model's implementation (a decoder with RoPE for litgpt)
  // Optimizer placement and sharding layout (docs/estimator.md, "Optimizers, offload and sharding").
  bool offload_optimizer = false;           ///< ZeRO-Offload: states, fp32 master and step on the host
  ShardingLayout sharding = ShardingLayout::Flat;  ///< Fsdp2, Gpuops and Fsdp1 require zero_stage 3
  bool reshard_after_forward = true;        ///< Fsdp2 and Gpuops: the blocks freed after their forward
  /// Fsdp1 only: FullyShardedDataParallel(use_orig_params=True). With LoRA a block's flat parameter holds frozen
  /// and trainable weights and requires grad, so the frozen weights (views of it) save their inputs and get
  /// gradients as trainable ones do (features/fsdp1_orig_params.cpp).
  bool fsdp_orig_params = false;
  int64_t zero_prefetch = 1;                ///< Gpuops only: units gathered ahead of the one running, [0, 64]
  /// Flat ZeRO-3 (DeepSpeed) only: its reduce_bucket_size in elements, the contiguous gradient bucket it makes at
  /// setup (DeepSpeed's default 5e8; kDsReduceBucketAuto: Hugging Face's "auto", hidden_size squared; 0: none,
  /// contiguous_gradients off).
  int64_t ds_reduce_bucket = 500'000'000;
  ReduceDtype reduce_dtype = ReduceDtype::Grad;  ///< Fsdp2 only: the dtype of the reduce-scatter
};

/// TrainingSetup::ds_reduce_bucket for Hugging Face's "auto" (hidden_size squared).
inline constexpr int64_t kDsReduceBucketAuto = -1;

/// Throws ArgumentError naming the first setting that is out of range or inconsistent with `model`.
void validate(const TrainingSetup& setup, const ModelSpec& model);

/// Parsers accept the names below (case-insensitive) and throw ArgumentError listing them otherwise.
Precision parse_precision(std::string_view text);              ///< fp32, fp16-mixed, bf16-mixed, bf16
AmpLayout parse_amp_layout(std::string_view text);             ///< autocast, master-copy
OptimizerKind parse_optimizer(std::string_view text);  ///< adamw, adam, sgd, sgd-momentum, adamw-8bit, adafactor,
                                                       ///< paged-adamw-8bit, paged-adamw-32bit
OptimizerImpl parse_optimizer_impl(std::string_view text);     ///< default, for-loop, foreach, fused
AttentionKind parse_attention(std::string_view text);          ///< eager, sdpa, flash
BaseWeightDtype parse_base_dtype(std::string_view text);       ///< fp16, bf16, int8, nf4, nf4-nodq
ShardingLayout parse_sharding(std::string_view text);          ///< flat, fsdp2, gpuops, fsdp1
HeldLogits parse_held_logits(std::string_view text);           ///< none, model, fp32
ModelCode parse_model_code(std::string_view text);             ///< hf, litgpt
ReduceDtype parse_reduce_dtype(std::string_view text);         ///< grad, fp32
int64_t parse_ds_reduce_bucket(std::string_view text);         ///< auto (kDsReduceBucketAuto) or elements
std::string ds_reduce_bucket_to_string(int64_t elements);     ///< "auto" or the number
/// true or false (case-insensitive); ArgumentError naming `argument` otherwise.
bool parse_bool(std::string_view text, const char* argument);
/// none, full, every:K (K >= 1), selective; sets setup.checkpoint and setup.checkpoint_every_k.
void parse_checkpointing(std::string_view text, TrainingSetup& setup);

std::string_view to_string(Precision p);
std::string_view to_string(AmpLayout a);
std::string_view to_string(OptimizerKind o);
std::string_view to_string(OptimizerImpl o);
std::string_view to_string(AttentionKind a);
std::string_view to_string(BaseWeightDtype b);
std::string_view to_string(ShardingLayout l);
std::string_view to_string(HeldLogits h);
std::string_view to_string(ModelCode c);
std::string_view to_string(ReduceDtype r);
/// none, full, every:K or selective.
std::string checkpointing_to_string(const TrainingSetup& setup);
/// standard, no-upcast, chunked:C, chunked-no-upcast:C (C >= 1) or fused-linear-ce; sets setup.loss,
/// setup.loss_chunks and setup.loss_upcast.
void parse_loss(std::string_view text, TrainingSetup& setup);
/// standard, no-upcast, chunked:C, chunked-no-upcast:C or fused-linear-ce.
std::string loss_to_string(const TrainingSetup& setup);
/// A probability written in decimal ("0.05", ".1", "0"); ArgumentError naming lora-dropout otherwise
/// (the range 0 <= p < 1 is checked by validate).
double parse_lora_dropout(std::string_view text);

/// Bytes of one element of the 16-bit-or-fp32 compute dtype (activations, logits): 4 for fp32, else 2.
int64_t compute_dtype_bytes(Precision p);

/// Bytes of one logit as the loss's log-softmax reads it: 4 when the loss upcasts, else the compute dtype's.
int64_t loss_logit_bytes(const TrainingSetup& setup);

/// True when the gradients exist during the forward and the early backward: kept zeroed between steps, or
/// accumulated over several micro-batches.
bool gradients_alive_in_forward(const TrainingSetup& setup);  // src/estimator/features/features.cpp

/// "backward" or "step" (TrainingSetup::zero_reduce_at_step); ArgumentError naming --zero-reduce otherwise.
bool parse_zero_reduce(std::string_view text);

/// "MAJOR.MINOR" or "MAJOR.MINOR.PATCH" (e.g. 0.42.0); ArgumentError naming --bnb-version otherwise.
BnbVersion parse_bnb_version(std::string_view text);
std::string to_string(const BnbVersion& v);

/// "none" (set_to_none=True) or "zeros" (set_to_none=False); ArgumentError naming --zero-grad otherwise.
bool parse_zero_grad(std::string_view text);

/// True for fp16-mixed and bf16-mixed.
bool is_mixed(Precision p);

/// The sequence length `gpuops estimate` and gpuops.estimate() use when none is given: kDefaultSeqLen, or the
/// model's maximum when a learned position table makes it shorter (GPT-2: 1024).
inline constexpr int64_t kDefaultSeqLen = 2048;
int64_t default_seq_len(const ModelSpec& model);

/// True when the model itself runs in 16 bits: pure bf16, or mixed precision with a master copy.
bool runs_in_16_bits(const TrainingSetup& setup);

}  // namespace gpuops::estimator
