// gpuops::TrainingState: round trip of model, optimizer, scaler, RNG and progress; keep-K and LATEST; corrupt
// and truncated files skipped; a load that does not fit changes nothing; signals; two ranks agreeing on the
// stop flag; SIGKILL at random moments while saving.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <dirent.h>
#include <sys/stat.h>
#include <fstream>
#include <functional>
#include <mutex>
#include <random>
#include <optional>
#include <thread>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/linear.h>

#include "gpuops/grad_scaler.h"
#include "gpuops/optimizers.h"
#include "gpuops/state_store.h"
#include "gpuops/training_state.h"
#include "thread_backend.h"

namespace {

gpuops::TrainingStateOptions keeping(int64_t keep, bool catch_signals = true) {
  gpuops::TrainingStateOptions options;
  options.keep = keep;
  if (!catch_signals) options.signals = {};
  return options;
}

// POSIX, not std::filesystem: libtorch.so interposes a crashing copy of it (src/state/posix_files.h).
void remove_tree(const std::string& path) {
  std::system(("rm -rf '" + path + "'").c_str());
}

bool exists(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0;
}

// Every entry of a folder but the manifest and LATEST (states, and any temporary left behind).
std::vector<std::string> states_in(const std::string& folder) {
  std::vector<std::string> names;
  if (DIR* dir = ::opendir(folder.c_str())) {
    while (const dirent* e = ::readdir(dir)) {
      const std::string name = e->d_name;
      if (name != "." && name != ".." && name != "manifest.json" && name != "LATEST") names.push_back(name);
    }
    ::closedir(dir);
  }
  std::sort(names.begin(), names.end());
  return names;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

void flip_middle_byte(const std::string& path) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(0, std::ios::end);
  const auto middle = f.tellg() / 2;
  f.seekg(middle);
  const char old = static_cast<char>(f.get());
  f.seekp(middle);
  f.put(static_cast<char>(old ^ 0x5a));
}

void save_filled(gpuops::TrainingState& state, torch::nn::Linear& model, int64_t step) {
  {
    at::NoGradGuard no_grad;
    model->weight.fill_(static_cast<double>(step));
  }
  gpuops::TrainingProgress progress;
  progress.step = step;
  state.save(progress, {model.get()});
}

std::string fresh_folder(const std::string& name) {
  const std::string path = "/tmp/gpuops-state-" + name + "-" + std::to_string(::getpid());
  remove_tree(path);
  return path;
}

void train_a_step(torch::nn::Linear& model, gpuops::optim::AdamW& optimizer) {
  optimizer.zero_grad();
  model->forward(at::randn({8, 6})).square().mean().backward();
  optimizer.step();
}

TEST(TrainingState, RoundTripRestoresEverythingAndTheRandomStream) {
  const auto folder = fresh_folder("roundtrip");
  torch::manual_seed(1);
  torch::nn::Linear model(6, 3);
  gpuops::optim::AdamW optimizer(model->parameters(), gpuops::optim::AdamWOptions(1e-2));
  gpuops::amp::GradScaler scaler;
  for (int i = 0; i < 3; ++i) train_a_step(model, optimizer);
  gpuops::TrainingProgress progress;
  progress.step = 3;
  progress.epoch = 1;
  progress.data_position = 17;
  progress.extras["note"] = c10::IValue(std::string("warm"));
  progress.extras["ema"] = c10::IValue(at::randn({4}));
  {
    gpuops::TrainingState state(folder);
    state.save(progress, {model.get(), &optimizer, &scaler});
  }
  const auto next_draw = at::randn({5});  // what the random stream gives after the save
  torch::manual_seed(5);
  train_a_step(model, optimizer);
  const auto weight_after_step4 = model->weight.detach().clone();

  torch::manual_seed(99);
  torch::nn::Linear resumed(6, 3);
  gpuops::optim::AdamW resumed_optimizer(resumed->parameters(), gpuops::optim::AdamWOptions(1e-2));
  gpuops::amp::GradScalerOptions other_scale;
  other_scale.init_scale = 8.0;
  gpuops::amp::GradScaler resumed_scaler(other_scale);
  gpuops::TrainingState state(folder);
  const auto loaded = state.load({resumed.get(), &resumed_optimizer, &resumed_scaler});
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->step, 3);
  EXPECT_EQ(loaded->epoch, 1);
  EXPECT_EQ(loaded->data_position, 17);
  EXPECT_EQ(loaded->extras.at("note").toStringRef(), "warm");
  EXPECT_TRUE(at::equal(loaded->extras.at("ema").toTensor(), progress.extras["ema"].toTensor()));
  EXPECT_EQ(resumed_scaler.get_scale(), scaler.get_scale());
  EXPECT_TRUE(at::equal(at::randn({5}), next_draw));
  // Model and optimizer state (moments, step count) came back: the same next step, bit for bit.
  torch::manual_seed(5);
  train_a_step(resumed, resumed_optimizer);
  EXPECT_TRUE(at::equal(resumed->weight, weight_after_step4));
  remove_tree(folder);
}

