// Activation-side training setups: selective (op-level) checkpointing, chunked and fused linear
// cross-entropy, LoRA dropout and torch.compile. Each term is checked against hand arithmetic written out
// below on a small Llama (h 128, 2 layers, 4 heads, 2 kv heads, I 352, V 2000; head width 32); the compiled
// and selective numbers were also measured on the CPU with torch 2.11 (docs/estimator.md).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "cli_runner.h"
#include "gpuops/errors.h"
#include "gpuops/estimator.h"
#include "gpuops/estimator/activations.h"
#include "gpuops/estimator/step_phases.h"

namespace est = gpuops::estimator;
using gpuops::testing::run_cli;

namespace {

est::ModelSpec small_llama() {
  return est::model_from_hf_config(R"({"model_type": "llama", "vocab_size": 2000, "hidden_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 352,
    "max_position_embeddings": 256, "tie_word_embeddings": false})", "small-llama");
}

est::TrainingSetup setup(est::Precision p, int64_t b = 2, int64_t s = 48) {
  est::TrainingSetup t;
  t.precision = p;
  t.micro_batch = b;
  t.seq_len = s;
  return t;
}

int64_t loss_moment_logits(const est::ModelSpec& m, const est::TrainingSetup& t, const est::DeviceProfile& d) {
  return est::phase_breakdowns(m, t, d, est::MemoryBreakdown{})[static_cast<int>(est::StepPhase::LossBackward)]
      .logits;
}

constexpr int64_t N = 96;  // b 2 x s 48

}  // namespace

TEST(SetupsAct, SelectiveKeepsEveryOtherMmOutputPerBlockOnTheCpu) {
  const auto m = small_llama();
  auto full = setup(est::Precision::Fp32), sel = full;
  full.checkpoint = est::CheckpointKind::Full;
  sel.checkpoint = est::CheckpointKind::Selective;
  const auto cpu = est::cpu_device();
  const auto f_full = est::forward_saved(m, full, cpu), f_sel = est::forward_saved(m, sel, cpu);
  // mm order q(1) k(2) v(3) o(4) gate(5) up(6) down(7): odd ones kept, fp32; the CPU's SDPA op is not listed.
  const int64_t cache = N * 4 * (128 /*q*/ + 64 /*v*/ + 352 /*gate*/ + 128 /*down*/);  // 258,048 (measured)
  EXPECT_EQ(f_sel.last_block_cache, cache);
  EXPECT_EQ(f_sel.layers - f_full.layers, 2 * cache);  // 516,096, as measured on torch 2.11's CPU
  EXPECT_TRUE(f_sel.last_block_checkpointed);
  // Measured bytes alive at the end of the forward (torch profiler, above the input ids), none / full
  // (non-reentrant) / selective: fp32 3,034,760 / 1,042,312 / 1,558,408; bf16-mixed 3,552,904 /
  // 1,529,736 / 1,787,784. The estimate counts the N x 8 ids too.
  auto none = full;
  none.checkpoint = est::CheckpointKind::None;
  EXPECT_NEAR(est::forward_saved(m, none, cpu).total(), 3034760 + N * 8, 4);  // one 4-byte scalar
  EXPECT_EQ(f_full.total(), 1042312 + N * 8);
  EXPECT_EQ(f_sel.total(), 1558408 + N * 8);
  for (auto* t : {&none, &full, &sel}) t->precision = est::Precision::Bf16Mixed;
  EXPECT_NEAR(est::forward_saved(m, none, cpu).total(), 3552904 + N * 8, 4);  // one 4-byte scalar
  EXPECT_EQ(est::forward_saved(m, full, cpu).total(), 1529736 + N * 8);
  EXPECT_EQ(est::forward_saved(m, sel, cpu).total(), 1787784 + N * 8);
}

