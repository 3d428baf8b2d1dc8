// The triad probe computes what it claims, with and without a pool, at the tails.
#include <gtest/gtest.h>

#include <vector>

#include "ops/cpu/Bandwidth.h"
#include "ops/cpu/ThreadPool.h"

namespace superchip::ops {
namespace {

TEST(Bandwidth, TriadMatchesLoopAtAllSizes) {
  ThreadPool pool(2);
  for (int64_t n : {0, 1, 15, 16, 17, (1 << 14) - 1, (1 << 14) + 1, 3 * (1 << 14) + 5}) {
    for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
      std::vector<float> a(n + 1, -1.0f), b(n), expect(n);
      for (int64_t i = 0; i < n; ++i) {
        a[i] = 0.5f * static_cast<float>(i);
        b[i] = static_cast<float>(i % 7) - 3.0f;
        expect[i] = a[i] + 2.0f * b[i];
      }
      stream_triad_inplace(a.data(), b.data(), 2.0f, n, p);
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(a[i], expect[i]) << "n=" << n << " i=" << i;
      EXPECT_EQ(a[n], -1.0f) << "wrote past the end, n=" << n;
    }
  }
}

TEST(Bandwidth, AdamTrafficFloorTouchesEveryElement) {
  ThreadPool pool(2);
  for (int64_t n : {0, 1, 17, (1 << 14) + 3, 2 * (1 << 14)}) {
    std::vector<float> p(n + 1, 1.0f), g(n, 2.0f), m(n + 1, 0.0f), v(n + 1, 5.0f);
    adam_traffic_floor(p.data(), g.data(), m.data(), v.data(), n, &pool);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(p[i], 1.0f + 1e-3f * 2.0f);
      ASSERT_EQ(m[i], 2.0f);
      ASSERT_EQ(v[i], 7.0f);
    }
    EXPECT_EQ(p[n], 1.0f);
    EXPECT_EQ(m[n], 0.0f);
    EXPECT_EQ(v[n], 5.0f);
  }
}

}  // namespace
}  // namespace superchip::ops
