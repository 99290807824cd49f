loom_test(test_core SOURCES unit/test_core.cc LIBS loom_core TIMEOUT 60)
# The library's contracts at its edges (fixed tolerances' regime, overlapping output views, sizes
# no memory holds, null pointers, .npy tuples): tests/unit/test_api_contracts.cc.
loom_test(test_api_contracts SOURCES unit/test_api_contracts.cc LIBS loom_verify TIMEOUT 120)
