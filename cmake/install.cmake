# `cmake --install <build> [--prefix <p>]`: what a C++ user needs to call loom's public API from
# another project (docs/library.md):
#   include/loom/...                       the public headers (include/loom/, same layout)
#   lib/libloom_<area>.a                   core, kernels, comm, cp, model, plan, verify
#   lib/cmake/loom/loomConfig.cmake        find_package(loom CONFIG): imported targets loom::core
#                                          ... loom::verify, and loom::loom linking all of them
#   bin/loom                               the command
# Tests, benchmarks, the torch backend and the Python extension are not installed. Included from
# the top-level CMakeLists.txt in the full build only (not with LOOM_KERNELS_ONLY).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# The static libraries, exported as loom::<area> (the area's folder under src/).
set(loom_installed_libraries
    loom_core loom_kernels loom_comm loom_cp loom_model loom_plan loom_verify)
foreach(lib ${loom_installed_libraries})
  string(REPLACE "loom_" "" area ${lib})
  set_target_properties(${lib} PROPERTIES EXPORT_NAME ${area})
endforeach()

install(TARGETS ${loom_installed_libraries} EXPORT loomTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
# (loom::core carries the include path: src/core/CMakeLists.txt.)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/loom DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.h")
install(TARGETS loom RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

set(loom_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/loom)
install(EXPORT loomTargets NAMESPACE loom:: DESTINATION ${loom_cmake_dir})

# What loomConfig.cmake must find again for the libraries' link interface (src/*/CMakeLists.txt):
# Threads and OpenMP (core, kernels, verify), Highway (kernels: $<LINK_ONLY:hwy::hwy>), MPI's C
# library where the build has the MPI backend (comm), and OpenBLAS (model: loom::openblas, made
# by the config file from the library this build linked). nlohmann_json is a build-time header
# only ($<BUILD_INTERFACE:...>), CLI11 the command's alone.
get_filename_component(LOOM_OPENBLAS_DIR "${LOOM_OPENBLAS_LIB}" DIRECTORY)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/loomConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/cmake/loomConfig.cmake
                              INSTALL_DESTINATION ${loom_cmake_dir})
# 0.x: a minor version may change the API (CMake's rule for 0.x under SameMinorVersion).
write_basic_package_version_file(${PROJECT_BINARY_DIR}/cmake/loomConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/cmake/loomConfig.cmake
              ${PROJECT_BINARY_DIR}/cmake/loomConfigVersion.cmake
        DESTINATION ${loom_cmake_dir})
