loom_test(test_core SOURCES unit/test_core.cc LIBS loom_core TIMEOUT 60)
