// Persistent-state setups (docs/estimator.md, "Optimizers, offload and sharding"): Adafactor, paged
// optimizers, optimizer offload, FSDP2, nf4 without double quantisation, a quantised LM head, LoRA on
// lm_head / embed. Every expected value is hand arithmetic written out below, from the shapes of the
// Hugging Face / PEFT / bitsandbytes tensors, not a call back into the formula under test.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpuops/errors.h"
#include "gpuops/estimator.h"
#include "gpuops/estimator/activations.h"
#include "gpuops/estimator/step_phases.h"
#include "cli_runner.h"

namespace est = gpuops::estimator;
using nlohmann::json;

namespace {

// A tiny untied Llama: V 1000, h 64, 4 layers, 4 heads of 16 (2 kv heads), SwiGLU 160, RMSNorm.
// Tensors (nn.Linear weight is out x in): embed 1000x64; per layer q 64x64, k 32x64, v 32x64, o 64x64,
// gate 160x64, up 160x64, down 64x160 and two norms of 64; the final norm 64; lm_head 1000x64.
// Parameters: 64000 + 4 * (4096 + 2048 + 2048 + 4096 + 3 * 10240 + 128) + 64 + 64000 = 300608, 39 tensors.
est::ModelSpec tiny() {
  est::ModelSpec s;
  s.name = "tiny-llama";
  s.family = est::ModelFamily::Decoder;
  s.vocab_size = 1000;
  s.hidden_size = 64;
  s.num_layers = 4;
  s.num_heads = 4;
  s.num_kv_heads = 2;
  s.intermediate_size = 160;
  s.max_positions = 256;
  s.mlp = est::MlpKind::SwiGlu;
  s.norm = est::NormKind::RmsNorm;
  s.softmax_upcast = true;
  return s;
}

est::TrainingSetup fp32_setup(est::OptimizerKind o) {
  est::TrainingSetup s;
  s.precision = est::Precision::Fp32;
  s.optimizer = o;
  s.micro_batch = 2;
  s.seq_len = 8;
  return s;
}

std::string error_of(const est::ModelSpec& m, const est::TrainingSetup& s) {
  try {
    est::estimate_memory(m, s, est::cpu_device());
  } catch (const gpuops::ArgumentError& e) {
    return e.what();
  }
  return "";
}

int64_t unsharded(const est::ModelSpec& m, const est::TrainingSetup& s, est::StepPhase p) {
  return est::unsharded_bytes(m, s, p);
}

}  // namespace

TEST(SetupsState, TinySpecTensorsSumToTheParameterCount) {
  const est::ModelSpec m = tiny();
  ASSERT_EQ(est::parameter_count(m), 300608);
  int64_t params = 0, tensors = 0;
  for (const auto& t : est::model_tensor_shapes(m)) {
    params += t.count * t.elements();
    tensors += t.count;
  }
  EXPECT_EQ(params, 300608);
  EXPECT_EQ(tensors, 39);  // embed, 4 x (7 linears + 2 norms), final norm, lm_head
  // The presets too (GPT-2's c_attn is one 768 x 2304 Conv1D tensor; BERT has biases and LayerNorms).
  for (const char* name : {"gpt2", "llama-2-7b", "bert-base"}) {
    const est::ModelSpec p = est::preset(name);
    int64_t n = 0, c = 0;
    for (const auto& t : est::model_tensor_shapes(p)) {
      n += t.count * t.elements();
      c += t.count;
    }
    EXPECT_EQ(n, est::parameter_count(p)) << name;
    EXPECT_EQ(c, est::parameter_tensor_count(p)) << name;
  }
}

