// A stand-in for libnvidia-ml.so.1 with the entry points gpuops' DeviceMonitor loads (src/telemetry/
// device_monitor.cpp), answering known figures: the C++ and Python tests load it through GPUOPS_NVML_LIBRARY
// to check the monitor and the records without a GPU. Each reading advances a counter: utilisation 10, 20, ..
// 90 %, memory used 1 GiB + counter MiB, temperature 40 + counter % 7 C, power 150 W, SM clock 1410 MHz, and
// the energy counter 2 J per reading. One GPU: index 0, PCI bus id "00000000:3B:00.0".
#include <cstring>

extern "C" {

typedef void* Device;
typedef struct { unsigned int gpu, memory; } Utilization;
typedef struct { unsigned long long total, free, used; } Memory;

static unsigned long long readings = 0;
static int the_gpu = 0;

int nvmlInit_v2(void) { return 0; }
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned int index, Device* device) {
  if (index != 0) return 2; // NVML_ERROR_INVALID_ARGUMENT
  *device = &the_gpu;
  return 0;
}
int nvmlDeviceGetHandleByPciBusId_v2(const char* bus, Device* device) {
  if (std::strcmp(bus, "00000000:3B:00.0") != 0) return 6; // NVML_ERROR_NOT_FOUND
  *device = &the_gpu;
  return 0;
}
int nvmlDeviceGetUtilizationRates(Device d, Utilization* u) {
  (void)d;
  ++readings;
  u->gpu = (unsigned int)(10 * (1 + readings % 9));
  u->memory = 5;
  return 0;
}
int nvmlDeviceGetMemoryInfo(Device d, Memory* m) {
  (void)d;
  m->total = 80ull << 30;
  m->used = (1ull << 30) + readings * (1ull << 20);
  m->free = m->total - m->used;
  return 0;
}
int nvmlDeviceGetTemperature(Device d, int sensor, unsigned int* t) {
  (void)d, (void)sensor;
  *t = (unsigned int)(40 + readings % 7);
  return 0;
}
int nvmlDeviceGetPowerUsage(Device d, unsigned int* milliwatts) {
  (void)d;
  *milliwatts = 150000;
  return 0;
}
int nvmlDeviceGetClockInfo(Device d, int clock, unsigned int* mhz) {
  (void)d, (void)clock;
  *mhz = 1410;
  return 0;
}
int nvmlDeviceGetTotalEnergyConsumption(Device d, unsigned long long* millijoules) {
  (void)d;
  *millijoules = 2000ull * readings;
  return 0;
}

}  // extern "C"
