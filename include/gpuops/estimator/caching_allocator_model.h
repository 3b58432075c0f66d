#pragma once
// A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp), replayed over the
// allocation trace of a training step to find the reserved peak: what the allocator holds in segments,
// as opposed to what tensors occupy. Torch-free; the rules and constants are c10's (docs/estimator.md,
// "Three figures", cites them):
//  - every request is rounded up to 512 bytes (kMinBlockSize);
//  - requests up to 1 MiB (kSmallSize) come from the small pool, whose segments are 2 MiB (kSmallBuffer);
//    larger ones from the large pool: 20 MiB segments (kLargeBuffer) below 10 MiB (kMinLargeAlloc), else a
//    segment of the request rounded up to 2 MiB (kRoundLarge);
//  - a request takes the smallest cached free block of its pool that is large enough (best fit), split when
//    the rest is at least 512 bytes (small pool, or expandable segments) or more than 1 MiB (large pool); a
//    block not split is handed out whole and counted whole by max_memory_allocated; freed blocks merge with
//    free neighbours of the same segment; segments are never given back (no empty_cache, no OOM retry);
//  - expandable_segments: one segment per pool (and stream) that grows in pages of the pool's segment size (2 MiB small,
//    20 MiB large), a request at its end reusing the free tail;
//  - every block belongs to the stream it was allocated on, and a request reuses only cached blocks of its own
//    stream (c10's BlockPool orders by stream first; get_free_block requires the same stream): what one stream
//    freed is reserved but unusable by another.

#include <cstdint>
#include <map>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

namespace gpuops::estimator {

/// PYTORCH_CUDA_ALLOC_CONF's expandable_segments: off (torch's default) or on.
enum class AllocatorMode { Default, ExpandableSegments };

/// Replays malloc/free requests with the caching allocator's rules; tracks reserved and requested bytes.
class CachingAllocatorModel {
 public:
  explicit CachingAllocatorModel(AllocatorMode mode = AllocatorMode::Default) : mode_(mode) {}

  /// Allocates `bytes` (> 0) on `stream` (0: the default stream; any other id a side stream) and returns a
  /// handle for free().
  int64_t malloc(int64_t bytes, int stream = 0);
  /// Frees a handle returned by malloc (each once).
  void free(int64_t handle);

  int64_t reserved() const { return reserved_; }            ///< bytes held in segments now
  int64_t peak_reserved() const { return peak_reserved_; }  ///< torch.cuda.max_memory_reserved
  int64_t allocated() const { return allocated_; }          ///< bytes of the blocks handed out now
  int64_t peak_allocated() const { return peak_allocated_; }  ///< torch.cuda.max_memory_allocated
  int64_t requested() const { return requested_; }          ///< bytes the live requests asked for
  int64_t peak_requested() const { return peak_requested_; }
  /// Forgets the peaks (torch.cuda.reset_peak_memory_stats): they restart from the current values.
  void reset_peaks() { peak_reserved_ = reserved_, peak_allocated_ = allocated_, peak_requested_ = requested_; }

 private:
  struct Block {
    int64_t segment = 0, offset = 0, size = 0, requested = 0;
    bool small = false, free = true;
    int stream = 0;
  };
  using FreeKey = std::tuple<int, int64_t, int64_t>;  // (stream, size, block id): best fit is lower_bound
  static FreeKey key_of(const Block& b, int64_t id) { return {b.stream, b.size, id}; }

  int64_t new_block(const Block& b);
  int64_t take(int64_t id, int64_t size);     // splits `id` to `size` when the rule says so; returns its id
  int64_t grow_expandable(bool small, int64_t size, int stream);
  void mark_free(int64_t id);

  AllocatorMode mode_;
  std::map<int64_t, Block> blocks_;                 // id -> block
  std::map<std::pair<int64_t, int64_t>, int64_t> by_position_;  // (segment, offset) -> id
  std::set<FreeKey> free_small_, free_large_;
  std::map<int64_t, int64_t> segment_size_;         // segment -> bytes
  std::map<std::pair<int, bool>, int64_t> expandable_segment_;  // (stream, small) -> segment in expandable mode
  int64_t next_id_ = 0, next_segment_ = 0;
  int64_t reserved_ = 0, peak_reserved_ = 0, allocated_ = 0, peak_allocated_ = 0, requested_ = 0, peak_requested_ = 0;
};

/// c10's rounding of a request: up to a multiple of 512 bytes (512 at least).
int64_t allocator_round_size(int64_t bytes);

/// The size of the segment c10 allocates for a (rounded) request that no cached block can serve.
int64_t allocator_segment_size(int64_t rounded);

}  // namespace gpuops::estimator
