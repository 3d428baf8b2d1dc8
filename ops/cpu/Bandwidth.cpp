#include "ops/cpu/Bandwidth.h"

#include "ops/cpu/ThreadPool.h"

namespace superchip::ops {
namespace {

// The plain loop: the compiler vectorises it, and at these sizes memory is the limit.
void triad_range(float* a, const float* b, float s, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) a[i] = a[i] + s * b[i];
}

void traffic_range(float* p, const float* g, float* m, float* v, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float gi = g[i];
    p[i] = p[i] + 1e-3f * gi;
    m[i] = m[i] + gi;
    v[i] = v[i] + gi;
  }
}

// 16K floats = 64 KiB per item: page-sized, cache-line aligned split points.
constexpr int64_t kItem = 1 << 14;

template <typename Fn>
void split(int64_t n, ThreadPool* pool, const Fn& fn) {
  if (n <= 0) return;
  if (pool == nullptr) {
    fn(0, n);
    return;
  }
  const int64_t items = (n + kItem - 1) / kItem;
  pool->parallel_for(items, 1, [&](int64_t lo, int64_t hi) {
    fn(lo * kItem, hi * kItem < n ? hi * kItem : n);
  });
}

}  // namespace

void adam_traffic_floor(float* p, const float* g, float* m, float* v, int64_t n, ThreadPool* pool) {
  split(n, pool, [&](int64_t b, int64_t e) { traffic_range(p, g, m, v, b, e); });
}

void stream_triad_inplace(float* a, const float* b, float s, int64_t n, ThreadPool* pool) {
  split(n, pool, [&](int64_t lo, int64_t hi) { triad_range(a, b, s, lo, hi); });
}

}  // namespace superchip::ops
