// gpuops::dist::Communicator over c10d (communicator.h). Gloo has no AVG: an average is a sum divided by
// size() when the handle is waited on, on every backend, so that the result does not depend on the backend.
#include "gpuops/communicator.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <future>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "../memory/memory_scope.h"
#include "gloo_factory.h"

namespace gpuops::dist {

namespace {

std::optional<std::string> env_var(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

/// A whole decimal integer in [lo, hi]; ValueError naming the variable otherwise.
int int_var(const char* launcher, const char* name, const std::string& text, long lo, long hi) {
  errno = 0;
  char* end = nullptr;
  const long v = text.empty() ? 0 : std::strtol(text.c_str(), &end, 10);
  TORCH_CHECK_VALUE(!text.empty() && end != nullptr && *end == '\0' && errno == 0,
                    "gpuops::dist::Communicator::from_environment (", launcher, "): ", name, "='", text,
                    "' is not an integer");
  TORCH_CHECK_VALUE(v >= lo && v <= hi, "gpuops::dist::Communicator::from_environment (", launcher, "): ", name,
                    "=", v, " is outside [", lo, ", ", hi, "]");
  return static_cast<int>(v);
}

std::string required_var(const char* launcher, const char* name, const char* why) {
  auto v = env_var(name);
  TORCH_CHECK_VALUE(v.has_value() && !v->empty(), "gpuops::dist::Communicator::from_environment (", launcher,
                    "): the environment variable ", name, " is not set (", why, ")");
  return *v;
}

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr == "::1" || addr.rfind("127.", 0) == 0;
}

// The TCPStore of the rendezvous. A client pings the server once connected and waits for the answer with no
// deadline: behind MASTER_PORT, something that is not the store (another service, a stale process) would block
// it forever. A client is made on a helper thread and given the rendezvous timeout (and 5 s) to come back; past
// it this rank raises, and the helper is left to the process's exit.
c10::intrusive_ptr<c10d::Store> connect_store(const std::string& addr, const c10d::TCPStoreOptions& so) {
  if (so.isServer) return c10::make_intrusive<c10d::TCPStore>(addr, so);
  auto made = std::make_shared<std::promise<c10::intrusive_ptr<c10d::Store>>>();
  auto future = made->get_future();
  std::thread([made, addr, so] {
    try {
      made->set_value(c10::make_intrusive<c10d::TCPStore>(addr, so));
    } catch (...) {
      made->set_exception(std::current_exception());
    }
  }).detach();
  // The store's own error first when it has one at the timeout (it says more); ours just after.
  if (future.wait_for(so.timeout + std::chrono::milliseconds(200)) != std::future_status::ready)
    C10_THROW_ERROR(DistStoreError, fmt::format("no TCPStore answered at {}:{} within the rendezvous timeout: "
                                                "something else listens there, or rank 0 stalls after connecting",
                                                addr, so.port));
  return future.get();
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Average:  // summed, then divided in wait()
      return c10d::ReduceOp::SUM;
    case ReduceOp::Max:
      return c10d::ReduceOp::MAX;
    case ReduceOp::Min:
      return c10d::ReduceOp::MIN;
  }
  TORCH_CHECK_VALUE(false, "gpuops::dist: unknown ReduceOp ", static_cast<int>(op));
}

}  // namespace

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Average: return "avg";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
  }
  return "?";
}

