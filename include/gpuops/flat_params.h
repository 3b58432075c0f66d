#pragma once
// FlatParams: parameters gathered by (device, dtype) into one contiguous buffer each, every
// parameter an alias of its slice, and gradients in a matching flat buffer (every .grad an alias: made with
// set_, not an autograd view, so that optimizers' zero_grad, which detaches in place, works on them). Unscale,
// the overflow check, the norm and an optimizer step can then run once per buffer, and a ZeRO shard is a
// slice [rank * S, (rank + 1) * S) of it.

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

namespace gpuops {

struct FlatParamsOptions {
  int64_t alignment_bytes = 16;  ///< every parameter starts at a multiple of this (a power of two in [element size, 4096])
  int64_t world_size = 1;        ///< each buffer's length is padded to a multiple of world_size * alignment; [1, 2^20]
};

class FlatParams {
 public:
  /// Where one parameter lives in its bucket.
  struct Slot {
    at::Tensor param;
    int64_t offset = 0;  ///< in elements
    int64_t numel = 0;
  };
  struct Bucket {
    c10::Device device = c10::Device(c10::kCPU);
    at::ScalarType dtype = at::kFloat;
    at::Tensor data;  ///< the parameters' values, padding zero
    at::Tensor grad;  ///< the gradients, padding zero
    std::vector<Slot> slots;
  };

  /// Moves every parameter's values into its bucket and makes it a view of it (the parameter objects, their
  /// autograd identity and their order in optimizers stay the same); existing gradients are copied into
  /// the flat gradient buffer, missing ones start at zero. c10::ValueError, with nothing changed, for: an
  /// empty list, a parameter given twice, one that is not a leaf requiring grad, sparse, or not contiguous,
  /// a .grad that is not a dense tensor of its parameter's shape, dtype and device, or bad options.
  explicit FlatParams(const std::vector<at::Tensor>& params, FlatParamsOptions options = {});
  /// The constructor's checks alone (c10::ValueError), changing nothing: for callers that build several
  /// FlatParams from one list and must refuse it before the first one changes a parameter.
  static void check(const std::vector<at::Tensor>& params, const FlatParamsOptions& options = {});

  const std::vector<Bucket>& buckets() const { return buckets_; }

  /// One leaf tensor per bucket, aliasing the whole buffer, with the flat gradient as its .grad: hand these
  /// to an optimizer and it steps once per buffer, with its state flat as well (every parameter then shares
  /// the group options; padding stays zero). The parameters see every update (same storage).
  std::vector<at::Tensor> flat_parameters() const;

  /// Zeroes the flat gradient buffers and points every .grad back at its view (an optimizer's
  /// zero_grad(set_to_none=True) drops the views; the next backward would then allocate new gradients).
  void zero_grad();
  /// Frees the flat gradient buffers (every parameter's .grad becomes undefined, a bucket's `grad` an undefined
  /// tensor): ZeRO stage 2 keeps only its reduced shard. zero_grad() allocates them again.
  void release_grads();
  /// Puts back into the buffers the parameters that something pointed at other storage (torch's C++
  /// Module::load and InputArchive::read set_ the loaded tensor into a parameter): their values are copied
  /// into their slots and they become views again. c10::ValueError, with nothing changed, when such a parameter
  /// changed shape, dtype or device. Returns how many were put back.
  int64_t reattach();
  /// Whether every parameter is still a view of its buffer (reattach() would copy nothing).
  bool attached() const;
  /// Makes slot `slot` of bucket `bucket`'s parameter's .grad a view of the bucket's gradient buffer again,
  /// keeping its values: when the buffer was released (release_grads) it is allocated, zeroed, and every
  /// parameter of the bucket gets its view. For a reduction from autograd hooks, where autograd made the
  /// gradient of a parameter whose .grad was undefined.
  void adopt_grad(size_t bucket, size_t slot);
  /// Makes `data` (same length and dtype, any device; its values are not read) bucket `bucket`'s buffer: gradients
  /// allocated from now on follow it. The parameters are not touched (ZeRO stage 3 re-points them itself).
  void rebind_data(size_t bucket, const at::Tensor& data);
  /// Allocates bucket `bucket`'s gradient buffer, zeroed, when it has none, without giving the parameters views
  /// (ZeRO stage 3: they may be placeholders of another shape).
  void allocate_grad(size_t bucket);
  /// Whether every parameter's .grad and data are still the views of the buffers.
  bool intact() const;
  /// The rank-th of world_size equal slices of a bucket's `data` or `grad` buffer (ZeRO's shard).
  static at::Tensor shard(const at::Tensor& flat, int64_t rank, int64_t world_size);

 private:
  std::vector<Bucket> buckets_;
};

}  // namespace gpuops