TEST(SetupsState, AdafactorStatesAreFactoredRowAndColumnVectorsInFp32) {
  const est::ModelSpec m = tiny();
  const est::TrainingSetup s = fp32_setup(est::OptimizerKind::Adafactor);
  // transformers' Adafactor: exp_avg_sq_row (R) + exp_avg_sq_col (C) for a matrix, exp_avg_sq (n) for a
  // vector, and a 0-d fp32 'RMS' per tensor. embed 1000+64; per layer q 64+64, k 32+64, v 32+64, o 64+64,
  // gate/up 160+64, down 64+160, norms 64+64; final norm 64; lm_head 1000+64.
  const int64_t per_layer = 128 + 96 + 96 + 128 + 224 + 224 + 224 + 128;
  const int64_t values = 1064 + 4 * per_layer + 64 + 1064;
  ASSERT_EQ(values, 7184);
  const int64_t expected = 4 * values + 4 * 39;
  EXPECT_EQ(est::persistent_memory(m, s, est::cpu_device()).optimizer_states, expected);
  // AdamW would hold 8 bytes per parameter: Adafactor's state is 1/80th of it here.
  EXPECT_LT(expected * 80, 8 * 300608);
}

TEST(SetupsState, AdafactorStepTemporariesOfTheLargestMatrix) {
  const est::ModelSpec m = tiny();
  est::TrainingSetup s = fp32_setup(est::OptimizerKind::Adafactor);
  // Largest: embed / lm_head 1000 x 64. update (R x C) beside the product of the row and column factors
  // (R x C), plus the two factors (R + C), all fp32: (2 * 64000 + 1000 + 64) * 4.
  EXPECT_EQ(est::optimizer_step_temporaries(m, s, est::cpu_device()), (2 * 64000 + 1064) * 4);
  // Pure bf16 adds the fp32 upcasts of the gradient and the parameter: + 2 * 64000 * 4.
  s.precision = est::Precision::Bf16Pure;
  EXPECT_EQ(est::optimizer_step_temporaries(m, s, est::cpu_device()), (2 * 64000 + 1064) * 4 + 2 * 64000 * 4);
  // States stay fp32 under pure bf16 (transformers casts them to the upcast gradient's dtype).
  EXPECT_EQ(est::persistent_memory(m, s, est::cpu_device()).optimizer_states, 4 * 7184 + 4 * 39);
}

TEST(SetupsState, AdafactorOnFlatZeroPartitionsKeepsAFullSecondMoment) {
  const est::ModelSpec m = tiny();
  est::TrainingSetup s = fp32_setup(est::OptimizerKind::Adafactor);
  s.zero_stage = 1;
  s.num_gpus = 4;
  // DeepSpeed hands the optimizer one flat 1-D fp32 partition of ceil(300608 / 4) = 75152 values.
  EXPECT_EQ(est::persistent_memory(m, s, est::cpu_device()).optimizer_states, 4 * 75152 + 4);
  EXPECT_EQ(est::optimizer_step_temporaries(m, s, est::cpu_device()), 2 * 75152 * 4);
}

TEST(SetupsState, PagedOptimizersKeepLargeTensorStatesOnTheHost) {
  const est::ModelSpec m = est::preset("llama-2-7b");
  est::TrainingSetup s;
  s.optimizer = est::OptimizerKind::PagedAdamW32bit;
  // bitsandbytes pages tensors of >= 100000 values; llama-2-7b's 65 RMSNorm weights (4096) stay on the
  // device: 65 * 4096 * 8 bytes of fp32 exp_avg + exp_avg_sq.
  const est::MemoryBreakdown p32 = est::persistent_memory(m, s, est::cuda_device());
  EXPECT_EQ(p32.optimizer_states, 65 * 4096 * 8);
  EXPECT_EQ(p32.host_memory, int64_t{8} * (6738415616 - 65 * 4096));
  // At the step the device holds the largest paged tensor's states: the 32000 x 4096 embedding.
  EXPECT_EQ(est::optimizer_step_temporaries(m, s, est::cuda_device()), int64_t{32000} * 4096 * 8);

  s.optimizer = est::OptimizerKind::PagedAdamW8bit;
  // Per tensor: two uint8 states and one fp32 absmax per 2048-value block each: 2n + 8 * ceil(n / 2048).
  const int64_t embed = 2 * int64_t{131072000} + 8 * 64000;          // 32000 x 4096
  const int64_t attn = 2 * int64_t{16777216} + 8 * 8192;             // 4096 x 4096 (q, k, v, o)
  const int64_t mlp = 2 * int64_t{45088768} + 8 * 22016;             // 11008 x 4096 (gate, up, down)
  const est::MemoryBreakdown p8 = est::persistent_memory(m, s, est::cuda_device());
  EXPECT_EQ(p8.host_memory, 2 * embed + 32 * (4 * attn + 3 * mlp));
  EXPECT_EQ(p8.optimizer_states, 65 * (2 * 4096 + 8 * 2));
  // On the CPU bitsandbytes does not page: everything stays in the one memory.
  const est::MemoryBreakdown cpu = est::persistent_memory(m, s, est::cpu_device());
  EXPECT_EQ(cpu.host_memory, 0);
  EXPECT_GT(cpu.optimizer_states, p8.host_memory);
}

