# The GPT trainer (src/model, `loom train`): layer gradients against finite differences, mesh
# equivalence of loss and gradients, resume, checkpoints, and the issue's acceptance run.
loom_test(test_model_ops SOURCES unit/test_model_ops.cc LIBS loom_model TIMEOUT 120)
loom_test(test_train_mesh SOURCES dist/test_train_mesh.cc LIBS loom_model TIMEOUT 300)
# The issue's acceptance run (`loom train` 4-rank ring vs 1 rank), CLI resume and error lines.
add_test(NAME loom_train_check
         COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/tools/train_check.sh $<TARGET_FILE:loom>
                 ${PROJECT_SOURCE_DIR})
set_tests_properties(loom_train_check PROPERTIES TIMEOUT 300 LABELS "tool")
