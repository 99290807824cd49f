# bench_comm: nccl-tests style sweep of ring step, all_to_all, all_gather and all_reduce on the
# local backend (--ranks N) or under mpirun. See docs/performance.md, "Communication (issue 3)".
add_executable(bench_comm ${CMAKE_CURRENT_LIST_DIR}/bench_comm.cc)
target_link_libraries(bench_comm PRIVATE loom_comm CLI11::CLI11 nlohmann_json::nlohmann_json)

# A tiny checked sweep keeps the harness itself from rotting (not a measurement).
if(LOOM_BUILD_TESTS)
  add_test(NAME bench_comm_smoke
           COMMAND bench_comm --ranks 3 --min-bytes 1K --max-bytes 64K --iters 2 --warmup 1)
  set_tests_properties(bench_comm_smoke PROPERTIES LABELS "comm;bench" TIMEOUT 60)
endif()
# Bad values: one line, exit 2, before anything runs (--ranks 0 printed an internal expression,
# --timeout -1 was taken).
if(LOOM_BUILD_TESTS)
  add_test(NAME bench_comm_refuses_bad_values COMMAND bench_comm --ranks 0)
  set_tests_properties(bench_comm_refuses_bad_values PROPERTIES LABELS "comm;bench" TIMEOUT 60
                       PASS_REGULAR_EXPRESSION "^bench_comm: --ranks: Value 0 not in range 1 to 1024")
endif()
# The edge cases of the sweep and of mpirun, each checked by its output and exit status (the
# command's stdout and stderr, then "bench_comm lines: N, exit R": N lines that start
# "bench_comm:", R its status). A size below one f32 element per rank buffer was skipped without a
# word, and a sweep of nothing printed the header alone, wrote "results": [] and exited 0;
# --ops ring_step,ring_step printed every row twice.
if(LOOM_BUILD_TESTS)
  function(loom_bench_comm_test name regex)
    add_test(NAME ${name}
             COMMAND sh -c [=[out=$("$@" 2>&1); rc=$?; printf '%s\n' "$out"
                             echo "bench_comm lines: $(printf '%s\n' "$out" | grep -c '^bench_comm:'), exit $rc"]=]
                     sh ${ARGN})
    set_tests_properties(${name} PROPERTIES LABELS "comm;bench" TIMEOUT 60
                                            PASS_REGULAR_EXPRESSION "${regex}")
  endfunction()
  loom_bench_comm_test(bench_comm_refuses_empty_sweep
    "^bench_comm: --max-bytes 3 on 2 ranks measures nothing[^\n]*raise --max-bytes\nbench_comm lines: 1, exit 2"
    $<TARGET_FILE:bench_comm> --min-bytes 3 --max-bytes 3)
  loom_bench_comm_test(bench_comm_says_skipped_sizes
    "\n# skipped: all_to_all at 4 B \\(it needs at least 12 B: one f32 element for each of the 3 ranks\\)\n# skipped: all_gather at 4 B [^\n]*\n.*  ring_step .*  all_reduce .*bench_comm lines: 0, exit 0"
    $<TARGET_FILE:bench_comm> --ranks 3 --min-bytes 4 --max-bytes 4 --iters 1 --warmup 0)
  loom_bench_comm_test(bench_comm_runs_each_op_once
    "#wrong\n  ring_step +4 [^\n]*\nbench_comm lines: 0, exit 0"
    $<TARGET_FILE:bench_comm> --ops ring_step,ring_step --min-bytes 4 --max-bytes 4 --iters 1
    --warmup 0)
endif()
# Under mpirun: --ranks (ignored: mpirun's -np sets the ranks) and --backend local (each process
# ran a sweep and table of its own and wrote the same --json) are refused, and a command-line
# error (a bad --json, a sweep of nothing) is one line from rank 0, not one per rank.
if(LOOM_BUILD_TESTS AND LOOM_HAVE_MPI AND MPIEXEC_EXECUTABLE)
  set(loom_bench_mpi_flags "")
  execute_process(COMMAND ${MPIEXEC_EXECUTABLE} --version OUTPUT_VARIABLE loom_bench_mpi_version
                  ERROR_QUIET)
  if(loom_bench_mpi_version MATCHES "Open MPI|OpenRTE")  # CI runs as root on 2 cores
    set(loom_bench_mpi_flags --oversubscribe --allow-run-as-root)
  endif()
  set(loom_bench_mpi ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 2 ${loom_bench_mpi_flags}
                     ${MPIEXEC_PREFLAGS} $<TARGET_FILE:bench_comm> ${MPIEXEC_POSTFLAGS})
  set(loom_bench_tiny --min-bytes 4 --max-bytes 8 --iters 1 --warmup 0)
  loom_bench_comm_test(bench_comm_mpi_refuses_ranks
    "bench_comm: --ranks is for the local backend; under mpirun the number of ranks is mpirun's -np.*bench_comm lines: 1, exit [1-9]"
    ${loom_bench_mpi} --ranks 4 ${loom_bench_tiny})
  loom_bench_comm_test(bench_comm_mpi_refuses_local_backend
    "bench_comm: --backend local under mpirun: .*bench_comm lines: 1, exit [1-9]"
    ${loom_bench_mpi} --backend local ${loom_bench_tiny})
  loom_bench_comm_test(bench_comm_mpi_bad_json_once
    "bench_comm: --json /nonexistent-loom-dir/x.json: .*bench_comm lines: 1, exit [1-9]"
    ${loom_bench_mpi} --json /nonexistent-loom-dir/x.json ${loom_bench_tiny})
  loom_bench_comm_test(bench_comm_mpi_refuses_empty_sweep
    "bench_comm: --max-bytes 3 on 2 ranks measures nothing.*bench_comm lines: 1, exit [1-9]"
    ${loom_bench_mpi} --min-bytes 3 --max-bytes 3)
  foreach(t bench_comm_mpi_refuses_ranks bench_comm_mpi_refuses_local_backend
            bench_comm_mpi_bad_json_once bench_comm_mpi_refuses_empty_sweep)
    set_tests_properties(${t} PROPERTIES LABELS "mpi;comm;bench" PROCESSORS 2
                         ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1")
  endforeach()
endif()
