// OffloadEngine under concurrency (run under ThreadSanitizer by `scripts/test.sh tsan`):
// several submitting threads, readers that must see a job's writes complete once
// wait_for_storage() returns, speculation holds turned into rollbacks by a reader, exceptions
// reaching wait(), and finished jobs released from many threads at once. The jobs write plain
// (non-atomic) bytes on the worker: every ordering the engine promises is a happens-before
// edge ThreadSanitizer checks.
#include <gtest/gtest.h>

#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include "backend/engine/OffloadEngine.h"

namespace superchip {
namespace {

constexpr size_t kBytes = 1 << 16;

c10::intrusive_ptr<c10::StorageImpl> make_storage() {
  return c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), kBytes,
                                               c10::GetCPUAllocator()->allocate(kBytes),
                                               c10::GetCPUAllocator(), /*resizable=*/false);
}

uint8_t* bytes(const c10::intrusive_ptr<c10::StorageImpl>& s) {
  return static_cast<uint8_t*>(s->mutable_data());
}

// A job that fills the storage with `value` (slowly enough that readers race it).
EngineJob fill_job(const c10::intrusive_ptr<c10::StorageImpl>& s, uint8_t value, int64_t owner) {
  EngineJob job;
  job.name = "superchip::test_fill";
  job.owner = owner;
  job.touched = {s};
  uint8_t* p = bytes(s);
  job.run = [p, value] {
    for (size_t i = 0; i < kBytes; ++i) p[i] = static_cast<uint8_t>(value + (i & 1));
  };
  return job;
}

void expect_filled(const uint8_t* p, uint8_t value) {
  for (size_t i = 0; i < kBytes; ++i) {
    ASSERT_EQ(p[i], static_cast<uint8_t>(value + (i & 1))) << "byte " << i;
  }
}

TEST(OffloadEngine, ReadersSeeCompleteJobsFromManySubmitters) {
  OffloadEngine& e = OffloadEngine::get();
  constexpr int kThreads = 4, kRounds = 20;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&e, t] {
      auto s = make_storage();
      for (int r = 0; r < kRounds; ++r) {
        const uint8_t v = static_cast<uint8_t>(t * 40 + r);
        e.submit(fill_job(s, v, 100 + t));
        e.wait_for_storage(s.get());  // what every operator on s does first
        expect_filled(bytes(s), v);
      }
    });
  }
  for (auto& th : threads) th.join();
  e.synchronize();
  for (int t = 0; t < kThreads; ++t) EXPECT_GT(e.stats(100 + t).optimizer_seconds, 0.0);
}

TEST(OffloadEngine, WaitCoversEveryEarlierTicket) {
  OffloadEngine& e = OffloadEngine::get();
  std::vector<c10::intrusive_ptr<c10::StorageImpl>> storages;
  for (int i = 0; i < 8; ++i) storages.push_back(make_storage());
  uint64_t last = 0;
  for (int i = 0; i < 8; ++i) last = e.submit(fill_job(storages[i], static_cast<uint8_t>(i), 7));
  std::thread other([&] { e.wait(last, 7); });
  e.wait(last, 7);
  other.join();
  for (int i = 0; i < 8; ++i) expect_filled(bytes(storages[i]), static_cast<uint8_t>(i));
}

// A job that runs until `open` is set: a wait for it surely waits.
EngineJob gated_job(const c10::intrusive_ptr<c10::StorageImpl>& s, std::atomic<bool>* open, int64_t owner) {
  EngineJob job;
  job.name = "superchip::test_gated";
  job.owner = owner;
  job.touched = {s};
  job.run = [open] {
    while (!open->load()) std::this_thread::yield();
  };
  return job;
}

TEST(OffloadEngine, SynchronizeChargesExposedTimeOnlyWhenAsked) {
  // offload_stats() synchronizes to report complete counters; its wait is not the training
  // loop's, so it must not count as exposed time (a loop logging the stats every step showed
  // its whole optimizer time as exposed).
  OffloadEngine& e = OffloadEngine::get();
  constexpr int64_t kOwner = 21;
  auto s = make_storage();
  for (bool charge : {false, true}) {
    std::atomic<bool> open{false};
    const double before = e.stats(kOwner).exposed_seconds;
    e.submit(gated_job(s, &open, kOwner));
    std::thread opener([&open] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      open.store(true);
    });
    e.synchronize(charge);
    opener.join();
    const double after = e.stats(kOwner).exposed_seconds;
    if (charge) {
      EXPECT_GT(after, before);
    } else {
      EXPECT_EQ(after, before);
    }
  }
}

class FillHold final : public SpeculationHold {
 public:
  FillHold(uint8_t* p, int64_t owner) : p_(p), owner_(owner) {}
  void rollback() override {
    rollbacks_.fetch_add(1);
    std::memset(p_, 0xEE, kBytes);
  }
  int64_t owner() const override { return owner_; }
  int rollbacks() const { return rollbacks_.load(); }

 private:
  uint8_t* p_;
  int64_t owner_;
  std::atomic<int> rollbacks_{0};
};

TEST(OffloadEngine, AReaderTurnsAHoldIntoOneRollback) {
  OffloadEngine& e = OffloadEngine::get();
  const int64_t rollbacks_before = e.stats(9).rollbacks_on_read;  // cumulative per owner
  auto s = make_storage();
  e.submit(fill_job(s, 1, 9));  // the "speculative step"
  auto hold = std::make_shared<FillHold>(bytes(s), 9);
  e.hold({s}, hold);
  std::vector<std::thread> readers;
  for (int r = 0; r < 3; ++r) {
    readers.emplace_back([&] {
      e.wait_for_storage(s.get());
      for (size_t i = 0; i < kBytes; ++i) ASSERT_EQ(bytes(s)[i], 0xEE);
    });
  }
  for (auto& th : readers) th.join();
  EXPECT_EQ(hold->rollbacks(), 1);
  EXPECT_EQ(e.stats(9).rollbacks_on_read - rollbacks_before, 1);
}

