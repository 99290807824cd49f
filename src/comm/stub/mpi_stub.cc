// The MPI backend in builds without MPI: reports itself unavailable and refuses to start.
// launched_by_mpirun() lives in communicator.cc and works in every build.
#include <algorithm>
#include <chrono>
#include <thread>

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

bool mpi_report_error(double wait_s, std::string* hint) {
  if (hint) hint->clear();
  std::this_thread::sleep_for(std::chrono::duration<double>(std::clamp(wait_s, 0.0, 1e9)));
  return true;
}

std::shared_ptr<void> mpi_rank0_alone() {
  return nullptr;
}

}  // namespace loom
