// SVG pictures of an estimate, written by hand: the native `gpuops` does not load Python, and a plot is
// a few dozen rectangles and labels (docs/estimator.md, "Pictures and advice").
#include "gpuops/plot_svg.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <map>
#include <system_error>

#include <fmt/format.h>

#include "gpuops/errors.h"

namespace gpuops {
namespace {
namespace est = gpuops::estimator;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// Panel geometry (px).
constexpr double kWidth = 1000, kPanelHeight = 540;
constexpr double kChartLeft = 80, kChartRight = 520, kChartTop = 116, kChartHeight = 300;
constexpr double kGpuNamesRight = 660, kGpuBarsLeft = 668, kGpuBarsWidth = 150;

double gib(int64_t bytes) { return static_cast<double>(bytes) / kGiB; }

// Text for an XML text node or attribute: bytes that are not printable UTF-8 as \xNN, markup escaped.
std::string xml(std::string_view text) {
  std::string out;
  for (char c : est::printable(text)) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
  }
  return out;
}

// Fixed colours per category; a category added later gets one of the spare colours by its name.
std::string colour_of(const std::string& category) {
  static const std::map<std::string, std::string> fixed = {
      {"weights", "#4e79a7"},      {"gradients", "#f28e2b"},       {"master_weights", "#9c755f"},
      {"optimizer_states", "#e15759"}, {"activations", "#59a14f"}, {"logits", "#edc948"},
      {"temporaries", "#b07aa1"},  {"workspaces", "#76b7b2"},      {"allocator_slack", "#bab0ac"},
      {"cuda_context", "#555555"}, {"nccl_buffers", "#ff9da7"}, {"block_rounding", "#499894"}};
  if (const auto it = fixed.find(category); it != fixed.end()) return it->second;
  static const char* spare[] = {"#17becf", "#bcbd22", "#8c564b", "#1f77b4", "#d62728", "#9467bd"};
  uint32_t h = 2166136261u;  // FNV-1a: the same colour for the same name in every picture
  for (unsigned char c : category) h = (h ^ c) * 16777619u;
  return spare[h % std::size(spare)];
}

// A step of 1, 2 or 5 x 10^k giving about five ticks up to `top`.
double tick_step(double top) {
  const double raw = top / 5;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0})
    if (m * mag >= raw) return m * mag;
  return 10 * mag;
}

std::string tick_label(double v, double step) {
  const int decimals = std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9)));
  return fmt::format("{:.{}f}", v, decimals);
}

// The category with the most bytes (ties: the first in items()).
std::pair<std::string, int64_t> dominant(const est::MemoryBreakdown& b) {
  std::pair<std::string, int64_t> best{"", -1};
  for (const auto& item : b.items())
    if (item.second > best.second) best = item;
  return best;
}

