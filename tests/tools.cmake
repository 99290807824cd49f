# The loom command end to end: independent NumPy float64 check of --output files, the issue's
# acceptance runs, and bad-input handling.
find_program(LOOM_SYSTEM_PYTHON NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
if(LOOM_SYSTEM_PYTHON)
  add_test(NAME loom_output_vs_numpy
           COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/tools/output_check.sh $<TARGET_FILE:loom>)
  set_tests_properties(loom_output_vs_numpy PROPERTIES TIMEOUT 300 LABELS "tool")
endif()
# bench_kernels' target lines against its own rows on a tiny sweep: which rows each line divides,
# and in which order, how each is printed, the lines a sweep cannot compute, --torch-json's rows
# matched by shape, and its refusals. Nothing is timed against a threshold.
if(LOOM_SYSTEM_PYTHON AND LOOM_BUILD_BENCH)
  add_test(NAME bench_kernels_targets
           COMMAND ${LOOM_SYSTEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/tools/bench_kernels_check.py
                   $<TARGET_FILE:bench_kernels> ${CMAKE_CURRENT_BINARY_DIR}/bench_kernels_check)
  set_tests_properties(bench_kernels_targets PROPERTIES TIMEOUT 300 LABELS "tool")
  # The benchmark scripts (torch_compare.py, bench_torch_binding.py, plan_validate.py,
  # train_validate.py, scaling.sh) and bench_comm: bad input refused in one line before anything
  # runs. Needs neither torch nor the loom command.
  add_test(NAME bench_scripts_bad_input
           COMMAND ${LOOM_SYSTEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/tools/bench_scripts_check.py
                   $<TARGET_FILE:bench_comm> ${CMAKE_CURRENT_BINARY_DIR}/bench_scripts_check)
  set_tests_properties(bench_scripts_bad_input PROPERTIES TIMEOUT 300 LABELS "tool")
endif()
# bench_kernels --torch: PyTorch's rows beside loom's in one run, and its errors.
if(LOOM_HAVE_TORCH AND LOOM_BUILD_BENCH)
  add_test(NAME bench_kernels_torch
           COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/tools/bench_torch_check.py
                   $<TARGET_FILE:bench_kernels> ${Python3_EXECUTABLE}
                   ${CMAKE_CURRENT_BINARY_DIR}/bench_torch_check)
  set_tests_properties(bench_kernels_torch PROPERTIES TIMEOUT 300 LABELS "tool;torch")
endif()
# bench/torch_attention.py, the benchmarks' PyTorch side, against fp64 (and its check failing).
if(LOOM_HAVE_TORCH)
  add_test(NAME bench_torch_attention
           COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/tools/torch_attention_check.py)
  set_tests_properties(bench_torch_attention PROPERTIES TIMEOUT 120 LABELS "tool;torch")
endif()
# bench_kernels' ggml rows and ggml_compare, where a ggml build was given (-DLOOM_GGML_DIR, see
# bench/kernels.cmake): ggml is not in Debian, so CI builds and runs neither.
if(LOOM_SYSTEM_PYTHON AND LOOM_BUILD_BENCH AND LOOM_GGML_DIR)
  add_test(NAME bench_kernels_ggml
           COMMAND ${LOOM_SYSTEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/tools/bench_ggml_check.py
                   $<TARGET_FILE:bench_kernels> $<TARGET_FILE:ggml_compare>
                   ${CMAKE_CURRENT_BINARY_DIR}/bench_ggml_check)
  set_tests_properties(bench_kernels_ggml PROPERTIES TIMEOUT 300 LABELS "tool")
endif()
add_test(NAME loom_cli_checks COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/tools/cli_checks.sh $<TARGET_FILE:loom>)
set_tests_properties(loom_cli_checks PROPERTIES TIMEOUT 600 LABELS "tool")
# loom attn's memory estimate against the peak RSS of the runs it estimates (every strategy,
# forward and backward, bf16, GQA, threads, --check). Resident sizes mean nothing under the
# sanitizers (shadow memory, quarantined frees), so the sanitized build leaves it out.
if(LOOM_SYSTEM_PYTHON AND NOT LOOM_SANITIZE)
  add_test(NAME loom_attn_memory
           COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/tools/attn_memory_check.sh $<TARGET_FILE:loom>)
  set_tests_properties(loom_attn_memory PROPERTIES TIMEOUT 300 LABELS "tool")
endif()

# loom attn's outputs and limits that failed late, hung or aborted: a FIFO whose reader stops
# reading (times out), kernel threads under ulimit -v (refused before the run), and, as root, a
# mount point as --output or a report, a read-only --output directory of its owner, and an old set
# of another user's files (named when it cannot be removed).
add_test(NAME loom_output_guards
         COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/tools/output_guard_check.sh $<TARGET_FILE:loom>)
set_tests_properties(loom_output_guards PROPERTIES TIMEOUT 120 LABELS "tool")

# Reliability (issue 11): a bounded random-fault soak on the local backend (about 35 s), and the
# MPI path once more with Open MPI forced onto TCP (pml ob1, btl tcp,self), including a rank
# killed and a rank stopped mid-run.
add_test(NAME loom_fault_soak
         COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/tools/fault_soak.sh $<TARGET_FILE:loom> 35)
set_tests_properties(loom_fault_soak PROPERTIES TIMEOUT 150 LABELS "tool;soak")
if(LOOM_HAVE_MPI AND MPIEXEC_EXECUTABLE)
  set(loom_tcp_flags --oversubscribe --allow-run-as-root --mca pml ob1 --mca btl tcp,self)
  set(loom_tcp_env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
                   OMPI_MCA_rmaps_base_oversubscribe=1)
  if(TARGET test_comm_mpi)
    add_test(NAME comm_mpi_tcp_np4
             COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 4 ${loom_tcp_flags}
                     $<TARGET_FILE:test_comm_mpi>)
    set_tests_properties(comm_mpi_tcp_np4 PROPERTIES LABELS "mpi;comm;tcp" TIMEOUT 180
                         PROCESSORS 4 ENVIRONMENT "${loom_tcp_env}")
  endif()
  if(TARGET test_cp_mpi)
    add_test(NAME cp_mpi_tcp_np3
             COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 3 ${loom_tcp_flags}
                     $<TARGET_FILE:test_cp_mpi>)
    set_tests_properties(cp_mpi_tcp_np3 PROPERTIES LABELS "mpi;cp;tcp" TIMEOUT 180 PROCESSORS 3
                         ENVIRONMENT "${loom_tcp_env}")
  endif()
  add_test(NAME loom_mpi_tcp_faults
           COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/tools/mpi_tcp_faults.sh ${MPIEXEC_EXECUTABLE}
                   $<TARGET_FILE:loom> --oversubscribe --allow-run-as-root)
  # The three fault scripts (this one, loom_mpi_error_line, loom_mpi_agree) mostly wait out
  # timeouts: 25, 41 and 48 s of wall time for 4, 10 and 15 CPU-seconds. Held to PROCESSORS 4
  # (both cores), ctest ran them alone at the end of the pass, 117 s of one idle core (clean-clone
  # CI of 44020d0). They take one slot each instead, one at a time (RESOURCE_LOCK: their timing
  # bounds stay clear of each other), started first (COST) beside the other tests; they passed
  # with their usual timings beside two busy-looping processes.
  set_tests_properties(loom_mpi_tcp_faults PROPERTIES LABELS "mpi;tool;tcp" TIMEOUT 240
                       RESOURCE_LOCK loom_mpi_faults COST 80 ENVIRONMENT "${loom_tcp_env}")
  # A rank stopped (SIGSTOP) mid-run, during rank 0's --check or before MPI_Init: one error
  # line, naming the rank at fault; a --check longer than LOOM_FINALIZE_TIMEOUT_S passes.
  add_test(NAME loom_mpi_error_line
           COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/tools/mpi_error_line_check.sh ${MPIEXEC_EXECUTABLE}
                   $<TARGET_FILE:loom> --oversubscribe --allow-run-as-root)
  set_tests_properties(loom_mpi_error_line PROPERTIES LABELS "mpi;tool" TIMEOUT 240
                       RESOURCE_LOCK loom_mpi_faults COST 90
                       ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
  # Ranks started with other arguments, reading other --input bytes or checkpoints, or failing
  # alone: the job ends at once with one line naming the rank (tools/mpi_agree_check.sh).
  add_test(NAME loom_mpi_agree
           COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/tools/mpi_agree_check.sh ${MPIEXEC_EXECUTABLE}
                   $<TARGET_FILE:loom> --oversubscribe --allow-run-as-root)
  set_tests_properties(loom_mpi_agree PROPERTIES LABELS "mpi;tool" TIMEOUT 240
                       RESOURCE_LOCK loom_mpi_faults COST 100
                       ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
endif()
