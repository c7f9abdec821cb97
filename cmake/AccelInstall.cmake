# `cmake --install` puts headers, static libraries and a package config in the prefix so that a consumer can
# `find_package(accelerate_cpp)` and link `accelerate_cpp::accelerate_cpp`.
include(CMakePackageConfigHelpers)

install(DIRECTORY ${PROJECT_SOURCE_DIR}/accelerate_cpp/include/accel DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS accel_trainer accelerate_cpp accel_backends accel_runtime accel_core accel_torch EXPORT accelerate_cppTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT accelerate_cppTargets NAMESPACE accelerate_cpp::
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/accelerate_cpp)
# The package config refuses a LibTorch other than the one we were built with (cmake/AccelTorchVersion.cmake,
# installed beside it; also copied next to the build tree's config, where tests/cmake/ exercises it).
set(ACCEL_BUILT_TORCH_VERSION "${Torch_VERSION}")
configure_file(${PROJECT_SOURCE_DIR}/cmake/AccelTorchVersion.cmake ${PROJECT_BINARY_DIR}/AccelTorchVersion.cmake COPYONLY)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/accelerate_cppConfig.cmake.in
  ${PROJECT_BINARY_DIR}/accelerate_cppConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/accelerate_cpp)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/accelerate_cppConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/accelerate_cppConfig.cmake ${PROJECT_BINARY_DIR}/accelerate_cppConfigVersion.cmake
  ${PROJECT_SOURCE_DIR}/cmake/AccelTorchVersion.cmake DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/accelerate_cpp)