TEST(SetupsState, OffloadMovesStatesAndMasterFromDeviceToHost) {
  const est::ModelSpec m = est::preset("llama-2-7b");
  est::TrainingSetup s;
  s.precision = est::Precision::Bf16Mixed;
  s.amp = est::AmpLayout::MasterCopy;
  s.zero_stage = 2;
  s.num_gpus = 8;
  const int64_t local = 6738415616 / 8;  // 842301952, exact
  const est::MemoryBreakdown on_device = est::persistent_memory(m, s, est::cuda_device());
  EXPECT_EQ(on_device.optimizer_states, 8 * local);
  EXPECT_EQ(on_device.master_weights, 4 * local);
  EXPECT_EQ(on_device.host_memory, 0);
  s.offload_optimizer = true;
  const est::MemoryBreakdown off = est::persistent_memory(m, s, est::cuda_device());
  // Host: Adam's two fp32 states, the fp32 master partition and the fp32 gradient partition.
  EXPECT_EQ(off.host_memory, 8 * local + 4 * local + 4 * local);
  EXPECT_EQ(off.optimizer_states, 0);
  EXPECT_EQ(off.master_weights, 0);
  EXPECT_EQ(off.weights, on_device.weights);  // 16-bit weights stay on the device
  // The step runs on the CPU: no device temporaries, gradients already copied out.
  EXPECT_EQ(est::optimizer_step_temporaries(m, s, est::cuda_device()), 0);
  const auto phases = est::phase_breakdowns(m, s, est::cuda_device(), off);
  EXPECT_EQ(phases[static_cast<int>(est::StepPhase::OptimizerStep)].gradients, 0);
  EXPECT_LT(est::estimate_memory(m, s, est::cuda_device()).total(),
            [&] { auto t = s; t.offload_optimizer = false; return est::estimate_memory(m, t, est::cuda_device()).total(); }());
}

TEST(SetupsState, Fsdp2PadsEveryTensorWhereZero3PadsOnce) {
  const est::ModelSpec m = tiny();
  est::TrainingSetup s = fp32_setup(est::OptimizerKind::AdamW);
  s.zero_stage = 3;
  s.num_gpus = 3;
  // Flat: ceil(300608 / 3) = 100203. FSDP2: ceil(rows / 3) x cols per tensor: embed 334 x 64 = 21376;
  // per layer q 22x64 = 1408, k 11x64 = 704, v 704, o 1408, gate 54x64 = 3456, up 3456, down 22x160 = 3520,
  // norms 22 + 22; final norm 22; lm_head 21376.
  const int64_t layer = 1408 + 704 + 704 + 1408 + 3456 + 3456 + 3520 + 44;
  const int64_t fsdp2 = 21376 + 4 * layer + 22 + 21376;
  ASSERT_EQ(fsdp2, 101574);
  EXPECT_EQ(est::sharded_trainable_elements(m, s, 3), 100203);
  EXPECT_EQ(est::persistent_memory(m, s, est::cpu_device()).weights, 4 * 100203 + 4 * 8);  // + RoPE inv_freq (8 fp32)
  s.sharding = est::ShardingLayout::Fsdp2;
  EXPECT_EQ(est::sharded_trainable_elements(m, s, 3), fsdp2);
  const est::MemoryBreakdown p = est::persistent_memory(m, s, est::cpu_device());
  EXPECT_EQ(p.weights, 4 * fsdp2 + 4 * 8);
  EXPECT_EQ(p.gradients, 4 * fsdp2);
  EXPECT_EQ(p.optimizer_states, 8 * fsdp2 + 4 * 39);  // exp_avg, exp_avg_sq, and 'step' per tensor (CPU)
}

