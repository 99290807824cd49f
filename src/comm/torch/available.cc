// This build has the torch backend (src/comm/torch/torch_comm.cc, library loom_comm_torch).
#include "loom/comm.h"

namespace loom {

bool torch_available() {
  return true;
}

}  // namespace loom
