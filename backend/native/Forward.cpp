#include "backend/native/Forward.h"

#include <ATen/EmptyTensor.h>
#include <ATen/NestedTensorImpl.h>
#include <ATen/SparseCsrTensorImpl.h>
#include <ATen/SparseTensorImpl.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>
#include <ATen/core/List.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/engine/OffloadEngine.h"
#include "backend/runtime/Runtime.h"
#include "backend/runtime/SuperchipAllocator.h"
#include "backend/runtime/SuperchipGenerator.h"
#include "backend/runtime/WriteWatch.h"
#include "backend/stream/WeightStreamer.h"

namespace superchip {
namespace {

// ---- aliases ----

// Note [One executor storage per superchip storage]
// ATen detects an out= tensor that overlaps an input, and in-place aliasing, by comparing
// StorageImpls (Storage::is_alias_of) before it compares byte ranges. One fresh executor
// StorageImpl per operand would hide every overlap: CPU raises "some elements of the input
// tensor and the written-to tensor refer to a single memory location" where superchip would
// compute a wrong answer. So, within one executor call, all operands over one superchip
// storage are aliased over ONE executor StorageImpl, as they share one StorageImpl on CPU.
// When the kernel resizes that storage (an out= resize), every alias sees the new bytes, as
// on CPU, and sync_mutated_arguments adopts them into the superchip storage once.
//
// Note [Copy-on-write operands]
// torch._lazy_clone makes storages share bytes until one is written (c10/core/impl/COW.cpp):
// taking a storage's mutable data pointer copies it. An operand the executor only reads is
// aliased through the const pointer, so reading a lazy clone never copies it (as on CPU);
// an operand the schema marks as written (Tensor(a!)) is materialized first. When a written
// operand comes after a read one over the same storage, the shared executor storage is
// re-pointed at the materialized bytes before the kernel runs.

// An alias DataPtr's context is the superchip StorageImpl, holding one reference.
void alias_release(void* ctx) noexcept {
  c10::raw::intrusive_ptr::decref(static_cast<c10::StorageImpl*>(ctx));
}

c10::StorageImpl* aliased_superchip_storage(const c10::Storage& s) {
  const c10::DataPtr& dp = s.data_ptr();
  if (dp.get_deleter() != &alias_release) return WeightStreamer::source_of(dp);
  return static_cast<c10::StorageImpl*>(dp.get_context());
}

c10::DataPtr alias_data_ptr(c10::StorageImpl* si, Access access, c10::Device executor_device) {
  void* data = access == Access::kWrite ? si->mutable_data() : const_cast<void*>(si->data());
  c10::raw::intrusive_ptr::incref(si);
  return c10::DataPtr(data, si, &alias_release, executor_device);
}

c10::Allocator* executor_allocator() {
  return c10::GetAllocator(executor_device_type());
}

// The executor's runtime key for a functionality (Dense, NestedTensor, Sparse, SparseCsr).
c10::DispatchKey executor_key(c10::DispatchKey functionality) {
  return c10::toRuntimePerBackendFunctionalityKey(
      functionality, executor() == Executor::kCuda ? c10::BackendComponent::CUDABit : c10::BackendComponent::CPUBit);
}

// `backend` plus the ZeroTensor key when `like` is a zero tensor: that key can only be given
// at construction (TensorImpl::_set_zero(true) asserts).
c10::DispatchKeySet keys_like(c10::DispatchKey backend, const at::Tensor& like) {
  c10::DispatchKeySet keys(backend);
  if (like._is_zerotensor()) keys = keys.add(c10::DispatchKey::ZeroTensor);
  return keys;
}

bool is_superchip(const at::Tensor& t) {
  return t.defined() && t.device().type() == c10::DeviceType::PrivateUse1;
}

void copy_view_bits(c10::TensorImpl* dst, const at::Tensor& src) {
  if (src.is_conj()) dst->_set_conj(true);
  if (src.is_neg()) dst->_set_neg(true);
}

c10::Storage adopt_as_superchip_storage(const c10::Storage& executor_storage, c10::DeviceIndex device) {
  return c10::Storage(c10::Storage::use_byte_size_t(), executor_storage.nbytes(),
                      adopt_executor_storage(executor_storage, device), &superchip_allocator(),
                      /*resizable=*/true);
}

// A superchip tensor over `storage` with the sizes, strides, offset and view bits of `like`.
at::Tensor superchip_tensor(c10::Storage storage, const at::Tensor& like) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(storage), keys_like(c10::DispatchKey::PrivateUse1, like), like.dtype());
  impl->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  copy_view_bits(impl.get(), like);
  return at::Tensor(std::move(impl));
}

// A fresh executor result that is a zero tensor owns no memory: it stays a zero tensor on
// superchip, with nothing accounted.
at::Tensor retag_zero_tensor(const at::Tensor& r, c10::DeviceIndex device) {
  at::Tensor z = superchip_zero_tensor(r.sizes(), r.strides(), r.dtype(), device);
  z.unsafeGetTensorImpl()->set_storage_offset(r.storage_offset());
  copy_view_bits(z.unsafeGetTensorImpl(), r);
  return z;
}

// Memory of a zero tensor: none. The allocator exists so the storage has one; it hands out
// null pointers, like ATen's ZeroTensorAllocator.
class ZeroAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t /*nbytes*/) override {
    return c10::DataPtr(nullptr, c10::Device(c10::DeviceType::PrivateUse1, current_device()));
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* /*dest*/, const void* /*src*/, std::size_t /*count*/) const override {}
};

ZeroAllocator& zero_allocator() {
  static ZeroAllocator a;
  return a;
}

// ---- per-operator facts, computed once per schema and thread ----

struct OpFacts {
  c10::OperatorName name{"", ""};    // what the cached facts describe
  std::vector<int> generator_args;   // positions of Generator? arguments
  std::vector<int> device_args;      // positions of Device? arguments
  std::vector<bool> mutable_args;    // per argument: written by the op (alias_info is_write)
  bool writes_arguments = false;     // any of mutable_args
  bool cpu_index_operands = false;   // index ops: CPU indices are accepted, as on CUDA
                                     // (`t[cpu_idx]`); values only 0-dim, as on CUDA (a CPU
                                     // values tensor was written, where CUDA raises: found by
                                     // PyTorch's test_indexing); the indexed tensor never
  int rows_arg = -1;                 // the operand read by rows (Access::kReadRows), or -1
  bool kernel_reads_requires_grad = false;  // Note [Kernels that read requires_grad]
};

