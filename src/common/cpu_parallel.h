#pragma once
// at::parallel_for for the CPU loops. In torch's OpenMP builds it is inline header code that runs serially
// unless this file is compiled with -fopenmp (cmake/GpuopsOpenMP.cmake): fail the build, not the speed.
#include <ATen/Config.h>
#include <ATen/Parallel.h>

#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "gpuops' CPU loops need -fopenmp with this torch build, or at::parallel_for runs on one thread"
#endif
