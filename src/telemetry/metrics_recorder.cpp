// MetricsRecorder: each step's reported values are stored as they are, on their device (a CUDA value is copied
// into a row of a small device buffer; a CPU value is read, which is no sync); at the end of a log interval the
// device rows are read once and one host function folds the interval's steps into its record.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <limits>

#include "gpuops/communicator.h"
#include "gpuops/device_monitor.h"
#include "gpuops/telemetry.h"
#include "prometheus_endpoint.h"
#include "record_file.h"
#include "tensorboard_events.h"

#ifdef GPUOPS_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace gpuops::telemetry {
namespace {

constexpr double kNone = std::numeric_limits<double>::quiet_NaN();

// The values a step reports, by column of the interval's rows.
enum Column : int64_t { kLoss, kGradNorm, kScale, kSkipped, kColumns };
const char* const kReportedNames[kColumns] = {"loss", "grad_norm", "loss_scale", "skipped_steps"};

const std::vector<std::string> kFigureNames = {
    "loss", "loss_last", "nonfinite_losses", "grad_norm", "grad_norm_max", "loss_scale", "skipped_steps",
    "skip_streak", "step_time_s", "gpu_step_time_s", "tokens_per_s", "samples_per_s", "data_wait_share", "tflops", "mfu", "peak_tflops",
    "peak_allocated_bytes", "peak_reserved_bytes", "alloc_retries", "ooms", "checkpoint_saves", "checkpoint_save_s",
    "checkpoint_bytes", "tokens_per_s_all_ranks",
    "samples_per_s_all_ranks", "step_time_s_max_rank", "peak_allocated_bytes_max_rank", "peak_reserved_bytes_max_rank",
    "comm_bytes_per_step", "gpu_util_pct", "gpu_memory_used_bytes", "gpu_temperature_c", "gpu_power_w",
    "gpu_sm_clock_mhz", "gpu_energy_j", "joules_per_token", "time"};

double seconds_since_epoch() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string rank_path(const std::string& path, const RecorderOptions& o) {
  return o.every_rank_writes ? fmt::format("{}.rank{}", path, o.rank) : path;
}

void check_options(const RecorderOptions& o) {
  TORCH_CHECK_VALUE(o.log_every >= 1, "MetricsRecorder: log_every ", o.log_every, " is not accepted; accepted: >= 1");
  TORCH_CHECK_VALUE(o.world_size >= 1, "MetricsRecorder: world_size ", o.world_size,
                    " is not accepted; accepted: >= 1");
  TORCH_CHECK_VALUE(o.rank >= 0 && o.rank < o.world_size, "MetricsRecorder: rank ", o.rank,
                    " is not accepted; accepted: 0 <= rank < world_size (", o.world_size, ")");
  TORCH_CHECK_VALUE(std::isfinite(o.flops_per_token) && o.flops_per_token >= 0, "MetricsRecorder: flops_per_token ",
                    o.flops_per_token, " is not accepted; accepted: a finite number >= 0 (0: no TFLOPS)");
  TORCH_CHECK_VALUE(std::isfinite(o.peak_flops) && o.peak_flops >= 0, "MetricsRecorder: peak_flops ", o.peak_flops,
                    " is not accepted; accepted: a finite number >= 0 (0: no MFU)");
  TORCH_CHECK_VALUE(std::isfinite(o.gpu_sample_s) && o.gpu_sample_s > 0 && o.gpu_sample_s <= 3600,
                    "MetricsRecorder: gpu_sample_s ", o.gpu_sample_s, " is not accepted; accepted: > 0 and <= 3600 "
                    "seconds");
  TORCH_CHECK_VALUE(o.prometheus_port == -1 || (o.prometheus_port >= 0 && o.prometheus_port + o.world_size - 1 <= 65535),
                    "MetricsRecorder: prometheus_port ", o.prometheus_port, " is not accepted; accepted: -1 (none), "
                    "0 (a free port) or a port with port + world_size - 1 <= 65535 (rank r serves port + r)");
}

void check_reported(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined() && t.numel() == 1, "MetricsRecorder.step_done: ", name,
                    " must be a one-element tensor, got ", t.defined() ? t.numel() : 0, " elements");
  TORCH_CHECK_VALUE(!t.is_complex(), "MetricsRecorder.step_done: ", name, " must be a real number, got ",
                    t.scalar_type());
}

}  // namespace