// (a) a stacked bar per phase.
void phase_chart(const EstimatePlot& p, double y0, std::string& svg) {
  const double top = y0 + kChartTop, bottom = top + kChartHeight;
  int64_t highest = 0;
  for (const est::MemoryBreakdown& b : p.phases) highest = std::max(highest, b.total_high());
  const size_t peak = static_cast<size_t>(p.peak_phase);
  const double line = p.memory_line ? gib(p.memory_line->memory_bytes) : 0;
  double ymax = std::max(gib(highest), line) * 1.08;
  if (!(ymax > 0)) ymax = 1;
  const double step = tick_step(ymax);
  ymax = std::ceil(ymax / step) * step;
  const auto y_of = [&](double g) { return bottom - g / ymax * kChartHeight; };

  svg += fmt::format("<text x=\"{}\" y=\"{:.1f}\" font-size=\"13\" font-weight=\"bold\">Memory per GPU by moment of "
                     "the step ({})</text>\n", kChartLeft, y0 + kChartTop - 48, xml(p.device));
  // Axis, ticks and grid.
  svg += fmt::format("<g class=\"axis\" font-size=\"11\" fill=\"#333\">\n");
  for (double v = 0; v <= ymax + step / 2; v += step) {
    svg += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#ddd\"/>\n", kChartLeft,
                       y_of(v), kChartRight, y_of(v));
    svg += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n", kChartLeft - 6, y_of(v) + 4,
                       tick_label(v, step));
  }
  svg += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"#333\"/>\n", kChartLeft, top, bottom);
  svg += fmt::format("<text transform=\"translate(28 {:.1f}) rotate(-90)\" text-anchor=\"middle\">GiB</text>\n",
                     top + kChartHeight / 2);
  svg += "</g>\n";

  const double slot = (kChartRight - kChartLeft) / std::max<size_t>(p.phases.size(), 1), bar = 64;
  for (size_t i = 0; i < p.phases.size(); ++i) {
    const est::MemoryBreakdown& b = p.phases[i];
    const std::string phase(est::to_string(static_cast<est::StepPhase>(i)));
    const double x = kChartLeft + slot * i + (slot - bar) / 2;
    svg += fmt::format("<g class=\"phase{}\" data-phase=\"{}\">\n", i == peak ? " peak" : "", phase);
    double at = 0;
    for (const auto& [name, bytes] : b.items()) {
      if (bytes <= 0) continue;
      const double g = gib(bytes);
      svg += fmt::format("<rect class=\"segment\" data-category=\"{}\" x=\"{:.1f}\" y=\"{:.2f}\" width=\"{}\" "
                         "height=\"{:.2f}\" fill=\"{}\"><title>{}: {:.2f} GiB</title></rect>\n",
                         xml(name), x, y_of(at + g), bar, y_of(at) - y_of(at + g), colour_of(name), xml(name), g);
      at += g;
    }
    const double total = gib(b.total());
    if (i == peak)
      svg += fmt::format("<rect class=\"peak-outline\" x=\"{:.1f}\" y=\"{:.2f}\" width=\"{}\" height=\"{:.2f}\" "
                         "fill=\"none\" stroke=\"#000\" stroke-width=\"2.5\"/>\n", x, y_of(total), bar,
                         bottom - y_of(total));
    const double high = gib(b.total_high());
    if (b.band_below > 0 || b.band_above > 0)  // the uncertainty band of the device figure
      svg += fmt::format("<path class=\"band\" d=\"M{0:.1f} {1:.2f}V{2:.2f}M{3:.1f} {1:.2f}h10M{3:.1f} {2:.2f}h10\" "
                         "stroke=\"#000\" fill=\"none\"><title>band {4:.2f} to {5:.2f} GiB</title></path>\n",
                         x + bar / 2, y_of(gib(b.total_low())), y_of(high), x + bar / 2 - 5, gib(b.total_low()), high);
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\" text-anchor=\"middle\"{}>{}{:.2f}</text>\n",
                       x + bar / 2, y_of(std::max(total, high)) - 6, i == peak ? " font-weight=\"bold\"" : "",
                       i == peak ? "peak " : "", total);
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\" text-anchor=\"middle\">{}</text>\n",
                       x + bar / 2, bottom + 16, phase);
    svg += "</g>\n";
  }
  if (peak < p.phases.size()) {
    const est::MemoryBreakdown& b = p.phases[peak];
    const auto [name, bytes] = dominant(b);
    const double share = b.total() > 0 ? 100.0 * static_cast<double>(bytes) / static_cast<double>(b.total()) : 0;
    svg += fmt::format("<text class=\"peak-label\" x=\"{}\" y=\"{:.1f}\" font-size=\"12\">Peak at {}: {:.2f} GiB, "
                       "largest term {} ({:.0f}%)</text>\n", kChartLeft, y0 + kChartTop - 32,
                       est::to_string(static_cast<est::StepPhase>(peak)), gib(b.total()), xml(name), share);
  }
  if (p.memory_line) {
    svg += fmt::format("<g class=\"memory-line\"><line x1=\"{}\" y1=\"{:.2f}\" x2=\"{}\" y2=\"{:.2f}\" stroke=\"#c00\" "
                       "stroke-width=\"1.5\" stroke-dasharray=\"6 4\"/><text x=\"{}\" y=\"{:.2f}\" font-size=\"12\" "
                       "fill=\"#c00\">dashed: {}: {:.2f} GiB</text></g>\n",
                       kChartLeft, y_of(line), kChartRight, y_of(line), kChartLeft, y0 + kChartTop - 16,
                       xml(p.memory_line->name), line);
  }
  // Legend: every category with bytes in some phase, in items() order.
  std::vector<std::string> shown;
  if (!p.phases.empty())
    for (const auto& item : p.phases.front().items()) {
      const std::string& name = item.first;
      const bool used = std::any_of(p.phases.begin(), p.phases.end(), [&](const est::MemoryBreakdown& b) {
        for (const auto& [n, v] : b.items())
          if (n == name && v > 0) return true;
        return false;
      });
      if (used) shown.push_back(name);
    }
  svg += "<g class=\"legend\" font-size=\"11\">\n";
  svg += fmt::format("<text x=\"24\" y=\"{:.1f}\" fill=\"#555\">bar: device memory used (nvidia-smi) by category; "
                     "whisker: uncertainty band</text>\n", bottom + 36);
  for (size_t i = 0; i < shown.size(); ++i) {
    const double lx = 24 + 170.0 * (i % 3), ly = bottom + 56 + 18.0 * (i / 3);
    svg += fmt::format("<rect x=\"{}\" y=\"{:.1f}\" width=\"12\" height=\"12\" fill=\"{}\"/><text x=\"{}\" "
                       "y=\"{:.1f}\">{}</text>\n", lx, ly - 10, colour_of(shown[i]), lx + 17, ly, xml(shown[i]));
  }
  svg += "</g>\n";
}

