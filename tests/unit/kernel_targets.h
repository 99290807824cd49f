// Value-parameterised tests over every compiled instruction-set target of the tile operations
// (src/kernels/tile_ops.h): GetParam() is the target's LOOM_KERNEL name. A target this CPU cannot
// run is skipped with its name and the reason, never silently passed:
//   const TileOps* ops = ops_or_skip();
//   if (ops == nullptr) GTEST_SKIP() << GetParam() << ": this CPU cannot run this target";
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "../src/kernels/tile_ops.h"

namespace loom::kernels {

inline std::vector<std::string> kernel_target_names() {
  std::vector<std::string> names;
  for (const KernelTarget& t : kernel_targets()) names.push_back(t.name);
  return names;
}

class PerKernelTarget : public ::testing::TestWithParam<std::string> {
 protected:
  // The target's table, or nullptr when this CPU cannot run it (a name that is no target fails).
  const TileOps* ops_or_skip() {
    for (const KernelTarget& t : kernel_targets())
      if (t.name == GetParam()) return t.runnable ? t.ops : nullptr;
    ADD_FAILURE() << "no target " << GetParam();
    return nullptr;
  }
};

}  // namespace loom::kernels
