# The installed library as a C++ user sees it (docs/library.md): `cmake --install` of this build
# into a prefix under the build folder, then examples/cpp configured by a fresh CMake with
# find_package(loom), built with the same compilers and run (cmake/install_check.cmake). Needs the
# whole build (the libraries and the loom command are installed), as every test does. Not under
# the sanitizers (scripts/test.sh builds only some targets there) nor in a cross build.
if(NOT LOOM_SANITIZE AND NOT CMAKE_CROSSCOMPILING)
  add_test(NAME install_example
           COMMAND ${CMAKE_COMMAND} -DBUILD_DIR=${PROJECT_BINARY_DIR}
                   -DSOURCE_DIR=${PROJECT_SOURCE_DIR}
                   -DWORK_DIR=${CMAKE_CURRENT_BINARY_DIR}/install_example
                   -DGENERATOR=${CMAKE_GENERATOR} -DMAKE_PROGRAM=${CMAKE_MAKE_PROGRAM}
                   -DC_COMPILER=${CMAKE_C_COMPILER} -DCXX_COMPILER=${CMAKE_CXX_COMPILER}
                   -DBUILD_TYPE=$<CONFIG> -P ${PROJECT_SOURCE_DIR}/cmake/install_check.cmake)
  set_tests_properties(install_example PROPERTIES TIMEOUT 300 LABELS "install")
endif()
