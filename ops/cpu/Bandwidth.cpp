#include "ops/cpu/Bandwidth.h"

#include "ops/cpu/ThreadPool.h"

namespace superchip::ops {
namespace {

// The plain loop: the compiler vectorises it, and at these sizes memory is the limit.
void triad_range(float* a, const float* b, float s, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) a[i] = a[i] + s * b[i];
}

}  // namespace

void stream_triad_inplace(float* a, const float* b, float s, int64_t n, ThreadPool* pool) {
  if (n <= 0) return;
  if (pool == nullptr) {
    triad_range(a, b, s, 0, n);
    return;
  }
  // 16K floats = 64 KiB per item: page-sized, cache-line aligned split points.
  constexpr int64_t kItem = 1 << 14;
  const int64_t items = (n + kItem - 1) / kItem;
  pool->parallel_for(items, 1, [&](int64_t lo, int64_t hi) {
    triad_range(a, b, s, lo * kItem, hi * kItem < n ? hi * kItem : n);
  });
}

}  // namespace superchip::ops