const std::vector<std::string>& figure_names() { return kFigureNames; }

std::string Record::to_json() const {
  nlohmann::ordered_json j;
  j["step"] = step;
  for (const auto& [name, value] : figures) j[name] = std::isfinite(value) ? nlohmann::ordered_json(value) : nullptr;
  j["lr"] = lrs;
  return j.dump();
}

// What the steps of an interval add up to; the one place where the figures are computed from the values.
struct Totals {
  double loss_sum = 0, loss_count = 0, nonfinite = 0, loss_last = kNone;
  double norm_last = kNone, norm_max = -std::numeric_limits<double>::infinity();
  double scale_last = kNone, skipped_last = kNone, streak = 0;
  bool reported[kColumns] = {};

  void add(const double (&row)[kColumns], const bool (&given)[kColumns]) {
    if (given[kLoss]) {
      const double l = row[kLoss];
      if (std::isfinite(l)) {
        loss_sum += l;
        loss_count += 1;
      } else {
        nonfinite += 1;
      }
      loss_last = l;
    }
    if (given[kGradNorm]) {
      norm_last = row[kGradNorm];
      norm_max = std::isnan(norm_last) || norm_last > norm_max ? norm_last : norm_max;
    }
    if (given[kScale]) scale_last = row[kScale];
    if (given[kSkipped]) {  // a step was skipped when the running count grew: the streak goes on, else ends
      if (reported[kSkipped]) streak = row[kSkipped] > skipped_last ? streak + 1 : 0;
      skipped_last = row[kSkipped];
    }
    for (int64_t c = 0; c < kColumns; ++c) reported[c] = reported[c] || given[c];
  }
  // The interval's figures are over; what goes on across intervals (the running count, the streak) stays.
  void next_interval() {
    loss_sum = loss_count = nonfinite = 0;
    norm_max = -std::numeric_limits<double>::infinity();
    reported[kLoss] = reported[kGradNorm] = reported[kScale] = false;
  }
};

struct MetricsRecorder::State {
  RecorderOptions options;
  std::vector<std::unique_ptr<detail::RecordSink>> sinks;
  std::unique_ptr<detail::PrometheusEndpoint> endpoint;
  RecordCallback callback;
  std::optional<dist::Communicator> communicator;
  int64_t traffic_at_record = 0;  // the communicator's ring bytes when the last record was made
  // The interval's steps: values read on the host, and rows of a device buffer for the device's values.
  std::vector<std::array<double, kColumns>> host_rows;
  std::vector<std::array<bool, kColumns>> given, on_device;
  at::Tensor device_rows;  // log_every x kColumns doubles on the device of the first device value reported
  Totals totals;
  bool warned_unreadable = false;  // a value the recorder cannot read was dropped (said once)
  int64_t last_step = 0, interval_first_step = 0, tokens = 0, samples = 0, host_reads = 0, resumed_after = 0;
  double data_wait = 0;  // the interval's seconds waiting for data, when reported
  bool data_wait_reported = false;
  CheckpointSaves saves_at_record = checkpoint_saves();
  std::vector<double> lrs;
  std::unique_ptr<DeviceMonitor> monitor;  // RecorderOptions::gpu: NVML on its own thread

  // The GPU's NVML figures over the interval (NaN without a monitor or NVML), and the energy per token.
  void device_figures(std::vector<std::pair<std::string, double>>& out) const {
    DeviceFigures f;
    f.util_pct = f.memory_used_bytes = f.temperature_c = f.power_w = f.sm_clock_mhz = f.energy_j = kNone;
    if (monitor) f = monitor->take();
    out.insert(out.end(), {{"gpu_util_pct", f.util_pct}, {"gpu_memory_used_bytes", f.memory_used_bytes},
                           {"gpu_temperature_c", f.temperature_c}, {"gpu_power_w", f.power_w},
                           {"gpu_sm_clock_mhz", f.sm_clock_mhz}, {"gpu_energy_j", f.energy_j},
                           {"joules_per_token", tokens > 0 ? f.energy_j / static_cast<double>(tokens) : kNone}});
  }
  std::chrono::steady_clock::time_point interval_start = std::chrono::steady_clock::now();

