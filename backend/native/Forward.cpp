#include "backend/native/Forward.h"

#include <ATen/core/List.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include <string>
#include <unordered_map>
#include <vector>

#include "backend/engine/OffloadEngine.h"
#include "backend/runtime/Runtime.h"
#include "backend/runtime/SuperchipAllocator.h"
#include "backend/runtime/SuperchipGenerator.h"

namespace superchip {
namespace {

// ---- aliases ----

// An alias DataPtr's context is the superchip StorageImpl, holding one reference.
void alias_release(void* ctx) noexcept {
  c10::raw::intrusive_ptr::decref(static_cast<c10::StorageImpl*>(ctx));
}

c10::StorageImpl* aliased_superchip_storage(const c10::Storage& s) {
  const c10::DataPtr& dp = s.data_ptr();
  if (dp.get_deleter() != &alias_release) return nullptr;
  return static_cast<c10::StorageImpl*>(dp.get_context());
}

c10::Allocator* executor_allocator() {
  return c10::GetAllocator(executor_device_type());
}

c10::DispatchKeySet executor_keyset() {
  return c10::DispatchKeySet(executor() == Executor::kCuda ? c10::DispatchKey::CUDA
                                                           : c10::DispatchKey::CPU);
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
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), like.dtype());
  impl->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  copy_view_bits(impl.get(), like);
  return at::Tensor(std::move(impl));
}

// ---- per-operator facts, computed once per schema and thread ----

struct OpFacts {
  c10::OperatorName name{"", ""};    // what the cached facts describe
  std::vector<int> generator_args;   // positions of Generator? arguments
  std::vector<int> device_args;      // positions of Device? arguments
  std::vector<bool> mutable_args;    // per argument: written by the op (alias_info is_write)
  bool allows_cpu_operands = false;  // index ops take CPU index tensors, as on CUDA
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
  }
  const std::string& name = schema.name();
  f.allows_cpu_operands = name == "aten::index" || name == "aten::index_put_" ||
                          name == "aten::_index_put_impl_" || name == "aten::index_put";
  return cache.emplace(&schema, std::move(f)).first->second;
}

// ---- one forwarded call ----

struct AliasPair {
  at::Tensor original;  // superchip
  at::Tensor alias;     // executor
  bool mutated;         // the op may write it (sync storage and metadata back)
};

class ForwardedCall {
 public:
  ForwardedCall(const c10::OperatorHandle& op, torch::jit::Stack* stack)
      : op_(op), stack_(stack), facts_(facts_of(op)) {
    num_args_ = op.schema().arguments().size();
    first_ = stack->size() - num_args_;
  }

  void run() {
    find_device();
    rewrite_arguments();
    op_.redispatchBoxed(executor_keyset(), stack_);
    sync_mutated_arguments();
    retag_returns();
  }

 private:
  void note_device(const at::Tensor& t, bool mutated) {
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
    } else if (mutated || (!(t.dim() == 0 && d.is_cpu()) && !facts_.allows_cpu_operands)) {
      // A CPU 0-dim tensor is accepted as a scalar operand, never as an output (as on CUDA).
      foreign_ = d;
    }
  }

  void find_device() {
    for (size_t k = 0; k < num_args_; ++k) {
      const c10::IValue& v = (*stack_)[first_ + k];
      const bool mutated = facts_.mutable_args[k];
      if (v.isTensor()) {
        note_device(v.toTensor(), mutated);
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorList()) note_device(t, mutated);
      } else if (v.isList()) {
        for (const c10::IValue& e : v.toListRef()) {
          if (e.isTensor()) note_device(e.toTensor(), mutated);
        }
      }
    }
    if (foreign_.has_value()) {
      // Here either a superchip tensor meets a tensor of another device, or a superchip
      // generator or device argument meets tensors of another device.
      TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least "
                  "two devices, superchip", device_ >= 0 ? ":" + std::to_string(device_) : std::string(),
                  " and ", *foreign_, "! (in ", op_.schema().name(), "). Move them to one device "
                  "with .to(), and use a generator of that device.");
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

  at::Tensor alias_of(const at::Tensor& t, bool mutated) {
    if (!is_superchip(t)) return t;
    at::Tensor a = executor_alias(t);
    pairs_.push_back({t, a, mutated});
    return a;
  }

  void rewrite_arguments() {
    for (size_t k = 0; k < num_args_; ++k) {
      c10::IValue& v = (*stack_)[first_ + k];
      const bool mutated = facts_.mutable_args[k];
      if (v.isTensor()) {
        v = alias_of(v.toTensor(), mutated);
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

  // An out= or in-place op may have resized its executor alias: the bytes then live in new
  // executor memory, which the superchip storage adopts, and the metadata follows.
  void sync_mutated_arguments() {
    for (AliasPair& p : pairs_) {
      if (!p.mutated) continue;
      c10::TensorImpl* orig = p.original.unsafeGetTensorImpl();
      const at::Tensor& a = p.alias;
      c10::StorageImpl* orig_storage = p.original.storage().unsafeGetStorageImpl();
      if (aliased_superchip_storage(a.storage()) != orig_storage) {
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
    if (r.device().type() != executor_device_type()) return r;
    TORCH_CHECK(r.layout() == c10::kStrided, op_.schema().name(), " on superchip would return a ",
                r.layout(), " tensor; superchip holds dense (strided) tensors only. Run sparse "
                "work on the cpu: move the tensor with .cpu() first.");
    // Several results may view one fresh executor storage: adopt it once, share it.
    c10::StorageImpl* es = r.storage().unsafeGetStorageImpl();
    if (aliased_superchip_storage(r.storage()) == nullptr) {
      for (auto& [impl, storage] : adopted_) {
        if (impl == es) return superchip_tensor(storage, r);
      }
      c10::Storage storage = adopt_as_superchip_storage(r.storage(), device_);
      adopted_.emplace_back(es, storage);
      return superchip_tensor(std::move(storage), r);
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
  size_t num_args_ = 0;
  size_t first_ = 0;
  c10::DeviceIndex device_ = -1;
  std::optional<c10::Device> foreign_;
  std::vector<AliasPair> pairs_;
  std::vector<std::pair<c10::StorageImpl*, c10::Storage>> adopted_;
};

}  // namespace

at::Tensor executor_alias(const at::Tensor& t) {
  if (!t.defined()) return t;
  c10::StorageImpl* si = t.storage().unsafeGetStorageImpl();
  // An optimizer step still pending on these bytes finishes first (Note [Pending storages]).
  OffloadEngine::get().wait_for_storage(si);
  c10::raw::intrusive_ptr::incref(si);
  c10::DataPtr dp(si->mutable_data(), si, &alias_release, executor_device(t.device().index()));
  c10::Storage storage(c10::Storage::use_byte_size_t(), si->nbytes(), std::move(dp),
                       executor_allocator(), /*resizable=*/true);
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), executor_keyset(), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  copy_view_bits(impl.get(), t);
  return at::Tensor(std::move(impl));
}

at::Tensor retag_result(const at::Tensor& r, c10::DeviceIndex device) {
  if (c10::StorageImpl* base = aliased_superchip_storage(r.storage())) {
    return superchip_tensor(c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(base)), r);
  }
  return superchip_tensor(adopt_as_superchip_storage(r.storage(), device), r);
}

void forward_to_executor(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  ForwardedCall(op, stack).run();
}

}  // namespace superchip
