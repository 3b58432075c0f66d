// The three figures (allocated, reserved, device used): the caching-allocator model against c10's rules
// worked by hand, the CUDA runtime terms, the safe-side verdict and the catalog's precisions.
#include <gtest/gtest.h>

#include <algorithm>

#include <nlohmann/json.hpp>

#include "cli_runner.h"
#include "gpuops/errors.h"
#include "gpuops/estimator.h"

namespace est = gpuops::estimator;
using gpuops::testing::run_cli;

namespace {

constexpr int64_t KiB = int64_t{1} << 10;
constexpr int64_t MiB = int64_t{1} << 20;

// ---- the allocator model: each rule of CUDACachingAllocator.cpp on a case worked by hand -------------

TEST(AllocatorModel, RoundingAndSegmentSizesFollowC10) {
  EXPECT_EQ(est::allocator_round_size(1), 512);
  EXPECT_EQ(est::allocator_round_size(512), 512);
  EXPECT_EQ(est::allocator_round_size(513), 1024);
  EXPECT_EQ(est::allocator_segment_size(1 * MiB), 2 * MiB);        // small pool: 2 MiB segments
  EXPECT_EQ(est::allocator_segment_size(1 * MiB + 512), 20 * MiB);  // 1-10 MiB share 20 MiB segments
  EXPECT_EQ(est::allocator_segment_size(10 * MiB - 512), 20 * MiB);
  EXPECT_EQ(est::allocator_segment_size(10 * MiB), 10 * MiB);       // from 10 MiB: rounded to 2 MiB
  EXPECT_EQ(est::allocator_segment_size(11 * MiB), 12 * MiB);
}

TEST(AllocatorModel, SmallAndMidSizedRequestsShareSegments) {
  est::CachingAllocatorModel a;
  a.malloc(100);          // a 2 MiB small segment
  a.malloc(1000);         // the same segment: 512 + 1024 used
  EXPECT_EQ(a.reserved(), 2 * MiB);
  EXPECT_EQ(a.requested(), 1100);
  const int64_t m1 = a.malloc(5 * MiB);  // a 20 MiB segment
  a.malloc(5 * MiB);                     // the rest of it
  EXPECT_EQ(a.reserved(), 22 * MiB);
  a.malloc(11 * MiB - 1);                // its own 12 MiB segment
  EXPECT_EQ(a.reserved(), 34 * MiB);
  a.free(m1);
  a.malloc(4 * MiB);                     // reuses the freed 5 MiB block: no growth
  EXPECT_EQ(a.reserved(), 34 * MiB);
  EXPECT_EQ(a.peak_reserved(), 34 * MiB);
  EXPECT_EQ(a.peak_requested(), 1100 + 10 * MiB + 11 * MiB - 1);
}

TEST(AllocatorModel, AHoleTooSmallForTheNextRequestIsFragmentation) {
  // A and B 12 MiB each, A freed, then 14 MiB: the 12 MiB hole cannot serve it, a new segment comes.
  est::CachingAllocatorModel a;
  const int64_t first = a.malloc(12 * MiB);
  a.malloc(12 * MiB);
  a.free(first);
  a.malloc(14 * MiB);
  EXPECT_EQ(a.reserved(), 38 * MiB);
  EXPECT_EQ(a.requested(), 26 * MiB);
  // Expandable segments: pages of 20 MiB in the large pool; the segment's free tail (40 - 24 = 16 MiB)
  // serves the 14 MiB request: no growth.
  est::CachingAllocatorModel x(est::AllocatorMode::ExpandableSegments);
  const int64_t xa = x.malloc(12 * MiB);  // maps 20 MiB
  x.malloc(12 * MiB);                     // the free 8 MiB tail grows by 20 MiB
  EXPECT_EQ(x.reserved(), 40 * MiB);
  x.free(xa);
  x.malloc(14 * MiB);
  EXPECT_EQ(x.reserved(), 40 * MiB);
}

TEST(AllocatorModel, FreedNeighboursMergeAndServeALargerRequest) {
  est::CachingAllocatorModel a;
  const int64_t p = a.malloc(4 * MiB), q = a.malloc(4 * MiB);
  a.malloc(4 * MiB);  // keeps the segment's tail apart
  EXPECT_EQ(a.reserved(), 20 * MiB);
  a.free(p);
  a.free(q);
  a.malloc(8 * MiB);  // the merged 8 MiB block: no new segment
  EXPECT_EQ(a.reserved(), 20 * MiB);
  a.malloc(9 * MiB);  // only 8 MiB are left in the segment: a second one
  EXPECT_EQ(a.reserved(), 40 * MiB);
}

TEST(AllocatorModel, LargeBlocksAreNotSplitForARemainderOfOneMiBOrLess) {
  // 11.5 MiB in a 12 MiB segment leaves 512 KiB: not split (large pool splits only past 1 MiB), so a
  // 300 KiB request cannot use it (small pool anyway) and a later 600 KiB one neither.
  est::CachingAllocatorModel a;
  const int64_t big = a.malloc(11 * MiB + 512 * KiB);
  EXPECT_EQ(a.reserved(), 12 * MiB);
  EXPECT_EQ(a.allocated(), 12 * MiB);  // handed out whole: max_memory_allocated counts the block
  EXPECT_EQ(a.requested(), 11 * MiB + 512 * KiB);
  a.free(big);
  EXPECT_EQ(a.allocated(), 0);
  a.malloc(10 * MiB + 512 * KiB);  // leaves 1.5 MiB: split, so only the request's block is allocated
  EXPECT_EQ(a.reserved(), 12 * MiB);
  EXPECT_EQ(a.allocated(), 10 * MiB + 512 * KiB);
  // Expandable segments split any remainder of 512 bytes or more, in the large pool too.
  est::CachingAllocatorModel x(est::AllocatorMode::ExpandableSegments);
  x.malloc(19 * MiB + 512 * KiB);  // one 20 MiB page; the 512 KiB rest stays free
  EXPECT_EQ(x.reserved(), 20 * MiB);
  EXPECT_EQ(x.allocated(), 19 * MiB + 512 * KiB);
}

TEST(AllocatorModel, ABlockServesOnlyTheStreamThatAllocatedIt) {
  // c10 keeps one pool per stream in effect (BlockPool ordered by stream, get_free_block on the request's
  // stream): 30 MiB freed on a side stream is reserved and idle for the default stream's next 30 MiB.
  for (auto mode : {est::AllocatorMode::Default, est::AllocatorMode::ExpandableSegments}) {
    est::CachingAllocatorModel a(mode);
    const int64_t side = a.malloc(30 * MiB, 1);
    a.free(side);
    const int64_t reserved = a.reserved();
    const int64_t mine = a.malloc(30 * MiB, 0);  // a new segment (default) or page run (expandable)
    EXPECT_EQ(a.reserved(), 2 * reserved);
    a.free(mine);
    a.malloc(30 * MiB, 1);  // each stream reuses its own
    a.malloc(30 * MiB, 0);
    EXPECT_EQ(a.reserved(), 2 * reserved);
    EXPECT_EQ(a.allocated(), 60 * MiB);
    EXPECT_EQ(a.peak_reserved(), 2 * reserved);
  }
  // A split's tail stays with its stream: 4 MiB on stream 1 leaves 16 MiB of its 20 MiB segment free for stream 1
  // only, so stream 0's 4 MiB gets a segment of its own and stream 1's next 4 MiB the tail.
  est::CachingAllocatorModel a;
  a.malloc(4 * MiB, 1);
  a.malloc(4 * MiB, 0);
  EXPECT_EQ(a.reserved(), 40 * MiB);
  a.malloc(4 * MiB, 1);
  EXPECT_EQ(a.reserved(), 40 * MiB);
}

// ---- the estimate's CUDA terms ---------------------------------------------------------------------

est::TrainingSetup full_bf16() {
  est::TrainingSetup s;
  s.precision = est::Precision::Bf16Mixed;
  s.micro_batch = 2;
  s.seq_len = 1024;
  return s;
}

TEST(DeviceFigures, ContextTableByGenerationAndOverride) {
  // Lazy loading: 256-450 MiB measured on Ampere/Ada boards; 300-700 MiB for the data-centre parts.
  const est::DeviceProfile rtx = est::device_of(est::find_gpu("RTX-4090"));
  EXPECT_EQ(rtx.cuda_context_bytes, 400 * MiB);
  EXPECT_EQ(rtx.cuda_context_low, 256 * MiB);
  EXPECT_EQ(rtx.cuda_context_high, 450 * MiB);
  const est::DeviceProfile a100 = est::device_of(est::find_gpu("A100-80GB"));
  EXPECT_EQ(a100.cuda_context_bytes, 500 * MiB);
  // torch 2.11: 8 MiB + 128 KiB cuBLAS and 1 MiB cuBLASLt workspaces per handle before sm_90, two handles.
  EXPECT_EQ(a100.workspace_bytes, 2 * (8 * MiB + 128 * KiB + MiB));
  // sm_90 with CUDA 13: the H200 run's measured profile (bench/results/device-profile-h200.json) sets the
  // typical context and the workspaces; the range keeps the table's low end for drivers not measured.
  const est::DeviceProfile h100 = est::device_of(est::find_gpu("H100-80GB"));
  EXPECT_EQ(h100.cuda_context_bytes, 809041920);
  EXPECT_EQ(h100.cuda_context_low, 300 * MiB);
  EXPECT_EQ(h100.cuda_context_high, 813236224);
  EXPECT_EQ(h100.workspace_bytes, 68157440);
  EXPECT_NE(h100.context_basis.find("measured on NVIDIA H200"), std::string::npos) << h100.context_basis;
  const est::DeviceProfile cuda12 = est::cuda_device(90, est::CudaRuntime{12, true});
  EXPECT_EQ(cuda12.cuda_context_bytes, 500 * MiB);  // no run measured CUDA 12: the table
  EXPECT_EQ(cuda12.workspace_bytes, 2 * (32 * MiB + MiB));
  const est::DeviceProfile eager90 = est::cuda_device(90, est::CudaRuntime{13, false});
  EXPECT_EQ(eager90.cuda_context_bytes, 1000 * MiB);  // eager loading was not measured: the table
  EXPECT_EQ(eager90.workspace_bytes, 68157440);
  ASSERT_TRUE(est::builtin_measured_cuda(90, 13).has_value());
  EXPECT_FALSE(est::builtin_measured_cuda(80, 13).has_value());
  EXPECT_FALSE(est::builtin_measured_cuda(90, 12).has_value());
  const est::DeviceProfile eager = est::cuda_device(80, est::CudaRuntime{12, false});
  EXPECT_EQ(eager.cuda_context_bytes, 1000 * MiB);  // every kernel image loaded at start
  est::CudaRuntime given;
  given.context_bytes = 777 * MiB;
  const est::DeviceProfile measured = est::device_of(est::find_gpu("L4"), given);
  EXPECT_EQ(measured.cuda_context_bytes, 777 * MiB);
  EXPECT_EQ(measured.cuda_context_low, 777 * MiB);  // a measured context has no range
  const est::MemoryBreakdown b = est::estimate_memory(est::preset("gpt2"), full_bf16(), measured);
  EXPECT_EQ(b.cuda_context, 777 * MiB);
  EXPECT_EQ(b.total(), b.reserved_peak() + 777 * MiB);
}

TEST(DeviceFigures, AMeasuredProfileReplacesTheTableForItsComputeCapabilityOnly) {
  est::CudaRuntime rt;
  rt.measured = est::MeasuredCuda{90, 612 * MiB, 600 * MiB, 650 * MiB, 40 * MiB, "a test GPU"};
  const est::DeviceProfile h100 = est::cuda_device(90, rt);
  EXPECT_EQ(h100.cuda_context_bytes, 612 * MiB);
  EXPECT_EQ(h100.cuda_context_low, 600 * MiB);
  EXPECT_EQ(h100.cuda_context_high, 650 * MiB);
  EXPECT_EQ(h100.workspace_bytes, 40 * MiB);
  EXPECT_NE(h100.context_basis.find("measured on a test GPU"), std::string::npos);
  const est::DeviceProfile a100 = est::cuda_device(80, rt);  // another chip: the table's figures
  EXPECT_EQ(a100.cuda_context_bytes, est::cuda_device(80).cuda_context_bytes);
  EXPECT_EQ(a100.workspace_bytes, est::cuda_device(80).workspace_bytes);
  rt.context_bytes = 700 * MiB;  // --context-bytes wins over the profile's context
  EXPECT_EQ(est::cuda_device(90, rt).cuda_context_bytes, 700 * MiB);
  EXPECT_EQ(est::cuda_device(90, rt).workspace_bytes, 40 * MiB);
}

TEST(DeviceFigures, NcclBuffersOnlyWithSeveralGpus) {
  est::TrainingSetup s = full_bf16();
  const est::ModelSpec m = est::preset("llama-2-7b");
  s.zero_stage = 3;
  EXPECT_EQ(est::estimate_memory(m, s, est::cuda_device()).nccl_buffers, 0);
  s.num_gpus = 8;
  const est::MemoryBreakdown eight = est::estimate_memory(m, s, est::cuda_device());
  EXPECT_EQ(eight.nccl_buffers, 1011 * MiB);  // 1.06 GB measured per GPU on 8 x H100
  EXPECT_EQ(eight.total(), eight.reserved_peak() + eight.cuda_context + 1011 * MiB);
  s.num_gpus = 2;
  EXPECT_EQ(est::estimate_memory(m, s, est::device_of(est::find_gpu("RTX-4090"))).nccl_buffers, 175 * MiB);  // PCIe
}

TEST(DeviceFigures, TheReserveIsTheReplayedStepsReservedMinusRequested) {
  // Recompute the reserve independently: the allocator model's peaks over the replayed step must give
  // reserved >= requested, and the estimate's slack is their difference (>= 0), the same on every phase.
  const est::ModelSpec m = est::preset("llama-2-7b");
  est::TrainingSetup s = full_bf16();
  const est::MemoryBreakdown d = est::estimate_memory(m, s, est::cuda_device());
  EXPECT_GT(d.allocator_slack, 0);
  EXPECT_LT(d.allocator_slack, d.allocated_peak() / 4);  // a reserve, not a second model
  for (const auto& p : est::estimate_phases(m, s, est::cuda_device())) EXPECT_EQ(p.allocator_slack, d.allocator_slack);
  // Expandable segments grow one segment per pool in pages: its reserve is never the larger here.
  est::CudaRuntime expandable;
  expandable.allocator = est::AllocatorMode::ExpandableSegments;
  const est::MemoryBreakdown x = est::estimate_memory(m, s, est::cuda_device(90, expandable));
  EXPECT_LE(x.allocator_slack, d.allocator_slack);
  EXPECT_EQ(x.allocated_peak(), d.allocated_peak());
}

TEST(DeviceFigures, TheVerdictIsOnTheTopOfTheBand) {
  const est::ModelSpec m = est::preset("gpt2");
  const est::MemoryBreakdown b = est::estimate_memory(m, full_bf16(), est::cuda_device());
  ASSERT_GT(b.band_above, 0);
  est::GpuModel between = est::find_gpu("H100-80GB");
  between.memory_bytes = b.total() + b.band_above / 2;  // the typical figure fits, the top does not
  EXPECT_FALSE(est::fits_on(b, between));
  between.memory_bytes = b.total_high();
  EXPECT_TRUE(est::fits_on(b, between));
}

// ---- the catalog's precisions ----------------------------------------------------------------------

TEST(GpuPrecisions, BfloatNeedsAmpere) {
  const est::GpuModel& t4 = est::find_gpu("T4");
  EXPECT_EQ(t4.compute_capability, 75);
  EXPECT_FALSE(est::supports_bf16(75));
  EXPECT_EQ(est::precisions_of(75), "fp16");
  EXPECT_EQ(est::precisions_of(80), "fp16, bf16");
  EXPECT_EQ(est::precisions_of(89), "fp16, bf16, fp8");
  EXPECT_FALSE(est::runs_precision(t4, est::Precision::Bf16Mixed));
  EXPECT_FALSE(est::runs_precision(t4, est::Precision::Bf16Pure));
  EXPECT_TRUE(est::runs_precision(t4, est::Precision::Fp16Mixed));
  EXPECT_TRUE(est::runs_precision(est::find_gpu("A10G"), est::Precision::Bf16Mixed));
  // A small bf16 job fits the T4's memory but is not recommended there; as fp16-mixed it is, first.
  est::TrainingSetup s = full_bf16();
  s.seq_len = 256;
  const est::ModelSpec m = est::preset("gpt2");
  for (const auto& f : est::fit_catalog(m, s))
    if (f.gpu->name == "T4") EXPECT_TRUE(f.fits && !f.precision_ok);
  for (const auto& f : est::recommend(m, s)) EXPECT_NE(f.gpu->name, "T4");
  s.precision = est::Precision::Fp16Mixed;
  EXPECT_EQ(est::recommend(m, s).front().gpu->name, "T4");
}

// ---- the command line ------------------------------------------------------------------------------

TEST(DeviceFiguresCli, JsonHasTheThreeFiguresAndTheBand) {
  const auto r = run_cli({"estimate", "--model", "gpt2", "--batch", "2", "--seq", "1024", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out)["runs"][0]["breakdown"];
  const int64_t allocated = j["allocated_peak"], reserved = j["reserved_peak"], total = j["total"];
  EXPECT_LT(allocated, reserved);
  EXPECT_LT(reserved, total);
  EXPECT_EQ(reserved - allocated, j["allocator_slack"].get<int64_t>());
  EXPECT_EQ(total - reserved, j["cuda_context"].get<int64_t>() + j["nccl_buffers"].get<int64_t>());
  EXPECT_LT(j["total_low"].get<int64_t>(), total);
  EXPECT_GT(j["total_high"].get<int64_t>(), total);
  const auto expected = est::estimate_memory(est::preset("gpt2"), [] {
    est::TrainingSetup s = full_bf16();
    return s;
  }(), est::cuda_device());
  EXPECT_EQ(total, expected.total());
}

TEST(DeviceFiguresCli, RuntimeOptionsChangeTheFiguresAndBadOnesNameTheOption) {
  auto total = [](std::vector<std::string> extra) {
    std::vector<std::string> args = {"estimate", "--model", "gpt2", "--json"};
    args.insert(args.end(), extra.begin(), extra.end());
    const auto r = run_cli(args);
    EXPECT_EQ(r.code, 0) << r.err;
    return nlohmann::json::parse(r.out)["runs"][0]["breakdown"]["total"].get<int64_t>();
  };
  const int64_t lazy = total({});
  // sm_90, CUDA 13: 1000 MiB eager (the table) vs the measured 809,041,920 bytes lazy.
  EXPECT_EQ(total({"--module-loading", "eager"}) - lazy, 1000 * MiB - 809041920);
  EXPECT_EQ(total({"--context-bytes", "0"}), lazy - 809041920);
  EXPECT_LE(total({"--allocator", "expandable"}), lazy);
  for (const auto& [args, needle] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--cuda", "10"}, "--cuda 10"},
           {{"--module-loading", "sometimes"}, "--module-loading 'sometimes'"},
           {{"--allocator", "buddy"}, "--allocator 'buddy'"},
           {{"--context-bytes", "-7"}, "--context-bytes -7"},
           {{"--context-bytes", "1e9"}, "--context-bytes '1e9'"},
           {{"--zero-grad", "false"}, "zero-grad 'false'"}}) {
    std::vector<std::string> a = {"estimate", "--model", "gpt2"};
    a.insert(a.end(), args.begin(), args.end());
    const auto r = run_cli(a);
    EXPECT_EQ(r.code, 2) << needle;
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

TEST(DeviceFiguresCli, GpusListsComputeCapabilityAndPrecisions) {
  const auto r = run_cli({"gpus", "--json"});
  ASSERT_EQ(r.code, 0);
  bool saw_t4 = false;
  const nlohmann::json doc = nlohmann::json::parse(r.out);
  for (const auto& g : doc["gpus"]) {
    if (g["name"] != "T4") continue;
    saw_t4 = true;
    EXPECT_EQ(g["compute_capability"], "7.5");
    EXPECT_EQ(g["tensor_precisions"], nlohmann::json::array({"fp32", "fp16"}));
    EXPECT_EQ(g["tensor_tflops_dtype"], "fp16");
  }
  EXPECT_TRUE(saw_t4);
  // A bf16 estimate says so next to the T4's fit.
  const auto e = run_cli({"estimate", "--model", "gpt2", "--precision", "bf16-mixed"});
  EXPECT_NE(e.out.find("no bf16-mixed on sm_75: use fp16-mixed"), std::string::npos) << e.out;
}

}  // namespace