TEST(TrainingState, KeepsTheLastKAndSkipsCorruptOrTruncatedFiles) {
  const auto folder = fresh_folder("keep");
  torch::nn::Linear model(4, 4);
  gpuops::TrainingState state(folder, keeping(2));
  for (int64_t step : {10, 20, 30, 40}) save_filled(state, model, step);
  EXPECT_EQ(states_in(folder), (std::vector<std::string>{"state-000000000030", "state-000000000040"}));
  std::ifstream latest(folder + "/LATEST");
  std::string name;
  latest >> name;
  EXPECT_EQ(name, "state-000000000040");

  flip_middle_byte(folder + "/state-000000000040/state.pt");  // the checksum catches it
  torch::nn::Linear loaded_model(4, 4);
  auto loaded = state.load({loaded_model.get()});
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->step, 30);
  EXPECT_TRUE(at::equal(loaded_model->weight, at::full({4, 4}, 30.0)));
  // Truncated as well: states exist but none is good, which is an error naming each, not "no state".
  ASSERT_EQ(::truncate((folder + "/state-000000000030/state.pt").c_str(), 100), 0);
  const auto before = loaded_model->weight.detach().clone();
  try {
    state.load({loaded_model.get()});
    ADD_FAILURE() << "a folder of broken states loaded";
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("none can be loaded"), std::string::npos) << what;
    EXPECT_NE(what.find("state-000000000030/state.pt has 100 bytes"), std::string::npos) << what;
    EXPECT_NE(what.find("state-000000000040/state.pt does not match its SHA-256"), std::string::npos) << what;
  }
  EXPECT_TRUE(at::equal(loaded_model->weight, before));
  remove_tree(folder);
}

TEST(TrainingState, WithoutAManifestTheFolderIsScannedAndEveryFileStillVerified) {
  const auto folder = fresh_folder("nomanifest");
  torch::nn::Linear model(4, 4);
  gpuops::TrainingState state(folder, keeping(3));
  for (int64_t step : {1, 2, 3}) save_filled(state, model, step);
  ASSERT_EQ(::unlink((folder + "/manifest.json").c_str()), 0);
  torch::nn::Linear loaded_model(4, 4);
  auto loaded = state.load({loaded_model.get()});
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->step, 3);
  flip_middle_byte(folder + "/state-000000000003/state.pt");  // its checksum lives with it
  loaded = state.load({loaded_model.get()});
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->step, 2);
  EXPECT_TRUE(at::equal(loaded_model->weight, at::full({4, 4}, 2.0)));
  // A garbage manifest, then one save: the good older states stay (keep 3: 1, 2 and the new 4).
  write_file(folder + "/manifest.json", R"({"states": [{"name": 5, "step": "x"}]})");
  save_filled(state, model, 4);
  EXPECT_EQ(states_in(folder), (std::vector<std::string>{"state-000000000001", "state-000000000002", "state-000000000004"}));
  loaded = state.load({loaded_model.get()});
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->step, 4);
  remove_tree(folder);
}

