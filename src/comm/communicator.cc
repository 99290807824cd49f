// The backend-independent parts of the Communicator interface: dtype sizes, the default
// timeout, batch_p2p's default (post each op), the equal-split all_to_all, and the mpirun check
// that every build has (with or without the MPI backend).
#include <cerrno>
#include <cstdlib>
#include <string>
#include <vector>

#include "loom/comm.h"
#include "loom/error.h"

namespace loom {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
      return 4;
    case DType::f64:
      return 8;
    case DType::i64:
      return 8;
  }
  throw InvalidArgument("dtype_size: unknown dtype " + std::to_string(static_cast<int>(t)),
                        __FILE__, __LINE__);
}

double Communicator::default_timeout_s() {
  constexpr double kDefault = 60;
  const char* text = std::getenv("LOOM_TIMEOUT_S");
  if (!text || !*text) return kDefault;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(text, &end);
  LOOM_CHECK(
      errno == 0 && end != text && *end == '\0' && v > 0 && v <= 1e9, InvalidArgument,
      "LOOM_TIMEOUT_S must be a positive number of seconds (at most 1e9), got '" << text << "'");
  return v;
}

std::vector<WorkPtr> Communicator::batch_p2p(const std::vector<P2POp>& ops) {
  std::vector<WorkPtr> works;
  works.reserve(ops.size());
  for (const P2POp& op : ops) {
    if (op.kind == P2POp::send) {
      works.push_back(isend(op.buf, op.bytes, op.peer, op.tag));
    } else {
      works.push_back(irecv(op.buf, op.bytes, op.peer, op.tag));
    }
  }
  return works;
}

void Communicator::all_to_all(const void* send, void* recv, size_t bytes_per_rank,
                              double timeout_s) {
  const int n = size();
  std::vector<size_t> bytes(n, bytes_per_rank), offsets(n);
  for (int p = 0; p < n; ++p) offsets[p] = p * bytes_per_rank;
  all_to_all(send, bytes.data(), offsets.data(), recv, bytes.data(), offsets.data(), timeout_s);
}

namespace {
// An integer environment variable, or -1 when unset or not a number.
long env_int(const char* name) {
  const char* text = std::getenv(name);
  if (!text || !*text) return -1;
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  return (end == text || *end != '\0') ? -1 : v;
}
}  // namespace

bool launched_by_mpirun() {
  // World sizes set by Open MPI, MPICH/Hydra (PMI), MVAPICH and Intel MPI launchers.
  for (const char* name :
       {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"}) {
    if (env_int(name) > 1) return true;
  }
  // PMIx launchers (srun --mpi=pmix, prterun) do not always export a size; a rank above 0
  // still proves there is more than one process.
  for (const char* name : {"PMIX_RANK", "PMI_RANK"}) {
    if (env_int(name) > 0) return true;
  }
  return false;
}

}  // namespace loom