const OpFacts& facts_of(const c10::OperatorHandle& op) {
  thread_local std::unordered_map<const c10::FunctionSchema*, OpFacts> cache;
  const c10::FunctionSchema& schema = op.schema();
  auto it = cache.find(&schema);
  // A schema address can be reused after a Python-registered op is deregistered: the entry
  // counts only if it describes an op of the same name and arity.
  if (it != cache.end() && it->second.mutable_args.size() == schema.arguments().size() &&
      it->second.name == schema.operator_name()) {
    return it->second;
  }
  if (it != cache.end()) cache.erase(it);
  OpFacts f;
  f.name = schema.operator_name();
  const auto& args = schema.arguments();
  f.mutable_args.resize(args.size(), false);
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::TypePtr& type = args[i].real_type();
    c10::TypePtr inner = type;
    if (auto opt = type->cast<c10::OptionalType>()) inner = opt->getElementType();
    if (inner->kind() == c10::TypeKind::GeneratorType) f.generator_args.push_back(int(i));
    if (inner->kind() == c10::TypeKind::DeviceObjType) f.device_args.push_back(int(i));
    f.mutable_args[i] = args[i].alias_info() && args[i].alias_info()->isWrite();
    f.writes_arguments |= f.mutable_args[i];
  }
  const std::string& name = schema.name();
  if (name == "aten::index" || name == "aten::index_put_" || name == "aten::_index_put_impl_" ||
      name == "aten::index_put") {
    f.cpu_index_operands = true;  // (Tensor self, Tensor?[] indices, ...)
  }
  if (name == "aten::_sparse_mm_reduce_impl") f.kernel_reads_requires_grad = true;
  // Gathers of rows: the table (weight / self) is their first argument.
  if (name == "aten::embedding" || name == "aten::index_select" || name == "aten::embedding_bag" ||
      name == "aten::_embedding_bag" || name == "aten::_embedding_bag_forward_only") {
    f.rows_arg = 0;
  }
  return cache.emplace(&schema, std::move(f)).first->second;
}

// Note [Quantized tensors]
// PyTorch's quantized tensors (dtypes torch.qint8, quint8, qint32, quint4x2, quint2x4: a
// QTensorImpl with a quantizer; deprecated in PyTorch, whose creation functions warn that they
// will be removed) are not held on superchip. Before, torch.quantize_per_tensor of a superchip
// tensor returned a tensor that claimed dtype qint8 but had lost its quantizer (is_quantized
// False; dequantize, int_repr, .cpu() and printing failed with unrelated errors), and
// .to("superchip") of a CPU quantized tensor found no kernel. Both now refuse with this message,
// before a superchip tensor exists. torchao's quantized tensor subclasses (NF4, used for QLoRA)
// are plain tensors underneath and run on superchip.
std::string quantized_refusal(const std::string& op) {
  return op + " would make a quantized tensor (torch.qint8, quint8, qint32, quint4x2 or quint2x4) "
         "on superchip, which does not hold PyTorch's quantized tensors (deprecated in PyTorch). "
         "Quantize on the cpu (.cpu() first), or use torchao's quantized tensor subclasses "
         "(e.g. NF4), which run on superchip.";
}

// ---- one forwarded call ----

struct AliasPair {
  at::Tensor original;  // superchip
  at::Tensor alias;     // executor
  bool mutated;         // the op may write it (sync storage and metadata back)
};

// Note [Sparse tensors]
// A sparse COO tensor (torch.sparse_coo: nn.Embedding(sparse=True)'s gradient, to_sparse())
// is a SparseTensorImpl holding two dense tensors, indices and values. On superchip those are
// superchip tensors and the dispatch key SparsePrivateUse1; its calls come here (a fallback,
// plus a kernel for every op the executor has a sparse kernel for, which would otherwise meet
// a composite one first): the operand is aliased as an executor sparse tensor over aliases of
// its indices and values, the executor's sparse kernel runs (SparseCPU / SparseCUDA), and a
// sparse result is re-tagged through its indices and values (an operand's own come back as
// they were). A kernel that replaces a sparse operand's indices or values (add_, coalesce_,
// resize) has its new ones, sizes and coalesced flag copied back onto the superchip tensor.
// The compressed layouts (CSR, CSC, BSR, BSC: SparseCsrTensorImpl, key SparseCsrPrivateUse1)
// are forwarded the same way over their compressed indices, plain indices and values.
// Before, such calls found no kernel and a sparse result was refused.
//
// Note [Nested tensors]
// A nested tensor (torch.nested, layout torch.strided; what nn.TransformerEncoder's and
// nn.MultiheadAttention's inference fast paths build from a padding mask) is a NestedTensorImpl:
// one buffer of bytes plus per-component sizes, strides and offsets (CPU tensors). On superchip
// the buffer is a superchip storage and the dispatch key NestedTensorPrivateUse1, whose calls
// come here through their own fallback: the operand is aliased as an executor nested tensor
// over the same bytes (the buffer through AliasSet, so its overlap rules hold) with the same
// metadata tensors, the executor's nested kernel runs (NestedTensorCPU / NestedTensorCUDA),
// and a nested result is re-tagged by its buffer. A call that names a device other than
// superchip (.cpu(), .to("cuda")) returns that device's tensors as the executor made them.
// Before, nested results met the dense re-tagging ("NestedTensorImpl doesn't support
// strides") and nested operands found no kernel.
class ForwardedCall {
 public:
  // functionality: the superchip key the call came through (Dense, NestedTensor, Sparse,
  // SparseCsr).
  ForwardedCall(const c10::OperatorHandle& op, torch::jit::Stack* stack,
                c10::DispatchKey functionality = c10::DispatchKey::Dense)
      : op_(op), stack_(stack), facts_(facts_of(op)), functionality_(functionality),
        layout_call_(functionality != c10::DispatchKey::Dense) {
    num_args_ = op.schema().arguments().size();
    first_ = stack->size() - num_args_;
  }

  void run() {
    find_device();
    rewrite_arguments();
    redispatch();
    sync_mutated_arguments();
    retag_returns();
  }

