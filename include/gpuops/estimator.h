#pragma once
// Umbrella header of the torch-free VRAM estimator.

#include "gpuops/estimator/activations.h"
#include "gpuops/estimator/advise.h"
#include "gpuops/estimator/caching_allocator_model.h"
#include "gpuops/estimator/checked_int.h"
#include "gpuops/estimator/device_profile.h"
#include "gpuops/estimator/estimate.h"
#include "gpuops/estimator/gpu_catalog.h"
#include "gpuops/estimator/hf_config.h"
#include "gpuops/estimator/memory_breakdown.h"
#include "gpuops/estimator/model_spec.h"
#include "gpuops/estimator/param_tensors.h"
#include "gpuops/estimator/presets.h"
#include "gpuops/estimator/printable.h"
#include "gpuops/estimator/state_layout.h"
#include "gpuops/estimator/step_phases.h"
#include "gpuops/estimator/training_setup.h"
