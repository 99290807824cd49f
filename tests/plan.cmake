# The planner: chunks and tile counts against the real layout and kernels, and the simulator's
# exact quantities (tiles, bytes) against what `loom attn --json` reports, with equality.
loom_test(test_plan SOURCES plan/test_plan.cc LIBS loom_plan nlohmann_json::nlohmann_json
          TIMEOUT 300 LABELS plan)
target_compile_definitions(test_plan PRIVATE LOOM_BIN="$<TARGET_FILE:loom>"
                                             LOOM_PROFILES="${PROJECT_SOURCE_DIR}/plan/profiles")
add_dependencies(test_plan loom)

# The command: a ranking with an explanation, and bad input refused in one line.
add_test(NAME loom_plan_ranks
         COMMAND $<TARGET_FILE:loom> plan --model llama3-8b --seq 131072 --devices 64
                 --profile ${PROJECT_SOURCE_DIR}/plan/profiles/h100_sxm.json --explain --top 3)
set_tests_properties(loom_plan_ranks PROPERTIES LABELS "plan;tool" TIMEOUT 60
                     PASS_REGULAR_EXPRESSION "The winner is dp[0-9]+ tp[0-9]+ u[0-9]+ r[0-9]+")
add_test(NAME loom_plan_bad_profile
         COMMAND $<TARGET_FILE:loom> plan --model llama3-8b --profile /nonexistent/profile.json)
set_tests_properties(loom_plan_bad_profile PROPERTIES LABELS "plan;tool" TIMEOUT 30
                     PASS_REGULAR_EXPRESSION "loom: error: cannot read profile /nonexistent")
add_test(NAME loom_plan_unknown_strategy
         COMMAND $<TARGET_FILE:loom> plan --simulate --strategy nope
                 --profile ${PROJECT_SOURCE_DIR}/plan/profiles/h100_sxm.json)
set_tests_properties(loom_plan_unknown_strategy PROPERTIES LABELS "plan;tool" TIMEOUT 30
                     PASS_REGULAR_EXPRESSION "unknown strategy 'nope' \\(choose allgather")
# loom train's step on meshes of this machine: one rank of a tiny model measured, four meshes
# predicted (the figures' composition is checked in test_plan's PlanTrainStep); bad input refused.
add_test(NAME loom_plan_train_step
         COMMAND $<TARGET_FILE:loom> plan --train-step
                 --profile ${PROJECT_SOURCE_DIR}/plan/profiles/cpu_epyc7763_node.json
                 --model 1,32,2,2,64,256 --seq 64 --batch 2 --measure-steps 1 --mesh 1,1,1,2
                 --mesh 2,1,1,1 --mesh 1,2,1,1 --mesh 1,1,2,1)
set_tests_properties(loom_plan_train_step PROPERTIES LABELS "plan;tool" TIMEOUT 60
                     PASS_REGULAR_EXPRESSION "1 1 2 1 ulysses +[0-9.]+ +[0-9.]+")
add_test(NAME loom_plan_train_step_bad_mesh
         COMMAND $<TARGET_FILE:loom> plan --train-step --mesh 1,1,x,2
                 --profile ${PROJECT_SOURCE_DIR}/plan/profiles/cpu_epyc7763_node.json)
set_tests_properties(loom_plan_train_step_bad_mesh PROPERTIES LABELS "plan;tool" TIMEOUT 30
                     PASS_REGULAR_EXPRESSION "loom: error: --mesh '1,1,x,2': 'x' is not an integer")
add_test(NAME loom_plan_train_step_vocab
         COMMAND $<TARGET_FILE:loom> plan --train-step --mesh 1,1,1,2 --model llama3-8b
                 --profile ${PROJECT_SOURCE_DIR}/plan/profiles/cpu_epyc7763_node.json)
set_tests_properties(loom_plan_train_step_vocab PROPERTIES LABELS "plan;tool" TIMEOUT 30
                     PASS_REGULAR_EXPRESSION "vocab must be 256 \\(got 128256\\)")
# The command's bad input: profiles read like every other input (a FIFO refused at once),
# conflicting modes and out-of-range values refused, outputs that would replace the profile or
# each other refused (tests/tools/plan_checks.sh).
add_test(NAME loom_plan_checks
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/tools/plan_checks.sh $<TARGET_FILE:loom>
                 ${PROJECT_SOURCE_DIR}/plan/profiles)
set_tests_properties(loom_plan_checks PROPERTIES LABELS "plan;tool" TIMEOUT 300)
# Profiles checked field by field at load, simulation sizes that would wrap the counters, options
# that do not apply to a mode or break loom attn's strategy rules, and what would make every
# candidate of the search invalid: each one `loom: error:` line (tests/plan/plan_input_checks.sh).
add_test(NAME loom_plan_input_checks
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/plan/plan_input_checks.sh $<TARGET_FILE:loom>
                 ${PROJECT_SOURCE_DIR}/plan/profiles)
set_tests_properties(loom_plan_input_checks PROPERTIES LABELS "plan;tool" TIMEOUT 120)
