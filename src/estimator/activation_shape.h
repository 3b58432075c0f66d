#pragma once
// The sizes the forward's saved-byte terms are written in, for one micro-batch (activations.cpp and the setup
// features that add to the forward). Private to src/estimator.

#include "gpuops/estimator/checked_int.h"
#include "gpuops/estimator/device_profile.h"
#include "gpuops/estimator/model_spec.h"
#include "gpuops/estimator/training_setup.h"

namespace gpuops::estimator {

/// How a block's tensors are typed: all fp32, autocast (fp32 residual stream, 16-bit matmuls), or 16-bit.
enum class Numerics { Fp32, Autocast, Half };

/// Every size is a CheckedInt: products of batch, sequence and model sizes throw SizeOverflow instead of
/// wrapping (estimate_memory names the argument).
struct Shape {
  Numerics mode;
  CheckedInt N, h, V, i, L;  // tokens, hidden, vocab, MLP width, layers
  CheckedInt b, s, a, d;     // batch, sequence, heads, head width
  CheckedInt e;              // compute dtype bytes (matmul outputs)
  CheckedInt r;              // residual-stream / norm-input dtype bytes
  CheckedInt mask;           // dropout mask bytes: the input dtype on the CPU, 1-byte bool on CUDA
  bool cpu;
  bool compiled;  // torch.compile: inductor's partition
  bool amp;       // autocast is on (mixed precision, AmpLayout::Autocast)
  bool peft;      // LoRA as PEFT runs it: frozen base, the LoRA terms (not compiled)
  CheckedInt Nq() const { return N * a * d; }          // q (and k, v after GQA expansion) elements
  CheckedInt scores() const { return b * a * s * s; }  // one attention matrix for all heads
};

Shape shape_of(const ModelSpec& model, const TrainingSetup& setup, const DeviceProfile& device);

}  // namespace gpuops::estimator