TEST(SetupsState, FlatFsdp1Fsdp2UnshardedBuffers) {
  const est::ModelSpec m = tiny();
  est::TrainingSetup s = fp32_setup(est::OptimizerKind::AdamW);
  s.zero_stage = 3;
  s.num_gpus = 3;
  const int64_t block = 43136 * 4, head = 64000 * 4, root = (64000 + 64 + 64000) * 4;  // root: embed, norm, head
  // Flat ZeRO-3 (DeepSpeed): current + prefetched block, 2 x 43136 x 4, in the backward moments only, and the
  // LM head gathered for its backward at the loss moment.
  EXPECT_EQ(unsharded(m, s, est::StepPhase::LossBackward), head + 2 * block);
  EXPECT_EQ(unsharded(m, s, est::StepPhase::AttentionBackward), 2 * block);
  EXPECT_EQ(unsharded(m, s, est::StepPhase::BackwardEnd), 0);
  EXPECT_EQ(unsharded(m, s, est::StepPhase::OptimizerStep), 0);
  // FSDP1: the root unit gathered through the backward (not freed after its forward), with the last block
  // prefetched at the loss, then the current and the prefetched block; the same flat partitions.
  s.sharding = est::ShardingLayout::Fsdp1;
  EXPECT_EQ(unsharded(m, s, est::StepPhase::LossBackward), root + block);
  EXPECT_EQ(unsharded(m, s, est::StepPhase::AttentionBackward), root + 2 * block);
  EXPECT_EQ(unsharded(m, s, est::StepPhase::BackwardEnd), root);
  EXPECT_EQ(unsharded(m, s, est::StepPhase::OptimizerStep), 0);
  EXPECT_EQ(est::sharded_trainable_elements(m, s, 3), 100203);
  s.num_gpus = 1;  // FSDP1 falls back to NO_SHARD: nothing gathered
  for (const auto p : {est::StepPhase::LossBackward, est::StepPhase::AttentionBackward, est::StepPhase::BackwardEnd})
    EXPECT_EQ(unsharded(m, s, p), 0);
  s.num_gpus = 3;
  s.sharding = est::ShardingLayout::Fsdp2;
  // reshard_after_forward true: the root stays unsharded (FSDP2's default for the root); in the last
  // block's backward it and the prefetched block are gathered, its unsharded gradients exist and are copied
  // into the reduce-scatter input (torch's foreach_reduce: both alive during the copy).
  EXPECT_EQ(unsharded(m, s, est::StepPhase::LossBackward), root);
  EXPECT_EQ(unsharded(m, s, est::StepPhase::AttentionBackward), root + 2 * block + block + block);
  EXPECT_EQ(unsharded(m, s, est::StepPhase::BackwardEnd), root + root);  // the root's gradients and their input
  EXPECT_EQ(unsharded(m, s, est::StepPhase::OptimizerStep), 0);
  // false: every block stays unsharded from its forward to its backward.
  est::TrainingSetup keep = s;
  keep.reshard_after_forward = false;
  EXPECT_EQ(unsharded(m, keep, est::StepPhase::LossBackward), root + 4 * block);
  EXPECT_EQ(unsharded(m, keep, est::StepPhase::AttentionBackward), root + 4 * block + block + block);
  // Pure bf16 with MixedPrecisionPolicy(reduce_dtype=float32): 2-byte weights and gradients, 4-byte reduce input.
  est::TrainingSetup bf16 = s;
  bf16.precision = est::Precision::Bf16Pure;
  EXPECT_EQ(unsharded(m, bf16, est::StepPhase::AttentionBackward), (root + 3 * block) / 2 + block / 2);
  bf16.reduce_dtype = est::ReduceDtype::Fp32;
  EXPECT_EQ(unsharded(m, bf16, est::StepPhase::AttentionBackward), (root + 3 * block) / 2 + block);
  EXPECT_EQ(unsharded(m, bf16, est::StepPhase::BackwardEnd), root / 2 + root);
  EXPECT_EQ(est::parse_reduce_dtype("FP32"), est::ReduceDtype::Fp32);
  est::TrainingSetup flat = fp32_setup(est::OptimizerKind::AdamW);
  flat.reduce_dtype = est::ReduceDtype::Fp32;
  EXPECT_NE(error_of(m, flat).find("reduce-dtype fp32 applies to sharding fsdp2 only"), std::string::npos);
  EXPECT_GT(est::estimate_memory(m, keep, est::cuda_device()).allocated_peak(),
            est::estimate_memory(m, s, est::cuda_device()).allocated_peak());
  // One GPU gathers nothing.
  s.num_gpus = 1;
  EXPECT_EQ(unsharded(m, s, est::StepPhase::AttentionBackward), 0);
}

