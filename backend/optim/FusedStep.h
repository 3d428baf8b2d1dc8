// The torch-facing side of the fused optimizer. fused_*: validates tensors, finds host
// pointers (staging through host memory the operands a CPU cannot address, i.e. hbm with the
// CUDA executor), cuts every parameter into cache-friendly chunks and runs the ops/cpu kernels
// on the optimizer thread pool (pinned to the GPU-local NUMA node). executor_*: the engine's
// tail buckets, stepped where their state lives (ops/cuda on the CUDA executor, enqueued on a
// stream; the ops/cpu kernels on the CPU executor), with the same bits. Called without the GIL.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <vector>

#include "ops/cpu/AdamUndo.h"
#include "ops/cpu/FusedOptim.h"

namespace superchip {

struct AdamGroup {
  std::vector<at::Tensor> params;            // fp32, bf16 or fp16; updated in place
  std::vector<at::Tensor> grads;             // fp32, bf16 or fp16, same numel as the param
  std::vector<std::optional<at::Tensor>> masters;  // fp32 master of a low-precision param
  std::vector<at::Tensor> exp_avgs;          // fp32
  std::vector<at::Tensor> exp_avg_sqs;       // fp32
  std::vector<std::optional<at::Tensor>> max_exp_avg_sqs;  // fp32, amsgrad only
  std::vector<int64_t> steps;                // step number after increment, per parameter
};

// The undo log of a speculative step (ops/cpu/AdamUndo.h), one per work chunk.
struct AdamUndoLogs {
  std::vector<ops::AdamUndoLog> chunks;
  int64_t bytes() const;         // host memory the log holds
  int64_t escape_count() const;  // fields whose residual is in a side stream
};

// One param group's share of a step: its tensors and hyper-parameters.
struct AdamPart {
  AdamGroup group;
  ops::AdamHyper hyper;
};

// Note [A step is all or nothing]
// Every entry point below steps all its parts or none: each operand of each part is checked
// and bound (staged into memory the kernel can address, where it must be) before any is
// written, so an error a caller can cause (a malformed operand, no memory for a staging copy)
// leaves every parameter and its state as they were, and the caller may retry. Bound one part
// at a time, an out-of-memory error in a later param group left the earlier groups stepped:
// the plain step's retry stepped them twice, and a speculation's undo never covered them.
// Only the write-back of staged results (copies into memory that exists) comes after the
// kernels. The plain step takes its staging window (below) before it writes anything.

// Note [The step's staging window]
// Under the CUDA executor the CPU kernels cannot address hbm, and the plain step
// (overlap=False, and an engine job's step or redo) staged every hbm parameter and gradient
// into torch's pinned memory at once: 4 bytes per bf16 parameter, the whole model's for the
// plain step, which torch's pinned cache then kept for good, outside host's budget (an 8B
// model: 32 GB of pinned host memory beside its 96 GB of fp32 master weights and moments).
// fused_adam_step and fused_sgd_step copy those operands slice by slice through one window:
// a host-tier block (pinned and mapped; counted in host's statistics) of at most
// SUPERCHIP_STEP_WINDOW_BYTES (default 64 MiB), taken before anything is written (a smaller
// one when host has less room, down to 4 KiB; then an error that changed nothing). Per
// window: the gradients (and fp32 parameters) are copied in on the current stream, the CPU
// waits for them, steps the slices, and the parameters are copied back (low-precision
// parameters are only written, so they are not copied in). Operands the CPU addresses in
// place (host-tier ones, every operand of the CPU executor) are stepped in one pass as
// before; a strided operand is still staged whole. The kernels are elementwise and do not
// depend on how the elements are cut: the bits are those of the unwindowed step
// (test_optim.py, with SUPERCHIP_STAGE_HBM_OPERANDS=1 emulating the CUDA executor's staging).
// The speculative step keeps its whole staging (Note [An undo needs no memory]); it stages
// one bucket.

// Steps the parts in place.
void fused_adam_step(const std::vector<AdamPart>& parts);

// Note [An undo needs no memory]
// A speculative step is undone when validation finds other gradients (clipping) or a reader
// comes first. The undo reads and writes the same operands as the step, so it needs the same
// staging copies (a strided parameter; on a GPU every hbm one, into pinned memory), and
// bound anew it could run out of memory after the step had been applied: the bucket then kept
// a step made from gradients validation had just rejected (found by review, reproduced with a
// strided parameter and both tiers full). So the recorded step keeps its bound operands
// (AdamStaging) until the step is committed or undone, and the undo runs through them: it
// allocates nothing (on a GPU, as long as the parameter is contiguous: the write-back into a
// strided hbm parameter may take a device temporary). The staging copies hold the step's values
// throughout: the speculation's hold makes every reader or writer of those storages undo the
// step first. The cost: every speculated bucket's copies are held until step() validates it
// (on a GPU, pinned copies of its hbm parameters), where they were held one bucket at a time;
// the engine's admission counts them (Note [Speculation and host memory], engine.py).
class AdamStaging {
 public:
  virtual ~AdamStaging() = default;
  // Bytes the staging copies hold (0 where every operand was addressed in place).
  virtual int64_t staged_bytes() const = 0;
};
// Steps the parts in place, all or nothing, and writes the undo log (amsgrad is rejected);
// returns the bound operands for fused_adam_undo.
std::unique_ptr<AdamStaging> fused_adam_step_recorded(const std::vector<AdamPart>& parts, AdamUndoLogs* log);
// Restores the parts to their values before the recorded step, through its staging; the
// gradients must be the bits the step read and the hyper-parameters its own. Allocates nothing.
void fused_adam_undo(AdamStaging& staging, const AdamUndoLogs& log);

struct SgdGroup {
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> grads;
  std::vector<std::optional<at::Tensor>> masters;
  std::vector<std::optional<at::Tensor>> momentum_buffers;  // fp32; required when momentum != 0
  std::vector<bool> first_steps;  // per parameter: its momentum buffer is new
};

struct SgdPart {
  SgdGroup group;
  ops::SgdHyper hyper;
};

void fused_sgd_step(const std::vector<SgdPart>& parts);

// Tail buckets (Engine in python/superchip/engine.py): with the CUDA executor, the ops/cuda
// kernels read and write every operand in place (superchip memory of either tier) and are
// enqueued on `stream` (a cudaStream_t of the parameters' device: the current one, so that
// backward's gradients and the next forward are ordered around the step); run() returns once
// they are enqueued. With the CPU executor, `stream` is ignored and run() is fused_*_step's
// computation. Results are bit for bit those of fused_*_step (ops/cuda/FusedOptimCuda.h).
// prepare_* binds every operand (Note [A step is all or nothing]) and raises, changing nothing,
// where it cannot: the engine prepares its tail buckets before it queues the other buckets'
// jobs, so a step() that raises has queued nothing. run() at most once. A build without
// ops/cuda raises on the CUDA executor, naming tail_buckets=0 as the way out.
class PreparedStep {
 public:
  virtual ~PreparedStep() = default;
  virtual void run() = 0;
};
std::unique_ptr<PreparedStep> prepare_executor_adam_step(std::vector<AdamPart> parts, void* stream);
std::unique_ptr<PreparedStep> prepare_executor_sgd_step(std::vector<SgdPart> parts, void* stream);

namespace ops {
class ThreadPool;
}
// The optimizer's thread pool, created on first use and pinned to the NUMA node nearest the
// GPU of superchip device `device` (-1: the calling thread's current device). The first use
// decides: steps run on the engine's worker, whose current device is 0 whatever the training
// thread set, so the step paths pass their parameters' device (a rank of torchrun on
// superchip:3 pins to GPU 3's node, not GPU 0's). One pool per process.
ops::ThreadPool& optimizer_pool(c10::DeviceIndex device = -1);
// In a forked child (Note [Fork] in register/Fork.cpp): forget the parent's pool, whose workers
// the child lacks; the next optimizer_pool() makes a new one.
void optimizer_pool_after_fork_child();
// Threads of the optimizer pool (SUPERCHIP_OPTIM_THREADS, or the cores of the GPU-local node).
int optimizer_threads();
// SUPERCHIP_OPTIM_THREADS: 0 when unset, else a thread count from 1 to 4x the hardware threads;
// raises naming the variable when it is malformed (superchip's _init calls it at import).
int optimizer_threads_from_env();
// The SIMD path the kernels take (SUPERCHIP_SIMD forces one).
const char* optimizer_simd_path();

}  // namespace superchip
