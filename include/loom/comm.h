// loom/comm.h: the Communicator interface. Everything that crosses ranks goes through it;
// context-parallel algorithms see only this header, never MPI or NCCL types.
//
// Buffers are bytes; a dtype appears only where a reduction needs one. Every blocking call takes
// a timeout in seconds (a negative value means "the communicator's default", which comes from
// LOOM_TIMEOUT_S, or 60 s when that is unset). A wait that runs past its deadline throws
// loom::Timeout; a failed peer or backend error throws loom::CommError. Both messages name this
// rank and the peer(s) involved.
//
// After an error a communicator cannot be used again. Once any operation of a communicator (a
// wait or test, a post, a collective, split) has thrown Timeout or CommError on this rank, that
// communicator and every communicator of its split tree (the one it was split from, and every
// split of those, transitively) throw CommError at once from every later operation, naming the
// first error: the failed operation may have left messages in flight (a late peer's send arrives
// after the receive gave up) and this rank's operations are out of step with its peers', so a
// later receive would take a stale message and return a wrong answer without an error. Create a
// new communicator instead (run_local, mpi_world, a new process group): every rank must take
// part, and mpi_world() throws Timeout when one does not (a rank that stopped). Errors found
// before anything is posted (InvalidArgument for bad arguments, NotSupported) leave it usable.
//
// Thread-safety. A Communicator is used by one thread at a time (its rank's thread); Work handles
// are used by the thread that created them. Different Communicators (ranks, or groups made by
// split) may be used concurrently from different threads.
//
// Collectives (barrier and split included) must be called by every rank of the group in the
// same order (as MPI requires): the same collective, with all_gather's bytes and the count, dtype
// and op of a reduction equal on every rank, and all_to_all's send_bytes[p] on rank r equal to
// recv_bytes[r] on rank p. Buffers: all_gather's send may overlap its receive only as this rank's
// own block (send = recv + rank * bytes, in place); reduce_scatter's send and receive must not
// overlap; all_to_all's receive parts must overlap neither each other nor a send part (all_reduce
// is in place). That is the caller's contract. What each backend checks of it:
//   local  all of it, before anything is posted: every rank of the call throws the same
//          InvalidArgument naming the ranks and what differs (or the rank whose buffers
//          overlap), and the communicator stays usable. A debugging aid: run the code on it.
//          A rank that never makes the call is waited for as any peer (Timeout; CommError at
//          once when it failed or returned).
//   mpi    none of it (checking would cost a collective per call): a size mismatch fails the
//          call on the rank that receives too much (MPI_ERR_TRUNCATE) and the others may return
//          with bytes unfilled and no error; another collective, dtype or op is erroneous in MPI
//          (a wrong answer, or a wait until Timeout). all_gather in place is passed as
//          MPI_IN_PLACE; other overlaps are MPI's erroneous aliasing.
//   torch  the local backend's algorithms over c10d, without its check: a size mismatch fails
//          where c10d notices it (CommError on a receiving rank) or ends in Timeout; another
//          dtype or op, or overlapping buffers, give a wrong answer without an error.
// Buffers handed to isend/irecv must stay valid until the Work completes (wait/test true) or the
// Work is destroyed; destroying an unfinished Work cancels it where the backend can and otherwise
// waits for it (bounded by the timeout).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "loom/io.h"

namespace loom {

enum class DType { f32, f64, i64 };
// max on f32/f64: a NaN on any rank gives NaN on every rank (as sum carries it), on every
// backend; +inf and -inf compare as usual.
enum class ReduceOp { sum, max };
size_t dtype_size(DType t);

// Counters every backend keeps per communicator (and its splits share nothing).
struct CommStats {
  int64_t bytes_sent = 0;
  int64_t bytes_recv = 0;
  int64_t messages_sent = 0;
  double wait_s = 0;  // seconds spent blocked in wait() / collectives
};

class Work {
 public:
  virtual ~Work() = default;
  // True when the operation finished; throws CommError if it failed.
  virtual bool test() = 0;
  // Blocks until done. timeout_s < 0: the communicator's default; else 0 to 1e9 seconds
  // (InvalidArgument for NaN, inf or more).
  virtual void wait(double timeout_s = -1) = 0;
};
using WorkPtr = std::unique_ptr<Work>;

// One side of a point-to-point exchange for batch_p2p.
// kind must be send or recv: batch_p2p refuses any other value (InvalidArgument) before it posts
// anything (int is the underlying type, so that such a value is one a caller can hold).
struct P2POp {
  enum Kind : int { send, recv } kind;
  void* buf;  // const for sends
  size_t bytes;
  int peer;
  int tag = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "local", "mpi" or "torch".
  virtual std::string backend() const = 0;