TEST(TrainingState, ManifestEntriesAreConfinedToTheStateFolder) {
  const auto folder = fresh_folder("confined");
  torch::nn::Linear model(4, 4);
  gpuops::TrainingState state(folder, keeping(3));
  save_filled(state, model, 1);
  const std::string sha(64, 'a');
  // Paths out of the folder, a device and a FIFO: none is opened (a FIFO would hang, a device stream forever).
  ASSERT_EQ(::mkfifo((folder + "/state-000000000009.pt").c_str(), 0600), 0);
  write_file(folder + "/manifest.json", R"({"states": [
    {"file": "../../../../etc/passwd", "bytes": 10, "sha256": ")" + sha + R"(", "step": 1},
    {"file": "/dev/zero", "bytes": 10, "sha256": ")" + sha + R"(", "step": 2},
    {"file": "state-000000000009.pt", "bytes": 10, "sha256": ")" + sha + R"(", "step": 9},
    {"name": "state-000000000008", "step": 8, "sequence": 0, "writer": "cpp",
     "files": [{"name": "../../../etc/passwd", "bytes": 10, "sha256": ")" + sha + R"("}]}]})");
  torch::nn::Linear loaded_model(4, 4);
  const auto loaded = state.load({loaded_model.get()});  // found by scanning; the FIFO is skipped, not read
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->step, 1);
  // A checksums file naming a path outside its folder is refused too.
  write_file(folder + "/state-000000000001/checksums.json",
             R"({"format": 2, "step": 1, "writer": "cpp", "files": [{"name": "../LATEST", "bytes": 19, "sha256": ")" + sha + R"("}]})");
  EXPECT_THROW(state.load({loaded_model.get()}), c10::Error);
  remove_tree(folder);
}

TEST(TrainingState, ASaveThatFailsNamesThePathAndLeavesNothing) {
  const auto folder = fresh_folder("unwritable");
  write_file(folder, "a file where the folder should be");
  try {
    gpuops::TrainingState state(folder + "/states");
    ADD_FAILURE() << "a folder inside a file was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(folder), std::string::npos) << e.what();
  }
  ::unlink(folder.c_str());
  // A serializer that fails half-way (here: an extras value the archive cannot hold) leaves no temporary.
  gpuops::TrainingState state(folder, keeping(2, false));
  torch::nn::Linear model(4, 4);
  save_filled(state, model, 1);
  gpuops::TrainingProgress bad;
  bad.step = 2;
  bad.extras["generator"] = c10::IValue(at::Generator());
  EXPECT_ANY_THROW(state.save(bad, {model.get()}));
  EXPECT_EQ(states_in(folder), (std::vector<std::string>{"state-000000000001"}));
  remove_tree(folder);
}

TEST(TrainingState, ResavingOneStepNeverRenamesOverTheStateItReplaces) {
  const auto folder = fresh_folder("resave");
  torch::nn::Linear model(4, 4);
  gpuops::TrainingState state(folder, keeping(1, false));
  save_filled(state, model, 5);
  save_filled(state, model, 5);  // a second save of step 5 is a new folder; the first goes after the manifest
  EXPECT_EQ(states_in(folder), (std::vector<std::string>{"state-000000000005.1"}));
  save_filled(state, model, 5);
  EXPECT_EQ(states_in(folder), (std::vector<std::string>{"state-000000000005.2"}));
  remove_tree(folder);
}

