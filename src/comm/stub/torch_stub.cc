// The torch backend in builds without torch (LOOM_WITH_TORCH=OFF, or libtorch-dev,
// python3-torch or pybind11-dev not found): there is no loom_comm_torch library and no Python
// package; this says so to the rest of loom.
#include "loom/comm.h"

namespace loom {

bool torch_available() {
  return false;
}

}  // namespace loom
