// gpuops::dist::Communicator over Gloo, with real processes: a test re-runs this binary as N ranks (the
// environment variable GPUOPS_COMM_WORKER picks the scenario, main() below runs it instead of the tests),
// torchrun-style variables set (MASTER_ADDR=127.0.0.1, MASTER_PORT a free port, OMP_NUM_THREADS=1), and
// waits for them with a deadline. Each rank's input is random, seeded per rank, so every rank recomputes
// every other rank's input and checks the collective's result in float64.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include "gpuops/agreement.h"
#include "gpuops/communicator.h"
#include "multiprocess.h"

extern char** environ;

namespace {

using gpuops::dist::Communicator;
using gpuops::dist::CommunicatorOptions;
using gpuops::dist::ReduceOp;
using namespace gpuops_test;  // NOLINT: the launch helpers (multiprocess.h)

constexpr int kCollectiveTimeoutMs = 4000;  // the killed and stalled scenarios
constexpr int kMarginMs = 2000;             // what they allow past the timeout

// ------------------------------------------------------------------------------------------------------
// Worker side (one rank)

at::Tensor input_of(int rank, int64_t numel, int salt) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * salt + rank);
  return at::randn({numel}, gen, at::TensorOptions().dtype(at::kDouble));
}

void expect_close(const at::Tensor& got, const at::Tensor& want, double tol, const std::string& what) {
  const auto g = got.to(at::kDouble), w = want.to(at::kDouble);
  const double err = (g - w).abs().max().item<double>();
  const double scale = std::max(1.0, w.abs().max().item<double>());
  WORKER_CHECK(err <= tol * scale, "{}: max abs error {} > {} (scale {})", what, err, tol * scale, scale);
}

void scenario_collectives(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  const int64_t S = 257, N = S * n;
  // reduce_scatter, sum and average, float32 and float64
  for (auto dtype : {at::kFloat, at::kDouble}) {
    for (auto op : {ReduceOp::Sum, ReduceOp::Average}) {
      const int salt = 1 + static_cast<int>(op);
      auto buf = input_of(r, N, salt).to(dtype);
      auto work = comm.reduce_scatter(buf, op);
      work.wait();
      WORKER_CHECK(work.is_completed(), "reduce_scatter: is_completed() false after wait()");
      auto want = at::zeros({N}, at::kDouble);
      for (int q = 0; q < n; ++q) want += input_of(q, N, salt).to(dtype).to(at::kDouble);
      if (op == ReduceOp::Average) want /= n;
      expect_close(comm.shard(buf), want.narrow(0, r * S, S), dtype == at::kFloat ? 1e-6 : 1e-13,
                   fmt::format("reduce_scatter({}) {}", gpuops::dist::reduce_op_name(op), c10::toString(dtype)));
    }
  }
  // all_gather: every rank's shard lands at its place, bit for bit
  {
    auto buf = at::full({N}, std::nan(""), at::kFloat);
    comm.shard(buf).copy_(input_of(r, N, 7).narrow(0, r * S, S));
    comm.all_gather(buf).wait();
    auto want = at::empty({N}, at::kFloat);
    for (int q = 0; q < n; ++q) want.narrow(0, q * S, S).copy_(input_of(q, N, 7).narrow(0, q * S, S));
    WORKER_CHECK(at::equal(buf, want), "all_gather: the gathered buffer differs");
  }
  // all_reduce: sum, avg, max, min in float32; sum in int64 exactly
  for (auto op : {ReduceOp::Sum, ReduceOp::Average, ReduceOp::Max, ReduceOp::Min}) {
    const int salt = 10 + static_cast<int>(op);
    auto buf = input_of(r, 1000, salt).to(at::kFloat);
    comm.all_reduce(buf, op).wait();
    auto all = at::stack([&] {
      std::vector<at::Tensor> v;
      for (int q = 0; q < n; ++q) v.push_back(input_of(q, 1000, salt).to(at::kFloat).to(at::kDouble));
      return v;
    }());
    at::Tensor want = op == ReduceOp::Sum       ? all.sum(0)
                      : op == ReduceOp::Average ? all.sum(0) / n
                      : op == ReduceOp::Max     ? std::get<0>(all.max(0))
                                                : std::get<0>(all.min(0));
    expect_close(buf, want, op == ReduceOp::Max || op == ReduceOp::Min ? 0.0 : 1e-6,
                 fmt::format("all_reduce({})", gpuops::dist::reduce_op_name(op)));
  }
  {
    auto buf = at::arange(100, at::kLong) * (r + 1);
    comm.all_reduce(buf).wait();
    WORKER_CHECK(at::equal(buf, at::arange(100, at::kLong) * (n * (n + 1) / 2)), "all_reduce(sum) int64");
  }
  // overlap: two collectives in flight, computation meanwhile, then waited in order
  {
    auto a = input_of(r, N, 20).to(at::kFloat);
    auto b = input_of(r, 4 * N, 21).to(at::kFloat);
    auto wa = comm.all_reduce(a, ReduceOp::Sum);
    auto wb = comm.reduce_scatter(b, ReduceOp::Average);
    auto m = at::ones({64, 64});
    for (int i = 0; i < 20; ++i) m = at::mm(m, m) / 64;  // work on this rank while both are in flight
    wa.wait();
    wb.wait();
    auto sa = at::zeros({N}, at::kDouble), sb = at::zeros({4 * N}, at::kDouble);
    for (int q = 0; q < n; ++q) {
      sa += input_of(q, N, 20).to(at::kFloat).to(at::kDouble);
      sb += input_of(q, 4 * N, 21).to(at::kFloat).to(at::kDouble);
    }
    expect_close(a, sa, 1e-6, "overlapped all_reduce(sum)");
    expect_close(comm.shard(b), (sb / n).narrow(0, r * 4 * S, 4 * S), 1e-6, "overlapped reduce_scatter(avg)");
    WORKER_CHECK(m.allclose(at::ones({64, 64})), "the computation meanwhile");
  }
  comm.barrier().wait();
}

