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
