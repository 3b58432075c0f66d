# Install rules and the CMake package: find_package(gpuops CONFIG REQUIRED) gives gpuops::gpuops.
# In a wheel (scikit-build-core, wheel.install-dir = "gpuops") the same layout lands in
# site-packages/gpuops/, next to the Python package; gpuops.cmake_prefix_path points there.
include(CMakePackageConfigHelpers)
set(GPUOPS_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/gpuops)

if(SKBUILD)
  # site-packages/gpuops/lib/libgpuops.so finds site-packages/torch/lib without LD_LIBRARY_PATH.
  set_target_properties(gpuops PROPERTIES INSTALL_RPATH "$ORIGIN/../../torch/lib")
  # The pip install's `gpuops` command (.venv/bin/gpuops) is the native, torch-free binary: it starts in
  # milliseconds, where a console script imports torch first. scikit-build-core rewrites only Python
  # shebangs in the scripts folder, and the binary needs only libstdc++ and libc: it runs as built.
  set(GPUOPS_CLI_DESTINATION "${SKBUILD_SCRIPTS_DIR}")
else()
  set(GPUOPS_CLI_DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
install(TARGETS gpuops_cli RUNTIME DESTINATION "${GPUOPS_CLI_DESTINATION}")

install(TARGETS gpuops EXPORT gpuopsTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/gpuops DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT gpuopsTargets NAMESPACE gpuops:: DESTINATION ${GPUOPS_CMAKE_DIR})

set(GPUOPS_BUILT_TORCH_DIR "${Torch_DIR}")  # the LibTorch this build used: its consumers find the same one
configure_package_config_file(cmake/gpuopsConfig.cmake.in ${PROJECT_BINARY_DIR}/gpuopsConfig.cmake
  INSTALL_DESTINATION ${GPUOPS_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/gpuopsConfigVersion.cmake COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/gpuopsConfig.cmake ${PROJECT_BINARY_DIR}/gpuopsConfigVersion.cmake
  DESTINATION ${GPUOPS_CMAKE_DIR})