TEST(SetupsState, Fsdp1OrigParamsGivesLoraBlocksTheirGradientsAndSaves) {
  // FSDP1 use_orig_params=True under LoRA: the blocks' frozen weights are views of a flat parameter that requires
  // grad. Per block 43,136 weights (4096 + 2 x 2048 + 4096 + 3 x 10240 + 128) in the base's dtype (fp32 here).
  const est::ModelSpec m = tiny();
  est::TrainingSetup s = fp32_setup(est::OptimizerKind::AdamW);
  s.lora.rank = 4;
  s.lora.targets = {"q", "v"};
  s.lora.base = est::BaseWeightDtype::Fp32;
  s.zero_stage = 3;
  s.num_gpus = 3;
  s.sharding = est::ShardingLayout::Fsdp1;
  auto orig = s;
  orig.fsdp_orig_params = true;
  const auto cpu = est::cpu_device();
  const auto plain = est::phase_breakdowns(m, s, cpu, est::MemoryBreakdown{});
  const auto with = est::phase_breakdowns(m, orig, cpu, est::MemoryBreakdown{});
  const auto gradients = [](const std::vector<est::MemoryBreakdown>& p, est::StepPhase phase) {
    return p[static_cast<int>(phase)].gradients;
  };
  const int64_t block = 43136 * 4, shards = (4 * 43136 + 2) / 3 * 4;  // ceil(172,544 / 3) fp32 elements
  EXPECT_EQ(gradients(with, est::StepPhase::LossBackward), gradients(plain, est::StepPhase::LossBackward));
  EXPECT_EQ(gradients(with, est::StepPhase::AttentionBackward) - gradients(plain, est::StepPhase::AttentionBackward),
            block);  // the unit's unsharded gradient, frozen parts included
  for (auto phase : {est::StepPhase::BackwardEnd, est::StepPhase::OptimizerStep})
    EXPECT_EQ(gradients(with, phase) - gradients(plain, phase), shards);  // kept until the next forward
  orig.num_gpus = 1;  // NO_SHARD: the whole gradient is kept
  s.num_gpus = 1;
  EXPECT_EQ(gradients(est::phase_breakdowns(m, orig, cpu, est::MemoryBreakdown{}), est::StepPhase::OptimizerStep) -
                gradients(est::phase_breakdowns(m, s, cpu, est::MemoryBreakdown{}), est::StepPhase::OptimizerStep),
            4 * block);
  // The blocks save what trainable ones save, plus the adapters: more than frozen LoRA, no less than full training.
  auto full = s;
  full.lora.rank = 0;
  const int64_t lora_layers = est::forward_saved(m, s, cpu).layers, orig_layers = est::forward_saved(m, orig, cpu).layers;
  EXPECT_GT(orig_layers, lora_layers);
  EXPECT_GT(orig_layers, est::forward_saved(m, full, cpu).layers);
  // Gradients kept through the forward (accumulation, or zero_grad to zeros) keep the shards too: FSDP1 resets
  // flat_param.grad at the forward only when every original weight's .grad is None.
  auto accumulating = s, accumulating_orig = orig;
  accumulating.grad_accum = accumulating_orig.grad_accum = 2;
  accumulating.num_gpus = accumulating_orig.num_gpus = 3;
  EXPECT_EQ(gradients(est::phase_breakdowns(m, accumulating_orig, cpu, est::MemoryBreakdown{}),
                      est::StepPhase::LossBackward) -
                gradients(est::phase_breakdowns(m, accumulating, cpu, est::MemoryBreakdown{}),
                          est::StepPhase::LossBackward),
            shards);
  // Only with FSDP1, a 16-bit or fp32 base, LoRA on the blocks' projections and no compile.
  auto head = orig;
  head.lora.targets = {"q", "lm_head"};
  EXPECT_NE(error_of(m, head).find("lm_head"), std::string::npos);
  auto compiled = orig;
  compiled.compile = true;
  EXPECT_NE(error_of(m, compiled).find("compile"), std::string::npos);
  auto flat = orig;
  flat.sharding = est::ShardingLayout::Flat;
  EXPECT_NE(error_of(m, flat).find("fsdp-orig-params"), std::string::npos);
  auto nf4 = orig;
  nf4.lora.base = est::BaseWeightDtype::Nf4;
  nf4.precision = est::Precision::Bf16Mixed;
  EXPECT_NE(error_of(m, nf4).find("fsdp-orig-params"), std::string::npos);
}

