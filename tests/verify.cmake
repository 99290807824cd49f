# loom verify (issue 15): conventions on hand-worked examples, the defect library (every injected
# defect named, every correct candidate passing), and the command end to end.
loom_test(test_verify SOURCES verify/test_verify.cc verify/defect_ring.cc LIBS loom_verify TIMEOUT 120)

# The defect library on disk, for the command-line runs (tests/verify/cli_checks.sh).
add_executable(make_defects ${CMAKE_CURRENT_LIST_DIR}/verify/make_defects.cc
                            ${CMAKE_CURRENT_LIST_DIR}/verify/defect_ring.cc)
target_include_directories(make_defects PRIVATE ${CMAKE_CURRENT_LIST_DIR})
target_link_libraries(make_defects PRIVATE loom_verify)
