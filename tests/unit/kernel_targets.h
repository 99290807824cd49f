// Value-parameterised tests over every compiled instruction-set target of the tile operations
// (src/kernels/tile_ops.h): GetParam() is the target's LOOM_KERNEL name. A target this CPU cannot
// run is skipped with its name and the reason, never silently passed:
//   const TileOps* ops = ops_or_skip();
//   if (ops == nullptr) GTEST_SKIP() << GetParam() << ": this CPU cannot run this target";
// LOOM_TEST_RUNNABLE (a comma-separated list of target names) names targets that must run here:
// one of them that the CPU cannot run fails instead of skipping, and so does a name that is no
// compiled target. The emulated Arm tests set it (tests/emulated/), so an emulator that lacks a
// target is caught.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "../src/kernels/tile_ops.h"

namespace loom::kernels {

// The target names LOOM_TEST_RUNNABLE lists (none when it is unset).
inline std::vector<std::string> required_to_run() {
  const char* env = std::getenv("LOOM_TEST_RUNNABLE");
  std::istringstream list(env != nullptr ? env : "");
  std::vector<std::string> names;
  for (std::string item; std::getline(list, item, ',');)
    if (!item.empty()) names.push_back(item);
  return names;
}

inline std::vector<std::string> kernel_target_names() {
  std::vector<std::string> names;
  for (const KernelTarget& t : kernel_targets()) names.push_back(t.name);
  return names;
}

// Whether the compiled target of that name has bf16 dot products (TileOps::gemm_bf16: avx512bf16,
// amx), which round p and ds to bf16 (the other targets widen bf16 to fp32).
inline bool target_has_bf16_dots(const std::string& name) {
  const TileOps* t = find_target(name);
  return t != nullptr && t->gemm_bf16 != nullptr;
}

class PerKernelTarget : public ::testing::TestWithParam<std::string> {
 protected:
  // The target's table, or nullptr when this CPU cannot run it (a name that is no target fails,
  // and so does a target LOOM_TEST_RUNNABLE names that the CPU cannot run).
  const TileOps* ops_or_skip() {
    const std::vector<std::string> required = required_to_run();
    for (const std::string& want : required) {  // a name no target has is a mistake, not a skip
      bool compiled = false;
      for (const KernelTarget& t : kernel_targets()) compiled = compiled || t.name == want;
      if (!compiled) ADD_FAILURE() << "LOOM_TEST_RUNNABLE names " << want << ": no such target";
    }
    for (const KernelTarget& t : kernel_targets()) {
      if (t.name != GetParam()) continue;
      const bool need = std::count(required.begin(), required.end(), t.name) > 0;
      if (!t.runnable && need)
        ADD_FAILURE() << t.name << ": LOOM_TEST_RUNNABLE requires it, but this CPU cannot run it";
      return t.runnable ? t.ops : nullptr;
    }
    ADD_FAILURE() << "no target " << GetParam();
    return nullptr;
  }
};

}  // namespace loom::kernels