LaunchEnvironment read_launch_environment() {
  LaunchEnvironment e;
  const char* who = nullptr;
  if (env_var("RANK")) {
    who = "torchrun";
    e.world_size = int_var(who, "WORLD_SIZE", required_var(who, "WORLD_SIZE", "the number of ranks; RANK is set"),
                           1, 1 << 20);
    e.rank = int_var(who, "RANK", *env_var("RANK"), 0, 1 << 20);
    e.local_rank = env_var("LOCAL_RANK") ? int_var(who, "LOCAL_RANK", *env_var("LOCAL_RANK"), 0, 1 << 20) : 0;
    TORCH_CHECK_VALUE(e.rank < e.world_size, "gpuops::dist::Communicator::from_environment (torchrun): RANK=",
                      e.rank, " must be below WORLD_SIZE=", e.world_size);
  } else if (env_var("SLURM_PROCID")) {
    who = "slurm";
    e.world_size = int_var(who, "SLURM_NTASKS",
                           required_var(who, "SLURM_NTASKS", "the number of tasks; SLURM_PROCID is set"), 1, 1 << 20);
    e.rank = int_var(who, "SLURM_PROCID", *env_var("SLURM_PROCID"), 0, 1 << 20);
    e.local_rank =
        env_var("SLURM_LOCALID") ? int_var(who, "SLURM_LOCALID", *env_var("SLURM_LOCALID"), 0, 1 << 20) : 0;
    TORCH_CHECK_VALUE(e.rank < e.world_size, "gpuops::dist::Communicator::from_environment (slurm): SLURM_PROCID=",
                      e.rank, " must be below SLURM_NTASKS=", e.world_size);
  } else {
    TORCH_CHECK_VALUE(false,
                      "gpuops::dist::Communicator::from_environment: no launcher environment: neither RANK "
                      "(torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) nor SLURM_PROCID "
                      "(srun; export MASTER_ADDR and MASTER_PORT in the job script) is set");
  }
  e.launcher = who;
  e.master_addr = required_var(who, "MASTER_ADDR", "the host of rank 0's TCPStore");
  e.master_port = int_var(who, "MASTER_PORT", required_var(who, "MASTER_PORT", "the port of rank 0's TCPStore"), 1,
                          65535);
  return e;
}

// ---------------------------------------------------------------------------------------------------------
// Work

void Work::wait() {
  if (done_) return;
  TORCH_CHECK(work_, "gpuops::dist::Work::wait: an empty handle (default-constructed or moved from)");
  const auto start = std::chrono::steady_clock::now();
  bool completed = false;
  std::string backend_error;
  try {
    completed = work_->wait(timeout_);
  } catch (const c10::Error& e) {
    backend_error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    backend_error = e.what();
  }
  done_ = true;
  if (completed && backend_error.empty()) {
    if (finish_) {
      auto finish = std::move(finish_);
      finish_ = nullptr;
      finish();
    }
    return;
  }
  finish_ = nullptr;
  const auto waited =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
  // c10d's wait(timeout) says only "Operation timed out!"; Gloo names the peer whose connection closed.
  const bool timed_out = !completed && (backend_error.empty() || backend_error.find("timed out") != std::string::npos ||
                                        backend_error.find("Timed out") != std::string::npos);
  if (timed_out)
    C10_THROW_ERROR(DistBackendError,
                    fmt::format("gpuops::dist: {} did not complete on {} within the timeout of {} ms (waited {} ms): "
                                "a peer process stalled or died; the group is unusable now{}{}",
                                name_, where_, timeout_.count(), waited, backend_error.empty() ? "" : " -- backend: ",
                                backend_error));
  C10_THROW_ERROR(DistBackendError,
                  fmt::format("gpuops::dist: {} failed on {} after {} ms (timeout {} ms): {} -- a peer process died or "
                              "called another collective; the group is unusable now",
                              name_, where_, waited, timeout_.count(), backend_error));
}

bool Work::is_completed() const { return done_ || (work_ && work_->isCompleted()); }

// ---------------------------------------------------------------------------------------------------------
// Communicator

Communicator::Communicator(c10::intrusive_ptr<c10d::ProcessGroup> process_group, CommunicatorOptions options)
    : group_(std::move(process_group)), options_(options) {
  TORCH_CHECK_VALUE(group_, "gpuops::dist::Communicator: process_group is null");
  TORCH_CHECK_VALUE(options_.timeout.count() > 0 && options_.timeout <= kMaxTimeout,
                    "gpuops::dist::Communicator: Invalid timeout value: ", options_.timeout.count(),
                    " ms (accepted: more than 0, at most a year)");
  rank_ = group_->getRank();
  size_ = group_->getSize();
}