TEST(SetupsState, Nf4WithoutDoubleQuantisationAndAQuantisedLmHead) {
  // 4096 x 4096: 0.5 byte per value; with double quantisation 1 byte per 64 values and 4 per 16384,
  // without it an fp32 absmax per 64 values.
  EXPECT_EQ(est::quantised_weight_bytes(4096, 4096, est::BaseWeightDtype::Nf4), 8388608 + 262144 + 4 * 1024);
  EXPECT_EQ(est::quantised_weight_bytes(4096, 4096, est::BaseWeightDtype::Nf4NoDq), 8388608 + 4 * 262144);
  const est::ModelSpec m = tiny();
  est::TrainingSetup s = fp32_setup(est::OptimizerKind::AdamW);
  s.lora.rank = 4;
  s.lora.base = est::BaseWeightDtype::Nf4NoDq;
  // Per layer: q 4096 values -> 2048 + 4*64 = 2304; k, v 2048 -> 1024 + 4*32 = 1152; o 2304; gate, up,
  // down 10240 -> 5120 + 4*160 = 5760. The rest (300608 - 4 * 43008 = 128576 values) stays 16-bit.
  const int64_t linears = 4 * (2304 + 1152 + 1152 + 2304 + 3 * 5760);
  EXPECT_EQ(est::frozen_weight_bytes(m, s), linears + 2 * 128576);
  // The LM head (1000 x 64 = 64000 values) quantised too: - 2 * 64000 + 32000 + 4 * 1000.
  s.lora.quantize_lm_head = true;
  EXPECT_EQ(est::frozen_weight_bytes(m, s), linears + 2 * 128576 - 128000 + 36000);
}

TEST(SetupsState, LoraOnLmHeadAndEmbeddings) {
  const est::ModelSpec m = tiny();
  est::TrainingSetup s = fp32_setup(est::OptimizerKind::AdamW);
  s.lora.rank = 4;
  s.lora.targets = {"q"};
  // q: 4 layers x 4 x (64 + 64) = 2048.
  EXPECT_EQ(est::trainable_parameter_count(m, s), 2048);
  const est::ForwardSaved before = est::forward_saved(m, s, est::cpu_device());
  s.lora.targets = {"q", "lm_head", "embed"};
  // lm_head: A 4 x 64, B 1000 x 4; embed: lora_embedding_A 4 x 1000, lora_embedding_B 64 x 4.
  EXPECT_EQ(est::trainable_parameter_count(m, s), 2048 + 4 * (64 + 1000) + 4 * (1000 + 64));
  // Saved: each outer adapter's A output, N x r in fp32: 2 x (16 x 4 x 4).
  const est::ForwardSaved after = est::forward_saved(m, s, est::cpu_device());
  EXPECT_EQ(after.extras - before.extras, 2 * 16 * 4 * 4);
  EXPECT_EQ(after.layers, before.layers);
  // Adafactor sees the four new 2-D adapters: (4 + 64) + (1000 + 4) + (4 + 1000) + (64 + 4) more values.
  s.optimizer = est::OptimizerKind::Adafactor;
  const int64_t q_adapters = 4 * ((4 + 64) + (64 + 4));
  EXPECT_EQ(est::persistent_memory(m, s, est::cpu_device()).optimizer_states,
            4 * (q_adapters + 68 + 1004 + 1004 + 68) + 4 * (8 + 4));
}

