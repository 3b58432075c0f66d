# One C++ runtime in the process: torch's Python extension and libtorch use the shared libstdc++. A GCC whose
# development link libstdc++.so is missing (only the runtime libstdc++.so.6 and libstdc++.a installed) links
# libstdc++.a into libgpuops.so instead: a second runtime beside torch's, whose streams crashed formatting a
# number into an error message on the first GPU machine (a segfault in c10::str from a TORCH_CHECK); so does
# -static-libstdc++ in the linker flags. There the shared runtime is linked by its full name, so that the archive
# contributes nothing, and a check after the link fails the build if libgpuops.so still defines the runtime.
set(GPUOPS_SHARED_LIBSTDCXX "")
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_SYSTEM_NAME STREQUAL "Linux")
  execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so
                  OUTPUT_VARIABLE gpuops_libstdcxx_dev OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT IS_ABSOLUTE "${gpuops_libstdcxx_dev}" OR GPUOPS_LINK_LIBSTDCXX_BY_PATH
     OR "${CMAKE_SHARED_LINKER_FLAGS} $ENV{LDFLAGS}" MATCHES "static-libstdc")
    execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so.6
                    OUTPUT_VARIABLE gpuops_libstdcxx OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(NOT IS_ABSOLUTE "${gpuops_libstdcxx}")
      find_library(gpuops_libstdcxx NAMES libstdc++.so.6 PATHS /usr/lib/x86_64-linux-gnu /lib/x86_64-linux-gnu)
    endif()
    if(NOT gpuops_libstdcxx OR NOT EXISTS "${gpuops_libstdcxx}")
      message(FATAL_ERROR "gpuops: ${CMAKE_CXX_COMPILER} has no libstdc++.so and no libstdc++.so.6 was found: "
                          "install the compiler's libstdc++ development package")
    endif()
    set(GPUOPS_SHARED_LIBSTDCXX "${gpuops_libstdcxx}")
    message(STATUS "gpuops: linking the shared C++ runtime by its path, ${GPUOPS_SHARED_LIBSTDCXX} "
                   "(the compiler's libstdc++.so: '${gpuops_libstdcxx_dev}')")
  endif()
endif()

# After the link: a libgpuops.so that defines std::locale::classic() carries its own C++ runtime.
function(gpuops_check_shared_runtime target)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_SYSTEM_NAME STREQUAL "Linux" AND CMAKE_NM)
    add_custom_command(TARGET ${target} POST_BUILD VERBATIM
      COMMAND ${CMAKE_COMMAND} -DNM=${CMAKE_NM} -DLIBRARY=$<TARGET_FILE:${target}>
              -P ${PROJECT_SOURCE_DIR}/cmake/check_shared_runtime.cmake)
  endif()
endfunction()
