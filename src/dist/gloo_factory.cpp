// The only file compiled with -DUSE_C10D_GLOO and gloo's headers (Debian's libgloo-dev; CMakeLists.txt).
// The symbols come from the torch wheel's libtorch_cpu.so, which exports ProcessGroupGloo and gloo. The
// headers are a different gloo snapshot than the wheel's, so this file touches no gloo internals: it builds
// Options, asks c10d for a transport device, constructs the group and wraps it. ProcessGroupGloo holds its
// gloo objects through smart pointers only, and the sizes below (the ones the wheel's own operator new
// calls allocate, torch 2.11.0) stop a torch upgrade that changes the layout we construct.
#include "gloo_factory.h"

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

static_assert(sizeof(c10d::ProcessGroupGloo) == 0x1e8,
              "c10d::ProcessGroupGloo's size differs from torch 2.11.0's: re-check src/dist/gloo_factory.cpp "
              "against this torch (docs/architecture.md, Process groups from C++)");
static_assert(sizeof(c10d::ProcessGroupGloo::Options) == 0xb0,
              "c10d::ProcessGroupGloo::Options' size differs from torch 2.11.0's: re-check "
              "src/dist/gloo_factory.cpp against this torch");

namespace gpuops::dist::detail {

c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_process_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                               int rank, int size,
                                                               std::chrono::milliseconds timeout,
                                                               const GlooDeviceChoice& device) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  if (!device.interface.empty())
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(device.interface));
  else if (!device.hostname.empty())
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(device.hostname));
  else
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, backend);
  return group;
}

}  // namespace gpuops::dist::detail