TEST(SetupsAct, SelectiveOnCudaAlsoKeepsSdpaOutputsAndAutocastWeights) {
  const auto m = small_llama();
  auto full = setup(est::Precision::Bf16Mixed), sel = full;
  full.checkpoint = est::CheckpointKind::Full;
  sel.checkpoint = est::CheckpointKind::Selective;
  const auto cuda = est::cuda_device();
  const auto f_full = est::forward_saved(m, full, cuda), f_sel = est::forward_saved(m, sel, cuda);
  const int64_t mm = N * 2 * (128 + 64 + 352 + 128);
  const int64_t sdpa = N * 128 * 2 /*out*/ + 2 * 4 * 48 * 4 /*fp32 lse*/;
  EXPECT_EQ(f_sel.last_block_cache, mm + sdpa);
  // No autocast weight copies of the blocks are kept (measured on the CPU: selective - full = the caches).
  EXPECT_EQ(f_sel.extras, f_full.extras);
  EXPECT_EQ(f_sel.layers - f_full.layers, 2 * (mm + sdpa));
}

TEST(SetupsAct, SelectiveLiesBetweenFullAndNone) {
  const auto m = small_llama();
  for (auto p : {est::Precision::Fp32, est::Precision::Bf16Mixed, est::Precision::Bf16Pure}) {
    auto none = setup(p, 4, 256), full = none, sel = none;
    full.checkpoint = est::CheckpointKind::Full;
    sel.checkpoint = est::CheckpointKind::Selective;
    const auto cuda = est::cuda_device();
    const int64_t a = est::forward_saved(m, full, cuda).total(), b = est::forward_saved(m, sel, cuda).total(),
                  c = est::forward_saved(m, none, cuda).total();
    EXPECT_LT(a, b);
    EXPECT_LT(b, c);
    EXPECT_LT(est::estimate_memory(m, full, cuda).total(), est::estimate_memory(m, none, cuda).total());
  }
}

TEST(SetupsAct, ChunkedLossHandArithmetic) {
  const auto m = small_llama();
  const auto cpu = est::cpu_device();
  auto std32 = setup(est::Precision::Fp32), ch32 = std32;
  ch32.loss = est::LossKind::Chunked;
  ch32.loss_chunks = 8;
  // Saved: every chunk's fp32 log-softmax (N x V x 4 in all) + labels N x 8 + the loss: 768,772 either way.
  EXPECT_EQ(est::forward_saved(m, ch32, cpu).loss, N * 2000 * 4 + N * 8 + 4);
  EXPECT_EQ(loss_moment_logits(m, std32, cpu), 768772 + 2 * N * 2000 * 4 - N * 8);  // 2,304,004
  // Chunked, fp32: end of the loss forward (the logits list, N x V x 4, still held) beats the first chunk's
  // backward (two fp32 gradients of 12 tokens): max(768,772 + 768,000, 768,004 + 192,000).
  EXPECT_EQ(loss_moment_logits(m, ch32, cpu), 768772 + N * 2000 * 4);
  auto ch16 = ch32;
  ch16.precision = est::Precision::Bf16Mixed;
  // bf16 logits list + the last chunk's fp32 upcast: 768,772 + 384,000 + 96,000.
  EXPECT_EQ(loss_moment_logits(m, ch16, cpu), 768772 + N * 2000 * 2 + 12 * 2000 * 4);
  // With many chunks and a small vocabulary share the backward side can win: chunked:1 is the standard
  // backward minus nothing but the forward list.
  auto ch1 = ch32;
  ch1.loss_chunks = 1;
  EXPECT_EQ(loss_moment_logits(m, ch1, cpu), 768772 - N * 8 + 2 * N * 2000 * 4);
  for (auto p : {est::Precision::Fp32, est::Precision::Bf16Mixed}) {
    auto a = setup(p, 4, 256), b = a;
    b.loss = est::LossKind::Chunked;
    EXPECT_LT(loss_moment_logits(m, b, cpu), loss_moment_logits(m, a, cpu));
  }
}

