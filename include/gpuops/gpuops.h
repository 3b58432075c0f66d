#pragma once
// gpuops: the umbrella header. Include it, link gpuops::gpuops.
#include "gpuops/amp.h"
#include "gpuops/autocast.h"
#include "gpuops/checkpoint.h"
#include "gpuops/device.h"
#include "gpuops/errors.h"
#include "gpuops/estimator.h"
#include "gpuops/fused_adam.h"
#include "gpuops/fused_sgd.h"
#include "gpuops/grad_accumulator.h"
#include "gpuops/grad_scaler.h"
#include "gpuops/memory_budget.h"
#include "gpuops/optimizers.h"
