#include "backend/native/GroupNorm.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/intrusive_ptr.h>

#include <mutex>
#include <unordered_map>

#include "backend/native/Forward.h"

namespace superchip::native {
namespace {

// rstd storage -> the channels-last format of the forward's input (Note [GroupNorm layouts]).
class Layouts {
 public:
  void remember(const at::Tensor& rstd, c10::MemoryFormat f) {
    c10::StorageImpl* s = rstd.storage().unsafeGetStorageImpl();
    std::lock_guard<std::mutex> lock(mu_);
    if (map_.size() >= purge_at_) purge();
    map_.insert_or_assign(s, Entry{c10::weak_intrusive_ptr<c10::StorageImpl>(
                                       c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(s)),
                                   f});
  }

  std::optional<c10::MemoryFormat> lookup(const at::Tensor& rstd) {
    if (!rstd.has_storage()) return std::nullopt;
    c10::StorageImpl* s = rstd.storage().unsafeGetStorageImpl();
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(s);
    // An expired entry is an older storage that happened to have this address.
    if (it == map_.end() || it->second.weak.expired()) return std::nullopt;
    return it->second.format;
  }

 private:
  struct Entry {
    c10::weak_intrusive_ptr<c10::StorageImpl> weak;
    c10::MemoryFormat format;
  };

  void purge() {
    for (auto it = map_.begin(); it != map_.end();) {
      if (it->second.weak.expired()) it = map_.erase(it);
      else ++it;
    }
    purge_at_ = std::max<size_t>(256, map_.size() * 2);
  }

  std::mutex mu_;
  std::unordered_map<const c10::StorageImpl*, Entry> map_;
  size_t purge_at_ = 256;
};

Layouts& layouts() {
  static Layouts* l = new Layouts();  // leaked: tensors may die during interpreter teardown
  return *l;
}

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> three(torch::jit::Stack& stack) {
  return {stack[0].toTensor(), stack[1].toTensor(), stack[2].toTensor()};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> native_group_norm(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    c10::SymInt N, c10::SymInt C, c10::SymInt HxW, int64_t group, double eps) {
  torch::jit::Stack stack;
  torch::jit::push(stack, input, weight, bias, std::move(N), std::move(C), std::move(HxW), group, eps);
  static const c10::OperatorHandle fwd = op("aten::native_group_norm");
  forward_to_executor(fwd, &stack);
  auto out = three(stack);
  const c10::MemoryFormat f = input.suggest_memory_format();
  if (f != c10::MemoryFormat::Contiguous && std::get<2>(out).defined() && std::get<2>(out).has_storage()) {
    layouts().remember(std::get<2>(out), f);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> native_group_norm_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, c10::SymInt N, c10::SymInt C, c10::SymInt HxW, int64_t group,
    std::array<bool, 3> output_mask) {
  at::Tensor g = grad_out;
  at::Tensor x = input;
  if (const auto f = layouts().lookup(rstd)) {
    // What the CPU formula passes a CPU input of this format (Note [GroupNorm layouts]).
    g = grad_out.contiguous(*f);
    x = input.contiguous(*f);
  }
  torch::jit::Stack stack;
  torch::jit::push(stack, g, x, mean, rstd, weight, std::move(N), std::move(C), std::move(HxW), group,
                   std::vector<bool>(output_mask.begin(), output_mask.end()));
  static const c10::OperatorHandle bwd = op("aten::native_group_norm_backward");
  forward_to_executor(bwd, &stack);
  return three(stack);
}

}  // namespace superchip::native