  // New communicator over the ranks that pass the same color, ordered by (key, old rank).
  // Collective over this communicator. color < 0 gives nullptr for that rank. On MPI the
  // ranks first meet in a timed all-gather (Timeout as any collective); MPI_Comm_split, which
  // has no non-blocking form, then runs under a watchdog: a rank that stops or dies inside it
  // makes the others print one line and exit with status 1 after the timeout (nothing can be
  // thrown into the blocked call), which ends the job under mpirun.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

  // Point to point. Messages between one (sender, receiver, tag) arrive in posting order.
  // A receive whose message is longer than `bytes` fails with CommError. More than PTRDIFF_MAX
  // bytes (a negative size cast to size_t) is InvalidArgument. The local backend's isend copies
  // a message whose receive is not posted yet: OutOfMemory naming the size when it cannot.
  virtual WorkPtr isend(const void* buf, size_t bytes, int peer, int tag = 0) = 0;
  virtual WorkPtr irecv(void* buf, size_t bytes, int peer, int tag = 0) = 0;

  // Posts all operations together (a ring step's send and receive) and returns their handles.
  virtual std::vector<WorkPtr> batch_p2p(const std::vector<P2POp>& ops);

  // Each rank sends send_bytes[p] bytes at send + send_offsets[p] to rank p and receives
  // recv_bytes[p] bytes from rank p into recv + recv_offsets[p]. Sizes may differ per peer and
  // may be zero; send_bytes[p] on rank r must equal recv_bytes[r] on rank p.
  virtual void all_to_all(const void* send, const size_t* send_bytes, const size_t* send_offsets,
                          void* recv, const size_t* recv_bytes, const size_t* recv_offsets,
                          double timeout_s = -1) = 0;
  // Equal splits: `bytes_per_rank` bytes to and from each rank, packed by rank.
  void all_to_all(const void* send, void* recv, size_t bytes_per_rank, double timeout_s = -1);

  // recv holds size() * bytes: rank p's contribution at p * bytes.
  virtual void all_gather(const void* send, size_t bytes, void* recv, double timeout_s = -1) = 0;
  // send holds size() * count elements; rank p receives the reduction of block p into recv
  // (count elements).
  virtual void reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                              double timeout_s = -1) = 0;
  // In place over count elements.
  virtual void all_reduce(void* buf, size_t count, DType dtype, ReduceOp op,
                          double timeout_s = -1) = 0;
  virtual void barrier(double timeout_s = -1) = 0;

  // Default timeout of this communicator's waits, seconds: as LOOM_TIMEOUT_S, from 0.001 to 1e9
  // (InvalidArgument otherwise: an infinite one made every local wait return at once and spin,
  // and the sender hang; a negative one made every wait time out "after 0 s").
  double timeout_s() const { return timeout_s_; }
  void set_timeout_s(double t) { timeout_s_ = checked_timeout_s(t); }
  // t if it is a communicator's timeout (above), else InvalidArgument naming it.
  static double checked_timeout_s(double t);

  CommStats& stats() { return stats_; }
  const CommStats& stats() const { return stats_; }

 protected:
  // The default timeout: LOOM_TIMEOUT_S, read (and checked) here.
  Communicator() = default;
  // A given timeout (checked_timeout_s): LOOM_TIMEOUT_S is not read, so a communicator made with
  // a timeout of its own works whatever the variable holds (an invalid one made every
  // communicator's construction throw, set_timeout's too).
  explicit Communicator(double timeout_s) : timeout_s_(checked_timeout_s(timeout_s)) {}
  // A wait's timeout: < 0 the communicator's; else at most 1e9 s (InvalidArgument for NaN, inf or
  // more: NaN waited with no timeout at all, inf for ever).
  double resolve_timeout(double t) const;
  double timeout_s_ = default_timeout_s();
  CommStats stats_;

 public:
  // LOOM_TIMEOUT_S if set (InvalidArgument unless a positive number of seconds), else 60.
  static double default_timeout_s();
};

// env_seconds (LOOM_TIMEOUT_S and the other variables of seconds): loom/io.h.

