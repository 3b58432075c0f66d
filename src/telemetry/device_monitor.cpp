// gpuops::telemetry::DeviceMonitor (device_monitor.h): NVML through dlopen. The few NVML declarations it needs
// are written here (their C ABI is stable across drivers: the _v2 entry points), so neither NVML's header nor
// its library is needed to build or to run.
#include "gpuops/device_monitor.h"

#include <dlfcn.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <limits>

#include <c10/util/Exception.h>
#include <fmt/format.h>

namespace gpuops::telemetry {
namespace {

constexpr double kNone = std::numeric_limits<double>::quiet_NaN();
constexpr int kSuccess = 0;  // NVML_SUCCESS
using Device = void*;        // nvmlDevice_t
struct Utilization {         // nvmlUtilization_t
  unsigned int gpu, memory;
};
struct Memory {  // nvmlMemory_t
  unsigned long long total, free, used;
};
constexpr int kTemperatureGpu = 0;  // NVML_TEMPERATURE_GPU
constexpr int kClockSm = 1;         // NVML_CLOCK_SM

}  // namespace

struct DeviceMonitor::Nvml {
  void* library = nullptr;
  Device device = nullptr;
  int (*init)() = nullptr;
  int (*shutdown)() = nullptr;
  int (*by_index)(unsigned int, Device*) = nullptr;
  int (*by_pci)(const char*, Device*) = nullptr;
  int (*utilization)(Device, Utilization*) = nullptr;
  int (*memory)(Device, Memory*) = nullptr;
  int (*temperature)(Device, int, unsigned int*) = nullptr;
  int (*power)(Device, unsigned int*) = nullptr;  // milliwatts
  int (*clock)(Device, int, unsigned int*) = nullptr;
  int (*energy)(Device, unsigned long long*) = nullptr;  // millijoules since the driver loaded

  template <class F>
  bool find(F& f, const char* name) {
    f = reinterpret_cast<F>(dlsym(library, name));
    return f != nullptr;
  }
  ~Nvml() {
    if (shutdown != nullptr) shutdown();
    if (library != nullptr) dlclose(library);
  }
};

struct DeviceMonitor::Totals {
  double util_sum = 0, power_sum = 0, clock_sum = 0, memory_max = kNone, temperature_max = kNone;
  int64_t util_n = 0, power_n = 0, clock_n = 0, samples = 0;
  double energy_first = kNone, energy_last = kNone;
};

namespace {
void add_max(double& max, double value) { max = std::isnan(max) ? value : std::max(max, value); }
}  // namespace

DeviceMonitor::DeviceMonitor(std::string gpu, double interval_s)
    : nvml_(std::make_unique<Nvml>()), totals_(std::make_unique<Totals>()), interval_s_(interval_s) {
  TORCH_CHECK_VALUE(std::isfinite(interval_s) && interval_s > 0 && interval_s <= 3600, "DeviceMonitor: interval_s ",
                    interval_s, " is not accepted; accepted: > 0 and <= 3600 seconds");
  const char* named = std::getenv("GPUOPS_NVML_LIBRARY");
  const std::string path = named != nullptr && *named != '\0' ? named : "libnvidia-ml.so.1";
  Nvml& n = *nvml_;
  n.library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (n.library == nullptr) {
    reason_ = fmt::format("NVML not loaded ({}): no NVIDIA driver here", path);
    return;
  }
  const bool found = n.find(n.init, "nvmlInit_v2") && n.find(n.shutdown, "nvmlShutdown") &&
                     n.find(n.by_index, "nvmlDeviceGetHandleByIndex_v2") &&
                     n.find(n.by_pci, "nvmlDeviceGetHandleByPciBusId_v2") &&
                     n.find(n.utilization, "nvmlDeviceGetUtilizationRates") &&
                     n.find(n.memory, "nvmlDeviceGetMemoryInfo") && n.find(n.temperature, "nvmlDeviceGetTemperature") &&
                     n.find(n.power, "nvmlDeviceGetPowerUsage") && n.find(n.clock, "nvmlDeviceGetClockInfo") &&
                     n.find(n.energy, "nvmlDeviceGetTotalEnergyConsumption");
  if (!found || n.init() != kSuccess) {
    n.shutdown = nullptr;  // NVML was not initialised: nothing to shut down
    reason_ = fmt::format("NVML ({}) lacks an entry point or did not initialise", path);
    return;
  }
  // An index: up to 9 digits (no overflow); anything else goes to NVML as a PCI bus id, which answers "not found".
  const bool index = !gpu.empty() && gpu.size() <= 9 && gpu.find_first_not_of("0123456789") == std::string::npos;
  const int got = index ? n.by_index(static_cast<unsigned int>(std::stoul(gpu)), &n.device)
                        : n.by_pci(gpu.c_str(), &n.device);
  if (got != kSuccess) {
    reason_ = fmt::format("NVML knows no GPU '{}' (error {})", gpu, got);
    return;
  }
  available_ = true;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    sample();
  }
  thread_ = std::thread([this] { run(); });
}