Communicator Communicator::from_environment(CommunicatorOptions options) {
  TORCH_CHECK_VALUE(options.timeout.count() > 0 && options.timeout <= kMaxTimeout,
                    "gpuops::dist::Communicator::from_environment: Invalid timeout value: ", options.timeout.count(),
                    " ms (accepted: more than 0, at most a year)");
  TORCH_CHECK_VALUE(options.rendezvous_timeout.count() > 0 && options.rendezvous_timeout <= kMaxTimeout,
                    "gpuops::dist::Communicator::from_environment: Invalid rendezvous_timeout value: ",
                    options.rendezvous_timeout.count(), " ms (accepted: more than 0, at most a year)");
  const LaunchEnvironment e = read_launch_environment();
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(e.master_port);
  so.isServer = e.rank == 0;
  so.numWorkers = e.world_size;
  so.timeout = options.rendezvous_timeout;
  c10::intrusive_ptr<c10d::Store> store;
  const auto deadline = std::chrono::steady_clock::now() + options.rendezvous_timeout;  // for both phases
  try {
    store = connect_store(e.master_addr, so);
  } catch (const c10::Error& err) {
    C10_THROW_ERROR(DistStoreError,
                    fmt::format("gpuops::dist::Communicator::from_environment ({}): rank {} of {} could not {} the "
                                "TCPStore at MASTER_ADDR={} MASTER_PORT={} within {} ms: {}",
                                e.launcher, e.rank, e.world_size, so.isServer ? "serve" : "reach", e.master_addr,
                                e.master_port, options.rendezvous_timeout.count(), err.what_without_backtrace()));
  }
  detail::GlooDeviceChoice device;
  if (auto ifname = env_var("GLOO_SOCKET_IFNAME"); ifname && !ifname->empty())
    device.interface = ifname->substr(0, ifname->find(','));
  else if (is_loopback(e.master_addr))
    device.hostname = e.master_addr;
  // The Gloo rendezvous gets what is left of rendezvous_timeout (it had all of it again: twice the timeout).
  const auto left = std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                               deadline - std::chrono::steady_clock::now()));
  auto group = detail::make_gloo_process_group(c10::make_intrusive<c10d::PrefixStore>("gpuops.dist/0", store),
                                               e.rank, e.world_size, left, device);
  return Communicator(std::move(group), options);
}

Communicator Communicator::from_backend(const c10::intrusive_ptr<c10d::Backend>& backend, CommunicatorOptions options) {
  TORCH_CHECK_VALUE(backend, "gpuops::dist::Communicator::from_backend: backend is null");
  const std::string name = backend->getBackendName();
  const auto type = c10d::ProcessGroup::strToBackendType(name);  // CUSTOM for a name it does not know
  auto group = c10::make_intrusive<c10d::ProcessGroup>(backend->getRank(), backend->getSize());
  group->setDefaultBackend(type);
  group->setBackend(name == "nccl" ? c10::DeviceType::CUDA : c10::DeviceType::CPU, type, backend);
  return Communicator(std::move(group), options);
}

Communicator Communicator::unchecked() const {
  Communicator c = *this;
  c.options_.check_collectives = false;
  return c;
}

