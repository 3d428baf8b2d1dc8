// Forwarding superchip operators to the executor (see DESIGN.md "Executing operators").
// A superchip tensor is *aliased* as an executor tensor over the same bytes (no copy); the
// executor's kernel runs; each result is *re-tagged* as a superchip tensor: a view of an
// input keeps that input's superchip storage, a fresh result is adopted and accounted in hbm.
// Aliases keep every view bit of the original (conj, neg, zero); see Note [One executor
// storage per superchip storage] and Note [Copy-on-write operands] in Forward.cpp.
// Thread-safety: stateless apart from a thread-local cache of per-operator facts.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <utility>
#include <vector>

#include "backend/stream/WeightStreamer.h"

namespace superchip {

// How an executor kernel uses an operand. kWrite materializes a copy-on-write storage
// (torch._lazy_clone) before aliasing it; kRead leaves it shared. kReadRows is a read of a few
// rows (embedding, index_select): a weight in host is read in place, never staged whole
// (Note [Row reads] in stream/WeightStreamer.cpp). kCopySource is the source of a copy that is
// no use of a weight: a weight copied whole into a new one, or a copy out of the device (Note
// [Copies of weights read in place] in native/Native.cpp): read in place, not staged, not
// recorded.
enum class Access { kRead, kWrite, kReadRows, kCopySource };

// Aliases for one executor call. Operands over one superchip storage share one executor
// StorageImpl, so ATen's overlap checks (out= overlapping an input) and in-place aliasing
// see what they see on CPU; one superchip tensor gets one alias tensor.
class AliasSet {
 public:
  AliasSet() = default;
  AliasSet(const AliasSet&) = delete;
  AliasSet& operator=(const AliasSet&) = delete;
  ~AliasSet();

  // An executor tensor over the bytes of superchip tensor `t` (same sizes, strides, offset,
  // dtype, conj/neg/zero bits). Undefined in, undefined out.
  at::Tensor alias(const at::Tensor& t, Access access);

 private:
  // First member: counted while any alias lives (Note [One thread runs the operators]).
  WeightStreamer::OperatorScope scope_;
  struct Shared {
    c10::StorageImpl* superchip;  // not owned: the executor storage's DataPtr holds a reference
    c10::Storage executor;
    bool writable;
    bool staged;  // reads a staged copy of a weight (stream/WeightStreamer.h)
  };
  c10::Storage executor_storage(const at::Tensor& t, Access access);
  std::vector<Shared> storages_;
  std::vector<std::pair<c10::TensorImpl*, at::Tensor>> tensors_;
};

// A one-operand AliasSet. kWrite (the default) is always safe; pass kRead for operands the
// executor only reads, so a lazily cloned storage is not copied.
at::Tensor executor_alias(const at::Tensor& t, Access access = Access::kWrite);
// Copies `src` into `dst` (each superchip, executor or cpu) through executor aliases, in the
// current stream's order: the backend's own copies (optimizer state, staged write-backs), not a
// user's copy_. No weight placement or marks (copy_from's, Note [Batches while streaming] in
// native/Native.cpp), no version bump on dst (Note [Kernel results keep the version]).
// `src_access` kCopySource: a source read whole for a copy is not a weight read the streamer
// records or stages (the optimizer step's window, Note [The step's staging window]).
void copy_through_aliases(const at::Tensor& dst, const at::Tensor& src, Access src_access = Access::kRead);
// A superchip tensor for executor result `r`: shares the superchip storage when `r` views an
// alias, otherwise adopts r's memory into superchip:device (accounted in hbm). A zero tensor
// (torch._efficientzerotensor) stays one and owns no memory.
at::Tensor retag_result(const at::Tensor& r, c10::DeviceIndex device);
// A zero tensor (no memory, reads as zeros, immutable) of superchip:device.
at::Tensor superchip_zero_tensor(c10::IntArrayRef sizes, c10::IntArrayRef strides,
                                 caffe2::TypeMeta dtype, c10::DeviceIndex device);

// The boxed fallback registered for every aten op without a native superchip kernel.
void forward_to_executor(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// The same for nested tensors (NestedTensorPrivateUse1): Note [Nested tensors] in Forward.cpp.
void forward_nested_to_executor(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// The same for sparse COO tensors (SparsePrivateUse1): Note [Sparse tensors] in Forward.cpp.
void forward_sparse_to_executor(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// ... and the compressed sparse layouts, CSR, CSC, BSR, BSC (SparseCsrPrivateUse1).
void forward_sparse_compressed_to_executor(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// Registered for QuantizedPrivateUse1: refuses, naming the op (Note [Quantized tensors]).
void refuse_quantized(const c10::OperatorHandle& op, torch::jit::Stack* stack);

}  // namespace superchip
