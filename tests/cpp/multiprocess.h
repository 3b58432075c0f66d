#pragma once
// Multi-process GoogleTest helpers (moved here from test_communicator.cpp): a test re-runs its own binary as
// N ranks with torchrun-style variables (MASTER_ADDR=127.0.0.1, MASTER_PORT a free port, RANK, WORLD_SIZE,
// LOCAL_RANK, OMP_NUM_THREADS=1), GPUOPS_COMM_WORKER naming the scenario and GPUOPS_COMM_DIR a fresh folder
// for logs and results; main() of the test runs the scenario instead of the tests when GPUOPS_COMM_WORKER is set.
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
#include <functional>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "gpuops/communicator.h"

extern char** environ;

#define WORKER_CHECK(cond, ...)                                                                    \
  do {                                                                                             \
    if (!(cond)) throw std::runtime_error(fmt::format("{}:{}: ", __FILE__, __LINE__) + fmt::format(__VA_ARGS__)); \
  } while (0)

namespace gpuops_test {

using Clock = std::chrono::steady_clock;  // CLOCK_MONOTONIC: one clock for every process of the machine

inline int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch()).count();
}

inline std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

inline void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}

inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
    throw std::runtime_error("free_port: cannot bind a socket on 127.0.0.1");
  const int port = ntohs(addr.sin_port);
  ::close(fd);
  return port;
}

inline std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

struct Ranks {
  std::string dir;
  std::vector<pid_t> pids;
  std::vector<int> status;

  std::string log(int r) const { return read_file(fmt::format("{}/rank{}.log", dir, r)); }
  std::string logs() const {
    std::string s;
    for (size_t r = 0; r < pids.size(); ++r) s += fmt::format("--- rank {} ---\n{}", r, log(static_cast<int>(r)));
    return s;
  }
};

/// Starts `n` copies of this binary as ranks 0..n-1 of `scenario`.
inline Ranks spawn(int n, const std::string& scenario, int timeout_ms) {
  Ranks ranks;
  char tmpl[] = "/tmp/gpuops-comm-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error("mkdtemp failed");
  ranks.dir = tmpl;
  const int port = free_port();
  const std::map<std::string, std::string> vars{
      {"GPUOPS_COMM_WORKER", scenario}, {"GPUOPS_COMM_DIR", ranks.dir},
      {"GPUOPS_COMM_TIMEOUT_MS", std::to_string(timeout_ms)}, {"MASTER_ADDR", "127.0.0.1"},
      {"MASTER_PORT", std::to_string(port)}, {"WORLD_SIZE", std::to_string(n)}, {"OMP_NUM_THREADS", "1"}};
  for (int r = 0; r < n; ++r) {
    // Everything the child needs is built before fork (the parent has threads: no malloc after fork).
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string kv = *e, key = kv.substr(0, kv.find('='));
      if (!vars.count(key) && key != "RANK" && key != "LOCAL_RANK" && key.rfind("SLURM_", 0) != 0) env.push_back(kv);
    }
    for (const auto& [k, v] : vars) env.push_back(k + "=" + v);
    env.push_back("RANK=" + std::to_string(r));
    env.push_back("LOCAL_RANK=" + std::to_string(r));
    std::vector<char*> envp;
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    const std::string log = fmt::format("{}/rank{}.log", ranks.dir, r);
    char self[] = "/proc/self/exe";
    char* argv[] = {self, nullptr};
    const pid_t pid = ::fork();
    if (pid == 0) {
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
      }
      ::execve(self, argv, envp.data());
      ::_exit(127);
    }
    if (pid < 0) throw std::runtime_error("fork failed");
    ranks.pids.push_back(pid);
  }
  ranks.status.assign(n, -1);
  return ranks;
}

/// Waits for the ranks in `which` (all when empty) until `deadline`; the late ones are SIGKILLed and get
/// status -1. Returns true when all of them exited in time.
inline bool wait_ranks(Ranks& ranks, Clock::time_point deadline, std::vector<int> which = {}) {
  if (which.empty())
    for (size_t r = 0; r < ranks.pids.size(); ++r) which.push_back(static_cast<int>(r));
  bool all = true;
  for (int r : which) {
    while (true) {
      int st = 0;
      const pid_t got = ::waitpid(ranks.pids[r], &st, WNOHANG);
      if (got == ranks.pids[r]) {
        ranks.status[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        break;
      }
      if (Clock::now() > deadline) {
        ::kill(ranks.pids[r], SIGKILL);
        ::waitpid(ranks.pids[r], &st, 0);
        all = false;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  return all;
}

inline void kill_rest(Ranks& ranks) {
  for (size_t r = 0; r < ranks.pids.size(); ++r)
    if (ranks.status[r] == -1) {
      int st = 0;
      if (::waitpid(ranks.pids[r], &st, WNOHANG) == 0) {
        ::kill(ranks.pids[r], SIGKILL);
        ::waitpid(ranks.pids[r], &st, 0);
      }
      ranks.status[r] = 137;
    }
}

inline void run_all_ok(int n, const std::string& scenario) {
  const auto t0 = Clock::now();
  auto ranks = spawn(n, scenario, 15000);
  const bool in_time = wait_ranks(ranks, t0 + std::chrono::seconds(25));
  EXPECT_TRUE(in_time) << "ranks still running after 25 s\n" << ranks.logs();
  for (int r = 0; r < n; ++r) EXPECT_EQ(ranks.status[r], 0) << "rank " << r << "\n" << ranks.logs();
  std::printf("[ %s, %d ranks: %.2f s ]\n", scenario.c_str(), n,
              std::chrono::duration<double>(Clock::now() - t0).count());
}

/// The message of the c10::ValueError `fn` raises ("" when it raises none).
template <typename Fn>
std::string value_error_of(Fn&& fn) {
  try {
    fn();
  } catch (const c10::ValueError& e) {
    return e.what_without_backtrace();
  }
  return "";
}

/// A worker's main: a communicator from the launcher's environment (spawn's timeout for collectives, 30 s
/// for the rendezvous), then the named scenario. 0, or 1 with the error on stderr.
inline int run_scenario(const std::string& scenario,
                        const std::map<std::string, std::function<void(gpuops::dist::Communicator&)>>& scenarios) {
  try {
    gpuops::dist::CommunicatorOptions o;
    o.timeout = std::chrono::milliseconds(std::stoi(env_or("GPUOPS_COMM_TIMEOUT_MS", "30000")));
    o.rendezvous_timeout = std::chrono::seconds(30);
    auto comm = gpuops::dist::Communicator::from_environment(o);
    const auto found = scenarios.find(scenario);
    if (found == scenarios.end()) throw std::runtime_error("unknown scenario " + scenario);
    found->second(comm);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %s: %s\n", env_or("RANK", "?").c_str(), e.what());
    return 1;
  }
}

}  // namespace gpuops_test
