# `cmake --install <build> [--prefix <p>]`: what a C++ user needs to call loom's public API from
# another project (docs/library.md):
#   include/loom/...                       the public headers (include/loom/, same layout)
#   lib/libloom_<area>.a                   core, kernels, comm, cp, model, plan, verify
#   lib/cmake/loom/loomConfig.cmake        find_package(loom CONFIG): imported targets loom::core
#                                          ... loom::verify, and loom::loom linking all of them
#   bin/loom                               the command
#   share/loom/profiles/*.json             the hardware profiles of plan/profiles/, which
#                                          `loom plan --profile NAME` finds by name
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

# The shipped hardware profiles, and where `loom plan --profile NAME` looks for NAME.json
# (tools/loom/plan.cc): the installed folder, relative to the running executable (a prefix can
# move: `cmake --install --prefix` picks it after the build), then this source tree's
# plan/profiles/ (for the build tree's loom).
set(loom_profiles_dir ${CMAKE_INSTALL_DATADIR}/loom/profiles)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/plan/profiles/ DESTINATION ${loom_profiles_dir}
        FILES_MATCHING PATTERN "*.json")
if(IS_ABSOLUTE "${CMAKE_INSTALL_DATADIR}")
  set(loom_profiles_from_bin "${loom_profiles_dir}")
else()
  file(RELATIVE_PATH loom_profiles_from_bin "${CMAKE_INSTALL_FULL_BINDIR}"
       "${CMAKE_INSTALL_PREFIX}/${loom_profiles_dir}")
endif()
target_compile_definitions(loom PRIVATE LOOM_PROFILES_FROM_BIN="${loom_profiles_from_bin}"
                                        LOOM_SOURCE_PROFILES="${PROJECT_SOURCE_DIR}/plan/profiles")

set(loom_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/loom)
install(EXPORT loomTargets NAMESPACE loom:: DESTINATION ${loom_cmake_dir})

# What loomConfig.cmake must find again for the libraries' link interface (src/*/CMakeLists.txt):
# Threads (core), OpenMP and Highway (kernels and verify link them privately, $<LINK_ONLY:...>:
# a user's sources are not compiled with -fopenmp), MPI's C library where the build has the MPI
# backend (comm), and OpenBLAS (model: loom::openblas, made by the config file from the library
# this build linked). nlohmann_json is a build-time header only ($<BUILD_INTERFACE:...>), CLI11
# the command's alone.
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
