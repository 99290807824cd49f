# Bounded libFuzzer runs (clang with -fsanitize=fuzzer) of the .npy reader and the --docs parser.
find_program(LOOM_CLANGXX clang++)
if(LOOM_CLANGXX)
  foreach(target npy docs)
    add_test(NAME fuzz_${target} COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/run_fuzz.sh ${target} 12)
    set_tests_properties(fuzz_${target} PROPERTIES LABELS fuzz TIMEOUT 180)
  endforeach()
endif()
