# The install test (tests/install.cmake, ctest install_example), run as
#   cmake -DBUILD_DIR=... -DSOURCE_DIR=... -DWORK_DIR=... -DGENERATOR=... -DMAKE_PROGRAM=...
#         -DC_COMPILER=... -DCXX_COMPILER=... -DBUILD_TYPE=... -P cmake/install_check.cmake
# Installs BUILD_DIR into WORK_DIR/prefix, configures SOURCE_DIR/examples/cpp against it with a
# fresh CMake (its own build folder, the same compilers and generator), builds it and runs it;
# then runs the installed loom's `plan --profile NAME` on the installed hardware profiles.
# Any step that fails fails the test, with that step's output.
foreach(var BUILD_DIR SOURCE_DIR WORK_DIR GENERATOR CXX_COMPILER)
  if(NOT ${var})
    message(FATAL_ERROR "install_check.cmake: -D${var}=... is required")
  endif()
endforeach()
if(NOT BUILD_TYPE)
  set(BUILD_TYPE Release)
endif()
set(prefix ${WORK_DIR}/prefix)
set(example ${WORK_DIR}/example)
# Nothing from an earlier run: the prefix holds exactly what this install put there.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

function(step name)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    list(JOIN ARGN " " command)
    message(NOTICE "${command}\n${out}")
    message(FATAL_ERROR "install_example: ${name} failed (${rc}), output above")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

step("install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix} --config ${BUILD_TYPE})

# The installed headers as docs/library.md promises them: each compiles alone (it includes what
# it uses) as C++17, and all of them together as C++20, warning-free under -Wall -Wextra
# -Wpedantic -Wconversion. (cp.h's consteval constructor made every header that includes it
# C++20-only.)
file(GLOB_RECURSE headers RELATIVE ${prefix}/include ${prefix}/include/loom/*.h)
list(SORT headers)
set(all_includes "")
foreach(header ${headers})
  string(MAKE_C_IDENTIFIER ${header} stem)
  file(WRITE ${WORK_DIR}/headers/${stem}.cc "#include <${header}>\n")
  string(APPEND all_includes "#include <${header}>\n")
  step("${header} alone as C++17" ${CXX_COMPILER} -std=c++17 -fsyntax-only -Wall -Wextra
       -Wpedantic -Wconversion -Werror -I${prefix}/include ${WORK_DIR}/headers/${stem}.cc)
endforeach()
file(WRITE ${WORK_DIR}/headers/all.cc "${all_includes}")
step("the headers as C++20" ${CXX_COMPILER} -std=c++20 -fsyntax-only -Wall -Wextra -Wpedantic
     -Wconversion -Werror -I${prefix}/include ${WORK_DIR}/headers/all.cc)
list(LENGTH headers n_headers)
message("installed headers: ${n_headers}, each alone as C++17 and together as C++20, no warning")
# As C++17, the oldest standard the headers support (a PyTorch 1.13 extension is built as C++17):
# -std=c++17 in the flags, and no newer standard asked for by loom's targets (checked below).
set(configure_args -S ${SOURCE_DIR}/examples/cpp -B ${example} -G ${GENERATOR}
    -DCMAKE_BUILD_TYPE=${BUILD_TYPE} -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
    -DCMAKE_CXX_FLAGS=-std=c++17
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_EXPORT_COMPILE_COMMANDS=ON)
if(C_COMPILER)
  list(APPEND configure_args -DCMAKE_C_COMPILER=${C_COMPILER})
endif()
if(MAKE_PROGRAM)
  list(APPEND configure_args -DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM})
endif()
step("configure examples/cpp" ${CMAKE_COMMAND} ${configure_args})
# The package came from this prefix, not from a loom installed elsewhere.
file(STRINGS ${example}/CMakeCache.txt loom_dir REGEX "^loom_DIR:")
if(NOT loom_dir MATCHES "^loom_DIR:PATH=${prefix}/")
  message(FATAL_ERROR "install_example: examples/cpp found loom at '${loom_dir}', not in ${prefix}")
endif()
step("build examples/cpp" ${CMAKE_COMMAND} --build ${example} --config ${BUILD_TYPE})
# loom's OpenMP stays inside its libraries: a user's sources are not compiled with -fopenmp
# (loom::kernels linked OpenMP PUBLIC, which turned on every `#pragma omp` of the user's code).
file(READ ${example}/compile_commands.json commands)
if(commands MATCHES "openmp")
  message(FATAL_ERROR "install_example: loom::loom compiles its users' sources with OpenMP:\n"
                      "${commands}")
endif()
if(NOT commands MATCHES "-std=c\\+\\+17" OR commands MATCHES "-std=(c|gnu)\\+\\+(2|1z|2a)")
  message(FATAL_ERROR "install_example: examples/cpp was not compiled as C++17 alone:\n"
                      "${commands}")
endif()
find_program(example_exe cp_attention PATHS ${example} ${example}/${BUILD_TYPE} NO_DEFAULT_PATH)
if(NOT example_exe)
  message(FATAL_ERROR "install_example: no cp_attention in ${example}")
endif()
step("run cp_attention" ${example_exe})
message("${step_output}")

# The hardware profiles are installed (share/loom/profiles/), and the installed loom finds one by
# its name: they were not installed, and `loom plan --help` pointed to plan/profiles/, which an
# installed loom does not have (`--profile h100_sxm`: "cannot open"). A copy under a name the
# source tree does not have proves the lookup goes through the prefix, not through the source
# tree this build also knows.
set(profiles ${prefix}/share/loom/profiles)
foreach(name h100_sxm h200 a100_80gb cpu_epyc7763_node)
  if(NOT EXISTS ${profiles}/${name}.json)
    message(FATAL_ERROR "install_example: ${profiles}/${name}.json was not installed")
  endif()
endforeach()
file(COPY_FILE ${profiles}/h100_sxm.json ${profiles}/install_check_copy.json)
foreach(name h100_sxm install_check_copy.json)
  step("loom plan --profile ${name}" ${prefix}/bin/loom plan --simulate --ranks 2 --strategy ring
       --seq 4096 --heads 2 --profile ${name})
  if(NOT step_output MATCHES "predicted forward")
    message(FATAL_ERROR "install_example: loom plan --profile ${name} said:\n${step_output}")
  endif()
endforeach()
step("loom plan --help" ${prefix}/bin/loom plan --help)
if(NOT step_output MATCHES "share/loom/profiles")
  message(FATAL_ERROR "install_example: loom plan --help does not say where the profiles are:\n"
                      "${step_output}")
endif()
message("installed loom plan --profile NAME: found in ${profiles}")