  int64_t steps() const { return static_cast<int64_t>(host_rows.size()); }

#ifdef GPUOPS_WITH_CUDA
  // Device time between step ends: from the first step with a CUDA value on, a timing event recorded at each
  // step's end on that device's current stream (no sync). The interval runs from the previous interval's last
  // event (the first such step's, at first).
  std::unique_ptr<c10::cuda::CUDAEvent> start_event, end_event;
  int64_t timed_steps = 0;  // steps from start_event to end_event

  void mark_device_step(const at::Device& device) {
    const auto stream = c10::cuda::getCurrentCUDAStream(device.index());
    auto& event = start_event ? end_event : start_event;
    if (!event) event = std::make_unique<c10::cuda::CUDAEvent>(cudaEventDefault);
    event->record(stream);
    if (&event == &end_event) ++timed_steps;
  }

  // Seconds of device time per step since the last record (one event synchronize, at the record); NaN before
  // any CUDA value, or when CUDA cannot compare the two events.
  double device_step_time() {
    if (!end_event || timed_steps == 0) return kNone;
    double seconds = kNone;
    try {
      end_event->synchronize();
      seconds = start_event->elapsed_time(*end_event) / 1e3 / static_cast<double>(timed_steps);
    } catch (const c10::Error&) {
    }
    std::swap(start_event, end_event);  // this interval's end starts the next one
    timed_steps = 0;
    return seconds;
  }
#else
  void mark_device_step(const at::Device&) {}
  double device_step_time() { return kNone; }
#endif

  // A row for this step in the device buffer: 64 rows at first, doubled when full (a large log_every costs
  // memory only as its steps come).
  void reserve_row(const at::Tensor& like) {
    if (!device_rows.defined()) {
      device_rows = at::zeros({std::min<int64_t>(options.log_every, 64), kColumns}, like.options().dtype(at::kDouble));
    } else if (steps() == device_rows.size(0)) {
      at::Tensor wider = at::zeros({2 * device_rows.size(0), kColumns}, device_rows.options());
      wider.narrow(0, 0, device_rows.size(0)).copy_(device_rows);
      device_rows = wider;
    }
  }

  void store(const StepReport& report) {
    const std::optional<at::Tensor>* values[kColumns] = {&report.loss, &report.grad_norm, &report.loss_scale,
                                                         &report.skipped_steps};
    std::array<double, kColumns> row{};
    std::array<bool, kColumns> has{}, device{};
    for (int64_t c = 0; c < kColumns; ++c) {
      if (!*values[c]) continue;
      const at::Tensor t = (*values[c])->detach().reshape({});
      if (t.is_meta() || (!t.is_cpu() && device_rows.defined() && t.device().type() != device_rows.device().type())) {
        // A value without data (a meta tensor), or on a second kind of device: that figure is dropped, once
        // said; the recorder goes on (holding it would make every later record fail to read).
        if (!warned_unreadable)
          TORCH_WARN("MetricsRecorder.step_done: ", kReportedNames[c], " is on ", t.device(), ", which the recorder "
                     "cannot read", device_rows.defined() ? " beside the other values' device" : "",
                     "; it is left out of the records (said once)");
        warned_unreadable = true;
        continue;
      }
      has[c] = true;
      if (t.is_cpu()) {
        row[c] = t.item<double>();  // a read of host memory: no sync
      } else {  // copied (and converted) into this step's row of the device buffer: no host read
        reserve_row(t);
        device_rows[steps()][c].copy_(t, /*non_blocking=*/true);
        device[c] = true;
      }
    }
    host_rows.push_back(row);
    given.push_back(has);
    on_device.push_back(device);
    // Every step's end, once a CUDA value made the buffer: elapsed time between two events spans every step
    // between them, those without a CUDA value too.
    if (device_rows.defined() && device_rows.is_cuda()) mark_device_step(device_rows.device());
  }

  // The peak device memory (since the process began or the user's last torch.cuda.reset_peak_memory_stats: the
  // recorder does not reset it, which would change what the user reads), the allocator's retries and OOMs (CUDA:
  // torch's caching allocator, read without a sync; the CPU: not reported).
  void memory_figures(std::vector<std::pair<std::string, double>>& out) const {
    double allocated = kNone, reserved = kNone, retries = kNone, ooms = kNone;
#ifdef GPUOPS_WITH_CUDA
    if (device_rows.defined() && device_rows.is_cuda()) {
      namespace cca = c10::cuda::CUDACachingAllocator;
      const auto stats = cca::getDeviceStats(device_rows.device().index());
      const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
      allocated = static_cast<double>(stats.allocated_bytes[all].peak);
      reserved = static_cast<double>(stats.reserved_bytes[all].peak);
      retries = static_cast<double>(stats.num_alloc_retries);
      ooms = static_cast<double>(stats.num_ooms);
    }
#endif
    out.insert(out.end(), {{"peak_allocated_bytes", allocated}, {"peak_reserved_bytes", reserved},
                           {"alloc_retries", retries}, {"ooms", ooms}});
  }

