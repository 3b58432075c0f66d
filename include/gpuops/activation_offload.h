#pragma once
// gpuops::ActivationOffloader (issue 33, item 2): the store behind activation offload. The tensors autograd
// saves inside a layer's forward go to host memory (pinned beside a GPU, copied on a side stream) and come back
// during the backward, the next `prefetch` layers' tensors brought back ahead of their backward (torchtune's
// activation offloading, per layer). A layer's activations are neither kept on the device nor recomputed: the
// third choice beside plain layers and checkpointed ones.
//
// Who calls it: LibTorch's default saved-tensor hooks take Python callables only
// (at::SavedTensorDefaultHooks::push_hooks), so Python's gpuops.offload_activations installs pack/unpack hooks
// that call this store; everything they do (what is offloaded, the copies, their events, deduplication,
// prefetch, the timeline) is here. C++ programs keep a segment's inputs on the host with
// CheckpointOptions::offload_inputs (checkpointing with recomputation) instead.

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/TensorImpl.h>  // c10::VariableVersion

namespace gpuops {

struct ActivationOffloadOptions {
  /// Saved tensors of fewer bytes stay where they are (a copy's fixed cost outweighs them). >= 0.
  int64_t min_bytes = 1024;
  /// During the backward, when a layer's first saved tensor is unpacked, the tensors of the `prefetch` layers
  /// whose backward comes next (the layers before it) start coming back. [0, 64].
  int64_t prefetch = 1;
};

/// One entry of the timeline: a layer's copy to the host (in its forward), a prefetch or a copy back on demand
/// (in the backward), seconds on a steady clock since the store was made or cleared.
struct ActivationOffloadEvent {
  std::string what;  ///< "to host", "prefetch", "back on demand"
  int64_t layer = 0;
  int64_t bytes = 0;
  double begin_s = 0;
  double end_s = 0;
};

class ActivationOffloader {
 public:
  /// c10::ValueError naming the option for min_bytes < 0 or prefetch outside [0, 64].
  explicit ActivationOffloader(ActivationOffloadOptions options = {});
  ~ActivationOffloader();
  ActivationOffloader(const ActivationOffloader&) = delete;
  ActivationOffloader& operator=(const ActivationOffloader&) = delete;

  /// Tensors packed from now on belong to `layer` (>= 0; the order of the forward: layer i's backward runs
  /// after layer i + 1's). c10::ValueError for a negative layer.
  void enter_layer(int64_t layer);
  /// No layer: pack() keeps what is saved outside every offloaded layer.
  void leave_layer();
  /// A tensor autograd saves: its handle (>= 0) once a host copy of it exists, or -1 when it stays (no layer
  /// entered, undefined, fewer than min_bytes, not on the CPU or a CUDA device, sparse, or on another GPU than
  /// the first one offloaded). The same tensor
  /// saved twice at the same version gets the same handle (one copy; each handle given counts one release).
  int64_t pack(const at::Tensor& t);
  /// The tensor behind `handle`, on its device again (brought back on demand, or the prefetched copy); the
  /// first unpack of a layer starts the prefetch of the next ones. c10::ValueError for a handle unknown or
  /// released; c10::Error when the original was changed in place after it was saved (torch's message).
  at::Tensor unpack(int64_t handle);
  /// One use of `handle` ends (the saved variable holding it was freed); the last frees its host and device
  /// copies. Unknown handles are ignored (release may come after clear()).
  void release(int64_t handle);
  /// Frees every entry and clears the timeline. (A pack while no entry is held starts a new timeline too: the
  /// last backward released everything.)
  void clear();

  /// Bytes of host copies held now, and of device copies brought back and not yet released.
  int64_t host_bytes() const;
  int64_t device_bytes() const;
  size_t entries() const { return entries_.size(); }
  const std::vector<ActivationOffloadEvent>& timeline() const { return timeline_; }
  const ActivationOffloadOptions& options() const { return options_; }

 private:
  struct Entry {
    at::Tensor host;                      ///< the values (pinned beside a GPU)
    at::Tensor device;                    ///< brought back (prefetched or on demand), until released
    c10::Device where = c10::kCPU;        ///< the original's device
    std::optional<c10::Event> to_host;    ///< GPU: its copy to the host has ended
    std::optional<c10::Event> back;       ///< GPU: its prefetch has ended
    c10::weak_intrusive_ptr<c10::TensorImpl> original{c10::intrusive_ptr<c10::TensorImpl>()};  ///< for dedup
    c10::VariableVersion version;         ///< the original's version counter (shared, not its storage)
    uint32_t saved_version = 0;           ///< its version when saved: unpack refuses a change in place since
    int64_t layer = 0;
    int64_t uses = 0;
  };
  Entry& entry(int64_t handle, const char* what);
  /// Starts bringing back every entry of `layer` (prefetch: on the side stream beside a GPU).
  void bring_back(int64_t layer, const char* what);
  double now_s() const;

  ActivationOffloadOptions options_;
  std::optional<int64_t> layer_;
  int64_t next_handle_ = 0;
  std::map<int64_t, Entry> entries_;
  std::unordered_map<const c10::TensorImpl*, int64_t> handle_of_;  ///< dedup within the entries held
  std::map<int64_t, std::vector<int64_t>> handles_of_layer_;
  int64_t last_unpacked_layer_ = -1;
  std::optional<c10::Stream> side_;  ///< GPU: the copies' stream
  std::vector<ActivationOffloadEvent> timeline_;
  std::chrono::steady_clock::time_point began_;
};

}  // namespace gpuops