void Communicator::agree_on_call(const char* op, const at::Tensor& t, ReduceOp reduce,
                                 const std::function<void()>& checks) const {
  std::exception_ptr refused;  // this rank's own checks of its arguments
  try {
    checks();
  } catch (...) {
    refused = std::current_exception();
  }
  if (!options_.check_collectives || size_ == 1) {
    if (refused) std::rethrow_exception(refused);
    return;
  }
  memory::UnbudgetedEverywhere unbudgeted;  // the check's few bytes: a rank at its budget's limit takes part
  // Every rank's call (which collective, elements, dtype, reduce op) and whether its arguments were refused, in
  // one small all-gather: a rank whose arguments are refused raises with the others, not alone.
  static constexpr const char* kCollectives[] = {"reduce_scatter", "all_gather", "all_reduce"};
  const auto code = std::find_if(std::begin(kCollectives), std::end(kCollectives),
                                 [&](const char* name) { return std::string(name) == op; }) - std::begin(kCollectives);
  const bool known = t.defined() && !refused;
  const std::vector<int64_t> call{static_cast<int64_t>(code), known ? static_cast<int64_t>(t.numel()) : -1,
                                  known ? static_cast<int64_t>(t.scalar_type()) : -1, static_cast<int64_t>(reduce),
                                  refused ? 1 : 0};
  at::Tensor mine = at::tensor(call, at::kLong).to(control_device());
  at::Tensor all = at::empty({5 * size_}, mine.options());
  c10d::AllgatherOptions o;
  o.timeout = options_.timeout;
  // Named as the collective itself: a peer lost here reads as a failure of the call the user made.
  const std::string name = code == 1 ? std::string(op) : fmt::format("{}({})", op, reduce_op_name(reduce));
  launch(name, group_->_allgather_base(all, mine, o)).wait();
  if (refused) std::rethrow_exception(refused);
  all = all.cpu();
  const auto* v = all.data_ptr<int64_t>();
  for (int r = 0; r < size_; ++r)
    TORCH_CHECK_VALUE(v[5 * r + 4] == 0, "gpuops::dist::", op, ": rank ", r, " refused its arguments (its own error "
                      "says why); nothing was sent");
  const auto describe = [&](int r) {
    const int64_t* c = v + 5 * r;
    const std::string called = c[0] >= 0 && c[0] < 3 ? kCollectives[c[0]] : "another call";
    return fmt::format("{} of {} elements of {}{}", called, c[1], c10::toString(static_cast<at::ScalarType>(c[2])),
                       called == "all_gather" ? "" : fmt::format(" ({})", reduce_op_name(static_cast<ReduceOp>(c[3]))));
  };
  for (int r = 1; r < size_; ++r)
    TORCH_CHECK_VALUE(std::equal(v, v + 4, v + 5 * r), "gpuops::dist::", op, ": the ranks call different collectives: "
                      "rank 0 calls ", describe(0), ", rank ", r, " calls ", describe(r), "; every rank must call "
                      "the same collective with the same sizes and dtypes (nothing was sent)");
}

at::Device Communicator::control_device() const {
  const auto types = group_->getDeviceTypes();
  const auto serves = [&](c10::DeviceType t) {
    return std::any_of(types.begin(), types.end(), [&](const c10::Device& d) { return d.type() == t; });
  };
  if (serves(at::kCPU) || !serves(at::kCUDA)) return at::Device(at::kCPU);
  return at::Device(at::kCUDA);  // the current device, as NCCL's collectives use it
}

at::Tensor Communicator::shard(const at::Tensor& buffer) const {
  TORCH_CHECK_VALUE(buffer.defined(), "gpuops::dist::Communicator::shard: buffer is an undefined tensor");
  TORCH_CHECK_VALUE(buffer.numel() % size_ == 0, "gpuops::dist::Communicator::shard: buffer's numel ",
                    buffer.numel(), " is not divisible by the communicator's size ", size_);
  const int64_t s = buffer.numel() / size_;
  return buffer.view({-1}).narrow(0, rank_ * s, s);
}

void Communicator::check_tensor(const char* op, const char* arg, const at::Tensor& t) const {
  TORCH_CHECK_VALUE(t.defined(), "gpuops::dist::", op, ": ", arg, " is an undefined tensor");
  TORCH_CHECK_VALUE(t.is_contiguous(), "gpuops::dist::", op, ": ", arg,
                    " must be contiguous (a flat buffer), got sizes ", t.sizes(), " and strides ", t.strides());
  TORCH_CHECK_VALUE(!t.is_sparse() && t.layout() == at::kStrided, "gpuops::dist::", op, ": ", arg,
                    " must be a dense tensor, got layout ", t.layout());
  const auto types = group_->getDeviceTypes();
  const bool served = std::any_of(types.begin(), types.end(),
                                  [&](const c10::Device& d) { return d.type() == t.device().type(); });
  if (!served) {
    std::string have;
    for (const auto& d : types) have += (have.empty() ? "" : ", ") + d.str();
    TORCH_CHECK_VALUE(false, "gpuops::dist::", op, ": ", arg, " is on ", t.device(),
                      " but this communicator's process group (", group_->getBackendName(),
                      ") has a backend only for: ", have.empty() ? "no device" : have,
                      " (Communicator::from_environment builds Gloo for CPU tensors; for CUDA tensors hand in a "
                      "torch.distributed NCCL group)");
  }
}

