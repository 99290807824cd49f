# Communication tests (issue 3).
#   test_comm_local      every communicator body on the local backend, world sizes 1..8, plus
#                        fault injection, run_local, mesh and helper tests
#   comm_mpi_<op>_np<N>  the same bodies under mpirun -n 4 and -n 3, one ctest test per
#                        operation (label `mpi`)
loom_test(test_comm_local
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/dist/test_comm_local.cc ${CMAKE_CURRENT_LIST_DIR}/dist/comm_bodies.cc
  LIBS loom_comm
  LABELS comm dist
  TIMEOUT 120)

if(LOOM_HAVE_MPI AND MPIEXEC_EXECUTABLE)
  add_executable(test_comm_mpi
    ${CMAKE_CURRENT_LIST_DIR}/mpi/test_comm_mpi.cc ${CMAKE_CURRENT_LIST_DIR}/dist/comm_bodies.cc)
  target_include_directories(test_comm_mpi PRIVATE ${CMAKE_CURRENT_LIST_DIR})
  target_link_libraries(test_comm_mpi PRIVATE loom_comm GTest::gtest)

  # CI runs as root on 2 cores: Open MPI needs leave to run as root and to place more ranks
  # than cores. The environment variables say the same for launchers that ignore the flags.
  set(loom_mpiexec_flags "")
  execute_process(COMMAND ${MPIEXEC_EXECUTABLE} --version OUTPUT_VARIABLE loom_mpiexec_version
                  ERROR_QUIET)
  if(loom_mpiexec_version MATCHES "Open MPI|OpenRTE")
    set(loom_mpiexec_flags --oversubscribe --allow-run-as-root)
  endif()
  set(loom_mpi_env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
                   OMPI_MCA_rmaps_base_oversubscribe=1)

  # <ctest name part> <gtest filter>
  set(loom_comm_mpi_cases
    p2p "Bodies/CommMpi.Body/p2p_*"
    batch_p2p "Bodies/CommMpi.Body/batch_p2p_*"
    all_to_all "Bodies/CommMpi.Body/all_to_all_*"
    all_gather "Bodies/CommMpi.Body/all_gather"
    reduce_scatter "Bodies/CommMpi.Body/reduce_scatter"
    all_reduce "Bodies/CommMpi.Body/all_reduce:Bodies/CommMpi.Body/max_carries_nan"
    barrier "Bodies/CommMpi.Body/barrier:CommMpiEnv.*"
    split "Bodies/CommMpi.Body/split"
    timeout "Bodies/CommMpi.Body/timeout"
    stats "Bodies/CommMpi.Body/stats"
    mesh "CommMpiMesh.*")
  foreach(np 4 3)
    set(cases ${loom_comm_mpi_cases})
    while(cases)
      list(POP_FRONT cases name filter)
      set(test comm_mpi_${name}_np${np})
      add_test(NAME ${test}
               COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} ${loom_mpiexec_flags}
                       ${MPIEXEC_PREFLAGS} $<TARGET_FILE:test_comm_mpi> ${MPIEXEC_POSTFLAGS}
                       --gtest_filter=${filter})
      set_tests_properties(${test} PROPERTIES LABELS "mpi;comm" TIMEOUT 60 PROCESSORS ${np}
                                              ENVIRONMENT "${loom_mpi_env}")
    endwhile()
  endforeach()
endif()
