#pragma once
// gpuops: the umbrella header. Include it, link gpuops::gpuops.
#include "gpuops/device.h"
#include "gpuops/errors.h"
#include "gpuops/estimator.h"
#include "gpuops/memory_budget.h"
