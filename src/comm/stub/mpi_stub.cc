// The MPI backend in builds without MPI: reports itself unavailable and refuses to start.
// launched_by_mpirun() lives in communicator.cc and works in every build.
#include "loom/comm.h"
#include "loom/error.h"

namespace loom {

bool mpi_available() {
  return false;
}

std::unique_ptr<Communicator> mpi_world() {
  throw NotSupported(
      "this build of loom has no MPI backend (MPI was not found or LOOM_WITH_MPI=OFF); "
      "install an MPI (e.g. libopenmpi-dev) and reconfigure, or use the local backend "
      "(--ranks N)",
      __FILE__, __LINE__);
}

int mpi_ranks_on_this_node() {
  return 0;
}

void mpi_abort(int) {}

}  // namespace loom
