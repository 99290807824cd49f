# The GPT trainer (src/model, `loom train`): layer gradients against finite differences, mesh
# equivalence of loss and gradients, resume, checkpoints, and the issue's acceptance run.
loom_test(test_model_ops SOURCES unit/test_model_ops.cc LIBS loom_model TIMEOUT 120)
# The layer ops are model-internal (src/model/ops.h); only this unit test reads them.
target_include_directories(test_model_ops PRIVATE ${PROJECT_SOURCE_DIR}/src/model)
loom_test(test_train_mesh SOURCES dist/test_train_mesh.cc LIBS loom_model TIMEOUT 300)
# The issue's acceptance run (`loom train` 4-rank ring vs 1 rank), CLI resume and error lines.
add_test(NAME loom_train_check
         COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/tools/train_check.sh $<TARGET_FILE:loom>
                 ${PROJECT_SOURCE_DIR})
set_tests_properties(loom_train_check PROPERTIES TIMEOUT 300 LABELS "tool")
# The trainer under mpirun (label mpi): tp 2 x ring 2 on 4 processes == one local rank.
if(LOOM_HAVE_MPI AND MPIEXEC_EXECUTABLE)
  add_test(NAME loom_train_mpi_np4
           COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/tools/train_mpi_check.sh ${MPIEXEC_EXECUTABLE}
                   $<TARGET_FILE:loom> --oversubscribe --allow-run-as-root)
  set_tests_properties(loom_train_mpi_np4 PROPERTIES LABELS "mpi;tool" TIMEOUT 120 PROCESSORS 4
                       ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
endif()
# The recorder's span bounds, and the soak (issue 11 item 3): RSS after N iterations / steps
# within 2 MB of RSS after N / 10.
loom_test(test_soak_rss SOURCES dist/test_soak_rss.cc LIBS loom_model TIMEOUT 120)
