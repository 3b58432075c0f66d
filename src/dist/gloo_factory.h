#pragma once
// The one door to ProcessGroupGloo (docs/architecture.md, "Process groups from C++"): only gloo_factory.cpp
// is compiled with -DUSE_C10D_GLOO and gloo's headers; everything else sees c10d::ProcessGroup.
#include <chrono>
#include <string>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace gpuops::dist::detail {

/// Where the Gloo transport binds: an interface name (GLOO_SOCKET_IFNAME), else a host name or address,
/// else (both empty) c10d's default device (this host's name, falling back to loopback).
struct GlooDeviceChoice {
  std::string interface;
  std::string hostname;
};

/// A c10d::ProcessGroup whose CPU backend is a ProcessGroupGloo with one transport device and `timeout` on
/// every collective. Blocks until every rank has connected (the rendezvous goes through `store`).
c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_process_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                               int rank, int size,
                                                               std::chrono::milliseconds timeout,
                                                               const GlooDeviceChoice& device);

}  // namespace gpuops::dist::detail