TEST(TrainingState, ALoadThatDoesNotFitChangesNothing) {
  const auto folder = fresh_folder("mismatch");
  torch::nn::Linear small(4, 2);
  gpuops::TrainingState state(folder);
  state.save({}, {small.get()});
  torch::nn::Linear other(5, 3);
  const auto before = other->weight.detach().clone();
  try {
    state.load({other.get()});
    ADD_FAILURE() << "a model of another shape was loaded";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("does not fit"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(at::equal(other->weight, before));
  EXPECT_THROW(gpuops::TrainingState(folder, keeping(0)), c10::ValueError);
  remove_tree(folder);
}

TEST(TrainingState, SignalsSetTheStopFlagAndHandlersComeBack) {
  struct sigaction before {};
  sigaction(SIGUSR1, nullptr, &before);
  {
    gpuops::TrainingState state(fresh_folder("signal"));
    EXPECT_FALSE(state.should_stop());
    ::raise(SIGUSR1);  // would kill the process without the handler
    EXPECT_TRUE(state.should_stop());
    remove_tree(state.directory());
  }
  struct sigaction after {};
  sigaction(SIGUSR1, nullptr, &after);
  EXPECT_EQ(after.sa_handler, before.sa_handler);
}

// Rank 0 writes one state holding every rank's own data position and extras, and each rank loads its own back
// (every rank got rank 0's). Ranks whose folders differ raise together and write nothing (rank 1's folder was
// ignored without a word).
TEST(TrainingState, EveryRankAgreesToStopAndOnlyRankZeroWrites) {
  const auto folder = fresh_folder("ranks");
  auto shared = std::make_shared<ThreadBackend::Shared>(2);
  bool stop[2] = {false, false};
  std::optional<gpuops::LoadedState> loaded[2];
  std::string apart[2];
  auto rank = [&](int r) {
    gpuops::TrainingStateOptions options;
    options.signals = {};
    options.process_group = c10::make_intrusive<ThreadBackend>(r, shared);
    gpuops::TrainingState state(folder, options);
    if (r == 1) state.request_stop();  // only rank 1 got the signal
    stop[r] = state.should_stop();
    gpuops::TrainingProgress progress;
    progress.step = 7;
    progress.data_position = 10 * r + 1;
    progress.extras["rank"] = c10::IValue(int64_t{r});
    state.save(progress, {});
    loaded[r] = state.load({});
    gpuops::TrainingState elsewhere(folder + "/rank" + std::to_string(r), options);
    try {
      elsewhere.save(progress, {});
    } catch (const c10::ValueError& e) {
      apart[r] = e.what_without_backtrace();
    }
  };
  std::thread one(rank, 1);
  rank(0);
  one.join();
  EXPECT_TRUE(stop[0]);
  EXPECT_TRUE(stop[1]);
  EXPECT_TRUE(exists(folder + "/state-000000000007/state.pt"));
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(loaded[r].has_value());
    EXPECT_EQ(loaded[r]->data_position, 10 * r + 1) << "rank " << r;
    EXPECT_EQ(loaded[r]->extras.at("rank").toInt(), r);
    ASSERT_EQ(loaded[r]->ranks.size(), 2u);
    EXPECT_EQ(loaded[r]->ranks[1].data_position, 11);
    EXPECT_NE(apart[r].find("TrainingState.save: the ranks disagree on folder"), std::string::npos) << apart[r];
    EXPECT_FALSE(exists(folder + "/rank" + std::to_string(r) + "/state-000000000007"));
  }
  remove_tree(folder);
}

// Saved by 2 ranks, loaded by 3: ranks 0 and 1 get their own data positions; rank 2, which the saving job did
// not have, gets rank 0's with a warning saying so; every rank sees both saved ranks'.
TEST(TrainingState, ALoadByMoreRanksGivesTheNewRankRankZerosPartWithAWarning) {
  const auto folder = fresh_folder("more-ranks");
  const auto run = [&](int world, const std::function<void(int, gpuops::TrainingState&)>& body) {
    auto shared = std::make_shared<ThreadBackend::Shared>(world);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        gpuops::TrainingStateOptions options;
        options.signals = {};
        options.process_group = c10::make_intrusive<ThreadBackend>(r, shared);
        gpuops::TrainingState state(folder, options);
        body(r, state);
      });
    }
    for (auto& t : threads) t.join();
  };
  run(2, [](int r, gpuops::TrainingState& state) {
    gpuops::TrainingProgress progress;
    progress.step = 5;
    progress.data_position = 100 + r;
    state.save(progress, {});
  });
  struct Collect : c10::WarningHandler {
    std::vector<std::string> messages;
    void process(const c10::Warning& w) override { messages.push_back(w.msg()); }
  };
  int64_t position[3] = {0, 0, 0};
  size_t saved[3] = {0, 0, 0};
  std::string warned[3];
  run(3, [&](int r, gpuops::TrainingState& state) {
    Collect collect;
    c10::WarningUtils::WarningHandlerGuard guard(&collect);
    const auto loaded = state.load({});
    position[r] = loaded ? loaded->data_position : -1;
    saved[r] = loaded ? loaded->ranks.size() : 0;
    for (const auto& m : collect.messages) warned[r] += m;
  });
  EXPECT_EQ(position[0], 100);
  EXPECT_EQ(position[1], 101);
  EXPECT_EQ(position[2], 100);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(saved[r], 2u) << "rank " << r;
  EXPECT_TRUE(warned[0].empty() && warned[1].empty()) << warned[0] << warned[1];
  EXPECT_NE(warned[2].find("was saved by 2 ranks: rank 2 has no data position"), std::string::npos) << warned[2];
  remove_tree(folder);
}

