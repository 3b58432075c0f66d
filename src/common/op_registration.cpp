// The autograd-side kernels shared by every gpuops operator (see op_registration.h). Boxed, so one function
// serves every schema: the written arguments are read from the schema's alias annotations.
#include "op_registration.h"

#include <vector>

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

namespace gpuops::ops {
namespace {

// Calls fn(argument index, element index or -1, tensor) for every tensor in a written argument on the stack.
template <typename Fn>
void for_each_written(const c10::OperatorHandle& op, const torch::jit::Stack& stack, const Fn& fn) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t start = stack.size() - n;
  for (size_t i = 0; i < n; ++i) {
    if (!schema.is_mutable({c10::SchemaArgType::input, i})) continue;
    const c10::IValue& value = stack[start + i];
    if (value.isTensor()) {
      fn(i, int64_t{-1}, value.toTensor());
    } else if (value.isTensorList()) {
      const auto list = value.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) fn(i, static_cast<int64_t>(j), static_cast<at::Tensor>(list[j]));
    }
  }
}

void non_differentiable(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  if (c10::GradMode::is_enabled()) {
    for_each_written(op, *stack, [&](size_t arg, int64_t element, const at::Tensor& t) {
      if (!t.defined() || !t.requires_grad()) return;
      const std::string where = op.schema().arguments()[arg].name() +
                                (element < 0 ? std::string() : "[" + std::to_string(element) + "]");
      TORCH_CHECK(false, op.schema().name(), ": ", where,
                  t.is_leaf() ? " is a leaf Variable that requires grad and is being used in an in-place operation"
                              : " requires grad, and this op writes it in place without a derivative",
                  "; call it under torch.no_grad()");
    });
  }
  at::AutoDispatchBelowAutograd guard;
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

void bump_versions_after(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  std::vector<at::Tensor> written;  // collected first: the call pops its arguments off the stack
  for_each_written(op, *stack, [&](size_t, int64_t, const at::Tensor& t) {
    if (t.defined()) written.push_back(t);
  });
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const at::Tensor& t : written) t.unsafeGetTensorImpl()->bump_version();
}

void no_outputs(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  TORCH_INTERNAL_ASSERT(op.schema().returns().empty(), op.schema().name(), " returns something: give it a Meta kernel");
  torch::jit::drop(*stack, op.schema().arguments().size());
}

}  // namespace

torch::CppFunction no_outputs_meta_kernel() {
  return torch::CppFunction::makeFromBoxedFunction<&no_outputs>();
}

torch::CppFunction non_differentiable_kernel() {
  return torch::CppFunction::makeFromBoxedFunction<&non_differentiable>();
}

torch::CppFunction version_bumping_kernel() {
  return torch::CppFunction::makeFromBoxedFunction<&bump_versions_after>();
}

}  // namespace gpuops::ops