TEST(SetupsAct, LossWithoutUpcastKeepsTheLogSoftmaxInTheComputeDtype) {
  // cross_entropy on bf16 logits outside autocast (LitGPT, Thunder): log_softmax saves its bf16 output and its
  // backward makes bf16 gradients (torch 2.11 on the CPU: tests/python/test_estimator_loss.py measures both).
  const auto m = small_llama();
  const auto cpu = est::cpu_device();
  for (auto p : {est::Precision::Bf16Pure, est::Precision::Bf16Mixed}) {
    auto upcast = setup(p), plain = upcast;
    plain.loss_upcast = false;
    const int64_t saved = N * 2000 * 2 + N * 8 + 4;  // 384,772
    EXPECT_EQ(est::forward_saved(m, plain, cpu).loss, saved);
    EXPECT_EQ(est::forward_saved(m, upcast, cpu).loss, N * 2000 * 4 + N * 8 + 4);
    EXPECT_EQ(loss_moment_logits(m, plain, cpu), saved + 2 * N * 2000 * 2 - N * 8);
    // LitGPT's chunked loss: the bf16 list is held to the end of the forward, no chunk is upcast.
    auto chunked = plain;
    chunked.loss = est::LossKind::Chunked;
    chunked.loss_chunks = 8;
    EXPECT_EQ(loss_moment_logits(m, chunked, cpu), std::max(saved + N * 2000 * 2, saved - N * 8 + 2 * 12 * 2000 * 2));
    auto long_plain = plain, long_upcast = upcast;  // long enough for the loss to be the peak
    long_plain.micro_batch = long_upcast.micro_batch = 8;
    long_plain.seq_len = long_upcast.seq_len = 256;
    EXPECT_LT(est::estimate_memory(m, long_plain, cpu).total(), est::estimate_memory(m, long_upcast, cpu).total());
  }
  // In fp32 there is nothing to upcast: the same bytes.
  auto f32 = setup(est::Precision::Fp32), f32_plain = f32;
  f32_plain.loss_upcast = false;
  EXPECT_EQ(est::estimate_memory(m, f32_plain, cpu).total(), est::estimate_memory(m, f32, cpu).total());
}

TEST(SetupsAct, FusedLinearCrossEntropyHandArithmetic) {
  const auto m = small_llama();
  const auto cuda = est::cuda_device();
  auto t = setup(est::Precision::Fp32);
  t.loss = est::LossKind::FusedLinearCe;
  // grad_input N x h fp32, grad_weight V x h fp32, fp32 per-token loss, labels, loss: 1,074,308.
  const int64_t saved = N * 128 * 4 + 2000 * 128 * 4 + N * 4 + N * 8 + 4;
  EXPECT_EQ(est::forward_saved(m, t, cuda).loss, saved);
  // Transient chunk: ceil(2000 / 128) = 16, ceil(96 / 16) = 6 -> next power of two 8 tokens x V fp32.
  EXPECT_EQ(loss_moment_logits(m, t, cuda), saved + 8 * 2000 * 4);
  auto standard = setup(est::Precision::Fp32, 4, 256), fused = standard;
  fused.loss = est::LossKind::FusedLinearCe;
  EXPECT_LT(loss_moment_logits(m, fused, cuda), loss_moment_logits(m, standard, cuda));
}

TEST(SetupsAct, LoraDropoutAddsExactlyItsBytes) {
  const auto m = small_llama();
  auto t = setup(est::Precision::Bf16Mixed);
  t.lora.rank = 8;
  t.lora.targets = {"q", "v"};
  auto d = t;
  d.lora_dropout = 0.1;
  // As measured with PEFT on the CPU (bench/estimator_validation/FINDINGS.md, "LoRA (PEFT)"): under autocast
  // each adapter's A keeps its own 16-bit copy of its input anyway, so dropout replaces that copy by the
  // dropped one and adds only its mask: bool on CUDA, the (fp32) adapter dtype on the CPU. The first block's
  // input needs no gradient, so only the second of the two blocks adds it: 2 targets x N x 128 x mask bytes.
  EXPECT_EQ(est::forward_saved(m, d, est::cuda_device()).layers - est::forward_saved(m, t, est::cuda_device()).layers,
            2 * N * 128 * 1);
  EXPECT_EQ(est::forward_saved(m, d, est::cpu_device()).layers - est::forward_saved(m, t, est::cpu_device()).layers,
            2 * N * 128 * 4);
}

