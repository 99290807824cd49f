# loom.torch tests (issue 13), only in builds with the torch backend and the Python package.
#   torch_single       one process: attention() vs torch eager and both fp64 references, fp32 and
#                      bf16, bshd and thd; an error case for every bad input
#   torch_cp_np<N>     under torchrun (loom.torchrun) with gloo, N = 2, 3, 4 processes: every
#                      strategy x layout x mask x GQA x dtype, forward and backward, against loom's
#                      fp64 reference and an independent fp64 torch implementation (N = 3: fp32
#                      only, to keep the time down; bf16 runs at 2 and 4)
#   torch_torchrun     loom.torchrun's MASTER_PORT lies outside the ephemeral port range (torch's own
#                      choice can be taken by any connection's source port before rank 0 binds it);
#                      --redirects / --tee 0-3 and i:v,j:w parsed as torchrun documents (3 was
#                      silently none on Python 3.11), bad values refused
#   torch_kill         a worker SIGKILLed mid-call: the others raise within the timeout, the
#                      launcher returns
#   torch_example      examples/torch_cp_train.py at 4 processes: at step 0 its attention outputs
#                      and every parameter gradient match one process with loom.torch.attention and
#                      torch eager attention (1e-5 norm-relative; the losses alone missed dk x 1.1),
#                      and its per-step losses (1e-5, 1e-4)
#   torch_scripts      the failure paths of examples/torch_cp_train.py (NaN losses are a mismatch,
#                      exit 1; bad values one line) and bench/bench_torch_binding.py (--alternate
#                      at head dim 128; a wrong dk found before timing, in the script and in its
#                      torchrun workers, whose own error line reaches the parent's)
if(LOOM_HAVE_TORCH)
  set(loom_torch_env PYTHONPATH=${CMAKE_BINARY_DIR}/python OMP_NUM_THREADS=1 LOOM_TIMEOUT_S=60)
  set(loom_torch_dir ${CMAKE_CURRENT_LIST_DIR}/torch)

  add_test(NAME torch_single COMMAND ${Python3_EXECUTABLE} ${loom_torch_dir}/test_single.py)
  set_tests_properties(torch_single PROPERTIES LABELS "torch" TIMEOUT 120
                                               ENVIRONMENT "${loom_torch_env}")
  foreach(np 2 3 4)
    add_test(NAME torch_cp_np${np}
             COMMAND ${Python3_EXECUTABLE} -m loom.torchrun --standalone --nproc_per_node ${np}
                     ${loom_torch_dir}/test_cp.py)
    set(env ${loom_torch_env})
    if(np EQUAL 3)
      list(APPEND env LOOM_TEST_DTYPES=fp32)
    endif()
    set_tests_properties(torch_cp_np${np} PROPERTIES LABELS "torch;dist" TIMEOUT 300
                                                     PROCESSORS ${np} ENVIRONMENT "${env}")
  endforeach()
  add_test(NAME torch_torchrun COMMAND ${Python3_EXECUTABLE} ${loom_torch_dir}/test_torchrun.py)
  set_tests_properties(torch_torchrun PROPERTIES LABELS "torch" TIMEOUT 60
                                                 ENVIRONMENT "${loom_torch_env}")
  add_test(NAME torch_kill COMMAND ${Python3_EXECUTABLE} ${loom_torch_dir}/test_kill.py)
  set_tests_properties(torch_kill PROPERTIES LABELS "torch;dist" TIMEOUT 180 PROCESSORS 3
                                             ENVIRONMENT "${loom_torch_env}")
  add_test(NAME torch_scripts
           COMMAND ${Python3_EXECUTABLE} ${loom_torch_dir}/test_scripts.py $<TARGET_FILE_DIR:loom>)
  set_tests_properties(torch_scripts PROPERTIES LABELS "torch;dist" TIMEOUT 240 PROCESSORS 2
                                                ENVIRONMENT "${loom_torch_env}")
  add_test(NAME torch_example
           COMMAND ${Python3_EXECUTABLE} -m loom.torchrun --standalone --nproc_per_node 4
                   ${PROJECT_SOURCE_DIR}/examples/torch_cp_train.py --data ${PROJECT_SOURCE_DIR}/data/kjv.txt)
  set_tests_properties(torch_example PROPERTIES LABELS "torch;dist" TIMEOUT 300 PROCESSORS 4
                                                ENVIRONMENT "${loom_torch_env}")
endif()
