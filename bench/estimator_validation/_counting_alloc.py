"""A tiny counting CPU allocator (built with torch.utils.cpp_extension.load_inline) used to cross-check the
profiler meter. It stands in for gpuops.memory_budget until that is built: it counts exactly the bytes
requested from c10's CPU allocator (size of each allocate(n) call), with current/peak counters."""
import os
import torch
from torch.utils.cpp_extension import load_inline

_SRC = r"""
#include <torch/extension.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <mutex>
#include <unordered_map>
#include <vector>
#include <algorithm>

namespace {
void counting_delete(void* ptr);
struct Rec { c10::DataPtr inner; int64_t bytes; };
class CountingAllocator final : public c10::Allocator {
 public:
  c10::Allocator* underlying = nullptr;
  std::mutex mu;
  std::unordered_map<void*, Rec> recs;
  int64_t current = 0, peak = 0, nalloc = 0;
  bool active = false;
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = underlying->allocate(n);
    if (n == 0) return inner;
    void* data = inner.get();
    c10::Device dev = inner.device();
    std::lock_guard<std::mutex> g(mu);
    current += (int64_t)n; peak = std::max(peak, current); ++nalloc;
    recs.emplace(data, Rec{std::move(inner), (int64_t)n});
    return {data, data, &counting_delete, dev};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counting_delete; }
  void copy_data(void* d, const void* s, std::size_t c) const override { default_copy_data(d, s, c); }
  void release(void* p) {
    c10::DataPtr inner;
    { std::lock_guard<std::mutex> g(mu);
      auto it = recs.find(p);
      TORCH_INTERNAL_ASSERT(it != recs.end(), "unknown pointer");
      current -= it->second.bytes; inner = std::move(it->second.inner); recs.erase(it); }
  }
};
CountingAllocator* g = new CountingAllocator();
void counting_delete(void* p) { g->release(p); }
}

void install() {
  c10::Allocator* cur = c10::GetAllocator(c10::kCPU);
  if (cur != g) { g->underlying = cur; c10::SetAllocator(c10::kCPU, g); }
  TORCH_CHECK(c10::GetAllocator(c10::kCPU) == g, "could not install");
}
void uninstall() { if (c10::GetAllocator(c10::kCPU) == g) c10::SetAllocator(c10::kCPU, g->underlying); }
int64_t current() { std::lock_guard<std::mutex> l(g->mu); return g->current; }
int64_t peak() { std::lock_guard<std::mutex> l(g->mu); return g->peak; }
int64_t nalloc() { std::lock_guard<std::mutex> l(g->mu); return g->nalloc; }
void reset_peak() { std::lock_guard<std::mutex> l(g->mu); g->peak = g->current; }
"""

_mod = None


def get():
    global _mod
    if _mod is None:
        _mod = load_inline(
            name="est_counting_alloc",
            cpp_sources=_SRC,
            functions=["install", "uninstall", "current", "peak", "nalloc", "reset_peak"],
            build_directory=_build_dir(),
            extra_cflags=["-O1"],
            verbose=False,
        )
    return _mod


def _build_dir():
    d = os.path.join("/tmp", "est_counting_alloc_build")
    os.makedirs(d, exist_ok=True)
    return d
