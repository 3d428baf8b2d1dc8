// ProcessGroupSccl: the c10d::Backend of the superchip device (backend name "sccl"). It owns
// no transport: every collective hands its operands to an inner c10d::Backend that torch
// created (Gloo when the executor is the CPU, NCCL with the CUDA executor) and wraps the inner
// Work so that results, futures and errors carry the caller's superchip tensors.
// Invariants: an operand's bytes are never moved while its collective is in flight (each
// superchip storage holds a StorageLease until the work completes); the inner group only
// ever sees executor tensors (aliases, or staged copies for NCCL: see Note [Staging for NCCL]).
// Thread-safety: as the inner backend; a Work may complete on the inner backend's thread.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace superchip {

class ProcessGroupSccl final : public c10d::Backend {
 public:
  // Options of an sccl group; copyable, so torch's split_group can deep-copy them.
  struct SccOptions : Options {
    explicit SccOptions(std::chrono::milliseconds timeout) : Options("sccl", timeout) {}
  };
  // Builds the options object for splitting `inner` (its own Options type, never the
  // parent's object, which the inner split would modify) named and timed like `opts`.
  using InnerSplitOptionsFn = std::function<c10::intrusive_ptr<Options>(
      const c10::intrusive_ptr<c10d::Backend>& inner, const Options& opts)>;

  // `inner` is a backend over the same ranks (a Gloo or NCCL group built by torch).
  // `split_options` may be empty: the group then does not support splitting.
  ProcessGroupSccl(c10::intrusive_ptr<c10d::Backend> inner, int rank, int size,
                   std::chrono::milliseconds timeout, InnerSplitOptionsFn split_options = {});

  const std::string getBackendName() const override { return "sccl"; }
  c10::intrusive_ptr<Options> getBackendOptions() override { return options_; }
  void setTimeout(std::chrono::milliseconds timeout) override;
  const c10::intrusive_ptr<c10d::Backend>& inner() const { return inner_; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  // Splits empty: even; otherwise per-rank row counts along dim 0 (they may be uneven).
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // Splitting (DeviceMesh and new_group when the default group is bound to a device) splits
  // the inner group and wraps the child; the inner group receives its own options object
  // with the caller's group name and timeout, as torch passes it to a plain Gloo/NCCL group.
  bool supportsSplitting() const override {
    return static_cast<bool>(split_options_) && inner_->supportsSplitting();
  }
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;

  void setSequenceNumberForGroup() override { inner_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return inner_->getSequenceNumberForGroup(); }
  void shutdown() override { inner_->shutdown(); }
  void abort() override { inner_->abort(); }

 private:
  // The inner group reduces with AVG itself (NCCL) or gets SUM and the wrapper divides (Gloo).
  bool emulate_avg_;
  // NCCL cannot read host memory: host-tier and CPU operands go through device copies.
  bool stage_host_;
  c10::intrusive_ptr<c10d::Backend> inner_;
  c10::intrusive_ptr<SccOptions> options_;
  InnerSplitOptionsFn split_options_;
};

}  // namespace superchip
