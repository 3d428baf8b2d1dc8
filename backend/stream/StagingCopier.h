// StagingCopier: the side stream that stages weights into hbm for WeightStreamer, and the
// ordering between its copies and the kernels that read them.
//  - Emulated (CPU executor): a thread runs the copies (started by the first one); a kernel
//    that reads a copy waits for it on the CPU.
//  - CUDA executor: a non-blocking copy stream of the device and events; the CPU never waits
//    (Note [Copy stream ordering] in StagingCopier.cpp).
// usable() is false where the copies cannot be ordered with the kernels (CUDA executor, a
// torch without c10::Stream::native_handle, a non-default current stream; with native_handle,
// any stream but the first that asked, since a block is reused once that one stream has passed
// its readers): the streamer then reads weights in place. Errors of the CUDA runtime throw std::runtime_error naming the call.
// Thread-safety: every member may be called from any thread.
#pragma once

#include <c10/core/Device.h>

#include <cstddef>
#include <memory>

namespace superchip {

class MemoryManager;

class StagingCopier {
 public:
  struct Ticket {  // one copy issued ahead of use
    virtual ~Ticket() = default;
  };

  virtual ~StagingCopier() = default;
  virtual bool usable() = 0;
  // Issues dst <- src (n bytes; dst a staging block of hbm, src host-tier bytes) on the side
  // stream, ordered after the work already enqueued on the current stream.
  virtual std::shared_ptr<Ticket> issue(void* dst, const void* src, size_t n) = 0;
  // Before a kernel reads the copy: the copy is complete for it. True when the CPU waited.
  virtual bool make_visible(Ticket& t) = 0;
  // A copy made at use, ordered before the next kernel on the current stream.
  virtual void copy_now(void* dst, const void* src, size_t n) = 0;
  // A staging block is about to be released (t: its copy if never made visible, or null):
  // whatever reuses the block next comes after the copy into it.
  virtual void before_release(Ticket* t) noexcept = 0;
  // Measured copy time and the bytes it covers (the link's staging rate is their ratio).
  virtual double seconds() = 0;
  virtual double measured_bytes() = 0;
  // "thread" or "cuda_stream".
  virtual const char* kind() const noexcept = 0;
  // fork() (Note [Fork] in register/Fork.cpp): prepare_fork() waits for the copies in flight
  // and keeps new ones out until after_fork(); a child's next copy starts a new thread.
  virtual void prepare_fork() {}
  virtual void after_fork(bool /*child*/) {}
};

// The copier of `device` for the executor in use.
std::unique_ptr<StagingCopier> make_staging_copier(MemoryManager& mm, c10::DeviceIndex device);

}  // namespace superchip