// Returns the message of the c10::Error `fn` throws; fails when it throws nothing.
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  throw std::runtime_error("expected an error, got none");
}

void expect_error(const std::string& what, const std::string& message, const std::vector<std::string>& parts) {
  for (const auto& p : parts)
    WORKER_CHECK(message.find(p) != std::string::npos, "{}: the message '{}' lacks '{}'", what, message, p);
}

void scenario_bad_input(Communicator& comm) {
  const int n = comm.size();
  auto odd = at::arange(2 * n + 1, at::kFloat);
  const auto odd_before = odd.clone();
  const auto odd_numel = std::to_string(odd.numel()), size = std::to_string(n);
  expect_error("reduce_scatter odd", error_of([&] { comm.reduce_scatter(odd); }),
               {"reduce_scatter", "buffer", odd_numel, "size " + size});
  expect_error("all_gather odd", error_of([&] { comm.all_gather(odd); }),
               {"all_gather", "buffer", odd_numel, "size " + size});
  WORKER_CHECK(at::equal(odd, odd_before), "a refused call changed its buffer");
  auto strided = at::zeros({4, 2 * n}).t();
  expect_error("non-contiguous", error_of([&] { comm.all_reduce(strided); }), {"all_reduce", "contiguous"});
  expect_error("non-contiguous rs", error_of([&] { comm.reduce_scatter(strided); }), {"reduce_scatter", "contiguous"});
  auto in = at::zeros({2 * n}), out_double = at::zeros({2}, at::kDouble), out_short = at::zeros({1});
  expect_error("dtype", error_of([&] { comm.reduce_scatter(in, out_double, ReduceOp::Sum); }),
               {"reduce_scatter", "dtype", "Double", "Float"});
  expect_error("numel", error_of([&] { comm.reduce_scatter(in, out_short, ReduceOp::Sum); }),
               {"reduce_scatter", "output's numel 1"});
  expect_error("gather dtype", error_of([&] { comm.all_gather(out_double, in); }), {"all_gather", "dtype"});
  expect_error("rs max", error_of([&] { comm.reduce_scatter(in, ReduceOp::Max); }), {"reduce_scatter", "sum or avg"});
  auto ints = at::arange(2 * n, at::kLong);
  expect_error("avg int", error_of([&] { comm.all_reduce(ints, ReduceOp::Average); }), {"avg", "floating", "Long"});
  expect_error("undefined", error_of([&] { comm.all_reduce(at::Tensor()); }), {"undefined"});
  // Nothing was launched: the group still agrees on the next collective.
  auto ok = at::ones({3});
  comm.all_reduce(ok).wait();
  WORKER_CHECK(at::equal(ok, at::full({3}, static_cast<float>(n))), "all_reduce after the refused calls");
}