TEST(SetupsAct, BitsandbytesReleaseDecidesWhatAQuantisedBaseKeeps) {
  // bitsandbytes/autograd/_functions.py as shipped in each wheel: MatMul4Bit keeps ctx.tensors = (A, B) up to
  // 0.43.1 and (None, B) from 0.43.2; MatMul8bitLt keeps (CAt, subA, A) in every release, CAt (int8 A^T)
  // being computed for a frozen weight only before 0.45.0. Pure bf16 (2 bytes), CUDA, SDPA, dropout 0.05 so
  // that no adapter saves the base's input itself.
  const auto m = small_llama();
  const auto cuda = est::cuda_device();
  auto t = setup(est::Precision::Bf16Pure);
  t.lora.rank = 8;
  t.lora.targets = {"q", "v"};
  t.lora.base = est::BaseWeightDtype::Nf4;
  t.lora_dropout = 0.05;
  auto at = [&](const char* version, est::BaseWeightDtype base = est::BaseWeightDtype::Nf4) {
    auto u = t;
    u.lora.base = base;
    u.lora.bnb_version = est::parse_bnb_version(version);
    return est::forward_saved(m, u, cuda);
  };
  const auto current = est::forward_saved(m, t, cuda);
  EXPECT_EQ(at("0.43.2").layers, current.layers);
  EXPECT_EQ(at("0.50.2").layers, current.layers);
  // Before 0.43.2, per block: the attention norm's output (q, k, v share it) N x 128, the MLP norm's output
  // (gate, up) N x 128, down's input N x 352, all bf16; o reads SDPA's output, saved by the kernel already.
  // The first block's input needs no gradient: no attention input there.
  const int64_t block = N * 2 * (128 + 128 + 352), first = block - N * 2 * 128;
  EXPECT_EQ(at("0.43.1").layers - current.layers, block + first);  // 208,896
  EXPECT_EQ(at("0.42").layers - current.layers, block + first);
  // Eager attention: o's input is a copy of its own (N x 128) in both blocks.
  auto eager = t;
  eager.attention = est::AttentionKind::Eager;
  auto eager_old = eager;
  eager_old.lora.bnb_version = est::parse_bnb_version("0.42.0");
  EXPECT_EQ(est::forward_saved(m, eager_old, cuda).layers - est::forward_saved(m, eager, cuda).layers,
            block + first + 2 * N * 2 * 128);
  // int8 keeps the input in every release; before 0.45.0 also an int8 A^T per linear whose input needs a
  // gradient: q, k, v, o, gate, up read 128 features, down 352 (the first block without q, k, v).
  auto bf16 = t;
  bf16.lora.base = est::BaseWeightDtype::Bf16;
  const int64_t bf16_layers = est::forward_saved(m, bf16, cuda).layers;
  EXPECT_EQ(current.layers, bf16_layers);  // nf4 from 0.43.2 keeps nothing
  EXPECT_EQ(at("0.45.0", est::BaseWeightDtype::Int8).layers - bf16_layers, block + first);
  const int64_t copies = N * (6 * 128 + 352) + N * (3 * 128 + 352);
  EXPECT_EQ(at("0.44.1", est::BaseWeightDtype::Int8).layers - bf16_layers, block + first + copies);  // 387,072
  // Without dropout the q, v and down adapters save the very tensors the base keeps: only the MLP norm's
  // output is new (in both blocks: counted as needing a gradient, the safe side).
  auto shared = t;
  shared.lora_dropout = 0;
  shared.lora.targets = {"q", "v", "down"};
  auto shared_old = shared;
  shared_old.lora.bnb_version = est::parse_bnb_version("0.42.0");
  EXPECT_EQ(est::forward_saved(m, shared_old, cuda).layers - est::forward_saved(m, shared, cuda).layers,
            2 * N * 2 * 128);
  // A quantised LM head keeps its input (the final norm's output) too.
  auto head = t, head_old = t;
  head.lora.quantize_lm_head = head_old.lora.quantize_lm_head = true;
  head_old.lora.bnb_version = est::parse_bnb_version("0.42.0");
  EXPECT_EQ(est::forward_saved(m, head_old, cuda).extras - est::forward_saved(m, head, cuda).extras, N * 128 * 2);
  // Parsing: MAJOR.MINOR[.PATCH], nothing else.
  EXPECT_EQ(est::to_string(est::parse_bnb_version("0.43")), "0.43.0");
  EXPECT_EQ(est::to_string(est::BnbVersion{}), "0.45.0");
  for (const char* bad : {"", "0", "0.", ".43", "0.43.", "0..1", "0.43.1.2", "0.43.1rc1", "v0.43", "-1.0", "12345.0"}) {
    try {
      est::parse_bnb_version(bad);
      ADD_FAILURE() << bad;
    } catch (const gpuops::ArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("bnb-version"), std::string::npos) << e.what();
    }
  }
  const auto ok = run_cli({"estimate", "--model", "llama-2-7b", "--lora-rank", "8", "--base-dtype", "nf4",
                           "--bnb-version", "0.42.0", "--json"});
  ASSERT_EQ(ok.code, 0) << ok.err;
  EXPECT_NE(ok.out.find("\"bnb_version\": \"0.42.0\""), std::string::npos);
  const auto bad = run_cli({"estimate", "--model", "llama-2-7b", "--bnb-version", "latest"});
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("bnb-version"), std::string::npos) << bad.err;
  EXPECT_EQ(std::count(bad.err.begin(), bad.err.end(), '\n'), 1) << bad.err;
}