  // The training states saved since the last record (their seconds and bytes only when there were some).
  void checkpoint_figures(std::vector<std::pair<std::string, double>>& out) {
    const CheckpointSaves now = checkpoint_saves();
    const int64_t count = now.count - saves_at_record.count;
    out.insert(out.end(),
               {{"checkpoint_saves", static_cast<double>(count)},
                {"checkpoint_save_s", count > 0 ? now.seconds - saves_at_record.seconds : kNone},
                {"checkpoint_bytes", count > 0 ? static_cast<double>(now.bytes - saves_at_record.bytes) : kNone}});
    saves_at_record = now;
  }

  // Over all ranks (a communicator given): total rates, the slowest step and the largest peaks, in two small
  // all-reduces on the group's control device; and the collective bytes this rank sent per step since the last
  // record (the traffic counters: no sync), the recorder's own all-reduces left out.
  void rank_figures(std::vector<std::pair<std::string, double>>& out, double interval_steps) {
    double total[2] = {kNone, kNone}, largest[3] = {kNone, kNone, kNone}, bytes = kNone;
    if (communicator) {
      const auto figure = [&](const char* name) {
        for (const auto& [n, v] : out) if (n == name) return v;
        return kNone;
      };
      const int64_t sent = communicator->traffic().ring_sent_bytes();
      bytes = static_cast<double>(sent - traffic_at_record) / interval_steps;
      const auto options = at::TensorOptions().dtype(at::kDouble).device(communicator->control_device());
      const auto zero_if_none = [](double v) { return std::isnan(v) ? 0.0 : v; };
      const auto low_if_none = [](double v) { return std::isnan(v) ? -1.0 : v; };
      at::Tensor sums = at::tensor({zero_if_none(figure("tokens_per_s")), zero_if_none(figure("samples_per_s"))},
                                   at::kDouble).to(options);
      // The record's step, as its largest and (negated) smallest over the ranks: ranks recording other steps
      // would otherwise be combined without a word.
      const auto step = static_cast<double>(last_step);
      at::Tensor maxes = at::tensor({low_if_none(figure("step_time_s")), low_if_none(figure("peak_allocated_bytes")),
                                     low_if_none(figure("peak_reserved_bytes")), step, -step}, at::kDouble).to(options);
      communicator->all_reduce(sums, dist::ReduceOp::Sum).wait();
      communicator->all_reduce(maxes, dist::ReduceOp::Max).wait();
      const at::Tensor s = sums.cpu(), m = maxes.cpu();
      const double latest = m[3].item<double>(), earliest = -m[4].item<double>();
      TORCH_CHECK_VALUE(latest == earliest, "MetricsRecorder: the ranks make records of different steps (from ",
                        static_cast<int64_t>(earliest), " to ", static_cast<int64_t>(latest), ", this rank's ",
                        last_step, "): every rank must call step_done for the same steps, with the same log_every");
      for (int i = 0; i < 2; ++i) total[i] = s[i].item<double>() > 0 ? s[i].item<double>() : kNone;
      for (int i = 0; i < 3; ++i) largest[i] = m[i].item<double>() >= 0 ? m[i].item<double>() : kNone;
      traffic_at_record = communicator->traffic().ring_sent_bytes();
    }
    out.insert(out.end(), {{"tokens_per_s_all_ranks", total[0]}, {"samples_per_s_all_ranks", total[1]},
                           {"step_time_s_max_rank", largest[0]}, {"peak_allocated_bytes_max_rank", largest[1]},
                           {"peak_reserved_bytes_max_rank", largest[2]}, {"comm_bytes_per_step", bytes}});
  }

