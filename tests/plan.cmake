# The planner: chunks and tile counts against the real layout and kernels, and the simulator's
# exact quantities (tiles, bytes) against what `loom attn --json` reports, with equality.
loom_test(test_plan SOURCES plan/test_plan.cc LIBS loom_plan nlohmann_json::nlohmann_json
          TIMEOUT 300 LABELS plan)
target_compile_definitions(test_plan PRIVATE LOOM_BIN="$<TARGET_FILE:loom>"
                                             LOOM_PROFILES="${PROJECT_SOURCE_DIR}/plan/profiles")
add_dependencies(test_plan loom)
