# cmake -DNM=<nm> -DLIBRARY=<shared library> -P check_shared_runtime.cmake: fails when LIBRARY defines
# std::locale::classic(), i.e. carries a static copy of libstdc++ (cmake/GpuopsSharedRuntime.cmake says why not).
execute_process(COMMAND ${NM} -D --defined-only ${LIBRARY} OUTPUT_VARIABLE symbols RESULT_VARIABLE failed)
if(failed)
  message(WARNING "gpuops: ${NM} could not read ${LIBRARY}; the C++ runtime check is skipped")
elseif(symbols MATCHES "_ZNSt6locale7classicEv")
  message(FATAL_ERROR "gpuops: ${LIBRARY} carries its own static libstdc++ (it defines std::locale::classic), a "
                      "second C++ runtime beside torch's: configure with -DGPUOPS_LINK_LIBSTDCXX_BY_PATH=ON and "
                      "drop -static-libstdc++ from the linker flags")
endif()