 private:
  // cpu: which CPU operands are accepted: kCpuScalar (a 0-dim one, as a scalar), kCpuAny (an
  // index op's indices and values), kCpuNone (an index op's indexed tensor).
  enum CpuOperand { kCpuScalar, kCpuAny, kCpuNone };
  void note_device(const at::Tensor& t, bool mutated, CpuOperand cpu) {
    if (!t.defined()) return;
    const c10::Device d = t.device();
    if (d.type() == c10::DeviceType::PrivateUse1) {
      if (device_ < 0) {
        device_ = d.index();
      } else {
        TORCH_CHECK(d.index() == device_, "Expected all tensors to be on the same device, but found "
                    "at least two devices, superchip:", int(device_), " and ", d, "! (in ",
                    op_.schema().name(), "). Move them to one device with .to().");
      }
    } else if (mutated || !d.is_cpu() || cpu == kCpuNone || (cpu == kCpuScalar && t.dim() != 0)) {
      // A CPU 0-dim tensor is accepted as a scalar operand, never as an output (as on CUDA).
      foreign_ = d;
      if (layout_call_) foreign_args_.push_back(t);
    }
  }

  // index_put_ (self, indices, values, accumulate, ...) as ATen's canDispatchToMaskedFill
  // takes it: one CPU value written without accumulating through a single bool/byte mask on
  // the device is a masked_fill_ with that value, which CUDA accepts whatever the value's dims.
  bool cpu_value_fills_a_mask() const {
    if (num_args_ < 4) return false;
    const c10::IValue& indices = (*stack_)[first_ + 1];
    const c10::IValue& values = (*stack_)[first_ + 2];
    const c10::IValue& accumulate = (*stack_)[first_ + 3];
    if (!indices.isList() || !values.isTensor() || !accumulate.isBool() || accumulate.toBool()) return false;
    const at::Tensor& v = values.toTensor();
    if (!v.defined() || v.numel() != 1 || !v.device().is_cpu()) return false;
    int masks = 0;
    for (const c10::IValue& e : indices.toListRef()) {
      if (!e.isTensor() || !e.toTensor().defined()) continue;
      const at::Tensor& i = e.toTensor();
      if ((i.scalar_type() != at::kBool && i.scalar_type() != at::kByte) || !is_superchip(i) || ++masks > 1) {
        return false;
      }
    }
    return masks == 1;
  }

