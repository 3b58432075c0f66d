# ccache in front of the C++ and CUDA compilers when it is installed: a rebuild with nothing changed
# (or a fresh clone of the same sources) compiles nothing twice. The precompiled headers need ccache's PCH
# sloppiness settings (its manual, "Precompiled headers"), set here so that every way of building gets them
# (the variable replaces a sloppiness set in ccache.conf for these compiles).
find_program(GPUOPS_CCACHE ccache)
if(GPUOPS_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(GPUOPS_CCACHE_SLOPPINESS pch_defines,time_macros,include_file_mtime,include_file_ctime)
  set(CMAKE_CXX_COMPILER_LAUNCHER ${CMAKE_COMMAND} -E env CCACHE_SLOPPINESS=${GPUOPS_CCACHE_SLOPPINESS} ${GPUOPS_CCACHE})
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${GPUOPS_CCACHE})
endif()