TEST(OffloadEngine, SubmitReplacingHoldRacesReaders) {
  OffloadEngine& e = OffloadEngine::get();
  for (int round = 0; round < 20; ++round) {
    auto s = make_storage();
    e.submit(fill_job(s, 3, 11));
    auto hold = std::make_shared<FillHold>(bytes(s), 11);
    e.hold({s}, hold);
    std::thread reader([&] { e.wait_for_storage(s.get()); });
    // The owner's validation: replaces the hold with a job over the same storage.
    e.submit_replacing_hold(fill_job(s, 5, 11), hold.get());
    reader.join();
    e.wait_for_storage(s.get());
    expect_filled(bytes(s), 5);  // the validation ran last, whatever the reader did
    EXPECT_LE(hold->rollbacks(), 1);
  }
}

TEST(OffloadEngine, AJobOverAnotherSpeculationsHoldRollsItBackFirst) {
  // Note [Holds of another speculation]: a second optimizer's job over storages the first one
  // holds speculatively runs after the first's rollback, not on top of its step; a hold's own
  // validation (submit_replacing_hold) does not roll it back.
  OffloadEngine& e = OffloadEngine::get();
  auto s = make_storage();
  e.submit(fill_job(s, 1, 12));  // owner 12's speculative step
  auto first = std::make_shared<FillHold>(bytes(s), 12);
  e.hold({s}, first);
  std::atomic<int> seen{-1};
  EngineJob other = fill_job(s, 7, 13);  // owner 13's step over the same storage
  uint8_t* p = bytes(s);
  auto fill = other.run;
  other.run = [p, fill, &seen] {
    seen.store(p[0]);
    fill();
  };
  e.submit(std::move(other));
  auto second = std::make_shared<FillHold>(bytes(s), 13);
  e.hold({s}, second);
  e.submit_replacing_hold(fill_job(s, 9, 13), second.get());  // owner 13's validation
  e.wait_for_storage(s.get());
  EXPECT_EQ(seen.load(), 0xEE);  // the first speculation was undone before the other step ran
  EXPECT_EQ(first->rollbacks(), 1);
  EXPECT_EQ(second->rollbacks(), 0);
  expect_filled(bytes(s), 9);
}

TEST(OffloadEngine, AJobsExceptionReachesTheNextWait) {
  OffloadEngine& e = OffloadEngine::get();
  e.synchronize();
  EngineJob job;
  job.owner = 13;
  job.run = [] { throw std::runtime_error("job failed on purpose"); };
  const uint64_t t = e.submit(std::move(job));
  EXPECT_THROW(e.wait(t, 13), std::runtime_error);
  e.synchronize();  // the error was consumed: the engine goes on
}

TEST(OffloadEngine, FailedTicketsAndErrorsAreKeptForTheirOwner) {
  // The optimizer restores the bookkeeping of a queued step that threw (Note [A job of the
  // asynchronous step that fails] in backend/python/EngineModule.cpp): it needs the tickets of
  // its own jobs that threw, each once, how far the queue has run, and its own error to raise;
  // another owner's error is neither dropped nor raised for it.
  OffloadEngine& e = OffloadEngine::get();
  e.synchronize();
  auto job = [](int64_t owner, bool fail, const char* what = "job failed on purpose") {
    EngineJob j;
    j.owner = owner;
    j.run = [fail, what] {
      if (fail) throw std::runtime_error(what);
    };
    return j;
  };
  e.submit(job(21, false));
  const uint64_t bad = e.submit(job(21, true, "21's"));
  e.submit(job(22, false));
  const uint64_t other = e.submit(job(22, true, "22's"));
  const uint64_t again = e.submit(job(21, true, "21's second"));
  const uint64_t last = e.submit(job(21, false));
  e.synchronize(/*charge_exposed=*/true, /*raise_errors=*/false);  // an owner's own wait
  const OffloadEngine::Failures mine = e.take_failures(21);
  EXPECT_EQ(mine.tickets, (std::vector<uint64_t>{bad, again}));
  EXPECT_GE(mine.done_upto, last);
  EXPECT_TRUE(e.take_failures(21).tickets.empty());  // taken once
  EXPECT_EQ(e.take_failures(22).tickets, std::vector<uint64_t>{other});
  // 22's error is taken by 22 only; 21's (its first) by a wait that raises errors.
  try {
    std::rethrow_exception(e.take_error(22));
  } catch (const std::runtime_error& err) {
    EXPECT_STREQ(err.what(), "22's");
  }
  EXPECT_EQ(e.take_error(22), nullptr);
  try {
    e.synchronize();
    ADD_FAILURE() << "21's error was not raised";
  } catch (const std::runtime_error& err) {
    EXPECT_STREQ(err.what(), "21's");
  }
  EXPECT_EQ(e.take_error(21), nullptr);  // raised once: not again
  EXPECT_NO_THROW(e.synchronize());
}

TEST(OffloadEngine, FinishedJobsReleasedFromManyThreads) {
  OffloadEngine& e = OffloadEngine::get();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&e, t] {
      for (int r = 0; r < 50; ++r) {
        auto s = make_storage();
        EngineJob job = fill_job(s, static_cast<uint8_t>(r), 20 + t);
        auto keep = std::make_shared<int>(r);  // released on a caller's thread
        job.run = [run = std::move(job.run), keep] { run(); };
        e.submit(std::move(job));
        e.release_finished();
      }
      e.synchronize();
    });
  }
  for (auto& th : threads) th.join();
  e.synchronize();
}

}  // namespace
}  // namespace superchip
