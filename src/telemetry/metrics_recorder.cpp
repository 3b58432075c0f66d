// MetricsRecorder: the step's device values are combined into one small device tensor with device ops; at the
// end of a log interval that tensor is read once and the interval's record is written to the sinks.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <limits>

#include "gpuops/telemetry.h"
#include "record_file.h"

#ifdef GPUOPS_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace gpuops::telemetry {
namespace {

constexpr double kNone = std::numeric_limits<double>::quiet_NaN();

// Slots of the device accumulator.
enum Slot : int64_t {
  kLossSum,         // finite losses of the interval, summed
  kLossCount,       // finite losses of the interval
  kNonFinite,       // non-finite losses of the interval
  kLossLast,
  kGradNormLast,
  kGradNormMax,     // over the interval
  kScaleLast,
  kSkippedLast,     // the scaler's running count
  kSkipStreak,      // skipped steps in a row, up to the last one
  kSlots
};

const std::vector<std::string> kFigureNames = {
    "loss", "loss_last", "nonfinite_losses", "grad_norm", "grad_norm_max", "loss_scale", "skipped_steps",
    "skip_streak", "step_time_s", "tokens_per_s", "samples_per_s", "peak_allocated_bytes", "peak_reserved_bytes",
    "alloc_retries", "ooms", "time"};

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
}

void check_reported(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined() && t.numel() == 1, "MetricsRecorder.step_done: ", name,
                    " must be a one-element tensor, got ", t.defined() ? t.numel() : 0, " elements");
  TORCH_CHECK_VALUE(!t.is_complex(), "MetricsRecorder.step_done: ", name, " must be a real number, got ",
                    t.scalar_type());
}