  void find_device() {
    // Index ops: (self, indices, values, ...): CPU indices, and a CPU value only as CUDA takes it.
    const CpuOperand values_allowed =
        facts_.cpu_index_operands && cpu_value_fills_a_mask() ? kCpuAny : kCpuScalar;
    for (size_t k = 0; k < num_args_; ++k) {
      const c10::IValue& v = (*stack_)[first_ + k];
      const bool mutated = facts_.mutable_args[k];
      const CpuOperand cpu_allowed =
          !facts_.cpu_index_operands ? kCpuScalar : (k == 0 ? kCpuNone : k == 1 ? kCpuAny : values_allowed);
      if (v.isTensor()) {
        note_device(v.toTensor(), mutated, cpu_allowed);
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorList()) note_device(t, mutated, cpu_allowed);
      } else if (v.isList()) {
        for (const c10::IValue& e : v.toListRef()) {
          if (e.isTensor()) note_device(e.toTensor(), mutated, cpu_allowed);
        }
      }
    }
    if (foreign_.has_value() && facts_.cpu_index_operands) {
      // `cpu_tensor[superchip_idx]`: ATen's own check and message (CUDA's, for cuda indices).
      const c10::IValue& self = (*stack_)[first_];
      const c10::IValue& indices = (*stack_)[first_ + 1];
      bool superchip_index = false;
      if (indices.isList()) {
        for (const c10::IValue& e : indices.toListRef()) {
          superchip_index |= e.isTensor() && is_superchip(e.toTensor());
        }
      }
      TORCH_CHECK(!superchip_index || !self.isTensor() || is_superchip(self.toTensor()),
                  "indices should be either on cpu or on the same device as the indexed tensor (",
                  self.toTensor().device(), "). Move the indexed tensor to superchip, or the "
                  "indices to ", self.toTensor().device(), ", with .to() (in ", op_.schema().name(), ").");
    }
    if (foreign_.has_value() && layout_call_ &&
        (names_superchip_device() || op_.schema().name() == "aten::copy_")) {
      // A copy between devices: BackendSelect sends .to("superchip") of a CPU nested tensor
      // here; the executor's sparse copy_ moves indices and values to its self's device.
      // The other device's operands are passed as they are, and come back as they went.
      foreign_.reset();
      foreign_operands_ = true;
    }
    if (foreign_.has_value()) {
      // Here either a superchip tensor meets a tensor of another device, or a superchip
      // generator or device argument meets tensors of another device.
      bool generator = false;  // the advice names a generator only where one was passed
      for (size_t k = 0; k < num_args_; ++k) generator |= (*stack_)[first_ + k].isGenerator();
      TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least "
                  "two devices, superchip", device_ >= 0 ? ":" + std::to_string(device_) : std::string(),
                  " and ", *foreign_, "! (in ", op_.schema().name(), "). Move them to one device "
                  "with .to()", generator ? ", and use a generator of that device." : ".");
    }
    if (device_ < 0) {
      for (int pos : facts_.device_args) {
        const c10::IValue& v = (*stack_)[first_ + pos];
        if (v.isDevice() && v.toDevice().type() == c10::DeviceType::PrivateUse1) {
          device_ = resolve_device(v.toDevice().index());
        }
      }
    }
    if (device_ < 0) device_ = current_device();
  }

  bool is_argument(const at::Tensor& r) const {
    for (const at::Tensor& t : foreign_args_) {
      if (t.unsafeGetTensorImpl() == r.unsafeGetTensorImpl()) return true;
    }
    return false;
  }

  bool names_superchip_device() const {
    for (int pos : facts_.device_args) {
      const c10::IValue& v = (*stack_)[first_ + pos];
      if (v.isDevice() && v.toDevice().type() == c10::DeviceType::PrivateUse1) return true;
    }
    return false;
  }

  at::Tensor alias_of(const at::Tensor& t, bool mutated, bool rows = false) {
    if (!is_superchip(t)) return t;
    if (t.is_nested()) return alias_nested(t, mutated);
    if (t.is_sparse()) return alias_sparse(t, mutated);
    if (is_compressed(t)) return alias_compressed(t, mutated);
    at::Tensor a = aliases_.alias(t, mutated ? Access::kWrite : rows ? Access::kReadRows : Access::kRead);
    if (mutated) note_write(t.storage().unsafeGetStorageImpl());  // backend/runtime/WriteWatch.h
    for (AliasPair& p : pairs_) {
      if (p.alias.unsafeGetTensorImpl() == a.unsafeGetTensorImpl()) {
        p.mutated |= mutated;
        return a;
      }
    }
    pairs_.push_back({t, a, mutated});
    return a;
  }

  // The pair of a nested or sparse operand aliased earlier in this call, or null.
  AliasPair* pair_of(const at::Tensor& t) {
    for (AliasPair& p : pairs_) {
      if (p.original.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return &p;
    }
    return nullptr;
  }

  // Note [Nested tensors]. One alias per nested operand; its buffer stays referenced by the
  // call (AliasSet caches aliases by TensorImpl address).
  at::Tensor alias_nested(const at::Tensor& t, bool mutated) {
    if (AliasPair* p = pair_of(t)) {
      p->mutated |= mutated;
      return p->alias;
    }
    const at::native::NestedTensorImpl* nt = at::native::get_nested_tensor_impl(t);
    at::Tensor buffer = nt->get_unsafe_storage_as_tensor();
    buffers_.push_back(buffer);
    const at::Tensor ab = aliases_.alias(buffer, mutated ? Access::kWrite : Access::kRead);
    at::Tensor a = at::detail::make_tensor<at::native::NestedTensorImpl>(
        ab.storage(), c10::DispatchKeySet(executor_key(c10::DispatchKey::NestedTensor)), t.dtype(),
        nt->get_nested_sizes(), nt->get_nested_strides(), nt->get_storage_offsets());
    pairs_.push_back({t, a, mutated});
    return a;
  }

  // Note [Sparse tensors]. Indices and values are aliased as operands of their own.
  at::Tensor alias_sparse(const at::Tensor& t, bool mutated) {
    if (AliasPair* p = pair_of(t)) {
      p->mutated |= mutated;
      return p->alias;
    }
    const at::SparseTensorImpl* st = static_cast<const at::SparseTensorImpl*>(t.unsafeGetTensorImpl());
    const at::Tensor indices = alias_of(st->indices(), mutated);
    const at::Tensor values = alias_of(st->values(), mutated);
    at::Tensor a = make_sparse(c10::DispatchKeySet(executor_key(c10::DispatchKey::Sparse)),
                               executor_device(t.device().index()), t, indices, values, st->coalesced());
    pairs_.push_back({t, a, mutated});
    return a;
  }

  // A sparse tensor of `keys` on `device` with the sizes of `like` over indices and values.
  static at::Tensor make_sparse(c10::DispatchKeySet keys, c10::Device device, const at::Tensor& like,
                                const at::Tensor& indices, const at::Tensor& values, bool coalesced) {
    const at::SparseTensorImpl* lt = static_cast<const at::SparseTensorImpl*>(like.unsafeGetTensorImpl());
    c10::DeviceGuard guard(device);  // the impl starts with empty indices and values there
    auto impl = c10::make_intrusive<at::SparseTensorImpl>(keys, like.dtype());
    impl->raw_resize_(lt->sparse_dim(), lt->dense_dim(), like.sizes());
    impl->set_indices_and_values_unsafe(indices, values);
    impl->set_coalesced(coalesced);
    return at::Tensor(std::move(impl));
  }

  at::Tensor retag_sparse(const at::Tensor& r) {
    const at::SparseTensorImpl* st = static_cast<const at::SparseTensorImpl*>(r.unsafeGetTensorImpl());
    const at::Tensor indices = retag(st->indices());
    const at::Tensor values = retag(st->values());
    return make_sparse(c10::DispatchKeySet(c10::DispatchKey::SparsePrivateUse1), values.device(), r,
                       indices, values, st->coalesced());
  }

  // A kernel that wrote a sparse operand may have given it new indices, values or sizes.
  void sync_sparse(const AliasPair& p) {
    const auto* a = static_cast<const at::SparseTensorImpl*>(p.alias.unsafeGetTensorImpl());
    auto* o = static_cast<at::SparseTensorImpl*>(p.original.unsafeGetTensorImpl());
    const at::Tensor indices = retag(a->indices());
    const at::Tensor values = retag(a->values());
    if (indices.unsafeGetTensorImpl() == o->indices().unsafeGetTensorImpl() &&
        values.unsafeGetTensorImpl() == o->values().unsafeGetTensorImpl() && o->sizes() == a->sizes() &&
        o->sparse_dim() == a->sparse_dim() && o->coalesced() == a->coalesced()) {
      return;
    }
    o->raw_resize_(a->sparse_dim(), a->dense_dim(), a->sizes());
    o->set_indices_and_values_unsafe(indices, values);
    o->set_coalesced(a->coalesced());
  }

  static bool is_compressed(const at::Tensor& t) {
    const c10::Layout l = t.layout();
    return l == c10::kSparseCsr || l == c10::kSparseCsc || l == c10::kSparseBsr || l == c10::kSparseBsc;
  }

  static const at::SparseCsrTensorImpl* compressed_impl(const at::Tensor& t) {
    return static_cast<const at::SparseCsrTensorImpl*>(t.unsafeGetTensorImpl());
  }

  // Note [Sparse tensors], compressed layouts.
  at::Tensor alias_compressed(const at::Tensor& t, bool mutated) {
    if (AliasPair* p = pair_of(t)) {
      p->mutated |= mutated;
      return p->alias;
    }
    const at::SparseCsrTensorImpl* st = compressed_impl(t);
    const at::Tensor compressed = alias_of(st->compressed_indices(), mutated);
    const at::Tensor plain = alias_of(st->plain_indices(), mutated);
    const at::Tensor values = alias_of(st->values(), mutated);
    at::Tensor a = make_compressed(c10::DispatchKeySet(executor_key(c10::DispatchKey::SparseCsr)),
                                   executor_device(t.device().index()), t, compressed, plain, values);
    pairs_.push_back({t, a, mutated});
    return a;
  }

  static at::Tensor make_compressed(c10::DispatchKeySet keys, c10::Device device, const at::Tensor& like,
                                    const at::Tensor& compressed, const at::Tensor& plain,
                                    const at::Tensor& values) {
    auto impl = c10::make_intrusive<at::SparseCsrTensorImpl>(keys, device, like.layout(), like.dtype());
    impl->set_member_tensors(compressed, plain, values, like.sizes());
    return at::Tensor(std::move(impl));
  }

  at::Tensor retag_compressed(const at::Tensor& r) {
    const at::SparseCsrTensorImpl* st = compressed_impl(r);
    const at::Tensor compressed = retag(st->compressed_indices());
    const at::Tensor plain = retag(st->plain_indices());
    const at::Tensor values = retag(st->values());
    return make_compressed(c10::DispatchKeySet(c10::DispatchKey::SparseCsrPrivateUse1), values.device(), r,
                           compressed, plain, values);
  }

  void sync_compressed(const AliasPair& p) {
    const at::SparseCsrTensorImpl* a = compressed_impl(p.alias);
    auto* o = const_cast<at::SparseCsrTensorImpl*>(compressed_impl(p.original));
    const at::Tensor compressed = retag(a->compressed_indices());
    const at::Tensor plain = retag(a->plain_indices());
    const at::Tensor values = retag(a->values());
    if (compressed.unsafeGetTensorImpl() == o->compressed_indices().unsafeGetTensorImpl() &&
        plain.unsafeGetTensorImpl() == o->plain_indices().unsafeGetTensorImpl() &&
        values.unsafeGetTensorImpl() == o->values().unsafeGetTensorImpl() && o->sizes() == a->sizes()) {
      return;
    }
    o->set_member_tensors(compressed, plain, values, a->sizes());
  }

  // Note [Views in inference mode]
  // A result over an argument's bytes is a view of it, and autograd's view tracking (as_view)
  // gives it the argument's version counter. Made inside torch.inference_mode() by the plain
  // constructors, a result is an inference tensor, which has none: a view of a normal tensor
  // raised "Cannot set version_counter for inference tensor" (nested views: transpose, view,
  // unbind, narrow; found by PyTorch's test_nestedtensor run on superchip), where ATen's view
  // kernels make views with TensorImpl::VIEW and the base's autograd keys, so a view of a
  // normal tensor stays normal. The argument that `r` views, if it is a normal tensor viewed in
  // inference mode; else nullptr.
  const at::Tensor* viewed_in_inference_mode(const at::Tensor& r) const {
    if (!c10::InferenceMode::is_enabled() || !r.has_storage()) return nullptr;
    const c10::StorageImpl* es = r.storage().unsafeGetStorageImpl();
    for (const AliasPair& p : pairs_) {
      if (!p.alias.has_storage() || p.alias.storage().unsafeGetStorageImpl() != es) continue;
      return p.original.is_inference() ? nullptr : &p.original;
    }
    return nullptr;
  }

  at::Tensor retag_nested(const at::Tensor& r) {
    const at::native::NestedTensorImpl* nt = at::native::get_nested_tensor_impl(r);
    if (const at::Tensor* base = viewed_in_inference_mode(r); base != nullptr && base->is_nested()) {
      return at::detail::make_tensor<at::native::NestedTensorImpl>(
          c10::TensorImpl::VIEW, *base, nt->get_nested_sizes(), nt->get_nested_strides(),
          nt->get_storage_offsets());
    }
    const at::Tensor buffer = retag(nt->get_unsafe_storage_as_tensor());
    return at::detail::make_tensor<at::native::NestedTensorImpl>(
        buffer, nt->get_nested_sizes(), nt->get_nested_strides(), nt->get_storage_offsets());
  }

  // Note [Kernels that read requires_grad]
  // An executor alias is a plain tensor: it does not require grad. A few executor kernels ask
  // their operands whether they do, to decide what to compute for a backward: the CPU's
  // _sparse_mm_reduce_impl (torch.sparse.mm(csr, dense, reduce="amax"/"amin")) saves the
  // argmax only when GradMode is on and an operand requires grad. On superchip it got
  // aliases, saved nothing, and the backward read an empty index tensor as indices: the
  // process died (a segmentation fault; found under AddressSanitizer, in the OpInfo sweep's
  // crash-isolating workers). Such kernels get aliases that require grad where the superchip
  // operand does: a shallow copy of the alias, so no other call sees the flag. The call runs
  // below autograd, so nothing is recorded on them.
  static at::Tensor requiring_grad(const at::Tensor& alias) {
    c10::TensorImpl* impl = alias.unsafeGetTensorImpl();
    at::Tensor out(impl->shallow_copy_and_detach(impl->version_counter(), /*allow_tensor_metadata_change=*/false));
    out.set_requires_grad(true);
    return out;
  }

  void rewrite_arguments() {
    const bool pass_requires_grad = facts_.kernel_reads_requires_grad && at::GradMode::is_enabled();
    for (size_t k = 0; k < num_args_; ++k) {
      c10::IValue& v = (*stack_)[first_ + k];
      const bool mutated = facts_.mutable_args[k];
      if (v.isTensor()) {
        const bool grad = pass_requires_grad && v.toTensor().requires_grad();
        v = alias_of(v.toTensor(), mutated, static_cast<int>(k) == facts_.rows_arg);
        if (grad) v = requiring_grad(v.toTensor());
      } else if (v.isTensorList()) {
        c10::List<at::Tensor> list = v.toTensorList();
        c10::List<at::Tensor> out;
        out.reserve(list.size());
        for (const at::Tensor& t : list) out.push_back(alias_of(t, mutated));
        v = std::move(out);
      } else if (v.isList() && v.toListRef().size() > 0) {
        // Tensor?[] (index ops): keep Nones, alias tensors.
        bool has_tensor = false;
        for (const c10::IValue& e : v.toListRef()) has_tensor |= e.isTensor();
        if (!has_tensor) continue;
        c10::List<std::optional<at::Tensor>> out;
        for (const c10::IValue& e : v.toListRef()) {
          if (e.isTensor()) out.push_back(alias_of(e.toTensor(), mutated));
          else out.push_back(std::nullopt);
        }
        v = std::move(out);
      }
    }
    for (int pos : facts_.device_args) {
      c10::IValue& v = (*stack_)[first_ + pos];
      if (v.isDevice() && v.toDevice().type() == c10::DeviceType::PrivateUse1) {
        v = executor_device(device_);
      } else if (v.isDevice() && layout_call_) {
        results_foreign_ = true;  // Note [Nested tensors]: .cpu(), .to("cuda")
      }
    }
    for (int pos : facts_.generator_args) {
      c10::IValue& v = (*stack_)[first_ + pos];
      if (v.isNone()) {
        v = executor_generator(default_generator(device_));
      } else if (v.isGenerator()) {
        // executor_generator() rejects a generator of another device, as CUDA does.
        v = executor_generator(v.toGenerator());
      }
    }
  }

  // Note [Executor out of memory]
  // A forwarded kernel allocates its outputs and temporaries with the executor's allocator
  // (CUDA's caching allocator, or the CPU's), which knows nothing of the blocks superchip
  // holds cached. So the executor could run out while superchip sat on free memory: a
  // weight demoted to host by the streaming plan leaves its hbm block in superchip's cache,
  // and the next large activation failed with CUDA's out-of-memory error (the CPU executor
  // shows the same with a bounded address space: test_memory.py). When the kernel runs out,
  // superchip gives back its cache where that executor allocates and runs the kernel again,
  // once: the executor has already given back its own cache before raising. Only an op that
  // writes none of its arguments is run again (a second run of one that wrote part of an
  // argument before failing would not be the first run's result); others, like a second
  // failure, raise the executor's error with what superchip released and what to change.
  // The arguments are kept for that second run: a copy of a few IValues per forwarded op.
  void redispatch() {
    try {
      redispatch_retrying();
    } catch (c10::NotImplementedError& e) {
      explain_missing_kernel(e);  // raises when the executor has no kernel for the operator
      throw;
    }
  }

  // Note [An operator the executor lacks]
  // An operator with no kernel for the executor (CUDA-only ones on the emulated superchip:
  // SyncBatchNorm's batch_norm_stats and its backward) raised the dispatcher's "Could
  // not run 'aten::X' with arguments from the 'CPU' backend" and a list of dispatch keys,
  // naming neither superchip nor what to do (found by review). The error now says it.
  // Only the dispatcher's own error for this operator, and only where the executor has no
  // kernel at all, computed ones included (a composite's own dtype error stays as it is).
  void explain_missing_kernel(const c10::NotImplementedError& e) const {
    const std::string dispatcher = "Could not run '" + op_.schema().operator_name().name + "'";
    if (e.msg().rfind(dispatcher, 0) != 0 || op_.hasComputedKernelForDispatchKey(executor_key(functionality_))) {
      return;
    }
    const std::string name = op_.schema().name();
    const char* ex = executor() == Executor::kCpu ? "CPU" : "CUDA";
    std::string m = "superchip: " + name + " has no kernel for superchip's " + ex +
                    " executor, which runs superchip's operators with PyTorch's " + ex + " kernels.";
    if (executor() == Executor::kCpu) {
      m += " PyTorch has no CPU kernel for it (such operators are CUDA-only): it runs on a machine "
           "with an NVIDIA GPU (the CUDA executor).";
      if (name.find("batch_norm_") != std::string::npos) {
        m += " nn.SyncBatchNorm uses it: on the emulated superchip keep nn.BatchNorm (do not call "
             "nn.SyncBatchNorm.convert_sync_batchnorm when superchip.executor() == 'cpu').";
      }
    }
    const std::string& was = e.msg();
    TORCH_CHECK_NOT_IMPLEMENTED(false, m, " (PyTorch: ", was.substr(0, was.find('.') + 1), ")");
  }

  void redispatch_retrying() {
    const c10::DispatchKeySet keys(executor_key(functionality_));
    if (facts_.writes_arguments) {
      try {
        op_.redispatchBoxed(keys, stack_);
      } catch (c10::Error& e) {
        if (!is_out_of_memory(e)) throw;
        explain_out_of_memory(e, release_cached_memory_for_executor(device_), /*retried=*/false);
        throw;
      }
      return;
    }
    c10::SmallVector<c10::IValue, 8> args(stack_->end() - static_cast<std::ptrdiff_t>(num_args_), stack_->end());
    size_t released = 0;
    try {
      op_.redispatchBoxed(keys, stack_);
      return;
    } catch (c10::Error& e) {
      if (!is_out_of_memory(e)) throw;
      released = release_cached_memory_for_executor(device_);
      if (released == 0) {
        explain_out_of_memory(e, 0, /*retried=*/false);
        throw;
      }
    }
    stack_->resize(first_);
    stack_->insert(stack_->end(), args.begin(), args.end());
    args.clear();  // the stack holds the only references the kernel expects
    try {
      op_.redispatchBoxed(keys, stack_);
    } catch (c10::Error& e) {
      if (is_out_of_memory(e)) explain_out_of_memory(e, released, /*retried=*/true);
      throw;
    }
  }

  static bool is_out_of_memory(const c10::Error& e) {
    if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) return true;
    // The CPU allocator raises a plain c10::Error (alloc_cpu.cpp's enforce).
    return executor() == Executor::kCpu && e.msg().find("DefaultCPUAllocator") != std::string::npos &&
           e.msg().find("allocate") != std::string::npos;
  }

  void explain_out_of_memory(c10::Error& e, size_t released, bool retried) const {
    std::string m = std::string("superchip: the ") + executor_name(executor()) +
                    " executor ran out of memory in " + op_.schema().name() + " on superchip:" +
                    std::to_string(device_) + "; ";
    if (released == 0) {
      m += "superchip held no cached memory to give back.";
    } else {
      m += "superchip gave back " + format_bytes(released) + " it held cached";
      m += retried ? " and ran the kernel again, which failed too."
                   : "; the kernel was not run again because it writes its arguments: run it again.";
    }
    if (MemoryManager* mm = memory_if_created(device_)) {
      const TierStats hbm = mm->stats(Tier::kHbm);
      m += " superchip's tensors use " + format_bytes(size_t(std::max<int64_t>(hbm.allocated_bytes, 0))) +
           " of hbm (budget " + (hbm.capacity_bytes == 0 ? std::string("unlimited") : format_bytes(size_t(hbm.capacity_bytes))) + ").";
    }
    m += executor() == Executor::kCuda
             ? " To leave the kernels more GPU memory, raise SUPERCHIP_HBM_RESERVE (more weights stay in "
               "host and stream) or lower SUPERCHIP_HBM_BYTES; or use smaller batches."
             : " The host is out of memory: free tensors or use smaller batches.";
    e.add_context(std::move(m));
  }

  // An out= or in-place op may have resized its executor alias: the bytes then live in new
  // executor memory, which the superchip storage adopts, and the metadata follows.
  // Operands over one superchip storage share one executor storage (Note [One executor
  // storage per superchip storage]): its new bytes are adopted once.
  void sync_mutated_arguments() {
    std::vector<c10::StorageImpl*> adopted;
    for (AliasPair& p : pairs_) {
      if (!p.mutated) continue;
      c10::TensorImpl* orig = p.original.unsafeGetTensorImpl();
      const at::Tensor& a = p.alias;
      // A nested tensor's metadata is fixed at construction: nested kernels write its buffer only.
      if (p.original.is_nested()) continue;
      if (p.original.is_sparse()) {
        sync_sparse(p);  // after its indices and values (aliased, and synced, before it)
        continue;
      }
      if (is_compressed(p.original)) {
        sync_compressed(p);
        continue;
      }
      c10::StorageImpl* orig_storage = p.original.storage().unsafeGetStorageImpl();
      if (aliased_superchip_storage(a.storage()) != orig_storage &&
          std::find(adopted.begin(), adopted.end(), orig_storage) == adopted.end()) {
        adopted.push_back(orig_storage);
        const size_t nbytes = a.storage().nbytes();
        c10::DataPtr adopted = adopt_executor_storage(a.storage(), device_);
        c10::DataPtr old = orig_storage->set_data_ptr(std::move(adopted));
        orig_storage->set_nbytes(nbytes);
      }
      if (orig->sizes() != a.sizes() || orig->strides() != a.strides() ||
          orig->storage_offset() != a.storage_offset()) {
        orig->set_sizes_and_strides(a.sizes(), a.strides(), a.storage_offset());
      }
    }
  }

  at::Tensor retag(const at::Tensor& r) {
    if (!r.defined()) return r;
    for (const AliasPair& p : pairs_) {
      if (p.alias.unsafeGetTensorImpl() == r.unsafeGetTensorImpl()) return p.original;
    }
    if (foreign_operands_ && is_argument(r)) return r;  // another device's self, returned
    if (r.device().type() != executor_device_type() || results_foreign_) return r;
    if (r.is_nested()) return retag_nested(r);
    if (r.is_sparse()) return retag_sparse(r);
    if (is_compressed(r)) return retag_compressed(r);
    TORCH_CHECK(r.layout() == c10::kStrided, op_.schema().name(), " on superchip would return a ",
                r.layout(), " tensor; superchip holds strided, nested and sparse (COO, CSR, CSC, "
                "BSR, BSC) tensors only. Run this work on the cpu: move the tensor with .cpu() first.");
    TORCH_CHECK(!r.is_quantized(), quantized_refusal(op_.schema().name()));
    // Several results may view one fresh executor storage: adopt it once, share it.
    c10::StorageImpl* es = r.storage().unsafeGetStorageImpl();
    if (aliased_superchip_storage(r.storage()) == nullptr) {
      if (r._is_zerotensor()) return retag_zero_tensor(r, device_);
      for (auto& [impl, storage] : adopted_) {
        if (impl == es) return superchip_tensor(storage, r);
      }
      c10::Storage storage = adopt_as_superchip_storage(r.storage(), device_);
      adopted_.emplace_back(es, storage);
      return superchip_tensor(std::move(storage), r);
    }
    if (const at::Tensor* base = viewed_in_inference_mode(r)) {
      // Note [Views in inference mode]: made as ATen's view kernels make one.
      // The keys the plain constructor gives outside inference mode (a dense result of a nested
      // base too: AutogradPrivateUse1, not the base's AutogradNestedTensor).
      constexpr auto backend = c10::BackendComponent::PrivateUse1Bit;
      const c10::DispatchKeySet keys = keys_like(c10::DispatchKey::PrivateUse1, r) |
                                       c10::getAutocastRelatedKeySetFromBackend(backend) |
                                       c10::getAutogradRelatedKeySetFromBackend(backend);
      auto impl = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(base->storage()),
                                                       keys, r.dtype());
      impl->set_sizes_and_strides(r.sizes(), r.strides(), r.storage_offset());
      copy_view_bits(impl.get(), r);
      return at::Tensor(std::move(impl));
    }
    return retag_result(r, device_);
  }

  void retag_returns() {
    const size_t num_returns = op_.schema().returns().size();
    for (size_t i = stack_->size() - num_returns; i < stack_->size(); ++i) {
      c10::IValue& v = (*stack_)[i];
      if (v.isTensor()) {
        v = retag(v.toTensor());
      } else if (v.isTensorList()) {
        c10::List<at::Tensor> list = v.toTensorList();
        c10::List<at::Tensor> out;
        out.reserve(list.size());
        for (const at::Tensor& t : list) out.push_back(retag(t));
        v = std::move(out);
      }
    }
  }

  const c10::OperatorHandle& op_;
  torch::jit::Stack* stack_;
  const OpFacts& facts_;
  const c10::DispatchKey functionality_;  // Dense, NestedTensor, Sparse or SparseCsr
  const bool layout_call_;       // came through the nested or sparse keys
  bool results_foreign_ = false;  // names a device other than superchip: results stay its
  bool foreign_operands_ = false;  // a copy between devices (layout calls): see find_device
  std::vector<at::Tensor> foreign_args_;  // its operands of the other device
  std::vector<at::Tensor> buffers_;  // superchip buffers of nested operands, aliased
  size_t num_args_ = 0;
  size_t first_ = 0;
  c10::DeviceIndex device_ = -1;
  std::optional<c10::Device> foreign_;
  AliasSet aliases_;
  std::vector<AliasPair> pairs_;
  std::vector<std::pair<c10::StorageImpl*, c10::Storage>> adopted_;
};

}  // namespace

