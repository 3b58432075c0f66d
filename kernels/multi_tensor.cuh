#pragma once
// Multi-tensor launches (after apex's multi_tensor_apply): one kernel launch covers many
// tensors. The host packs up to kMaxTensors tensors (each a tuple of Depth pointers: grad, param,
// states...) and up to kMaxBlocks chunks into a table passed by value; each block handles one chunk,
// kIlp elements per thread per round (Lanes).
#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "gpuops/cuda_check.h"

namespace gpuops::kernels {

inline constexpr int64_t kChunk = 1 << 16;
inline constexpr int kThreads = 512;
/// Elements per thread per round: every load of a round is issued before any is used, so that enough memory
/// requests are in flight to reach the device's bandwidth (one element per thread reached 59% of a copy's on
/// an H200; torch's multi-tensor kernels use 4 too).
inline constexpr int kIlp = 4;

template <int Depth>
struct TensorTable {
  static constexpr int kMaxTensors = Depth <= 2 ? 48 : 24;  // keeps the table well under 4 KiB
  static constexpr int kMaxBlocks = 320;
  void* data[Depth][kMaxTensors];
  int64_t numel[kMaxTensors];
  int32_t extra[kMaxTensors];  ///< per-tensor index the op may use (e.g. into a list of step counters)
  unsigned char tensor_of_block[kMaxBlocks];
  int32_t chunk_of_block[kMaxBlocks];
};

/// Element range [begin, end) of this block's chunk, and its tensor index in the table.
template <int Depth>
__device__ __forceinline__ int chunk_range(const TensorTable<Depth>& table, int64_t& begin, int64_t& end) {
  const int tensor = table.tensor_of_block[blockIdx.x];
  begin = static_cast<int64_t>(table.chunk_of_block[blockIdx.x]) * kChunk;
  end = min(begin + kChunk, table.numel[tensor]);
  return tensor;
}

/// kIlp values of one array, aligned so that a packed round moves them with one vector load or store.
template <typename T>
struct alignas(sizeof(T) * kIlp) Pack {
  T v[kIlp];
};

/// True when every array is aligned for Pack and the tensor's length is a multiple of kIlp: then each thread's
/// lanes are contiguous (vector loads), else strided by the block (scalar loads).
template <typename... T>
__device__ __forceinline__ bool packable(int64_t numel, const T*... arrays) {
  return numel % kIlp == 0 && ((reinterpret_cast<uintptr_t>(arrays) % sizeof(Pack<T>) == 0) && ...);
}

/// This thread's kIlp elements in one round of a chunk. Lanes past the chunk's end load as zero and are not
/// stored, so reductions need no mask (zero is finite and adds nothing).
struct Lanes {
  int64_t base, end;
  bool packed;

  __device__ __forceinline__ int64_t index(int lane) const {
    return packed ? base + int64_t{threadIdx.x} * kIlp + lane : base + threadIdx.x + int64_t{lane} * blockDim.x;
  }
  template <typename T>
  __device__ __forceinline__ Pack<T> load(const T* array) const {
    Pack<T> r{};
    if (packed) {
      if (index(0) < end) r = *reinterpret_cast<const Pack<T>*>(array + index(0));
    } else {
#pragma unroll
      for (int lane = 0; lane < kIlp; ++lane) {
        if (index(lane) < end) r.v[lane] = array[index(lane)];
      }
    }
    return r;
  }
  template <typename T>
  __device__ __forceinline__ void store(T* array, const Pack<T>& r) const {
    if (packed) {
      if (index(0) < end) *reinterpret_cast<Pack<T>*>(array + index(0)) = r;
    } else {
#pragma unroll
      for (int lane = 0; lane < kIlp; ++lane) {
        if (index(lane) < end) array[index(lane)] = r.v[lane];
      }
    }
  }
};

/// Calls body(lanes) for every round of the chunk [begin, end); `packed` as packable() says.
template <typename Body>
__device__ __forceinline__ void for_each_round(int64_t begin, int64_t end, bool packed, Body&& body) {
  for (int64_t base = begin; base < end; base += int64_t{blockDim.x} * kIlp) body(Lanes{base, end, packed});
}

/// Packs `lists` (Depth lists of equally long pointer vectors) and calls launch(table, blocks) per full table.
template <int Depth, typename Launch>
void for_each_table(const std::vector<void*> (&lists)[Depth], const std::vector<int64_t>& numel, Launch&& launch) {
  using Table = TensorTable<Depth>;
  Table table{};
  int tensors = 0, blocks = 0;
  auto put = [&](size_t t, int slot) {
    for (int d = 0; d < Depth; ++d) table.data[d][slot] = lists[d][t];
    table.numel[slot] = numel[t];
    table.extra[slot] = static_cast<int32_t>(t);
  };
  auto flush = [&] {
    if (blocks > 0) launch(table, blocks);
    tensors = 0;
    blocks = 0;
  };
  for (size_t t = 0; t < numel.size(); ++t) {
    if (numel[t] == 0) continue;
    if (tensors == Table::kMaxTensors) flush();
    put(t, tensors);
    const int64_t chunks = (numel[t] + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      if (blocks == Table::kMaxBlocks) {  // the tensor goes on in the next launch, as its entry 0
        flush();
        put(t, 0);
      }
      table.tensor_of_block[blocks] = static_cast<unsigned char>(tensors);
      table.chunk_of_block[blocks] = static_cast<int32_t>(c);
      ++blocks;
    }
    ++tensors;
  }
  flush();
}

}  // namespace gpuops::kernels
