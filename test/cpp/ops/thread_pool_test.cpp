// ThreadPool: every index exactly once, chunk bounds, exceptions reach the caller, nesting and
// concurrent callers do not deadlock, pinning.
#include "ops/cpu/ThreadPool.h"

#include <sched.h>

#include <atomic>
#include <mutex>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <vector>

#include "ops_test_util.h"

namespace superchip::ops::test {
namespace {

TEST(ThreadPool, CoversRangeExactlyOnce) {
  for (int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.num_threads(), threads);
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{64}, int64_t{1000}, int64_t{100003}}) {
      for (int64_t grain : {int64_t{1}, int64_t{3}, int64_t{100}, int64_t{1} << 20}) {
        SCOPED_TRACE("threads=" + std::to_string(threads) + " n=" + std::to_string(n) +
                     " grain=" + std::to_string(grain));
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        std::mutex mu;
        std::vector<std::pair<int64_t, int64_t>> chunks;
        pool.parallel_for(n, grain, [&](int64_t b, int64_t e) {
          {
            std::lock_guard<std::mutex> lock(mu);
            chunks.emplace_back(b, e);
          }
          for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)].fetch_add(1);
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 1) << i;
        if (n == 0) {
          EXPECT_TRUE(chunks.empty());
          continue;
        }
        EXPECT_LE(static_cast<int>(chunks.size()), threads);
        for (const auto& [b, e] : chunks) {
          EXPECT_LT(b, e);
          if (chunks.size() > 1) {
            EXPECT_GE(e - b, grain);
          }
        }
      }
    }
  }
}

TEST(ThreadPool, ChunksRunOnWorkersWhenSplit) {
  ThreadPool pool(2);
  std::mutex mu;
  std::vector<std::thread::id> ids;
  pool.parallel_for(1000, 10, [&](int64_t, int64_t) {
    std::lock_guard<std::mutex> lock(mu);
    ids.push_back(std::this_thread::get_id());
  });
  ASSERT_EQ(ids.size(), 2u);
  for (auto id : ids) EXPECT_NE(id, std::this_thread::get_id());
}

TEST(ThreadPool, ExceptionPropagatesAndPoolStaysUsable) {
  ThreadPool pool(3);
  EXPECT_THROW(
      pool.parallel_for(3000, 100,
                        [](int64_t b, int64_t e) {
                          if (b <= 1500 && 1500 < e) throw std::runtime_error("boom at 1500");
                        }),
      std::runtime_error);
  try {
    pool.parallel_for(3000, 100, [](int64_t b, int64_t) {
      if (b == 0) throw std::out_of_range("first chunk");
    });
    ADD_FAILURE() << "no exception";
  } catch (const std::out_of_range& e) {
    EXPECT_STREQ(e.what(), "first chunk");
  }
  // Inline (single chunk) calls propagate too.
  EXPECT_THROW(pool.parallel_for(5, 100, [](int64_t, int64_t) { throw std::logic_error("x"); }),
               std::logic_error);
  std::atomic<int64_t> sum{0};
  pool.parallel_for(3000, 100, [&](int64_t b, int64_t e) { sum += e - b; });
  EXPECT_EQ(sum.load(), 3000);
}

TEST(ThreadPool, NestedCallRunsInline) {
  ThreadPool pool(2);
  std::atomic<int64_t> sum{0};
  pool.parallel_for(100, 10, [&](int64_t b, int64_t e) {
    pool.parallel_for(e - b, 1, [&](int64_t ib, int64_t ie) { sum += ie - ib; });
  });
  EXPECT_EQ(sum.load(), 100);
}

TEST(ThreadPool, ConcurrentCallersAreSerialised) {
  ThreadPool pool(2);
  std::atomic<int64_t> sum{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int r = 0; r < 50; ++r) {
        pool.parallel_for(1000, 10, [&](int64_t b, int64_t e) { sum += e - b; });
      }
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(sum.load(), 4 * 50 * 1000);
}

TEST(ThreadPool, PinsWorkersToTheGivenCpus) {
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof allowed, &allowed), 0);
  int cpu = -1;
  for (int i = 0; i < CPU_SETSIZE; ++i) {
    if (CPU_ISSET(i, &allowed)) {
      cpu = i;
      break;
    }
  }
  ASSERT_GE(cpu, 0);
  ThreadPool pool(2, {cpu});
  std::mutex mu;
  std::vector<int> counts;
  pool.parallel_for(1000, 10, [&](int64_t, int64_t) {
    cpu_set_t mine;
    CPU_ZERO(&mine);
    sched_getaffinity(0, sizeof mine, &mine);
    std::lock_guard<std::mutex> lock(mu);
    counts.push_back(CPU_COUNT(&mine) == 1 && CPU_ISSET(cpu, &mine) ? 1 : 0);
  });
  ASSERT_EQ(counts.size(), 2u);
  EXPECT_EQ(counts[0] + counts[1], 2) << "workers not pinned to cpu " << cpu;
}

TEST(ThreadPool, BadArgumentsThrow) {
  EXPECT_THROW(ThreadPool(0), std::invalid_argument);
  EXPECT_THROW(ThreadPool(1, {-1}), std::invalid_argument);
  EXPECT_THROW(ThreadPool(1, {CPU_SETSIZE - 1}), std::system_error);  // no such CPU here
  ThreadPool pool(1);
  EXPECT_THROW(pool.parallel_for(-1, 1, [](int64_t, int64_t) {}), std::invalid_argument);
  EXPECT_THROW(pool.parallel_for(10, 0, [](int64_t, int64_t) {}), std::invalid_argument);
}

}  // namespace
}  // namespace superchip::ops::test