TEST(SetupsState, GpuopsStage3UnitsInFlight) {
  const est::ModelSpec m = tiny();
  est::TrainingSetup s = fp32_setup(est::OptimizerKind::AdamW);
  s.zero_stage = 3;
  s.num_gpus = 3;
  s.sharding = est::ShardingLayout::Gpuops;
  // Flat shards, and the fp32 gradient shard kept from construction on.
  const est::MemoryBreakdown p = est::persistent_memory(m, s, est::cpu_device());
  EXPECT_EQ(p.weights, 4 * 100203 + 4 * 8);
  EXPECT_EQ(p.gradients, 4 * 100203);
  const int64_t block = 43136 * 4, root = (64000 + 64 + 64000) * 4;  // unit 0: embed, final norm, lm_head
  const int64_t block_shard = 14379 * 4, root_shard = 42688 * 4;     // ceil(n / 3) fp32 reduced shards
  // Unit 0 from the loss on; a block's backward: it, the prefetched one, unit 0's gradient buffer, its own
  // gradient, and the previous block's reduction (its gradient, reduced shard and Gloo's clone on the CPU).
  EXPECT_EQ(unsharded(m, s, est::StepPhase::LossBackward), root);
  EXPECT_EQ(unsharded(m, s, est::StepPhase::AttentionBackward),
            root + 2 * block + root + block + (block + block_shard + block));
  // The end: unit 0's gradient, Gloo's clone of it, its reduced shard, the last block's reduction, and the
  // embedding's gradient still held.
  EXPECT_EQ(unsharded(m, s, est::StepPhase::BackwardEnd),
            root + root + root_shard + (block + block_shard) + 64000 * 4);
  EXPECT_EQ(unsharded(m, s, est::StepPhase::OptimizerStep), 0);
  EXPECT_EQ(est::gpuops_head_bytes(m, s), 2 * root + 64000 * 4);
  est::TrainingSetup none = s, keep = s;
  none.zero_prefetch = 0;
  keep.reshard_after_forward = false;
  EXPECT_EQ(unsharded(m, s, est::StepPhase::AttentionBackward) - unsharded(m, none, est::StepPhase::AttentionBackward),
            block);
  EXPECT_EQ(unsharded(m, keep, est::StepPhase::LossBackward), root + 4 * block);
  EXPECT_GT(est::estimate_memory(m, keep, est::cpu_device()).allocated_peak(),
            est::estimate_memory(m, s, est::cpu_device()).allocated_peak());
  // Stage 3 of gpuops only, with what its ZeroOptimizer steps, an architecture, no LoRA.
  est::TrainingSetup bad = s;
  bad.zero_stage = 2;
  EXPECT_NE(error_of(m, bad).find("sharding gpuops is gpuops.ZeroOptimizer(stage=3)"), std::string::npos);
  bad = s;
  bad.optimizer = est::OptimizerKind::Adafactor;
  EXPECT_NE(error_of(m, bad).find("sharding gpuops steps gpuops' AdamW, Adam or SGD"), std::string::npos);
  bad = s;
  bad.lora.rank = 8;
  EXPECT_NE(error_of(m, bad).find("sharding gpuops shards the trainable parameters only"), std::string::npos);
  bad = s;
  bad.zero_prefetch = 65;
  EXPECT_NE(error_of(m, bad).find("zero-prefetch must be in [0, 64]"), std::string::npos);
  bad = fp32_setup(est::OptimizerKind::AdamW);
  bad.zero_prefetch = 2;
  EXPECT_NE(error_of(m, bad).find("zero-prefetch applies to sharding gpuops only"), std::string::npos);
  EXPECT_NE(error_of(est::params_only_model(1000000), s).find("sharding gpuops needs an architecture"),
            std::string::npos);
  EXPECT_EQ(est::parse_sharding("GPUOPS"), est::ShardingLayout::Gpuops);
}