TEST(SetupsAct, HeldLogitsAreAliveAtEveryMoment) {
  // `out = model(...); out.loss.backward(); opt.step()` keeps out.logits (N x V in the LM head's dtype) until the
  // next forward replaces it; torchtune < 0.3 keeps fp32 logits. Measured on the CPU (measure.py's
  // hold_outputs, docs/estimator.md): the same bytes to within the step counters at backward and step peaks.
  const auto m = small_llama();
  const auto cpu = est::cpu_device();
  for (auto [precision, held, bytes] : std::vector<std::tuple<est::Precision, est::HeldLogits, int64_t>>{
           {est::Precision::Fp32, est::HeldLogits::Model, N * 2000 * 4},
           {est::Precision::Bf16Mixed, est::HeldLogits::Model, N * 2000 * 2},
           {est::Precision::Bf16Mixed, est::HeldLogits::Fp32, N * 2000 * 4},
           {est::Precision::Bf16Pure, est::HeldLogits::Model, N * 2000 * 2}}) {
    auto t = setup(precision);
    const auto none = est::phase_breakdowns(m, t, cpu, est::MemoryBreakdown{});
    t.held_logits = held;
    const auto kept = est::phase_breakdowns(m, t, cpu, est::MemoryBreakdown{});
    for (size_t p = 0; p < kept.size(); ++p) EXPECT_EQ(kept[p].total() - none[p].total(), bytes) << p;
    EXPECT_EQ(est::held_logits_bytes(m, t), bytes);
  }
  EXPECT_EQ(est::parse_held_logits("FP32"), est::HeldLogits::Fp32);
  EXPECT_EQ(est::to_string(est::HeldLogits::Model), "model");
  try {
    est::parse_held_logits("yes");
    ADD_FAILURE();
  } catch (const gpuops::ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("held-logits"), std::string::npos) << e.what();
  }
  auto bert = setup(est::Precision::Fp32);
  bert.held_logits = est::HeldLogits::Model;
  try {
    est::validate(bert, est::preset("bert-base"));
    ADD_FAILURE();
  } catch (const gpuops::ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("held-logits model needs a model with a language-model head"),
              std::string::npos) << e.what();
  }
  const auto cli = run_cli({"estimate", "--model", "llama-2-7b", "--held-logits", "fp32", "--json"});
  ASSERT_EQ(cli.code, 0) << cli.err;
  EXPECT_NE(cli.out.find("\"held_logits\": \"fp32\""), std::string::npos);
  const auto bad = run_cli({"estimate", "--model", "llama-2-7b", "--held-logits", "all"});
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("held-logits"), std::string::npos) << bad.err;
}