c10::Storage AliasSet::executor_storage(const at::Tensor& t, Access access) {
  c10::StorageImpl* si = t.storage().unsafeGetStorageImpl();
  // An optimizer step still pending on these bytes finishes first (Note [Pending storages]).
  OffloadEngine::get().wait_for_storage(si);
  WeightStreamer& streamer = WeightStreamer::get();
  const bool streaming = streamer.active();
  const bool rows = access == Access::kReadRows;
  const bool copy_source = access == Access::kCopySource;
  if (rows || copy_source) access = Access::kRead;
  // A write makes any staged copy of a weight stale (Note [Staged copies and writes]).
  if (access == Access::kWrite && streaming) streamer.note_written(si);
  const c10::Device device = executor_device(t.device().index());
  for (Shared& s : storages_) {
    if (s.superchip != si) continue;
    if (access == Access::kWrite && !s.writable) {
      // Note [Copy-on-write operands]: materialize, then re-point the shared storage. A
      // storage read from a staged copy of a weight is re-pointed at the weight's own bytes.
      const void* shared = si->data();
      if (si->mutable_data() != shared || s.staged) {
        s.executor.unsafeGetStorageImpl()->set_data_ptr_noswap(alias_data_ptr(si, access, device));
      }
      s.writable = true;
      s.staged = false;
    }
    return s.executor;
  }
  // A weight that lives in host is read from its copy in hbm (stream/WeightStreamer.h).
  // ... unless the kernel reads a few rows of it: then in place (Note [Row reads]).
  c10::DataPtr staged;
  if (access == Access::kRead && streaming && !copy_source) {
    if (rows) streamer.note_rows_read(si);
    else staged = streamer.read(si, device);
  }
  const bool is_staged = staged.get() != nullptr;
  c10::Storage storage(c10::Storage::use_byte_size_t(), si->nbytes(),
                       is_staged ? std::move(staged) : alias_data_ptr(si, access, device),
                       executor_allocator(), /*resizable=*/true);
  storages_.push_back({si, storage, access == Access::kWrite, is_staged});
  return storage;
}