Work Communicator::launch(std::string name, c10::intrusive_ptr<c10d::Work> work, std::function<void()> finish) const {
  Work w;
  w.work_ = std::move(work);
  w.name_ = std::move(name);
  w.where_ = fmt::format("rank {} of {}", rank_, size_);
  w.timeout_ = options_.timeout;
  w.finish_ = std::move(finish);
  return w;
}

void Communicator::count(TrafficCount& c, const at::Tensor& payload, int64_t ring_factor) const {
  const auto bytes = static_cast<int64_t>(payload.nbytes());
  c.calls += 1;
  c.payload_bytes += bytes;
  c.ring_sent_bytes += ring_factor * bytes * (size_ - 1) / size_;
}

Work Communicator::reduce_scatter(const at::Tensor& buffer, ReduceOp op) {
  const bool flat = buffer.defined() && buffer.is_contiguous() && buffer.numel() % size_ == 0;
  const at::Tensor output = flat ? shard(buffer) : at::Tensor();
  agree_on_call("reduce_scatter", buffer, op, [&] {
    check_tensor("reduce_scatter", "buffer", buffer);
    TORCH_CHECK_VALUE(buffer.numel() % size_ == 0, "gpuops::dist::reduce_scatter: buffer's numel ", buffer.numel(),
                      " is not divisible by the communicator's size ", size_,
                      " (pad the flat buffer to a multiple of the world size)");
    check_reduce_scatter(buffer, output, op);
  });
  return launch_reduce_scatter(buffer, output, op);
}

Work Communicator::reduce_scatter(const at::Tensor& input, const at::Tensor& output, ReduceOp op) {
  agree_on_call("reduce_scatter", input, op, [&] { check_reduce_scatter(input, output, op); });
  return launch_reduce_scatter(input, output, op);
}

void Communicator::check_reduce_scatter(const at::Tensor& input, const at::Tensor& output, ReduceOp op) const {
  check_tensor("reduce_scatter", "input", input);
  check_tensor("reduce_scatter", "output", output);
  TORCH_CHECK_VALUE(op == ReduceOp::Sum || op == ReduceOp::Average,
                    "gpuops::dist::reduce_scatter: op must be sum or avg, got ", reduce_op_name(op));
  TORCH_CHECK_VALUE(input.numel() % size_ == 0, "gpuops::dist::reduce_scatter: input's numel ", input.numel(),
                    " is not divisible by the communicator's size ", size_);
  TORCH_CHECK_VALUE(output.numel() * size_ == input.numel(), "gpuops::dist::reduce_scatter: output's numel ",
                    output.numel(), " must be input's numel ", input.numel(), " / size ", size_);
  TORCH_CHECK_VALUE(output.scalar_type() == input.scalar_type(), "gpuops::dist::reduce_scatter: output's dtype ",
                    output.scalar_type(), " differs from input's ", input.scalar_type());
  TORCH_CHECK_VALUE(output.device() == input.device(), "gpuops::dist::reduce_scatter: output is on ",
                    output.device(), " but input on ", input.device());
  TORCH_CHECK_VALUE(op != ReduceOp::Average || at::isFloatingType(input.scalar_type()),
                    "gpuops::dist::reduce_scatter: avg needs a floating dtype, got ", input.scalar_type());
}

