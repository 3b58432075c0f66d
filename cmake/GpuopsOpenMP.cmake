# at::parallel_for is inline header code over OpenMP in torch's OpenMP builds (ATen/ParallelOpenMP.h, the
# Linux wheels): a file compiled without -fopenmp runs every parallel_for on one thread. Our CPU loops use
# it, so the library is compiled with -fopenmp and linked to the OpenMP runtime torch itself loads (the
# libgomp.so.1 next to libtorch_cpu), never to a second copy: one thread pool, sized by torch.set_num_threads.
function(gpuops_use_torch_openmp target)
  list(GET TORCH_INCLUDE_DIRS 0 torch_include)
  file(STRINGS "${torch_include}/ATen/Config.h" parallel_openmp REGEX "#define AT_PARALLEL_OPENMP 1")
  if(NOT parallel_openmp)
    return()  # a native or TBB torch build: parallel_for is compiled into libtorch_cpu, nothing to do
  endif()
  get_filename_component(torch_lib_dir "${TORCH_LIBRARY}" DIRECTORY)
  find_library(GPUOPS_TORCH_OPENMP_RUNTIME NAMES libgomp.so.1 PATHS "${torch_lib_dir}" NO_DEFAULT_PATH)
  if(GPUOPS_TORCH_OPENMP_RUNTIME)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fopenmp>)
    target_link_libraries(${target} PRIVATE "${GPUOPS_TORCH_OPENMP_RUNTIME}")
  else()  # a torch that uses the system's OpenMP runtime
    find_package(OpenMP REQUIRED COMPONENTS CXX)
    target_link_libraries(${target} PRIVATE OpenMP::OpenMP_CXX)
  endif()
endfunction()
