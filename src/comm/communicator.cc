// The backend-independent parts of the Communicator interface: dtype sizes, the default
// timeout, batch_p2p's default (post each op), the equal-split all_to_all, the checking front
// every backend calls (front.h), and the launcher checks and backend choice that every build has
// (with or without the MPI and torch backends).
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "front.h"
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

double Communicator::checked_timeout_s(double t) {
  LOOM_CHECK(t >= 1e-3 && t <= 1e9, InvalidArgument,
             "timeout must be from 0.001 to 1e9 seconds, got " << seconds_text(t));
  return t;
}

double Communicator::resolve_timeout(double t) const {
  if (t < 0) return timeout_s_;
  LOOM_CHECK(t <= 1e9, InvalidArgument,
             "a wait's timeout must be at most 1e9 seconds (or < 0: the communicator's), got "
                 << seconds_text(t));
  return t;
}

double Communicator::default_timeout_s() {
  return env_seconds("LOOM_TIMEOUT_S", 60, 1e-3, 1e9);
}

std::vector<WorkPtr> Communicator::batch_p2p(const std::vector<P2POp>& ops) {
  detail::check_p2p_kinds(ops);
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

bool launched_by_torchrun() {
  // torch.distributed.run (torchrun) exports these to every worker it starts.
  return std::getenv("TORCHELASTIC_RUN_ID") != nullptr && env_int("WORLD_SIZE") >= 1 &&
         env_int("LOCAL_RANK") >= 0;
}

std::string launcher_backend() {
  if (launched_by_mpirun()) return "mpi";
  if (launched_by_torchrun()) return "torch";
  return "local";
}

namespace detail {

void check_p2p_kinds(const std::vector<P2POp>& ops) {
  for (size_t i = 0; i < ops.size(); ++i)
    LOOM_CHECK(ops[i].kind == P2POp::send || ops[i].kind == P2POp::recv, InvalidArgument,
               "batch_p2p: op " << i << " is neither a send nor a recv (kind "
                                << static_cast<int>(ops[i].kind) << ")");
}

void check_p2p(const char* op, const std::string& who, int size, const void* buf, size_t bytes,
               int peer, int tag, int max_tag) {
  LOOM_CHECK(
      peer >= 0 && peer < size, InvalidArgument,
      op << " on " << who << ": peer " << peer << " is outside the group of " << size << " ranks");
  LOOM_CHECK(tag >= 0, InvalidArgument,
             op << " on " << who << ": tag " << tag
                << " is negative (negative tags are reserved for collectives)");
  LOOM_CHECK(
      tag <= max_tag, InvalidArgument,
      op << " on " << who << ": tag " << tag << " is over this backend's largest tag " << max_tag);
  LOOM_CHECK(bytes == 0 || buf, InvalidArgument,
             op << " on " << who << ": null buffer for " << bytes << " bytes");
  // No object is larger than PTRDIFF_MAX bytes: a larger count is a wrapped size (a negative
  // number cast to size_t), which the local backend tried to allocate (std::bad_alloc).
  LOOM_CHECK(bytes <= static_cast<size_t>(PTRDIFF_MAX), InvalidArgument,
             op << " on " << who << ": " << bytes << " bytes is more than any buffer holds (at "
                << "most PTRDIFF_MAX = " << PTRDIFF_MAX << "); a negative size cast to size_t?");
}

void check_all_to_all(int rank, const size_t* send_bytes, const size_t* send_offsets,
                      const size_t* recv_bytes, const size_t* recv_offsets) {
  LOOM_CHECK(send_bytes && send_offsets && recv_bytes && recv_offsets, InvalidArgument,
             "all_to_all: size and offset arrays must not be null");
  LOOM_CHECK_EQ(send_bytes[rank], recv_bytes[rank], InvalidArgument,
                "all_to_all on rank " << rank << ": the part a rank sends to itself must "
                                      << "equal the part it receives from itself");
}

void check_buffers(const char* op, const void* send, const void* recv, size_t count,
                   const char* unit) {
  LOOM_CHECK(count == 0 || (send && recv), InvalidArgument,
             op << ": null buffer for " << count << " " << unit);
}

void check_reduction(const char* op, DType dtype, ReduceOp reduce) {
  LOOM_CHECK(dtype == DType::f32 || dtype == DType::f64 || dtype == DType::i64, InvalidArgument,
             op << ": unknown dtype " << static_cast<int>(dtype) << " (f32, f64 or i64)");
  LOOM_CHECK(reduce == ReduceOp::sum || reduce == ReduceOp::max, InvalidArgument,
             op << ": unknown reduction " << static_cast<int>(reduce) << " (sum or max)");
}

void Health::refuse(const std::string& who, const char* op) const {
  std::string first;
  {
    std::lock_guard<std::mutex> lock(mu_);
    first = first_;
  }
  throw CommError(who + ": " + op + ": this communicator failed earlier (" + first +
                      "); messages of that operation may still be in flight, so it cannot be used "
                      "again: create a new one (" +
                      remedy_ + ")",
                  __FILE__, __LINE__);
}

void Health::fail(const std::string& error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_.load(std::memory_order_relaxed)) return;
  first_ = error;
  failed_.store(true, std::memory_order_release);
}

}  // namespace detail

bool launched_by_mpirun() {
  // World sizes set by Open MPI, MPICH/Hydra (PMI), MVAPICH and Intel MPI launchers.
  bool sized = false;  // a launcher's own size wins (mpirun -np 1 inside a Slurm step)
  for (const char* name :
       {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"}) {
    const long size = env_int(name);
    if (size > 1) return true;
    sized = sized || size == 1;
  }
  if (sized) return false;
  // PMIx launchers (srun --mpi=pmix, prterun) do not always export a size; a rank above 0
  // still proves there is more than one process. Rank 0 of such a launch has only the launcher's
  // task count: Slurm's srun exports the step's (without it rank 0 ran the local backend alone
  // while the others waited for it in MPI). SLURM_STEP_NUM_TASKS alone is not enough: srun
  // without an MPI plugin starts independent processes, which export no PMI rank.
  for (const char* name : {"PMIX_RANK", "PMI_RANK"}) {
    if (env_int(name) > 0) return true;
    if (env_int(name) == 0 && env_int("SLURM_STEP_NUM_TASKS") > 1) return true;
  }
  return false;
}

long launcher_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"})
    if (const long r = env_int(name); r >= 0) return r;
  return -1;
}

}  // namespace loom
