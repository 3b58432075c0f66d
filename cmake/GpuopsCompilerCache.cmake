# ccache in front of the C++ and CUDA compilers when it is installed: a rebuild with nothing changed
# (or a fresh clone of the same sources) compiles nothing twice. The precompiled headers need two sloppiness
# settings (ccache's manual, "Precompiled headers"): set here so that every way of building gets them.
find_program(GPUOPS_CCACHE ccache)
if(GPUOPS_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(CMAKE_CXX_COMPILER_LAUNCHER ${CMAKE_COMMAND} -E env CCACHE_SLOPPINESS=pch_defines,time_macros ${GPUOPS_CCACHE})
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${GPUOPS_CCACHE})
endif()
