#pragma once
// Registration of the gpuops operators (torch.ops.gpuops.*) that write their Tensor(a!) arguments and have no
// derivative: every kernel an op needs to behave like torch's own in-place ops under autograd, fake tensors
// (torch.compile, torch.library.opcheck) and functionalization.
#include <utility>

#include <torch/library.h>

namespace gpuops::ops {

/// Autograd kernel of a non-differentiable op: refuses to write a tensor that requires grad while grad mode is
/// on (torch's in-place ops refuse a leaf; a non-leaf would need a derivative we do not have), then runs the op
/// below autograd. Outputs are not differentiable (as torch.argmax's).
torch::CppFunction non_differentiable_kernel();

/// ADInplaceOrView kernel: runs the op, then bumps the version counter of every tensor in a Tensor(a!) argument,
/// as torch's in-place ops do, so autograd notices a tensor it saved being overwritten.
torch::CppFunction version_bumping_kernel();

/// Meta kernel of an op that returns nothing: with fake tensors it has nothing to make (its writes are in place,
/// and the real kernel checks every argument before writing).
torch::CppFunction no_outputs_meta_kernel();

/// Registers `name` (already def'd in m) with `kernel` for CPU and CUDA (it picks the device itself), `meta`
/// for fake tensors (it checks metadata and makes the outputs, never reads data), and the two kernels above.
template <typename Kernel, typename Meta>
void impl_mutating_op(torch::Library& m, const char* name, Kernel kernel, Meta&& meta) {
  m.impl(name, torch::dispatch(c10::DispatchKey::CPU, kernel));
  m.impl(name, torch::dispatch(c10::DispatchKey::CUDA, kernel));
  m.impl(name, torch::dispatch(c10::DispatchKey::Meta, std::forward<Meta>(meta)));
  m.impl(name, torch::dispatch(c10::DispatchKey::Autograd, non_differentiable_kernel()));
  m.impl(name, torch::dispatch(c10::DispatchKey::ADInplaceOrView, version_bumping_kernel()));
}

}  // namespace gpuops::ops