// A peer that dies (the parent SIGKILLs it) or stalls: the others' all_reduce must raise naming it.
void scenario_peer_lost(Communicator& comm, bool killed) {
  const std::string dir = env_or("GPUOPS_COMM_DIR", "/tmp");
  const int victim = comm.size() - 1;
  comm.barrier().wait();
  if (comm.rank() == victim) {
    write_file(fmt::format("{}/ready", dir), "ready");
    std::this_thread::sleep_for(std::chrono::seconds(killed ? 60 : 20));  // killed, or stalled past the timeout
    return;
  }
  auto buf = at::ones({1 << 16});
  const int64_t start = now_ms();
  std::string message;
  try {
    comm.all_reduce(buf).wait();
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  }
  const int64_t end = now_ms();
  WORKER_CHECK(!message.empty(), "all_reduce completed without its peer");
  write_file(fmt::format("{}/result.{}", dir, comm.rank()),
             fmt::format("{} {}\n{}", end - start, end, message));
}

int run_worker(const std::string& scenario) {
  return run_scenario(scenario, {{"collectives", scenario_collectives},
                                 {"bad_input", scenario_bad_input},
                                 {"killed", [](Communicator& c) { scenario_peer_lost(c, true); }},
                                 {"stalled", [](Communicator& c) { scenario_peer_lost(c, false); }}});
}

// ------------------------------------------------------------------------------------------------------
// Parent side (launch helpers: multiprocess.h)

// The agreement's fingerprint of tensors (what construction compares across ranks for the initial weights) tells
// a swap of two elements apart, wherever they are: a weight repeating every 65521 positions let one pass.
TEST(Fingerprint, SeesASwapOfTwoElementsAtAnyDistance) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const at::Tensor values = at::randn({3 * 65521 + 17}, gen);
  const std::string base = gpuops::dist::fingerprint({values});
  EXPECT_EQ(base, gpuops::dist::fingerprint({values.clone()}));
  for (const int64_t distance : {int64_t{1}, int64_t{65521}, int64_t{2} * 65521, int64_t{1} << 16, int64_t{1} << 17}) {
    at::Tensor swapped = values.clone();
    swapped[5] = values[5 + distance];
    swapped[5 + distance] = values[5];
    EXPECT_NE(gpuops::dist::fingerprint({swapped}), base) << "a swap " << distance << " apart";
  }
  // The same values split into other tensors, or in another order of tensors, are another fingerprint.
  EXPECT_NE(gpuops::dist::fingerprint({values.narrow(0, 0, 10), values.narrow(0, 10, values.numel() - 10)}), base);
}

// It reads its tensors and never writes them, whatever their dtype (8-byte ones were multiplied in place by
// the position weights: a float64 state dict loaded into a stage-3 model came out as garbage).
TEST(Fingerprint, LeavesItsTensorsAsTheyWere) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(12);
  for (const auto dtype : {at::kDouble, at::kLong, at::kFloat, at::kInt, at::kHalf, at::kBFloat16, at::kByte}) {
    const at::Tensor values = (at::randn({1000}, gen) * 100).to(dtype);
    const at::Tensor copy = values.clone();
    const std::string first = gpuops::dist::fingerprint({values});
    EXPECT_TRUE(at::equal(values, copy)) << dtype << " changed";
    EXPECT_EQ(gpuops::dist::fingerprint({values}), first) << dtype;
  }
}

