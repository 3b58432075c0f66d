// gpuops::StateStore, the file protocol under both TrainingStates: states of several files (one per rank),
// what begin() accepts, abort, and folders written before the folder format.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <ctime>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <torch/nn/modules/linear.h>

#include "gpuops/state_store.h"
#include "gpuops/training_state.h"

namespace {

std::string fresh_folder(const std::string& name) {
  const std::string path = "/tmp/gpuops-store-" + name + "-" + std::to_string(::getpid());
  std::system(("rm -rf '" + path + "'").c_str());
  return path;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A state of one file per rank, as a sharded optimizer writes it; returns its payloads.
std::vector<std::string> save_ranks(const gpuops::StateStore& store, int64_t step, int ranks) {
  std::vector<std::string> files, payloads;
  for (int r = 0; r < ranks; ++r) files.push_back("rank-0000" + std::to_string(r) + ".pt");
  const auto pending = store.begin(step, files, "test");
  std::mt19937 rng(static_cast<unsigned>(step));
  for (const auto& f : files) {
    payloads.push_back(std::to_string(rng()) + " shard of " + f);
    write_file(pending.file_path(f), payloads.back());
  }
  store.commit(pending);
  return payloads;
}

TEST(StateStore, AStateOfSeveralFilesIsCompleteOnlyWithEveryFileIntact) {
  const auto folder = fresh_folder("ranks");
  const gpuops::StateStore store(folder, 2);
  save_ranks(store, 1, 3);
  const auto payloads = save_ranks(store, 2, 3);
  auto states = store.states();
  ASSERT_EQ(states.size(), 2u);
  EXPECT_EQ(states[0].step, 2);  // newest first
  EXPECT_EQ(store.verify(states[0]), "");
  ASSERT_EQ(states[0].files.size(), 3u);
  EXPECT_EQ(read_file(states[0].file_path("rank-00002.pt")), payloads[2]);
  EXPECT_EQ(states[0].writer, "test");

  write_file(states[0].file_path("rank-00001.pt"), "another rank's bytes!");  // one shard of three replaced
  auto newest = store.states()[0];
  EXPECT_NE(store.verify(newest).find("rank-00001.pt"), std::string::npos);
  ASSERT_EQ(::unlink(states[0].file_path("rank-00002.pt").c_str()), 0);  // or lost
  newest = store.states()[0];
  EXPECT_NE(store.verify(newest).find("rank-00001.pt"), std::string::npos);
  auto older = store.states()[1];
  EXPECT_EQ(store.verify(older), "");
  std::system(("rm -rf '" + folder + "'").c_str());
}

TEST(StateStore, BeginRefusesNamesThatCouldLeaveTheFolderAndAbortLeavesNothing) {
  const auto folder = fresh_folder("begin");
  const gpuops::StateStore store(folder, 1);
  for (const std::string& bad : std::vector<std::string>{"../x", "a/b", "", ".hidden", "checksums.json", std::string(200, 'a')})
    EXPECT_THROW(store.begin(1, {bad}, "test"), c10::ValueError) << bad;
  EXPECT_THROW(store.begin(1, {"a", "a"}, "test"), c10::ValueError);
  EXPECT_THROW(store.begin(-1, {"a"}, "test"), c10::ValueError);
  EXPECT_THROW(store.begin(1, {}, "test"), c10::ValueError);
  EXPECT_THROW(store.begin(1, {"a"}, "../w"), c10::ValueError);
  EXPECT_THROW(gpuops::StateStore(folder, 0), c10::ValueError);

  const auto pending = store.begin(3, {"a", "b"}, "test");
  EXPECT_THROW(pending.file_path("c"), c10::ValueError);  // not declared
  write_file(pending.file_path("a"), "only one of two");
  EXPECT_THROW(store.commit(pending), c10::Error);  // "b" was never written: nothing appears
  EXPECT_TRUE(store.states().empty());
  struct stat info {};
  EXPECT_NE(::stat(pending.folder.c_str(), &info), 0) << "the pending folder is left behind";
  std::system(("rm -rf '" + folder + "'").c_str());
}

TEST(StateStore, APendingSaveItDidNotBeginIsNeitherCommittedNorRemoved) {
  const auto folder = fresh_folder("forged");
  const auto outside = fresh_folder("outside");
  ::mkdir(outside.c_str(), 0777);
  write_file(outside + "/a", "someone else's file");
  const gpuops::StateStore store(folder, 1);
  gpuops::PendingState forged{5, "test", outside, {"a"}};  // a plain struct: anything can be put in it
  try {
    store.commit(forged);
    ADD_FAILURE() << "an outside folder was committed into the store";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("is not a pending save of"), std::string::npos) << e.what();
  }
  store.abort(forged);  // and not removed either
  EXPECT_EQ(read_file(outside + "/a"), "someone else's file");
  EXPECT_TRUE(store.states().empty());
  auto escaping = store.begin(6, {"a"}, "test");
  escaping.files = {"../../a"};
  EXPECT_THROW(store.commit(escaping), c10::ValueError);
  std::system(("rm -rf '" + folder + "' '" + outside + "'").c_str());
}

// Two writers on one store (two jobs, or two hosts on a shared filesystem): a commit sweeps leftovers of
// writers that are gone, never another writer's save in progress (it swept every ".tmp-*", and the temporary
// names held only the PID, which two containers share).
TEST(StateStore, ACommitRemovesDeadWritersTemporariesAndNoLiveWritersSave) {
  const auto folder = fresh_folder("writers");
  const gpuops::StateStore first(folder, 3), second(folder, 3);
  const auto pending = first.begin(1, {"a"}, "first");
  write_file(pending.file_path("a"), "the first writer's file");
  // Its name: ".tmp-v2-<host>-<pid>-<process nonce>-<counter>-state-1"; the leftovers below are named alike.
  const std::string name = pending.folder.substr(pending.folder.find_last_of('/') + 1);
  char host[9] = {}, nonce[9] = {};
  long pid = 0;
  ASSERT_EQ(std::sscanf(name.c_str(), ".tmp-v2-%8[0-9a-f]-%ld-%8[0-9a-f]-", host, &pid, nonce), 3) << name;
  ASSERT_EQ(pid, ::getpid());
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ::waitpid(dead, nullptr, 0);
  const std::string other_nonce = std::string(nonce) == "0badf00d" ? "0badf00e" : "0badf00d";
  const auto leftover = [&](const std::string& n, int64_t age_s) {
    const std::string path = folder + "/" + n;
    ::mkdir(path.c_str(), 0777);
    write_file(path + "/a", "bytes");
    const timespec times[2] = {{std::time(nullptr) - age_s, 0}, {std::time(nullptr) - age_s, 0}};
    ::utimensat(AT_FDCWD, path.c_str(), times, 0);
    return n;
  };
  const std::string h(host);
  const std::vector<std::string> gone = {
      leftover(".tmp-v2-" + h + "-" + std::to_string(dead) + "-" + other_nonce + "-0-state-7", 0),  // a dead writer
      leftover(".tmp-v2-" + h + "-" + std::to_string(pid) + "-" + other_nonce + "-0-state-7", 0),   // our PID before
      leftover(".tmp-v2-ffffffff-" + std::to_string(pid) + "-" + other_nonce + "-0-state-7", 3 * 86400),  // old
      leftover(".tmp-4242-0-state-7", 3 * 86400)};  // an older gpuops', untouched for days
  const std::vector<std::string> live = {
      leftover(".tmp-v2-" + h + "-" + std::to_string(::getppid()) + "-" + other_nonce + "-0-state-7", 0),
      leftover(".tmp-v2-ffffffff-" + std::to_string(pid) + "-" + other_nonce + "-0-state-8", 60),  // another host
      leftover(".tmp-4242-0-state-8", 60)};
  save_ranks(second, 2, 1);  // the second writer commits while the first is still writing
  struct stat info {};
  for (const auto& n : gone) EXPECT_NE(::stat((folder + "/" + n).c_str(), &info), 0) << n << " was kept";
  for (const auto& n : live) EXPECT_EQ(::stat((folder + "/" + n).c_str(), &info), 0) << n << " was removed";
  ASSERT_EQ(::stat(pending.folder.c_str(), &info), 0) << "the first writer's save in progress was removed";
  first.commit(pending);
  const auto states = first.states();
  ASSERT_EQ(states.size(), 2u);
  EXPECT_EQ(read_file(states[1].file_path("a")), "the first writer's file");
  std::system(("rm -rf '" + folder + "'").c_str());
}

TEST(StateStore, AFolderOfTheFormerLayoutStillLoadsInCpp) {
  const auto folder = fresh_folder("legacy");
  torch::nn::Linear model(3, 3);
  {
    at::NoGradGuard no_grad;
    model->weight.fill_(7.0);
  }
  gpuops::TrainingProgress progress;
  progress.step = 7;
  progress.data_position = 70;
  {
    gpuops::TrainingState state(folder, {});
    state.save(progress, {model.get()});
  }
  // Rewrite it as gpuops 0.1 laid it out: state-<step>.pt at the top, listed in a manifest with its checksum.
  const std::string file = folder + "/state-000000000007.pt";
  ASSERT_EQ(std::rename((folder + "/state-000000000007/state.pt").c_str(), file.c_str()), 0);
  const auto sums = nlohmann::json::parse(read_file(folder + "/state-000000000007/checksums.json"));
  std::system(("rm -rf '" + folder + "/state-000000000007'").c_str());
  const nlohmann::json manifest = {{"states", {{{"file", "state-000000000007.pt"}, {"bytes", sums["files"][0]["bytes"]},
                                                {"sha256", sums["files"][0]["sha256"]}, {"step", 7}}}}};
  write_file(folder + "/manifest.json", manifest.dump());

  torch::nn::Linear loaded(3, 3);
  gpuops::TrainingStateOptions options;
  options.signals = {};
  gpuops::TrainingState state(folder, options);
  const auto resumed = state.load({loaded.get()});
  ASSERT_TRUE(resumed.has_value());
  EXPECT_EQ(resumed->data_position, 70);
  EXPECT_TRUE(at::equal(loaded->weight, at::full({3, 3}, 7.0)));
  std::system(("rm -rf '" + folder + "'").c_str());
}

}  // namespace

namespace {

TEST(TrainingState, BadSignalsAreRefusedAndNoHandlerStaysInstalled) {
  const auto folder = fresh_folder("signals");
  for (int bad : {SIGKILL, SIGSTOP, 0, 999}) {
    struct sigaction before {};
    sigaction(SIGUSR1, nullptr, &before);
    gpuops::TrainingStateOptions options;
    options.signals = {SIGUSR1, bad};
    EXPECT_THROW(gpuops::TrainingState(folder, options), c10::ValueError) << bad;
    struct sigaction after {};
    sigaction(SIGUSR1, nullptr, &after);
    EXPECT_EQ(after.sa_handler, before.sa_handler) << "SIGUSR1 left caught after refusing " << bad;
  }
  std::system(("rm -rf '" + folder + "'").c_str());
}

}  // namespace