// 1234567 -> "1 234 567" (thin groups, as the docs write counts).
std::string grouped(int64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ' ';
    out += digits[i];
  }
  return out;
}

// (b) the largest micro-batch per catalog GPU.
void gpu_chart(const EstimatePlot& p, double y0, std::string& svg) {
  const double top = y0 + kChartTop;
  svg += fmt::format("<text x=\"{}\" y=\"{:.1f}\" font-size=\"13\" font-weight=\"bold\">{}</text>\n",
                     kGpuNamesRight - 90, top - 48,
                     p.has_micro_batch ? "Largest micro-batch per GPU (CUDA estimate)"
                                       : "Fit per GPU without activations (CUDA estimate)");
  int64_t most = 1;
  for (const auto& f : p.gpus) most = std::max(most, f.max_micro_batch);
  const double row = p.gpus.empty() ? 0 : std::min(32.0, kChartHeight / static_cast<double>(p.gpus.size()));
  svg += "<g class=\"gpus\" font-size=\"11\">\n";
  for (size_t i = 0; i < p.gpus.size(); ++i) {
    const est::GpuFit& f = p.gpus[i];
    const double y = top + row * i;
    const int64_t value = p.has_micro_batch ? f.max_micro_batch : 0;
    const double w = kGpuBarsWidth * static_cast<double>(value) / static_cast<double>(most);
    std::string label;
    // No architecture: what fits is the weights, gradients and states only, so a fit is not a verdict.
    if (!p.has_micro_batch) label = f.fits ? "states fit; activations unknown" : "does not fit (states alone)";
    else if (value == 0) label = "0: does not fit at micro-batch 1";
    else label = fmt::format("{}", value);
    svg += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{} ({:.0f} GiB)</text>\n", kGpuNamesRight - 6,
                       y + 14, xml(f.gpu->name), gib(f.gpu->memory_bytes));
    svg += fmt::format("<rect class=\"gpu-bar\" data-gpu=\"{}\" data-max-micro-batch=\"{}\" x=\"{}\" y=\"{:.1f}\" "
                       "width=\"{:.1f}\" height=\"18\" fill=\"{}\"/>\n", xml(f.gpu->name), value, kGpuBarsLeft, y + 1,
                       w, f.fits ? "#4e79a7" : "#a0b4c8");
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\"{}>{}</text>\n", kGpuBarsLeft + w + 4, y + 14,
                       value == 0 ? " fill=\"#c00\"" : "", label);
  }
  svg += fmt::format("<text x=\"{}\" y=\"{:.1f}\" fill=\"#555\">{}</text>\n", kGpuBarsLeft - 90,
                     top + row * p.gpus.size() + 18,
                     p.has_micro_batch ? "dark: fits at the requested micro-batch"
                                       : "dark: weights, gradients and states fit; activations not modelled");
  svg += "</g>\n";
}

std::string describe(const est::TrainingSetup& s, std::string_view device) {
  std::string lora = s.lora.rank > 0 ? fmt::format(", LoRA rank {} ({} base)", s.lora.rank, est::to_string(s.lora.base))
                                     : std::string();
  return fmt::format("{}, {}{}, micro-batch {}, seq {}, grad-accum {}, checkpointing {}, attention {}, ZeRO {} on {} "
                     "GPU(s), device {}", est::to_string(s.precision), est::to_string(s.optimizer), lora, s.micro_batch,
                     s.seq_len, s.grad_accum, est::checkpointing_to_string(s), est::to_string(s.attention),
                     s.zero_stage, s.num_gpus, device);
}

[[noreturn]] void fail(int error, const std::string& what) { throw std::system_error(error, std::generic_category(), what); }

}  // namespace