TEST(Communicator, CollectivesTwoRanks) { run_all_ok(2, "collectives"); }
TEST(Communicator, CollectivesFourRanks) { run_all_ok(4, "collectives"); }
TEST(Communicator, BadInputTwoRanks) { run_all_ok(2, "bad_input"); }

// The survivors raise the clear error: the killed peer within kCollectiveTimeoutMs + kMarginMs of the kill
// (Gloo sees the closed connection, usually at once), the stalled one at the timeout, within the margin.
void run_peer_lost(int n, bool killed) {
  const auto t0 = Clock::now();
  auto ranks = spawn(n, killed ? "killed" : "stalled", kCollectiveTimeoutMs);
  const int victim = n - 1;
  const std::string ready = ranks.dir + "/ready";
  while (::access(ready.c_str(), F_OK) != 0 && Clock::now() < t0 + std::chrono::seconds(20))
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(::access(ready.c_str(), F_OK), 0) << "the ranks never got past their first barrier\n" << ranks.logs();
  int64_t kill_at = 0;
  if (killed) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the survivors are inside all_reduce
    kill_at = now_ms();
    ::kill(ranks.pids[victim], SIGKILL);
  }
  std::vector<int> survivors;
  for (int r = 0; r < n - 1; ++r) survivors.push_back(r);
  const bool in_time =
      wait_ranks(ranks, Clock::now() + std::chrono::milliseconds(kCollectiveTimeoutMs + kMarginMs + 3000), survivors);
  kill_rest(ranks);
  ASSERT_TRUE(in_time) << "a survivor hung\n" << ranks.logs();
  for (int r : survivors) {
    ASSERT_EQ(ranks.status[r], 0) << "rank " << r << "\n" << ranks.logs();
    std::istringstream result(read_file(fmt::format("{}/result.{}", ranks.dir, r)));
    int64_t elapsed = 0, end = 0;
    result >> elapsed >> end;
    std::string message((std::istreambuf_iterator<char>(result)), std::istreambuf_iterator<char>());
    EXPECT_NE(message.find("all_reduce(sum)"), std::string::npos) << message;
    EXPECT_NE(message.find(fmt::format("rank {} of {}", r, n)), std::string::npos) << message;
    if (killed) {
      const int64_t after_kill = end - kill_at;
      EXPECT_LE(after_kill, kCollectiveTimeoutMs + kMarginMs) << message;
      std::printf("[ killed peer, %d ranks: rank %d raised %lld ms after the kill: %s ]\n", n, r,
                  static_cast<long long>(after_kill), message.substr(0, 400).c_str());
    } else {
      EXPECT_GE(elapsed, kCollectiveTimeoutMs - 50) << message;
      EXPECT_LE(elapsed, kCollectiveTimeoutMs + kMarginMs) << message;
      std::printf("[ stalled peer, %d ranks: rank %d raised after %lld ms (timeout %d ms): %s ]\n", n, r,
                  static_cast<long long>(elapsed), kCollectiveTimeoutMs, message.substr(0, 400).c_str());
    }
  }
}

TEST(Communicator, KilledPeerTwoRanks) { run_peer_lost(2, true); }
TEST(Communicator, KilledPeerFourRanks) { run_peer_lost(4, true); }
TEST(Communicator, StalledPeerThreeRanks) { run_peer_lost(3, false); }