TEST(SetupsAct, LitgptCodeIsParsedCheckedAndReported) {
  // The bytes of the term are tested from Python against what autograd saves (test_estimator_fused_qkv.py).
  EXPECT_EQ(est::parse_model_code("LitGPT"), est::ModelCode::LitGpt);
  EXPECT_EQ(est::to_string(est::ModelCode::HuggingFace), "hf");
  auto gpt2 = setup(est::Precision::Fp32);
  gpt2.model_code = est::ModelCode::LitGpt;
  try {
    est::validate(gpt2, est::preset("gpt2"));
    ADD_FAILURE();
  } catch (const gpuops::ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("model-code litgpt runs decoders with RoPE"), std::string::npos) << e.what();
  }
  const auto cli = run_cli({"estimate", "--model", "llama-2-7b", "--model-code", "litgpt", "--json"});
  ASSERT_EQ(cli.code, 0) << cli.err;
  EXPECT_NE(cli.out.find("\"model_code\": \"litgpt\""), std::string::npos);
  const auto hf = run_cli({"estimate", "--model", "llama-2-7b", "--json"});
  EXPECT_NE(hf.out.find("\"model_code\": \"hf\""), std::string::npos);
  const auto bad = run_cli({"estimate", "--model", "llama-2-7b", "--model-code", "jax"});
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("model-code"), std::string::npos) << bad.err;
}

TEST(SetupsAct, LitgptDequantisesThroughFloat16) {
  // Lightning quantises LitGPT's weights from float16, so a bf16 (or fp32) step casts the dequantised float16
  // weight: both copies alive at the cast, beside the 16-bit one any nf4 base makes. small_llama's largest block
  // linear is gate/up/down, 128 x 352 = 45,056 values; its LM head 2000 x 128 = 256,000.
  const auto m = small_llama();
  const auto attention_temporaries = [&](est::Precision p, est::ModelCode code, est::BaseWeightDtype base,
                                         bool head) {
    auto t = setup(p);
    t.lora.rank = 4;
    t.model_code = code;
    t.lora.base = base;
    t.lora.quantize_lm_head = head;
    const auto phases = est::phase_breakdowns(m, t, est::cuda_device(), est::MemoryBreakdown{});
    return phases[static_cast<int>(est::StepPhase::AttentionBackward)].temporaries;
  };
  using est::BaseWeightDtype;
  using est::ModelCode;
  for (const est::Precision p : {est::Precision::Bf16Pure, est::Precision::Bf16Mixed, est::Precision::Fp32,
                                 est::Precision::Fp16Mixed}) {
    const int64_t cast = p == est::Precision::Fp16Mixed ? 0 : est::compute_dtype_bytes(p);
    const int64_t hf = attention_temporaries(p, ModelCode::HuggingFace, BaseWeightDtype::Bf16, false);
    const int64_t lit = attention_temporaries(p, ModelCode::LitGpt, BaseWeightDtype::Bf16, false);
    EXPECT_EQ(attention_temporaries(p, ModelCode::HuggingFace, BaseWeightDtype::Nf4, false) - hf, 2 * 45056);
    EXPECT_EQ(attention_temporaries(p, ModelCode::LitGpt, BaseWeightDtype::Nf4, false) - lit, (2 + cast) * 45056);
    EXPECT_EQ(attention_temporaries(p, ModelCode::LitGpt, BaseWeightDtype::Nf4, true) - lit, (2 + cast) * 256000);
    // int8's matmul dequantises straight to the input's dtype: LitGPT adds nothing there.
    EXPECT_EQ(attention_temporaries(p, ModelCode::LitGpt, BaseWeightDtype::Int8, false) - lit,
              attention_temporaries(p, ModelCode::HuggingFace, BaseWeightDtype::Int8, false) - hf);
  }
}