AliasSet::~AliasSet() {
  // Writes have ended (or, for a one-operand alias handed to asynchronous work, begun):
  // copies staged meanwhile are stale.
  WeightStreamer& streamer = WeightStreamer::get();
  if (!streamer.active()) return;
  for (const Shared& s : storages_) {
    if (s.writable) streamer.note_written(s.superchip);
  }
}

at::Tensor AliasSet::alias(const at::Tensor& t, Access access) {
  if (!t.defined()) return t;
  c10::Storage storage = executor_storage(t, access);
  for (const auto& [impl, a] : tensors_) {
    if (impl == t.unsafeGetTensorImpl()) return a;
  }
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage),
                                                   keys_like(executor_dispatch_key(), t), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  copy_view_bits(impl.get(), t);
  at::Tensor a(std::move(impl));
  tensors_.emplace_back(t.unsafeGetTensorImpl(), a);
  return a;
}

at::Tensor executor_alias(const at::Tensor& t, Access access) {
  AliasSet one;
  return one.alias(t, access);
}

void copy_through_aliases(const at::Tensor& dst, const at::Tensor& src, Access src_access) {
  AliasSet aliases;  // one set: a source over dst's storage is seen as such
  const auto superchip = [](const at::Tensor& t) { return t.device().type() == c10::DeviceType::PrivateUse1; };
  const at::Tensor s = superchip(src) ? aliases.alias(src, src_access) : src;
  at::Tensor d = superchip(dst) ? aliases.alias(dst, Access::kWrite) : dst;
  d.copy_(s);
}

