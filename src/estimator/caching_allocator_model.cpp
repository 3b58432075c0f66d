// The caching allocator's rules replayed on requests (see caching_allocator_model.h for the rules and
// where they come from).
#include "gpuops/estimator/caching_allocator_model.h"

#include <algorithm>
#include <iterator>
#include <limits>

#include "gpuops/estimator/checked_int.h"

namespace gpuops::estimator {
namespace {

constexpr int64_t MiB = int64_t{1} << 20;
constexpr int64_t kMinBlockSize = 512;       // every request is rounded to a multiple of this
constexpr int64_t kSmallSize = 1 * MiB;      // largest request of the small pool
constexpr int64_t kSmallBuffer = 2 * MiB;    // segment of the small pool
constexpr int64_t kMinLargeAlloc = 10 * MiB; // below this, large requests share 20 MiB segments
constexpr int64_t kLargeBuffer = 20 * MiB;
constexpr int64_t kRoundLarge = 2 * MiB;     // larger segments are rounded to this
// Expandable segments grow by pages of the pool's segment size (c10: kSmallBuffer for the small pool,
// kLargeBuffer for the large one).
int64_t expandable_page(bool small) { return small ? kSmallBuffer : kLargeBuffer; }

int64_t round_up(int64_t v, int64_t to) { return ceil_div(v, to) * to; }

}  // namespace

int64_t allocator_round_size(int64_t bytes) { return bytes < kMinBlockSize ? kMinBlockSize : round_up(bytes, kMinBlockSize); }

int64_t allocator_segment_size(int64_t rounded) {
  if (rounded <= kSmallSize) return kSmallBuffer;
  if (rounded < kMinLargeAlloc) return kLargeBuffer;
  return round_up(rounded, kRoundLarge);
}

int64_t CachingAllocatorModel::new_block(const Block& b) {
  const int64_t id = next_id_++;
  blocks_[id] = b;
  by_position_[{b.segment, b.offset}] = id;
  if (b.free) (b.small ? free_small_ : free_large_).insert(key_of(b, id));
  return id;
}

int64_t CachingAllocatorModel::take(int64_t id, int64_t size) {
  Block& b = blocks_.at(id);
  (b.small ? free_small_ : free_large_).erase(key_of(b, id));
  b.free = false;
  const int64_t rest = b.size - size;
  const bool split = b.small || mode_ == AllocatorMode::ExpandableSegments ? rest >= kMinBlockSize : rest > kSmallSize;
  if (split) {
    Block tail{b.segment, b.offset + size, rest, 0, b.small, true, b.stream};
    b.size = size;
    new_block(tail);
  }
  return id;
}

int64_t CachingAllocatorModel::grow_expandable(bool small, int64_t size, int stream) {
  const auto found = expandable_segment_.find({stream, small});
  const int64_t segment = found != expandable_segment_.end() ? found->second : next_segment_++;
  if (found == expandable_segment_.end()) {
    expandable_segment_[{stream, small}] = segment;
    segment_size_[segment] = 0;
  }
  const int64_t end = segment_size_[segment];
  // The segment's last block, if it is free, is extended rather than left behind.
  int64_t last = -1;
  auto it = by_position_.lower_bound({segment + 1, std::numeric_limits<int64_t>::min()});
  if (it != by_position_.begin() && std::prev(it)->first.first == segment) last = std::prev(it)->second;
  const bool tail_free = last >= 0 && blocks_.at(last).free;
  const int64_t have = tail_free ? blocks_.at(last).size : 0;
  const int64_t grow = round_up(size - have, expandable_page(small));
  segment_size_[segment] = end + grow;
  reserved_ = (CheckedInt(reserved_) + grow).get();
  if (tail_free) {
    Block& b = blocks_.at(last);
    (b.small ? free_small_ : free_large_).erase(key_of(b, last));
    b.size += grow;
    (b.small ? free_small_ : free_large_).insert(key_of(b, last));
    return last;
  }
  return new_block(Block{segment, end, grow, 0, small, true, stream});
}

int64_t CachingAllocatorModel::malloc(int64_t bytes, int stream) {
  const int64_t size = allocator_round_size(bytes);
  const bool small = size <= kSmallSize;
  std::set<FreeKey>& pool = small ? free_small_ : free_large_;
  int64_t id = -1;
  const auto fit = pool.lower_bound({stream, size, std::numeric_limits<int64_t>::min()});
  if (fit != pool.end() && std::get<0>(*fit) == stream) {
    id = std::get<2>(*fit);
  } else if (mode_ == AllocatorMode::ExpandableSegments) {
    id = grow_expandable(small, size, stream);
  } else {
    const int64_t segment = next_segment_++;
    const int64_t segment_bytes = allocator_segment_size(size);
    segment_size_[segment] = segment_bytes;
    reserved_ = (CheckedInt(reserved_) + segment_bytes).get();
    id = new_block(Block{segment, 0, segment_bytes, 0, small, true, stream});
  }
  take(id, size);
  blocks_.at(id).requested = bytes;
  requested_ = (CheckedInt(requested_) + bytes).get();
  allocated_ = (CheckedInt(allocated_) + blocks_.at(id).size).get();
  peak_reserved_ = std::max(peak_reserved_, reserved_);
  peak_allocated_ = std::max(peak_allocated_, allocated_);
  peak_requested_ = std::max(peak_requested_, requested_);
  return id;
}

void CachingAllocatorModel::mark_free(int64_t id) {
  Block& b = blocks_.at(id);
  b.free = true;
  (b.small ? free_small_ : free_large_).insert(key_of(b, id));
}

void CachingAllocatorModel::free(int64_t handle) {
  Block& b = blocks_.at(handle);
  requested_ -= b.requested;
  allocated_ -= b.size;
  b.requested = 0;
  int64_t id = handle;
  // Merge with the free block just before it in the same segment.
  auto here = by_position_.find({b.segment, b.offset});
  if (here != by_position_.begin()) {
    const auto before = std::prev(here);
    Block& prev = blocks_.at(before->second);
    if (before->first.first == b.segment && prev.free && prev.offset + prev.size == b.offset) {
      (prev.small ? free_small_ : free_large_).erase(key_of(prev, before->second));
      prev.size += b.size;
      by_position_.erase(here);
      blocks_.erase(handle);
      id = before->second;
      prev.free = false;  // re-inserted below
    }
  }
  // Merge with the free block just after it.
  Block& merged = blocks_.at(id);
  const auto after = by_position_.find({merged.segment, merged.offset + merged.size});
  if (after != by_position_.end() && blocks_.at(after->second).free) {
    Block& next = blocks_.at(after->second);
    (next.small ? free_small_ : free_large_).erase(key_of(next, after->second));
    merged.size += next.size;
    blocks_.erase(after->second);
    by_position_.erase(after);
  }
  mark_free(id);
}

}  // namespace gpuops::estimator