TEST(SetupsAct, CompileMatchesTheMeasuredSavedTensors) {
  // Measured with saved_tensors_hooks on torch 2.11 (CPU, sdpa): Llama h 128, L 2, a 4, kv 4, I 352, V 2000,
  // b 2, s 64: eager saves 4,063,748 bytes, torch.compile 3,331,604; the difference is exactly the terms below.
  const auto m = est::model_from_hf_config(R"({"model_type": "llama", "vocab_size": 2000, "hidden_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 352,
    "max_position_embeddings": 256, "tie_word_embeddings": false})", "m");
  auto eager = setup(est::Precision::Fp32, 2, 64), compiled = eager;
  compiled.compile = true;
  const auto cpu = est::cpu_device();
  const auto a = est::forward_saved(m, eager, cpu), b = est::forward_saved(m, compiled, cpu);
  const int64_t n = 128, Nh = n * 128;
  // Per block: RMSNorm keeps input and output (not its fp32 copy), SwiGLU 3 of 4 N x I tensors, one shared
  // mask instead of one per layer; outside: final norm, RoPE freqs instead of cos/sin, the logits and two
  // fp32 values per row instead of the log-softmax, labels padded by one per sequence.
  const int64_t blocks = 2 * (2 * Nh * 4 + n * 352 * 4 + 2 * 64 * 64 * 4);
  const int64_t outside = Nh * 4 + (2 * 64 * 32 * 4 - 2 * 64 * 32) - 2 * 64 * 64 * 4 + (n * 8 - 2 * n * 4 - 2 * 65 * 8);
  EXPECT_EQ(a.total() - b.total(), blocks + outside);
  EXPECT_EQ(a.total() - b.total(), 4063748 - 3331604);
  // bf16-mixed, b 2, s 48, kv 2 (small_llama): measured 3,619,204 eager and 2,664,596 compiled.
  auto e16 = setup(est::Precision::Bf16Mixed), c16 = e16;
  c16.compile = true;
  const auto s = small_llama();
  EXPECT_EQ(est::forward_saved(s, e16, cpu).total() - est::forward_saved(s, c16, cpu).total(), 3619204 - 2664596);
}

TEST(SetupsAct, ParsersAndNames) {
  est::TrainingSetup t;
  est::parse_checkpointing("Selective", t);
  EXPECT_EQ(t.checkpoint, est::CheckpointKind::Selective);
  EXPECT_EQ(est::checkpointing_to_string(t), "selective");
  est::parse_loss("chunked:16", t);
  EXPECT_EQ(t.loss, est::LossKind::Chunked);
  EXPECT_EQ(t.loss_chunks, 16);
  EXPECT_EQ(est::loss_to_string(t), "chunked:16");
  est::parse_loss("fused-linear-ce", t);
  EXPECT_EQ(est::loss_to_string(t), "fused-linear-ce");
  for (const char* name : {"no-upcast", "chunked-no-upcast:4", "standard", "chunked:3"}) {
    est::parse_loss(name, t);
    EXPECT_EQ(est::loss_to_string(t), name);
  }
  est::parse_loss("No-Upcast", t);
  EXPECT_FALSE(t.loss_upcast);
  EXPECT_EQ(t.loss, est::LossKind::Standard);
  est::parse_loss("chunked:2", t);
  EXPECT_TRUE(t.loss_upcast);
  EXPECT_DOUBLE_EQ(est::parse_lora_dropout("0.05"), 0.05);
  EXPECT_DOUBLE_EQ(est::parse_lora_dropout(".1"), 0.1);
}

TEST(SetupsAct, BadInputIsRefusedNamingTheOption) {
  const auto m = small_llama();
  est::TrainingSetup t;
  for (const char* bad : {"chunked:0", "chunked:", "chunked:-1", "chunked:1e3", "chunked", "fused", "",
                          "chunked-no-upcast:0", "chunked-no-upcast", "no-upcast:3", "fused-linear-ce-no-upcast"}) {
    try {
      est::parse_loss(bad, t);
      ADD_FAILURE() << bad;
    } catch (const gpuops::ArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("loss"), std::string::npos) << e.what();
    }
  }
  for (const char* bad : {"nan", "inf", "-0.1", "1e-1", "0.1.2", ".", "", "0x1"}) {
    try {
      est::parse_lora_dropout(bad);
      ADD_FAILURE() << bad;
    } catch (const gpuops::ArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("lora-dropout"), std::string::npos) << e.what();
    }
  }
  auto lora = setup(est::Precision::Bf16Mixed);
  lora.lora.rank = 8;
  for (double p : {1.0, 1.5, -0.1, std::nan(""), std::numeric_limits<double>::infinity()}) {
    lora.lora_dropout = p;
    EXPECT_THROW(est::validate(lora, m), gpuops::ArgumentError) << p;
  }
  auto no_lora = setup(est::Precision::Bf16Mixed);
  no_lora.lora_dropout = 0.1;
  EXPECT_THROW(est::validate(no_lora, m), gpuops::ArgumentError);
  auto eager_compile = setup(est::Precision::Bf16Mixed);
  eager_compile.attention = est::AttentionKind::Eager;
  eager_compile.compile = true;
  EXPECT_THROW(est::validate(eager_compile, m), gpuops::ArgumentError);
  auto chunks0 = setup(est::Precision::Fp32);
  chunks0.loss = est::LossKind::Chunked;
  chunks0.loss_chunks = 0;
  EXPECT_THROW(est::validate(chunks0, m), gpuops::ArgumentError);
  auto bare = setup(est::Precision::Fp32);
  bare.loss = est::LossKind::FusedLinearCe;
  EXPECT_THROW(est::validate(bare, est::params_only_model(7000000000, "7B")), gpuops::ArgumentError);
  auto fused_plain = setup(est::Precision::Bf16Pure);
  fused_plain.loss = est::LossKind::FusedLinearCe;
  fused_plain.loss_upcast = false;  // only a struct written by hand can say this
  EXPECT_THROW(est::validate(fused_plain, m), gpuops::ArgumentError);
}

