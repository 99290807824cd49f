loom_test(test_layout SOURCES unit/test_layout.cc LIBS loom_cp TIMEOUT 60)
loom_test(test_cp_local SOURCES dist/test_cp_local.cc dist/cp_bodies.cc LIBS loom_cp TIMEOUT 600)
loom_test(test_cp_contracts SOURCES dist/test_cp_contracts.cc LIBS loom_cp loom_verify TIMEOUT 120)
# A strategy registered from outside src/cp (docs/strategies.md, "How to add a strategy").
loom_test(test_strategy_plugin SOURCES dist/test_strategy_plugin.cc dist/cp_bodies.cc LIBS loom_cp
          TIMEOUT 60)

# ring2d through the command (local backend), and its option errors.
add_test(NAME loom_attn_ring2d_local
         COMMAND $<TARGET_FILE:loom> attn --ranks 4 --strategy ring2d --inner 2 --layout zigzag
                 --seq 515 --heads 4 --kv-heads 2 --head-dim 32 --backward --check --iters 1
                 --warmup 0 --quiet)
set_tests_properties(loom_attn_ring2d_local PROPERTIES LABELS "tool;cp" TIMEOUT 120
                     PASS_REGULAR_EXPRESSION "check     passed")
add_test(NAME loom_attn_ring2d_errors
         COMMAND sh -c "! $<TARGET_FILE:loom> attn --ranks 4 --seq 64 --strategy ring2d --inner 3 && \
                        ! $<TARGET_FILE:loom> attn --ranks 4 --seq 64 --strategy ring2d && \
                        ! $<TARGET_FILE:loom> attn --ranks 4 --seq 64 --inner 2")
set_tests_properties(loom_attn_ring2d_errors PROPERTIES LABELS "tool;cp" TIMEOUT 60
                     PASS_REGULAR_EXPRESSION
                     "--inner 3 must divide the number of ranks 4.*needs --inner N.*--inner is only for --strategy ring2d")

# A subset under mpirun (label mpi), and the loom command under mpirun.
if(LOOM_HAVE_MPI AND MPIEXEC_EXECUTABLE)
  add_executable(test_cp_mpi ${CMAKE_CURRENT_LIST_DIR}/mpi/test_cp_mpi.cc
                             ${CMAKE_CURRENT_LIST_DIR}/dist/cp_bodies.cc)
  target_include_directories(test_cp_mpi PRIVATE ${CMAKE_CURRENT_LIST_DIR})
  target_link_libraries(test_cp_mpi PRIVATE loom_cp GTest::gtest)
  # As in comm.cmake: CI runs as root on 2 cores.
  set(loom_cp_mpi_flags --oversubscribe --allow-run-as-root)
  set(loom_cp_mpi_env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
                      OMPI_MCA_rmaps_base_oversubscribe=1)
  foreach(np 4 3)
    add_test(NAME cp_mpi_np${np}
             COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} ${loom_cp_mpi_flags}
                     $<TARGET_FILE:test_cp_mpi>)
    set_tests_properties(cp_mpi_np${np} PROPERTIES LABELS "mpi;cp" TIMEOUT 120 PROCESSORS ${np}
                                                   ENVIRONMENT "${loom_cp_mpi_env}")
  endforeach()
  # `loom attn` under mpirun, checked against fp64: one test per strategy run.
  function(loom_attn_mpi_np4 name)  # ARGN: the strategy's options
    add_test(NAME loom_attn_mpi_${name}_np4
             COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 4 ${loom_cp_mpi_flags}
                     $<TARGET_FILE:loom> attn ${ARGN} --head-dim 64 --backward --check --iters 1
                     --warmup 0 --quiet)
    set_tests_properties(loom_attn_mpi_${name}_np4 PROPERTIES LABELS "mpi;tool" TIMEOUT 120
                         PROCESSORS 4 ENVIRONMENT "${loom_cp_mpi_env}"
                         PASS_REGULAR_EXPRESSION "check     passed")
  endfunction()
  loom_attn_mpi_np4(hybrid --strategy hybrid --ulysses 2 --layout zigzag --seq 1024 --heads 8
                    --kv-heads 2)
  loom_attn_mpi_np4(ring2d --strategy ring2d --inner 2 --layout stripe --seq 1000 --heads 8
                    --kv-heads 1)
  add_test(NAME loom_attn_mpi_refuses_ranks
           COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 2 ${loom_cp_mpi_flags}
                   $<TARGET_FILE:loom> attn --ranks 2 --seq 64)
  set_tests_properties(loom_attn_mpi_refuses_ranks PROPERTIES LABELS "mpi;tool" TIMEOUT 60
                       PROCESSORS 2 ENVIRONMENT "${loom_cp_mpi_env}"
                       PASS_REGULAR_EXPRESSION "--ranks is for the local backend")
endif()
