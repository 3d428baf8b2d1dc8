// fork() handlers for superchip's own threads (Note [Fork]). Installed when the library loads.

#include <pthread.h>

#include "backend/engine/OffloadEngine.h"
#include "backend/optim/FusedStep.h"
#include "backend/stream/WeightStreamer.h"

// Note [Fork]
// fork() copies the process with only the calling thread. superchip has three of its own: the
// offload engine's worker, the weight streamer's copier (emulated mode) and the optimizer's
// thread pool. Without handlers a child inherits their queues but not the threads: a step
// still pending at fork (step() returns before its buckets have run) is never finished, and
// the child hangs in its first superchip call, or at exit in the atexit synchronize, even
// when it never used superchip (multiprocessing's "fork" start method, a hand-written
// os.fork()). So:
//  - prepare: the engine's queued jobs run to the end, then the copier's copies; both stay
//    locked until fork returns, so nothing new is queued meanwhile. The child's bytes are
//    therefore those of a finished step: parameters, gradients and optimizer state agree.
//  - parent: both unlock; nothing else changes.
//  - child: both unlock with fresh condition variables and no thread; the first job or copy
//    starts a new one. The optimizer pool is left behind and made again on first use.
// Order: the engine before the copier (a job's written hook may wait for a copy); the engine
// lock is taken before the copier's, released after it. As for any threaded library, a fork
// while another of the parent's threads is inside a superchip operator leaves that thread's
// locks held in the child: fork from the thread that trains, or use the "spawn" start method.
// With the CUDA executor the child cannot use CUDA at all (CUDA's rule, not ours).

namespace superchip {
namespace {

void prepare() {
  OffloadEngine::get().prepare_fork();
  WeightStreamer::get().prepare_fork();
}

void parent() {
  WeightStreamer::get().after_fork(/*child=*/false);
  OffloadEngine::get().after_fork(/*child=*/false);
}

void child() {
  WeightStreamer::get().after_fork(/*child=*/true);
  OffloadEngine::get().after_fork(/*child=*/true);
  optimizer_pool_after_fork_child();
}

const int installed = pthread_atfork(&prepare, &parent, &child);

}  // namespace
}  // namespace superchip