TEST(SetupsAct, CommandLineOptionsAndJson) {
  const std::vector<std::string> base = {"estimate", "--model", "llama-2-7b", "--seq", "512", "--json"};
  auto with = [&](std::vector<std::string> extra) {
    auto args = base;
    args.insert(args.end(), extra.begin(), extra.end());
    return run_cli(args);
  };
  auto r = with({"--checkpointing", "selective", "--loss", "chunked:8", "--lora-rank", "8", "--lora-dropout", "0.05",
                 "--compile"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("\"loss\": \"chunked:8\""), std::string::npos);
  EXPECT_NE(r.out.find("\"lora_dropout\": 0.05"), std::string::npos);
  EXPECT_NE(r.out.find("\"compile\": true"), std::string::npos);
  EXPECT_NE(r.out.find("\"checkpointing\": \"selective\""), std::string::npos);
  for (auto [option, value] : std::vector<std::pair<std::string, std::string>>{{"--loss", "chunked:0"},
                                                                               {"--lora-dropout", "1.5"},
                                                                               {"--lora-dropout", "nan"}}) {
    auto bad = with({option, value, "--lora-rank", "8"});
    EXPECT_EQ(bad.code, 2) << option << " " << value;
    EXPECT_NE(bad.err.find(option.substr(2)), std::string::npos) << bad.err;
    EXPECT_EQ(std::count(bad.err.begin(), bad.err.end(), '\n'), 1) << bad.err;
  }
  auto fsdp = with({"--sharding", "fsdp2", "--gpus", "8", "--reduce-dtype", "fp32"});
  ASSERT_EQ(fsdp.code, 0) << fsdp.err;
  EXPECT_NE(fsdp.out.find("\"reduce_dtype\": \"fp32\""), std::string::npos);
  auto flat_fp32 = with({"--zero", "3", "--gpus", "8", "--reduce-dtype", "fp32"});
  EXPECT_EQ(flat_fp32.code, 2);
  EXPECT_NE(flat_fp32.err.find("reduce-dtype"), std::string::npos) << flat_fp32.err;
  // gpuops' ZeroOptimizer reducing in the backward: the bucket size is in the JSON; it needs ZeRO 1-2.
  auto buckets = with({"--zero", "2", "--gpus", "4", "--zero-bucket-bytes", "4194304"});
  ASSERT_EQ(buckets.code, 0) << buckets.err;
  EXPECT_NE(buckets.out.find("\"zero_bucket_bytes\": 4194304"), std::string::npos);
  for (const auto& extra : std::vector<std::vector<std::string>>{{"--zero-bucket-bytes", "4194304"},
                                                                  {"--zero", "2", "--zero-bucket-bytes", "-1"},
                                                                  {"--zero", "2", "--zero-bucket-bytes", "4M"}}) {
    auto bad = with(extra);
    EXPECT_EQ(bad.code, 2) << extra.back();
    EXPECT_NE(bad.err.find("zero-bucket-bytes"), std::string::npos) << bad.err;
    EXPECT_EQ(std::count(bad.err.begin(), bad.err.end(), '\n'), 1) << bad.err;
  }
  auto eager = with({"--compile", "--attention", "eager"});
  EXPECT_EQ(eager.code, 2);
  EXPECT_NE(eager.err.find("compile"), std::string::npos) << eager.err;
}