// The launcher's environment, read in this process (nothing is started).
class CommunicatorEnvironment : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* k : kVars) {
      if (const char* v = std::getenv(k)) saved_[k] = v;
      ::unsetenv(k);
    }
  }
  void TearDown() override {
    for (const char* k : kVars) ::unsetenv(k);
    for (const auto& [k, v] : saved_) ::setenv(k.c_str(), v.c_str(), 1);
  }
  static void set(const std::map<std::string, std::string>& vars) {
    for (const auto& [k, v] : vars) ::setenv(k.c_str(), v.c_str(), 1);
  }
  static std::string error() {
    try {
      gpuops::dist::read_launch_environment();
    } catch (const c10::ValueError& e) {
      return e.what_without_backtrace();
    }
    return "";
  }
  static constexpr const char* kVars[] = {"RANK",         "WORLD_SIZE",   "LOCAL_RANK",   "MASTER_ADDR",
                                          "MASTER_PORT",  "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"};
  std::map<std::string, std::string> saved_;
};

TEST_F(CommunicatorEnvironment, Torchrun) {
  set({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29500"}});
  const auto e = gpuops::dist::read_launch_environment();
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.master_addr, "node0");
  EXPECT_EQ(e.master_port, 29500);
}

TEST_F(CommunicatorEnvironment, Slurm) {
  set({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"}, {"MASTER_ADDR", "n1"},
       {"MASTER_PORT", "12345"}});
  const auto e = gpuops::dist::read_launch_environment();
  EXPECT_EQ(e.launcher, "slurm");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
}

TEST_F(CommunicatorEnvironment, ClearErrors) {
  set({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}});
  EXPECT_NE(error().find("RANK=2 must be below WORLD_SIZE=2"), std::string::npos) << error();
  set({{"RANK", "0"}});
  ::unsetenv("MASTER_PORT");
  EXPECT_NE(error().find("MASTER_PORT is not set"), std::string::npos) << error();
  set({{"MASTER_PORT", "29x"}});
  EXPECT_NE(error().find("MASTER_PORT='29x' is not an integer"), std::string::npos) << error();
  set({{"MASTER_PORT", "70000"}});
  EXPECT_NE(error().find("MASTER_PORT=70000 is outside [1, 65535]"), std::string::npos) << error();
  set({{"MASTER_PORT", "29500"}});
  ::unsetenv("WORLD_SIZE");
  EXPECT_NE(error().find("WORLD_SIZE is not set"), std::string::npos) << error();
  ::unsetenv("RANK");
  EXPECT_NE(error().find("no launcher environment"), std::string::npos) << error();
  set({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "2"}});
  EXPECT_NE(error().find("SLURM_PROCID=3 must be below SLURM_NTASKS=2"), std::string::npos) << error();
  // from_environment checks before it starts anything (no TCPStore, no wait)
  const auto t0 = Clock::now();
  EXPECT_THROW(Communicator::from_environment(), c10::ValueError);
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(1));
  // Timeouts past a year would overflow c10d's deadlines (every collective then failed at once).
  gpuops::dist::CommunicatorOptions forever;
  forever.timeout = std::chrono::milliseconds::max();
  try {
    Communicator::from_environment(forever);
    ADD_FAILURE() << "a timeout of milliseconds::max() was accepted";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("at most a year"), std::string::npos) << e.what();
  }
}

// Something that is not the store listens on MASTER_PORT: a rank other than 0 raises within the rendezvous
// timeout (c10d's client pinged it forever; then 5 s after it: a 3 s timeout failed after 8 s).
TEST_F(CommunicatorEnvironment, AServiceThatIsNotTheStoreMakesTheRendezvousFailInTime) {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  ASSERT_EQ(::listen(listener, 8), 0);
  socklen_t length = sizeof address;
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length);
  set({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
       {"MASTER_PORT", std::to_string(ntohs(address.sin_port))}});
  gpuops::dist::CommunicatorOptions options;
  options.rendezvous_timeout = std::chrono::seconds(2);
  const auto t0 = Clock::now();
  EXPECT_THROW(Communicator::from_environment(options), c10::DistStoreError);  // accepted, never answered
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(2000 + 1000));
  ::close(listener);
}

}  // namespace

int main(int argc, char** argv) {
  if (const char* scenario = std::getenv("GPUOPS_COMM_WORKER")) return run_worker(scenario);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
