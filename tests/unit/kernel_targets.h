// Value-parameterised tests over every compiled instruction-set target of the tile operations
// (src/kernels/tile_ops.h): GetParam() is the target's LOOM_KERNEL name. A target this CPU cannot
// run is skipped with its name and the reason, never silently passed:
//   const TileOps* ops = ops_or_skip();
//   if (ops == nullptr) GTEST_SKIP() << GetParam() << ": this CPU cannot run this target";
// LOOM_TEST_RUNNABLE (a comma-separated list of target names) names targets that must run here:
// one of them that the CPU cannot run fails instead of skipping. The emulated Arm tests set it
// (tests/emulated/), so an emulator that lacks a target is caught.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "../src/kernels/tile_ops.h"

namespace loom::kernels {

// Whether LOOM_TEST_RUNNABLE names `name`.
inline bool required_to_run(const std::string& name) {
  const char* env = std::getenv("LOOM_TEST_RUNNABLE");
  std::istringstream list(env != nullptr ? env : "");
  for (std::string item; std::getline(list, item, ',');)
    if (item == name) return true;
  return false;
}

inline std::vector<std::string> kernel_target_names() {
  std::vector<std::string> names;
  for (const KernelTarget& t : kernel_targets()) names.push_back(t.name);
  return names;
}

class PerKernelTarget : public ::testing::TestWithParam<std::string> {
 protected:
  // The target's table, or nullptr when this CPU cannot run it (a name that is no target fails,
  // and so does a target LOOM_TEST_RUNNABLE names that the CPU cannot run).
  const TileOps* ops_or_skip() {
    for (const KernelTarget& t : kernel_targets()) {
      if (t.name != GetParam()) continue;
      if (!t.runnable && required_to_run(t.name))
        ADD_FAILURE() << t.name << ": LOOM_TEST_RUNNABLE requires it, but this CPU cannot run it";
      return t.runnable ? t.ops : nullptr;
    }
    ADD_FAILURE() << "no target " << GetParam();
    return nullptr;
  }
};

}  // namespace loom::kernels
