# kernels: fp64 reference, blockwise forward/backward, merge.
loom_test(test_reference SOURCES unit/test_reference.cc LIBS loom_kernels LABELS kernels TIMEOUT 120)
# The longest of the sanitized run (97 s of its 155 s of tests under ASan in the clean-clone CI of
# 623f97a, which then took 98 s on two cores): two shards there, each started first (ctest runs
# the costliest first in a clean build; it started last there).
loom_test(test_blockwise SOURCES unit/test_blockwise.cc LIBS loom_kernels LABELS kernels TIMEOUT 300
          SANITIZE_SHARDS 2)
if(LOOM_SANITIZE)
  set_tests_properties(test_blockwise_shard0 test_blockwise_shard1 PROPERTIES COST 50)
else()
  set_tests_properties(test_blockwise PROPERTIES COST 72)
endif()
loom_test(test_merge SOURCES unit/test_merge.cc LIBS loom_kernels LABELS kernels TIMEOUT 60)
loom_test(test_kernels_exp SOURCES unit/test_kernels_exp.cc LIBS loom_kernels LABELS kernels TIMEOUT 60)
loom_test(test_kernels_prefetch SOURCES unit/test_kernels_prefetch.cc LIBS loom_kernels LABELS kernels TIMEOUT 60)
# attend_workspace_bytes against the kernels' measured allocations (operator new replaced).
loom_test(test_kernel_memory SOURCES unit/test_kernel_memory.cc LIBS loom_kernels LABELS kernels TIMEOUT 120)
