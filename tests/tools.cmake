# The loom command end to end: independent NumPy float64 check of --output files, the issue's
# acceptance runs, and bad-input handling.
find_program(LOOM_SYSTEM_PYTHON NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
if(LOOM_SYSTEM_PYTHON)
  add_test(NAME loom_output_vs_numpy
           COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/tools/output_check.sh $<TARGET_FILE:loom>)
  set_tests_properties(loom_output_vs_numpy PROPERTIES TIMEOUT 300 LABELS "tool")
endif()
add_test(NAME loom_cli_checks COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/tools/cli_checks.sh $<TARGET_FILE:loom>)
set_tests_properties(loom_cli_checks PROPERTIES TIMEOUT 600 LABELS "tool")