// A reported one-element tensor as a double on the accumulator's device (no host read).
at::Tensor on_device(const at::Tensor& t, const at::Tensor& acc) {
  return t.detach().reshape({}).to(acc.device(), at::kDouble, /*non_blocking=*/true);
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

struct MetricsRecorder::State {
  RecorderOptions options;
  std::vector<std::unique_ptr<detail::RecordFile>> sinks;
  RecordCallback callback;
  at::Tensor acc;  // kSlots doubles on the device of the first tensor reported
  bool reported[kSlots] = {};
  bool skipped_seen = false;
  int64_t last_step = 0, interval_steps = 0, tokens = 0, samples = 0, host_reads = 0, resumed_after = 0;
  std::vector<double> lrs;
  std::chrono::steady_clock::time_point interval_start = std::chrono::steady_clock::now();

  at::Tensor accumulator(const at::Tensor& like) {
    if (!acc.defined()) {
      acc = at::zeros({kSlots}, at::TensorOptions().dtype(at::kDouble).device(like.device()));
      acc[kGradNormMax].fill_(-std::numeric_limits<double>::infinity());
    }
    return acc;
  }

  void add_loss(const at::Tensor& loss) {
    const at::Tensor a = accumulator(loss), l = on_device(loss, a);
    const at::Tensor finite = at::isfinite(l);
    a[kLossSum].add_(at::where(finite, l, at::zeros_like(l)));
    a[kLossCount].add_(finite.to(at::kDouble));
    a[kNonFinite].add_(at::logical_not(finite).to(at::kDouble));
    a[kLossLast].copy_(l);
    reported[kLossSum] = reported[kLossLast] = true;
  }

  void add_grad_norm(const at::Tensor& norm) {
    const at::Tensor a = accumulator(norm), g = on_device(norm, a);
    a[kGradNormLast].copy_(g);
    a[kGradNormMax].copy_(at::maximum(a[kGradNormMax], g));
    reported[kGradNormLast] = true;
  }

  void add_scaler(const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& skipped) {
    if (scale) {
      const at::Tensor a = accumulator(*scale);
      a[kScaleLast].copy_(on_device(*scale, a));
      reported[kScaleLast] = true;
    }
    if (skipped) {
      const at::Tensor a = accumulator(*skipped), s = on_device(*skipped, a);
      if (skipped_seen) {  // a step was skipped when the running count grew: the streak goes on, else ends
        const at::Tensor grew = at::gt(s, a[kSkippedLast]).to(at::kDouble);
        a[kSkipStreak].copy_((a[kSkipStreak] + 1) * grew);
      }
      a[kSkippedLast].copy_(s);
      skipped_seen = reported[kSkippedLast] = true;
    }
  }

  // The peak device memory since the last record, the allocator's retries and OOMs (CUDA: torch's caching
  // allocator, read without a sync; the CPU: not reported).
  void memory_figures(std::vector<std::pair<std::string, double>>& out) const {
    double allocated = kNone, reserved = kNone, retries = kNone, ooms = kNone;
#ifdef GPUOPS_WITH_CUDA
    if (acc.defined() && acc.is_cuda()) {
      namespace cca = c10::cuda::CUDACachingAllocator;
      const auto stats = cca::getDeviceStats(acc.device().index());
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

  Record make_record() {
    std::vector<double> v(kSlots, kNone);
    if (acc.defined()) {
      const at::Tensor host = acc.to(at::kCPU);  // the interval's one device-to-host read
      ++host_reads;
      for (int64_t i = 0; i < kSlots; ++i) v[i] = host[i].item<double>();
      acc[kLossSum].zero_(), acc[kLossCount].zero_(), acc[kNonFinite].zero_();
      acc[kGradNormMax].fill_(-std::numeric_limits<double>::infinity());
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - interval_start).count();
    const auto given = [&](Slot s, double value) { return reported[s] ? value : kNone; };
    Record r;
    r.step = last_step;
    r.lrs = lrs;
    r.figures = {
        {"loss", reported[kLossSum] && v[kLossCount] > 0 ? v[kLossSum] / v[kLossCount] : kNone},
        {"loss_last", given(kLossLast, v[kLossLast])},
        {"nonfinite_losses", given(kLossSum, v[kNonFinite])},
        {"grad_norm", given(kGradNormLast, v[kGradNormLast])},
        {"grad_norm_max", given(kGradNormLast, v[kGradNormMax])},
        {"loss_scale", given(kScaleLast, v[kScaleLast])},
        {"skipped_steps", given(kSkippedLast, v[kSkippedLast])},
        {"skip_streak", given(kSkippedLast, v[kSkipStreak])},
        {"step_time_s", seconds / static_cast<double>(interval_steps)},
        {"tokens_per_s", tokens > 0 ? static_cast<double>(tokens) / seconds : kNone},
        {"samples_per_s", samples > 0 ? static_cast<double>(samples) / seconds : kNone}};
    memory_figures(r.figures);
    r.figures.emplace_back("time", seconds_since_epoch());
    interval_steps = tokens = samples = 0;
    interval_start = std::chrono::steady_clock::now();
    return r;
  }
};

MetricsRecorder::MetricsRecorder(RecorderOptions options, RecordCallback callback)
    : state_(std::make_unique<State>()) {
  check_options(options);
  state_->options = options;
  const bool writes = options.every_rank_writes || options.rank == 0;
  if (writes) state_->callback = std::move(callback);
  if (writes && !options.jsonl_path.empty())
    state_->sinks.push_back(std::make_unique<detail::RecordFile>(rank_path(options.jsonl_path, options),
                                                                 detail::RecordFormat::JsonLines));
  if (writes && !options.csv_path.empty())
    state_->sinks.push_back(
        std::make_unique<detail::RecordFile>(rank_path(options.csv_path, options), detail::RecordFormat::Csv));
  for (const auto& sink : state_->sinks) state_->resumed_after = std::max(state_->resumed_after, sink->last_step());
}

MetricsRecorder::~MetricsRecorder() = default;

void MetricsRecorder::step_done(int64_t step, const StepReport& report) {
  State& s = *state_;
  TORCH_CHECK_VALUE(step > s.last_step, "MetricsRecorder.step_done: step ", step,
                    " is not accepted; accepted: steps that increase (the last was ", s.last_step, ")");
  TORCH_CHECK_VALUE(report.tokens >= 0 && report.samples >= 0, "MetricsRecorder.step_done: tokens ", report.tokens,
                    " and samples ", report.samples, " are not accepted; accepted: >= 0");
  for (const auto& [value, name] : {std::pair{&report.loss, "loss"}, {&report.grad_norm, "grad_norm"},
                                    {&report.loss_scale, "loss_scale"}, {&report.skipped_steps, "skipped_steps"}})
    if (*value) check_reported(**value, name);  // every value first: a refused report changes nothing
  if (report.loss) s.add_loss(*report.loss);
  if (report.grad_norm) s.add_grad_norm(*report.grad_norm);
  s.add_scaler(report.loss_scale, report.skipped_steps);
  s.lrs = report.lrs;
  s.tokens += report.tokens;
  s.samples += report.samples;
  s.last_step = step;
  ++s.interval_steps;
  if (step % s.options.log_every == 0) flush();
}

std::optional<Record> MetricsRecorder::flush() {
  State& s = *state_;
  if (s.interval_steps == 0) return std::nullopt;
  Record record = s.make_record();
  for (const auto& sink : s.sinks) {
    try {  // a full disk or a removed folder costs records, never the training
      sink->append(record);
    } catch (const c10::Error& e) {
      TORCH_WARN("MetricsRecorder: the record of step ", record.step, " was not written: ", e.what_without_backtrace());
    }
  }
  if (s.callback) {
    try {  // a user's sink that fails costs its record, never the training
      s.callback(record);
    } catch (const std::exception& e) {
      TORCH_WARN("MetricsRecorder: the callback failed on the record of step ", record.step, ": ", e.what());
    }
  }
  return record;
}

int64_t MetricsRecorder::host_reads() const { return state_->host_reads; }

int64_t MetricsRecorder::resumed_after() const { return state_->resumed_after; }

}  // namespace gpuops::telemetry