TEST(TrainingState, RanksThatDisagreeOrFailAloneRaiseTogetherAndSaveNothing) {
  const auto folder = fresh_folder("disagree");
  auto shared = std::make_shared<ThreadBackend::Shared>(2);
  std::string errors[2][2];
  auto rank = [&](int r) {
    gpuops::TrainingStateOptions options;
    options.signals = {};
    options.process_group = c10::make_intrusive<ThreadBackend>(r, shared);
    gpuops::TrainingState state(folder, options);
    gpuops::TrainingProgress progress;
    progress.step = 7 + r;  // the ranks disagree on the step
    try {
      state.save(progress, {});
    } catch (const c10::ValueError& e) {
      errors[r][0] = e.what_without_backtrace();
    }
    progress.step = r == 1 ? -1 : 9;  // rank 1 fails its own check
    try {
      state.save(progress, {});
    } catch (const c10::ValueError& e) {
      errors[r][1] = e.what_without_backtrace();
    }
  };
  std::thread one(rank, 1);
  rank(0);
  one.join();
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(errors[r][0].find("the ranks disagree on step: rank 0 has 7, rank 1 has 8"), std::string::npos) << errors[r][0];
  EXPECT_NE(errors[0][1].find("rank 1 failed: TrainingState::save: step must be >= 0, got -1"), std::string::npos)
      << errors[0][1];
  EXPECT_NE(errors[1][1].find("step must be >= 0, got -1"), std::string::npos) << errors[1][1];
  EXPECT_TRUE(gpuops::StateStore(folder, 3).states().empty());  // nothing saved, no pending folder left
  remove_tree(folder);
}

TEST(TrainingState, SigkillWhileSavingAlwaysLeavesACompleteState) {
  const auto folder = fresh_folder("sigkill");
  std::mt19937 rng(123);
  int64_t newest_seen = -1;
  for (int kill = 0; kill < 50; ++kill) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {  // the writer: saves states whose weights all equal their step, forever
      torch::nn::Linear model(64, 64);
      gpuops::TrainingState state(folder, keeping(2));
      for (int64_t step = 1000 * (kill + 1);; ++step) {
        {
          at::NoGradGuard no_grad;
          model->weight.fill_(static_cast<double>(step));
          model->bias.fill_(static_cast<double>(step));
        }
        gpuops::TrainingProgress progress;
        progress.step = step;
        state.save(progress, {model.get()});
      }
    }
    ::usleep(2000 + rng() % 20000);
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
    torch::nn::Linear model(64, 64);
    gpuops::TrainingState state(folder, keeping(2, false));
    const auto loaded = state.load({model.get()});
    if (!loaded) continue;  // killed before its first save completed
    EXPECT_TRUE(at::equal(model->weight, at::full({64, 64}, static_cast<double>(loaded->step)))) << kill;
    EXPECT_TRUE(at::equal(model->bias, at::full({64}, static_cast<double>(loaded->step)))) << kill;
    EXPECT_GE(loaded->step, newest_seen) << kill;
    newest_seen = loaded->step;
  }
  EXPECT_GT(newest_seen, 0) << "no save completed before any kill";
  remove_tree(folder);
}

}  // namespace