at::Tensor retag_result(const at::Tensor& r, c10::DeviceIndex device) {
  if (c10::StorageImpl* base = aliased_superchip_storage(r.storage())) {
    return superchip_tensor(c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(base)), r);
  }
  if (r._is_zerotensor()) return retag_zero_tensor(r, device);
  return superchip_tensor(adopt_as_superchip_storage(r.storage(), device), r);
}

at::Tensor superchip_zero_tensor(c10::IntArrayRef sizes, c10::IntArrayRef strides,
                                 caffe2::TypeMeta dtype, c10::DeviceIndex device) {
  const size_t nbytes = at::detail::computeStorageNbytes(sizes, strides, dtype.itemsize());
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes,
                       c10::DataPtr(nullptr, c10::Device(c10::DeviceType::PrivateUse1, device)),
                       &zero_allocator(), /*resizable=*/false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(storage),
      c10::DispatchKeySet(c10::DispatchKey::PrivateUse1).add(c10::DispatchKey::ZeroTensor), dtype);
  impl->set_sizes_and_strides(sizes, strides);
  return at::Tensor(std::move(impl));
}

namespace {

// Note [Another device's autocast]
// torch.autocast is per device type: autocast("cuda") casts CUDA tensors' operators and leaves
// any other device's alone, as it leaves CPU tensors. superchip's operators reach the executor
// below the autocast keys, so a script moved to superchip that kept a hard-coded
// `torch.autocast("cuda", dtype=torch.bfloat16)` (or `torch.cuda.amp.autocast()`) trained in
// float32 without a word: slower, with twice the activation memory. The first superchip
// operator that runs while the CUDA or CPU autocast is on and superchip's is not says so,
// once per process, and what to write instead. Nothing is cast: torch's semantics stay.
// (Inside superchip's own autocast kernels its key is excluded for the redispatch, so where
// both are on the warning may still come once; what it says holds there too.)
void warn_if_another_devices_autocast() {
  using c10::DispatchKey;
  using c10::impl::tls_is_dispatch_key_excluded;
  // Autocast keys are excluded by default; torch.autocast's __enter__ lifts its device's.
  const bool cuda = !tls_is_dispatch_key_excluded(DispatchKey::AutocastCUDA);
  if (C10_LIKELY(!cuda && tls_is_dispatch_key_excluded(DispatchKey::AutocastCPU))) return;
  if (!tls_is_dispatch_key_excluded(DispatchKey::AutocastPrivateUse1)) return;
  TORCH_WARN_ONCE("superchip: torch.autocast(\"", cuda ? "cuda" : "cpu", "\") is on, and it casts ",
                  cuda ? "cuda" : "cpu", " tensors' operators only: superchip's run in their own dtypes "
                  "(float32 stays float32). For mixed precision on superchip use "
                  "torch.autocast(\"superchip\", dtype=...), or torch.autocast(device_type=tensor.device.type, "
                  "...) in code that runs on several devices.");
}

}  // namespace

void forward_to_executor(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  warn_if_another_devices_autocast();
  ForwardedCall(op, stack).run();
}

void forward_nested_to_executor(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  ForwardedCall(op, stack, c10::DispatchKey::NestedTensor).run();
}

void forward_sparse_to_executor(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  ForwardedCall(op, stack, c10::DispatchKey::Sparse).run();
}

void forward_sparse_compressed_to_executor(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  ForwardedCall(op, stack, c10::DispatchKey::SparseCsr).run();
}

void refuse_quantized(const c10::OperatorHandle& op, torch::jit::Stack* /*stack*/) {
  TORCH_CHECK(false, quantized_refusal(op.schema().name()));
}

}  // namespace superchip