  Record make_record() {
    at::Tensor device_values;
    if (device_rows.defined() && std::any_of(on_device.begin(), on_device.end(), [](const auto& d) {
          return std::find(d.begin(), d.end(), true) != d.end();
        })) {
      device_values = device_rows.to(at::kCPU);  // the interval's one device-to-host read
      ++host_reads;
    }
    const double* read = device_values.defined() ? device_values.data_ptr<double>() : nullptr;  // rows x kColumns
    for (int64_t i = 0; i < steps(); ++i) {
      double row[kColumns];
      bool has[kColumns];
      for (int64_t c = 0; c < kColumns; ++c) {
        row[c] = on_device[i][c] ? read[i * kColumns + c] : host_rows[i][c];
        has[c] = given[i][c];
      }
      totals.add(row, has);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - interval_start).count();
    const Totals& t = totals;
    const auto given_or_none = [&](Column c, double value) { return t.reported[c] ? value : kNone; };
    Record r;
    r.step = last_step;
    r.first_step = interval_first_step;
    r.lrs = lrs;
    r.figures = {
        {"loss", t.loss_count > 0 ? t.loss_sum / t.loss_count : kNone},
        {"loss_last", given_or_none(kLoss, t.loss_last)},
        {"nonfinite_losses", given_or_none(kLoss, t.nonfinite)},
        {"grad_norm", given_or_none(kGradNorm, t.norm_last)},
        {"grad_norm_max", given_or_none(kGradNorm, t.norm_max)},
        {"loss_scale", given_or_none(kScale, t.scale_last)},
        {"skipped_steps", given_or_none(kSkipped, t.skipped_last)},
        {"skip_streak", given_or_none(kSkipped, t.streak)},
        {"step_time_s", seconds / static_cast<double>(steps())},
        {"gpu_step_time_s", device_step_time()},
        {"tokens_per_s", tokens > 0 ? static_cast<double>(tokens) / seconds : kNone},
        {"samples_per_s", samples > 0 ? static_cast<double>(samples) / seconds : kNone},
        {"data_wait_share", data_wait_reported ? data_wait / seconds : kNone}};
    // Model FLOPs of this rank's tokens, against the peak of one GPU.
    const double flops = tokens > 0 && options.flops_per_token > 0
                             ? static_cast<double>(tokens) * options.flops_per_token / seconds : kNone;
    r.figures.insert(r.figures.end(),
                     {{"tflops", flops / 1e12},
                      {"mfu", options.peak_flops > 0 ? flops / options.peak_flops : kNone},
                      {"peak_tflops", options.peak_flops > 0 ? options.peak_flops / 1e12 : kNone}});
    memory_figures(r.figures);
    checkpoint_figures(r.figures);
    rank_figures(r.figures, static_cast<double>(steps()));
    device_figures(r.figures);
    r.figures.emplace_back("time", seconds_since_epoch());
    totals.next_interval();
    host_rows.clear(), given.clear(), on_device.clear();
    tokens = samples = 0;
    data_wait = 0;
    data_wait_reported = false;
    interval_start = std::chrono::steady_clock::now();
    return r;
  }
};

MetricsRecorder::MetricsRecorder(RecorderOptions options, RecordCallback callback,
                                 const dist::Communicator* communicator)
    : state_(std::make_unique<State>()) {
  check_options(options);
  if (communicator != nullptr) {
    TORCH_CHECK_VALUE(communicator->rank() == options.rank && communicator->size() == options.world_size,
                      "MetricsRecorder: rank ", options.rank, " of ", options.world_size,
                      " is not accepted with a communicator of rank ", communicator->rank(), " of ",
                      communicator->size(), "; accepted: the communicator's");
    // The communicator as given: a checked one agrees on each call first, so that ranks recording different
    // steps raise naming the mismatch instead of pairing the wrong collectives.
    state_->communicator.emplace(*communicator);
    state_->traffic_at_record = communicator->traffic().ring_sent_bytes();
  }
  state_->options = options;
  if (!options.gpu.empty()) state_->monitor = std::make_unique<DeviceMonitor>(options.gpu, options.gpu_sample_s);
  const bool writes = options.every_rank_writes || options.rank == 0;
  const std::string tensorboard_dir =
      !writes || options.tensorboard_dir.empty() ? ""
      : options.every_rank_writes ? fmt::format("{}/rank{}", options.tensorboard_dir, options.rank)
                                  : options.tensorboard_dir;
  if (!tensorboard_dir.empty()) detail::check_tensorboard_folder(tensorboard_dir);  // before anything opens
  if (options.prometheus_port != -1) {  // before the files: a port in use leaves nothing behind
    const int64_t port = options.prometheus_port == 0 ? 0 : options.prometheus_port + options.rank;
    state_->endpoint = std::make_unique<detail::PrometheusEndpoint>(
        options.prometheus_address, port, detail::PrometheusLabels{options.job, options.rank, options.world_size});
  }
  if (writes) state_->callback = std::move(callback);
  if (writes && !options.jsonl_path.empty())
    state_->sinks.push_back(std::make_unique<detail::RecordFile>(rank_path(options.jsonl_path, options),
                                                                 detail::RecordFormat::JsonLines));
  if (writes && !options.csv_path.empty())
    state_->sinks.push_back(
        std::make_unique<detail::RecordFile>(rank_path(options.csv_path, options), detail::RecordFormat::Csv));
  if (!tensorboard_dir.empty()) state_->sinks.push_back(std::make_unique<detail::TensorBoardEvents>(tensorboard_dir));
  for (const auto& sink : state_->sinks) state_->resumed_after = std::max(state_->resumed_after, sink->last_step());
}

