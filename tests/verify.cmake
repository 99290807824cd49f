# loom verify (issue 15): conventions on hand-worked examples, the defect library (every injected
# defect named, every correct candidate passing), and the command end to end.
loom_test(test_verify SOURCES verify/test_verify.cc verify/defect_ring.cc LIBS loom_verify TIMEOUT 120)

# The defect library on disk, for the command-line runs (tests/verify/cli_checks.sh).
add_executable(make_defects ${CMAKE_CURRENT_LIST_DIR}/verify/make_defects.cc
                            ${CMAKE_CURRENT_LIST_DIR}/verify/defect_ring.cc)
target_include_directories(make_defects PRIVATE ${CMAKE_CURRENT_LIST_DIR})
target_link_libraries(make_defects PRIVATE loom_verify)
add_test(NAME loom_verify_cli
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/verify/cli_checks.sh $<TARGET_FILE:loom>
                 $<TARGET_FILE:make_defects>)
set_tests_properties(loom_verify_cli PROPERTIES TIMEOUT 300 LABELS "tool")

# The docs' worked example, where Debian's torch is installed (/usr/bin/python3).
if(LOOM_SYSTEM_PYTHON)
  execute_process(COMMAND ${LOOM_SYSTEM_PYTHON} -c "import torch, numpy"
                  RESULT_VARIABLE loom_verify_torch_rc OUTPUT_QUIET ERROR_QUIET)
  if(loom_verify_torch_rc EQUAL 0)
    add_test(NAME loom_verify_seed_ring
             COMMAND ${CMAKE_CURRENT_LIST_DIR}/verify/seed_check.sh $<TARGET_FILE:loom>
                     ${LOOM_SYSTEM_PYTHON})
    set_tests_properties(loom_verify_seed_ring PROPERTIES TIMEOUT 120 LABELS "tool")
  endif()
endif()