EstimatePlot make_estimate_plot(const est::ModelSpec& model, const est::TrainingSetup& setup,
                                const est::DeviceProfile& device, const est::GpuModel* memory_line,
                                const est::CudaRuntime& runtime) {
  EstimatePlot p;
  p.device = device.is_cpu() ? "cpu" : "cuda";
  const char* kind = setup.lora.rank > 0 ? "LoRA fine-tune" : "full fine-tune";
  p.title = fmt::format("{} of {}", kind, model.name);
  if (model.family == est::ModelFamily::ParamsOnly)  // a bare count's name is the count as given
    p.title = fmt::format("{} of {}{} trainable parameters (activations and logits not modelled)", kind,
                          std::isdigit(static_cast<unsigned char>(model.name[0])) ? std::string() : model.name + ": ",
                          grouped(est::parameter_count(model)));
  p.subtitle = describe(setup, p.device);
  p.phases = est::estimate_phases(model, setup, device);
  p.peak_phase = est::estimate_memory(model, setup, device).peak_phase;
  p.gpus = est::fit_catalog(model, setup, runtime);
  p.has_micro_batch = model.family != est::ModelFamily::ParamsOnly;
  p.memory_line = memory_line;
  return p;
}

std::string render_estimate_svg(const std::vector<EstimatePlot>& plots) {
  const double height = kPanelHeight * static_cast<double>(std::max<size_t>(plots.size(), 1));
  std::string svg = fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" "
      "height=\"{1}\" viewBox=\"0 0 {0} {1}\" font-family=\"DejaVu Sans, Arial, sans-serif\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"#fff\"/>\n", kWidth, height);
  for (size_t i = 0; i < plots.size(); ++i) {
    const double y0 = kPanelHeight * static_cast<double>(i);
    // Long titles (the default example's) get a smaller font to stay inside the width.
    const double title_size = std::clamp(950.0 / (0.6 * static_cast<double>(plots[i].title.size() + 1)), 11.0, 17.0);
    svg += fmt::format("<g class=\"panel\">\n<text class=\"title\" x=\"24\" y=\"{:.1f}\" font-size=\"{:.1f}\" "
                       "font-weight=\"bold\">{}</text>\n<text x=\"24\" y=\"{:.1f}\" font-size=\"11\" fill=\"#444\">{}"
                       "</text>\n", y0 + 28, title_size, xml(plots[i].title), y0 + 46, xml(plots[i].subtitle));
    phase_chart(plots[i], y0, svg);
    gpu_chart(plots[i], y0, svg);
    svg += "</g>\n";
  }
  svg += "</svg>\n";
  return svg;
}

std::string estimate_svg(const est::ModelSpec& model, const est::TrainingSetup& setup, const est::DeviceProfile& device,
                         const est::GpuModel* memory_line, const est::CudaRuntime& runtime) {
  return render_estimate_svg({make_estimate_plot(model, setup, device, memory_line, runtime)});
}

bool is_svg_name(std::string_view path) {
  if (path.size() < 4) return false;
  std::string suffix(path.substr(path.size() - 4));
  for (char& c : suffix) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return suffix == ".svg";
}

void write_file_atomically(const std::string& path, std::string_view text) {
  if (path.empty()) fail(ENOENT, "empty path");
  if (path.find('\0') != std::string::npos) fail(EINVAL, "holds a NUL byte (C would write another file)");
  std::string target = path;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) fail(EISDIR, "is a directory");
    if (!S_ISREG(st.st_mode)) fail(EINVAL, "is not a regular file");
    if (char* real = ::realpath(path.c_str(), nullptr)) {  // a symlink: replace its target, not the link
      target = real;
      std::free(real);
    }
  }
  if (target.back() == '/') fail(EISDIR, "is a directory");
  const size_t slash = target.rfind('/');
  const std::string folder = slash == std::string::npos ? std::string() : target.substr(0, slash + 1);
  static std::atomic<unsigned> counter{0};
  std::string temp;
  int fd = -1;
  for (int attempt = 0; fd < 0; ++attempt) {  // O_EXCL: never another file; mode 0666 less the umask
    temp = fmt::format("{}.gpuops-{}-{}.tmp", folder, ::getpid(), counter++);
    fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && (errno != EEXIST || attempt > 100)) fail(errno, "cannot create a file in its folder");
  }
  const auto give_up = [&](const char* what) {
    const int error = errno;
    ::close(fd);
    ::unlink(temp.c_str());
    fail(error, what);
  };
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) errno = EIO;
    if (n <= 0) give_up("cannot write");
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 && errno != EINVAL) give_up("cannot write");
  if (::close(fd) != 0) {
    const int error = errno;
    ::unlink(temp.c_str());
    fail(error, "cannot write");
  }
  if (::rename(temp.c_str(), target.c_str()) != 0) {
    const int error = errno;
    ::unlink(temp.c_str());
    fail(error, "cannot replace it");
  }
}

}  // namespace gpuops