TEST(SetupsState, BadInputIsRefusedNamingTheOption) {
  const est::ModelSpec m = tiny();
  est::TrainingSetup s = fp32_setup(est::OptimizerKind::PagedAdamW8bit);
  s.zero_stage = 3;
  s.num_gpus = 2;
  EXPECT_NE(error_of(m, s).find("optimizer paged-adamw-8bit is modelled without ZeRO"), std::string::npos);
  s = fp32_setup(est::OptimizerKind::Sgd);
  s.offload_optimizer = true;
  EXPECT_NE(error_of(m, s).find("offload-optimizer with optimizer sgd"), std::string::npos);
  s = fp32_setup(est::OptimizerKind::AdamW);
  s.reshard_after_forward = false;
  EXPECT_NE(error_of(m, s).find("reshard-after-forward false applies to sharding fsdp2"), std::string::npos);
  s = fp32_setup(est::OptimizerKind::AdamW);
  s.sharding = est::ShardingLayout::Fsdp2;
  s.zero_stage = 2;
  EXPECT_NE(error_of(m, s).find("sharding fsdp2"), std::string::npos);
  s = fp32_setup(est::OptimizerKind::Adafactor);
  EXPECT_NE(error_of(est::params_only_model(7000000000), s).find("optimizer adafactor needs an architecture"),
            std::string::npos);
  s = fp32_setup(est::OptimizerKind::AdamW);
  s.lora.rank = 8;
  s.lora.targets = {"q", "lm_head"};
  EXPECT_NE(error_of(est::preset("bert-base"), s).find("lora-targets 'lm_head': model 'bert-base' has no LM head"),
            std::string::npos);
  s.lora.targets = {"q"};
  s.lora.quantize_lm_head = true;  // bf16 base
  EXPECT_NE(error_of(m, s).find("quantize-lm-head needs a quantised LoRA base"), std::string::npos);
  s.lora.base = est::BaseWeightDtype::Nf4;
  EXPECT_NE(error_of(est::preset("gpt2"), s).find("quantize-lm-head needs an untied LM head"), std::string::npos);
  EXPECT_THROW(est::parse_sharding("fsdp"), gpuops::ArgumentError);
  EXPECT_THROW(est::parse_bool("yes", "--reshard-after-forward"), gpuops::ArgumentError);
}

TEST(SetupsState, CommandLineOptionsAndJson) {
  auto r = gpuops::testing::run_cli({"estimate", "--model", "llama-2-7b", "--sharding", "fsdp2", "--gpus", "8",
                                     "--reshard-after-forward", "false", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const json setup = json::parse(r.out)["runs"][0]["setup"];
  EXPECT_EQ(setup["sharding"], "fsdp2");
  EXPECT_EQ(setup["zero_stage"], 3);  // fsdp2 with --zero left at 0 means stage 3
  EXPECT_EQ(setup["reshard_after_forward"], false);
  EXPECT_EQ(setup["offload_optimizer"], false);
  r = gpuops::testing::run_cli({"estimate", "--model", "llama-2-7b", "--optimizer", "paged-adamw-8bit", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_GT(json::parse(r.out)["runs"][0]["breakdown"]["host_memory"].get<int64_t>(), 0);
  r = gpuops::testing::run_cli({"estimate", "--model", "llama-2-7b", "--lora-rank", "8", "--base-dtype", "nf4-nodq",
                                "--quantize-lm-head", "--lora-targets", "q,v,lm_head,embed", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const json lora = json::parse(r.out)["runs"][0]["setup"]["lora"];
  EXPECT_EQ(lora["base_dtype"], "nf4-nodq");
  EXPECT_EQ(lora["quantize_lm_head"], true);
  r = gpuops::testing::run_cli({"estimate", "--model", "llama-2-7b", "--sharding", "zero9"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("sharding 'zero9' is not accepted; accepted: flat, fsdp2"), std::string::npos) << r.err;
  r = gpuops::testing::run_cli({"estimate", "--model", "llama-2-7b", "--offload-optimizer", "--optimizer", "sgd"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("offload-optimizer"), std::string::npos) << r.err;
}