MetricsRecorder::~MetricsRecorder() = default;

void MetricsRecorder::step_done(int64_t step, const StepReport& report) {
  State& s = *state_;
  TORCH_CHECK_VALUE(step > s.last_step, "MetricsRecorder.step_done: step ", step,
                    " is not accepted; accepted: steps that increase (the last was ", s.last_step, ")");
  TORCH_CHECK_VALUE(report.tokens >= 0 && report.samples >= 0, "MetricsRecorder.step_done: tokens ", report.tokens,
                    " and samples ", report.samples, " are not accepted; accepted: >= 0");
  TORCH_CHECK_VALUE(!report.data_wait_s || (std::isfinite(*report.data_wait_s) && *report.data_wait_s >= 0),
                    "MetricsRecorder.step_done: data_wait_s ", report.data_wait_s.value_or(0),
                    " is not accepted; accepted: a finite number of seconds >= 0");
  for (const auto& [value, name] : {std::pair{&report.loss, "loss"}, {&report.grad_norm, "grad_norm"},
                                    {&report.loss_scale, "loss_scale"}, {&report.skipped_steps, "skipped_steps"}})
    if (*value) check_reported(**value, name);  // every value first: a refused report changes nothing
  s.store(report);
  if (s.steps() == 1) s.interval_first_step = step;
  s.lrs = report.lrs;
  s.tokens += report.tokens;
  s.samples += report.samples;
  if (report.data_wait_s) {
    s.data_wait += *report.data_wait_s;
    s.data_wait_reported = true;
  }
  s.last_step = step;
  if (step % s.options.log_every == 0 || s.steps() == s.options.log_every) flush();  // or log_every steps came
}

std::optional<Record> MetricsRecorder::flush() {
  State& s = *state_;
  if (s.steps() == 0) return std::nullopt;
  Record record = s.make_record();
  for (const auto& sink : s.sinks) {
    try {  // a full disk or a removed folder costs records, never the training
      sink->append(record);
    } catch (const c10::Error& e) {
      TORCH_WARN("MetricsRecorder: the record of step ", record.step, " was not written: ", e.what_without_backtrace());
    }
  }
  if (s.endpoint) s.endpoint->publish(record);
  if (s.callback) {
    try {  // a user's sink that fails costs its record, never the training
      s.callback(record);
    } catch (const CallbackStop&) {
      throw;  // the user stops the run (Python's KeyboardInterrupt, SystemExit): not ours to swallow
    } catch (const std::exception& e) {
      TORCH_WARN("MetricsRecorder: the callback failed on the record of step ", record.step, ": ", e.what());
    } catch (...) {
      TORCH_WARN("MetricsRecorder: the callback failed on the record of step ", record.step,
                 " with an exception that is not a std::exception");
    }
  }
  return record;
}

std::optional<Record> MetricsRecorder::close() {
  struct StopServing {  // even when the last record fails (ranks that disagree): the port is freed
    State& s;
    ~StopServing() { s.endpoint.reset(); }
  } stop{*state_};
  return flush();
}

int64_t MetricsRecorder::host_reads() const { return state_->host_reads; }

int64_t MetricsRecorder::resumed_after() const { return state_->resumed_after; }

int64_t MetricsRecorder::prometheus_port() const { return state_->endpoint ? state_->endpoint->port() : -1; }

bool prometheus_available() { return detail::prometheus_built(); }

bool tensorboard_available() { return detail::tensorboard_built(); }

}  // namespace gpuops::telemetry