// ---------------------------------------------------------------------------------------------
// local backend: ranks are threads of one process sharing mailboxes.

// Fault injection for tests and `loom attn --fault` (local backend only).
struct FaultPlan {
  int kill_rank = -1;      // this rank fails (throws CommError "rank R was killed") ...
  int64_t kill_at_op = 0;  // ... at its kill_at_op-th communication operation (0-based)
  int drop_rank = -1;      // this rank's drop_at_op-th send is silently lost
  int64_t drop_at_op = 0;
  int delay_rank = -1;  // every send of this rank is delivered delay_ms late
  int delay_ms = 0;
  bool any() const { return kill_rank >= 0 || drop_rank >= 0 || delay_rank >= 0; }
};

// Parses "kill:R", "drop:R", "delay:R:MS" (optionally ",at=K" for kill/drop). Without ",at=K",
// K = 1: the rank's second op (kill) or second message (drop), so the fault lands mid-run. An op
// is any isend, irecv, collective, barrier or split call of that rank on any of its
// communicators; messages include those sent inside collectives. Throws InvalidArgument naming
// the text.
FaultPlan parse_fault(const std::string& text);

// Runs fn(comm) on `ranks` threads, one local Communicator each. When any rank throws, the world
// is poisoned: every other rank's pending and future waits fail at once with CommError naming the
// failed rank, so nothing waits forever. Returns when all threads have ended; rethrows the first
// error (the failed rank's own, not the follow-on errors). timeout_s < 0: default. ranks in
// [1, 2^22] (Linux runs no more threads; InvalidArgument otherwise); OutOfMemory when the ranks'
// state cannot be allocated, CommError naming the rank when its thread cannot start.
void run_local(int ranks, const std::function<void(Communicator&)>& fn,
               const FaultPlan& faults = {}, double timeout_s = -1);

// ---------------------------------------------------------------------------------------------
// mpi backend (a stub that throws NotSupported in builds without MPI).

// True if this build has the MPI backend.
bool mpi_available();
// True if the process looks like it was started by mpirun/mpiexec with more than one process
// (checks OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_RANK, with srun SLURM_STEP_NUM_TASKS ...) without
// initialising MPI.
bool launched_by_mpirun();
// This process's world rank as the MPI launcher exported it (OMPI_COMM_WORLD_RANK, PMIX_RANK or
// PMI_RANK), without initialising MPI; -1 where none is set.
long launcher_rank();
// Initialises MPI (once; finalised at exit) and returns the world communicator. MPI errors are
// returned to loom (MPI_ERRORS_RETURN) and become CommError. MPI_Init itself has no timeout and
// waits for every rank of the job: if it has not returned after the default timeout (at least
// 10 s), as when another rank exited before initialising MPI, the process prints one line on
// stderr and exits with status 1 (_Exit: nothing can be thrown into the blocked call), which
// ends the job under mpirun. Every call is collective over the whole job (a new duplicate of
// MPI_COMM_WORLD, MPI_Comm_idup, and on the first call a timed count of the node's ranks): it
// throws Timeout when another rank has not joined within the default timeout (LOOM_TIMEOUT_S;
// at least 10 s on the first call, which starts the job). The MPI calls loom makes with no
// timeout of their own are MPI_Init, MPI_Comm_split (split, above) and MPI_Finalize (at exit,
// bounded by LOOM_FINALIZE_TIMEOUT_S), each under a watchdog that ends the process.
std::unique_ptr<Communicator> mpi_world();
// The job's ranks on this process's node (itself included), counted by the first mpi_world()
// from the ranks' processor names; 0 before that call, and in builds without MPI. Whatever the
// launcher (Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE is Open MPI's alone: under another launcher the
// tools took the whole world for one node, and refused a job by a node's memory that fitted).
int mpi_ranks_on_this_node();
// Ends the whole MPI job at once after a fatal error on this rank (MPI_Abort); no-op without MPI.
void mpi_abort(int code);
// For a tool about to print its error line and end the job (mpi_abort), so that the job prints
// one line, naming the rank at fault: call it on the failing rank in place of a wait of wait_s
// seconds before the line. It tells the other ranks which rank this one waited on when its MPI
// communication timed out, hears theirs, and watches for another rank's line, all on loom's own
// communicator and without waiting for anyone (a stopped rank never answers). Returns false when
// another rank has printed its line first (this rank's error follows from the same fault: print
// nothing, the job is ending). Else tells the others that this rank prints, and returns true with
// *hint set to the clause to add to this rank's line when its error is an MPI timeout: the ranks
// that its wait leads to (through the waits the others reported) that reported no timeout of
// their own ("; rank 4 stopped or is slow: it reported no timeout of its own, and rank 1 waited
// on rank 2, ..."), or "; rank 1, or a rank it waits on, stopped or is slow". Before mpi_world(),
// and in builds without MPI, it only waits. hint may be null.
bool mpi_report_error(double wait_s, std::string* hint);
// Under mpirun, for work that world rank 0 does alone after the job's last collective (checking
// results, writing files), which the other ranks wait out at exit for up to
// LOOM_FINALIZE_TIMEOUT_S: while the returned handle lives, rank 0 tells them every 5 s (a
// quarter of LOOM_FINALIZE_TIMEOUT_S, if less) that it is still working, and their limit counts
// from its latest word. A check longer than the limit ended a healthy job as if rank 0 had
// stopped; a stopped rank 0 still ends it after the limit. Null (nothing to do) on other ranks,
// before mpi_world(), and in builds without MPI.
std::shared_ptr<void> mpi_rank0_alone();

