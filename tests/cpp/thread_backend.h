#pragma once
// A c10d backend whose ranks are threads of one process: allreduce (MIN or MAX of one integer tensor),
// _allgather_base (what gpuops' agreements use) and barrier over shared memory. Lets C++ tests run "distributed" code paths without Gloo's headers.
#include <algorithm>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

class ThreadBackend : public c10d::Backend {
 public:
  struct Shared {  // a reusable barrier for `ranks` threads and the value being reduced
    explicit Shared(int ranks) : ranks(ranks) {}
    const int ranks;
    std::mutex mutex;
    std::condition_variable changed;
    int arrived = 0, generation = 0;
    int64_t value = 0;
    bool first = true;
    std::vector<at::Tensor> gathered;  // each rank's input of the all-gather in flight

    void arrive_and_wait() {
      std::unique_lock<std::mutex> lock(mutex);
      const int mine = generation;
      if (++arrived == ranks) {
        arrived = 0;
        ++generation;
        changed.notify_all();
      } else {
        changed.wait(lock, [&] { return generation != mine; });
      }
    }
  };

  ThreadBackend(int rank, std::shared_ptr<Shared> shared)
      : Backend(rank, shared->ranks), shared_(std::move(shared)) {}
  const std::string getBackendName() const override { return "threads"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& options) override {
    const bool max = options.reduceOp == c10d::ReduceOp::MAX;
    {
      std::lock_guard<std::mutex> lock(shared_->mutex);
      const int64_t mine = tensors[0].item<int64_t>();
      shared_->value = shared_->first ? mine : (max ? std::max(shared_->value, mine) : std::min(shared_->value, mine));
      shared_->first = false;
    }
    shared_->arrive_and_wait();
    tensors[0].fill_(shared_->value);
    shared_->arrive_and_wait();
    if (rank_ == 0) shared_->first = true;  // every rank has read the value: ready for the next call
    shared_->arrive_and_wait();
    return c10::make_intrusive<Done>();
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions&) override {
    {
      std::lock_guard<std::mutex> lock(shared_->mutex);
      shared_->gathered.resize(shared_->ranks);
      shared_->gathered[rank_] = input.clone();
    }
    shared_->arrive_and_wait();
    output.copy_(at::cat(shared_->gathered).view_as(output));
    shared_->arrive_and_wait();  // every rank has read them
    return c10::make_intrusive<Done>();
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    shared_->arrive_and_wait();
    return c10::make_intrusive<Done>();
  }

 private:
  struct Done : c10d::Work {
    bool wait(std::chrono::milliseconds) override { return true; }
  };
  std::shared_ptr<Shared> shared_;
};
