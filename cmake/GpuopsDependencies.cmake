# Third-party packages. LibTorch comes from the torch wheel of the Python that builds us.
include(GNUInstallDirs)
find_package(Python3 REQUIRED COMPONENTS Interpreter)
if(NOT Torch_DIR)
  execute_process(
    COMMAND ${Python3_EXECUTABLE} -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
    OUTPUT_VARIABLE GPUOPS_TORCH_PREFIX OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE GPUOPS_TORCH_RESULT)
  if(NOT GPUOPS_TORCH_RESULT EQUAL 0)
    message(FATAL_ERROR "gpuops needs the torch wheel: `${Python3_EXECUTABLE} -c 'import torch'` failed. "
                        "Run scripts/bootstrap, or pass -DTorch_DIR=<site-packages>/torch/share/cmake/Torch.")
  endif()
  list(APPEND CMAKE_PREFIX_PATH ${GPUOPS_TORCH_PREFIX})
endif()
# Torch's own architecture autodetection prints noise and does not apply to our targets.
if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(ENV{TORCH_CUDA_ARCH_LIST} "9.0")
endif()
find_package(Torch REQUIRED)
find_package(fmt REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 REQUIRED)