DeviceMonitor::~DeviceMonitor() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void DeviceMonitor::sample() {
  Nvml& n = *nvml_;
  Totals& t = *totals_;
  Utilization u{};
  if (n.utilization(n.device, &u) == kSuccess) t.util_sum += u.gpu, ++t.util_n;
  Memory m{};
  if (n.memory(n.device, &m) == kSuccess) add_max(t.memory_max, static_cast<double>(m.used));
  unsigned int value = 0;
  if (n.temperature(n.device, kTemperatureGpu, &value) == kSuccess) add_max(t.temperature_max, value);
  if (n.power(n.device, &value) == kSuccess) t.power_sum += value / 1e3, ++t.power_n;
  if (n.clock(n.device, kClockSm, &value) == kSuccess) t.clock_sum += value, ++t.clock_n;
  unsigned long long energy = 0;
  if (n.energy(n.device, &energy) == kSuccess) {
    if (std::isnan(t.energy_first)) t.energy_first = static_cast<double>(energy);
    t.energy_last = static_cast<double>(energy);
  }
  ++t.samples;
}

void DeviceMonitor::run() {
  // Short sleeps: the destructor's join waits at most one of them, not a whole interval.
  auto next = std::chrono::steady_clock::now();
  const auto every = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(interval_s_));
  while (!stop_) {
    next += every;
    while (!stop_ && std::chrono::steady_clock::now() < next)
      std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
          next - std::chrono::steady_clock::now(), std::chrono::milliseconds(20)));
    if (stop_) break;
    std::lock_guard<std::mutex> lock(mutex_);
    sample();
  }
}

DeviceFigures DeviceMonitor::take() {
  DeviceFigures f;
  f.util_pct = f.memory_used_bytes = f.temperature_c = f.power_w = f.sm_clock_mhz = f.energy_j = kNone;
  if (!available_) return f;
  std::lock_guard<std::mutex> lock(mutex_);
  sample();
  Totals& t = *totals_;
  const auto mean = [](double sum, int64_t n) { return n > 0 ? sum / static_cast<double>(n) : kNone; };
  f.util_pct = mean(t.util_sum, t.util_n);
  f.memory_used_bytes = t.memory_max;
  f.temperature_c = t.temperature_max;
  f.power_w = mean(t.power_sum, t.power_n);
  f.sm_clock_mhz = mean(t.clock_sum, t.clock_n);
  f.energy_j = (t.energy_last - t.energy_first) / 1e3;  // NaN when the counter did not answer
  f.samples = t.samples;
  const double last_energy = t.energy_last;
  t = Totals{};
  t.energy_first = last_energy;  // the next interval's energy starts where this one ended
  t.energy_last = last_energy;
  return f;
}

}  // namespace gpuops::telemetry