// ---------------------------------------------------------------------------------------------
// torch backend: a torch.distributed ProcessGroup through c10d (src/comm/torch/). Its
// constructor takes a c10d type, so it is declared in src/comm/torch/torch_comm.h, which only the
// Python package includes; builds without torch have a stub that says so.

// True if this build has the torch backend (and the Python package).
bool torch_available();
// True if the process looks like a worker started by torchrun (TORCHELASTIC_RUN_ID, WORLD_SIZE,
// LOCAL_RANK set).
bool launched_by_torchrun();
// The backend the environment asks for: "mpi" under mpirun/mpiexec, "torch" under torchrun (the
// Python package then takes the user's process group), else "local". The one place that picks a
// backend from the launcher; tools and the Python package call it.
std::string launcher_backend();

// ---------------------------------------------------------------------------------------------
// Mesh: dp x tp x cp groups with cp = ulysses x ring. Rank order: tp innermost, then ulysses,
// then ring, then dp: world rank = ((dp_i * ring + ring_i) * ulysses + uly_i) * tp + tp_i.
struct MeshShape {
  int dp = 1, tp = 1, ulysses = 1, ring = 1;
  int cp() const { return ulysses * ring; }
  // dp * tp * ulysses * ring in int64, saturating at INT64_MAX: check a mesh against its world
  // with this (in int, --dp 4 --ring 1073741825 wrapped to 4 ranks and matched --ranks 4).
  int64_t ranks() const {
    int64_t n = 1;
    const int sizes[] = {dp, tp, ulysses, ring};
    for (int size : sizes) {
      if (__builtin_mul_overflow(n, int64_t{size}, &n)) return INT64_MAX;
    }
    return n;
  }
  // ranks() as an int, for a mesh already checked against its world.
  int world() const { return static_cast<int>(ranks()); }
};

struct Mesh {
  MeshShape shape;
  int dp_rank = 0, tp_rank = 0, uly_rank = 0, ring_rank = 0;
  std::unique_ptr<Communicator> tp;       // tp ranks sharing (dp, ring, ulysses)
  std::unique_ptr<Communicator> ulysses;  // ulysses ranks sharing (dp, ring, tp)
  std::unique_ptr<Communicator> ring;     // ring ranks sharing (dp, ulysses, tp)
  std::unique_ptr<Communicator> cp;       // ulysses x ring ranks sharing (dp, tp); cp rank =
                                          // ring_rank * ulysses + uly_rank
  std::unique_ptr<Communicator> dp;       // dp ranks sharing (tp, cp)
  std::unique_ptr<Communicator> dp_cp;    // dp x cp ranks sharing tp, in world-rank order
  int cp_rank() const { return ring_rank * shape.ulysses + uly_rank; }
};

// Collective over world. First checks (one all-gather of 40 bytes per rank over world) that
// every rank passed the same shape, and throws InvalidArgument on every rank naming the first
// difference ("rank 1 has dp=1 x tp=1 x ulysses=2 x ring=2, rank 0 dp=1 x tp=1 x ulysses=4 x
// ring=1"); then InvalidArgument when shape.world() != world.size() or any size < 1, naming all
// five numbers.
Mesh build_mesh(Communicator& world, const MeshShape& shape);

}  // namespace loom