Work Communicator::launch_reduce_scatter(const at::Tensor& input, const at::Tensor& output, ReduceOp op) {
  at::NoGradGuard no_grad;
  at::Tensor in = input.view({-1}), out = output.view({-1});
  c10d::ReduceScatterOptions o;
  o.reduceOp = to_c10d(op);
  o.timeout = options_.timeout;
  auto work = group_->_reduce_scatter_base(out, in, o);
  count(traffic_->reduce_scatter, in, 1);
  std::function<void()> finish;
  if (op == ReduceOp::Average) {
    const int n = size_;
    finish = [out, n]() mutable {
      at::NoGradGuard g;
      out.div_(n);
    };
  }
  return launch(fmt::format("reduce_scatter({})", reduce_op_name(op)), std::move(work), std::move(finish));
}

Work Communicator::all_gather(const at::Tensor& buffer) {
  const bool flat = buffer.defined() && buffer.is_contiguous() && buffer.numel() % size_ == 0;
  const at::Tensor input = flat ? shard(buffer) : at::Tensor();
  agree_on_call("all_gather", input, ReduceOp::Sum, [&] {
    check_tensor("all_gather", "buffer", buffer);
    TORCH_CHECK_VALUE(buffer.numel() % size_ == 0, "gpuops::dist::all_gather: buffer's numel ", buffer.numel(),
                      " is not divisible by the communicator's size ", size_,
                      " (pad the flat buffer to a multiple of the world size)");
    check_all_gather(input, buffer);
  });
  return launch_all_gather(input, buffer);
}

Work Communicator::all_gather(const at::Tensor& input, const at::Tensor& output) {
  agree_on_call("all_gather", input, ReduceOp::Sum, [&] { check_all_gather(input, output); });
  return launch_all_gather(input, output);
}

void Communicator::check_all_gather(const at::Tensor& input, const at::Tensor& output) const {
  check_tensor("all_gather", "input", input);
  check_tensor("all_gather", "output", output);
  TORCH_CHECK_VALUE(output.numel() == input.numel() * size_, "gpuops::dist::all_gather: output's numel ",
                    output.numel(), " must be size ", size_, " x input's numel ", input.numel());
  TORCH_CHECK_VALUE(output.scalar_type() == input.scalar_type(), "gpuops::dist::all_gather: output's dtype ",
                    output.scalar_type(), " differs from input's ", input.scalar_type());
  TORCH_CHECK_VALUE(output.device() == input.device(), "gpuops::dist::all_gather: output is on ", output.device(),
                    " but input on ", input.device());
}

Work Communicator::launch_all_gather(const at::Tensor& input, const at::Tensor& output) {
  at::NoGradGuard no_grad;
  at::Tensor in = input.view({-1}), out = output.view({-1});
  c10d::AllgatherOptions o;
  o.timeout = options_.timeout;
  auto work = group_->_allgather_base(out, in, o);
  count(traffic_->all_gather, out, 1);
  return launch("all_gather", std::move(work));
}

Work Communicator::all_reduce(const at::Tensor& buffer, ReduceOp op) {
  agree_on_call("all_reduce", buffer, op, [&] {
    check_tensor("all_reduce", "buffer", buffer);
    TORCH_CHECK_VALUE(op != ReduceOp::Average || at::isFloatingType(buffer.scalar_type()),
                      "gpuops::dist::all_reduce: avg needs a floating dtype, got ", buffer.scalar_type());
  });
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> tensors{buffer};
  c10d::AllreduceOptions o;
  o.reduceOp = to_c10d(op);
  o.timeout = options_.timeout;
  auto work = group_->allreduce(tensors, o);
  count(traffic_->all_reduce, buffer, 2);
  std::function<void()> finish;
  if (op == ReduceOp::Average) {
    const int n = size_;
    finish = [buffer, n]() mutable {
      at::NoGradGuard g;
      buffer.div_(n);
    };
  }
  return launch(fmt::format("all_reduce({})", reduce_op_name(op)), std::move(work), std::move(finish));
}

Work Communicator::barrier() {
  c10d::BarrierOptions o;
  o.timeout = options_.timeout;
  return launch("barrier", group_->barrier(o));
}

}  // namespace gpuops::dist
