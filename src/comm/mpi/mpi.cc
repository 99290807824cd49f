// The MPI backend: a Communicator over an MPI communicator.
//
// Every operation is non-blocking underneath (MPI_Isend/Irecv, MPI_Ialltoallv, MPI_Iallgather,
// MPI_Ireduce_scatter_block, MPI_Iallreduce, MPI_Ibarrier), and every wait polls MPI_Test until
// the request completes or the deadline passes, yielding and then sleeping a little between
// polls so oversubscribed ranks leave each other the cores. Errors are returned, not fatal
// (MPI_ERRORS_RETURN), and become CommError with MPI's own text; a deadline becomes Timeout.
// Both name this rank and the peer (or the group, for collectives).
//
// MPI is initialised once (MPI_Init_thread, MPI_THREAD_SERIALIZED) by the first mpi_world()
// and finalised at exit if loom initialised it. MPI calls that block until other ranks join have
// no timeout of their own, so loom uses none where MPI has a non-blocking form: mpi_world()
// duplicates MPI_COMM_WORLD with MPI_Comm_idup and counts the node's ranks with a timed
// all-gather of processor names (MPI_Comm_dup and MPI_Comm_split_type held a rank for ever when
// another had stopped). MPI_Comm_split has no non-blocking form (MPI 3.1): split() runs it after
// a timed all-gather that every rank of the group has reached, under a watchdog that ends the
// process with one line past the timeout (within_deadline), as MPI_Init and MPI_Finalize are.
// All MPI calls of the process go through one mutex, so communicators may be used from
// different threads (comm.h) with SERIALIZED MPI.
// After a collective times out its request cannot be cancelled: the communicator is then
// unusable and the job should end (tools call mpi_abort). After any Timeout or CommError the
// communicator and its splits refuse every later operation with CommError (detail::Health): a
// late peer's message would otherwise meet the next receive.
//
// loom's own messages about the job go over a private duplicate of MPI_COMM_WORLD made by the
// first mpi_world() (the control communicator), never waited for beyond a deadline: rank 0's word
// that it is still working alone or has finished (mpi_rank0_alone, finalize_at_exit), and the
// reports with which failing ranks agree on one error line that names the rank at fault
// (mpi_report_error). They are small (eager) sends, started and let go: a stopped or dead peer
// never holds the sender.
//
// Traffic (CommStats) of collectives is booked as the local backend's algorithms would cause it
// (collectives.h), so the counters compare across backends.
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "../collectives.h"
#include "../front.h"
#include "loom/comm.h"
#include "loom/error.h"
#include "loom/timer.h"

namespace loom {
namespace {

// Seconds a wait polls without sleeping.
constexpr double kSpinS = 1.0;
// More ranks on this node than cores, and how many (set once at initialisation).
bool g_oversubscribed = false;
std::atomic<int> g_node_ranks{0};
// Set once a wait of this process has timed out or failed (any communicator): the job is then
// failing, and a pending send's destructor does not wait for a peer that is gone or stopped.
std::atomic<bool> g_comm_failed{false};

std::mutex& mpi_mutex() {
  static std::mutex mu;
  return mu;
}
using Lock = std::lock_guard<std::mutex>;

// The control communicator (above); MPI_COMM_NULL until the first mpi_world() has made it.
// Guarded by mpi_mutex.
MPI_Comm g_ctl = MPI_COMM_NULL;
// Its tags: rank 0's word to the others (kStillWorking, kDone), a failing rank's report of what
// it waited on, and the word of the rank that has printed the job's error line.
constexpr int kFinalTag = 1, kReportTag = 2, kPrintedTag = 3;
constexpr int kStillWorking = 1, kDone = 2;

// What this process waited on when its first MPI wait timed out (note_timeout), for its report:
// a peer's world rank, or (peer -1) every other rank of a group, `members` in world ranks (empty:
// the whole world). world: the wait was on a communicator numbered as the world.
struct Waited {
  bool timed_out = false;
  bool world = true;
  int peer = -1;
  std::vector<int> members;
};
std::mutex g_waited_mu;
Waited g_waited;

void note_timeout(int peer, const std::vector<int>& members, bool world) {
  std::lock_guard<std::mutex> lock(g_waited_mu);
  if (g_waited.timed_out) return;  // the first one: the later ones follow from it
  g_waited.timed_out = true;
  g_waited.world = world;
  g_waited.peer = peer;
  g_waited.members = members;
}

// This process's world rank and the world's size on the control communicator; false before it
// exists and after MPI_Finalize. Call with mpi_mutex held.
bool control_rank(int* rank, int* size) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  int finalized = 1;
  if (initialized) MPI_Finalized(&finalized);
  if (!initialized || finalized || g_ctl == MPI_COMM_NULL) return false;
  MPI_Comm_rank(g_ctl, rank);
  MPI_Comm_size(g_ctl, size);
  return true;
}

// Sends `words` (which must outlive the sends: static, or never freed) to every other rank on the
// control communicator and lets the requests go: a small send completes on its own, and a peer
// that stopped or died must not hold this rank. Errors are ignored (the peer is gone). Call with
// mpi_mutex held.
void tell_others(const int* words, int count, int tag, int rank, int size) {
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    MPI_Request request = MPI_REQUEST_NULL;
    if (MPI_Isend(words, count, MPI_INT, p, tag, g_ctl, &request) == MPI_SUCCESS &&
        request != MPI_REQUEST_NULL)
      MPI_Request_free(&request);
  }
}

// Waits until `deadline` (now_s) for a word that another rank has printed the job's error line,
// calling poll() (with mpi_mutex held) between looks. True when one came: this rank then prints
// nothing. Else tells the others that this rank prints (claims the line) and returns false.
// Without the control communicator it only waits.
bool another_rank_printed(double deadline, const std::function<void()>& poll = {}) {
  for (;;) {
    {
      Lock lock(mpi_mutex());
      int rank = 0, size = 0;
      if (control_rank(&rank, &size)) {
        if (poll) poll();
        int flag = 0;
        MPI_Iprobe(MPI_ANY_SOURCE, kPrintedTag, g_ctl, &flag, MPI_STATUS_IGNORE);
        if (flag) return true;
        if (now_s() >= deadline) {
          static const int kPrinted = 1;
          tell_others(&kPrinted, 1, kPrintedTag, rank, size);
          return false;
        }
      } else if (now_s() >= deadline) {
        return false;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS)
    return "MPI error " + std::to_string(code);
  return std::string(text, length);
}

bool mpi_finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

// MPI_Init waits for every rank of the job to reach it, with no timeout of its own: a rank that
// exits (even with status 0) or stops before initialising MPI leaves the others in MPI_Init
// for ever, and mpirun waits on them. A watchdog thread ends this process after the
// initialisation deadline (the communication timeout, at least kInitFloorS so a loaded machine
// starting many ranks is not mistaken for a dead one) with one line on stderr and status 1,
// which makes mpirun end the job. It cannot throw into the blocked thread, and MPI_Abort needs
// an initialised MPI, so _Exit is the only way out.
constexpr double kInitFloorS = 10;

// Open MPI's mpirun ends the other ranks about 1 s after one exits with a non-zero status
// (0.95 to 1.0 s measured at -np 4 and 8, whatever the exit: _exit, SIGKILL, SIGTERM), against a
// few milliseconds after MPI_Abort. A watchdog, which cannot call MPI, therefore waits this much
// longer on each rank above 0 (up to rank 3): the ranks reach such a deadline together (the
// split's watchdog fired on all 4 ranks at once and printed 4 lines), and the first exit now ends
// the others before they print. Rank 0 goes first, or rank 1 when rank 0 is the one stopped.
constexpr double kWatchdogStaggerS = 2;

// Runs call() (an MPI call with no timeout of its own) under a watchdog: past limit_s (plus
// kWatchdogStaggerS per rank above 0, up to rank 3) it prints "loom: error: [rank N: ]<why>" on
// stderr and ends the process with status 1 (_Exit: nothing can be thrown into the blocked call,
// and MPI_Abort may not be usable), which ends the job under mpirun.
int within_deadline(double limit_s, const std::string& why, const std::function<int()>& call) {
  const long rank = launcher_rank();
  // At most 1e9 s: wait_for's nanoseconds overflow past 9.2e9 s, and the wait returned at once
  // (10 x LOOM_TIMEOUT_S=1e9 would have ended every rank in MPI_Finalize).
  limit_s =
      std::min(limit_s, 1e9) + kWatchdogStaggerS * static_cast<double>(std::clamp(rank, 0L, 3L));
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::thread watchdog([&] {
    std::unique_lock<std::mutex> lock(mu);
    if (cv.wait_for(lock, std::chrono::duration<double>(limit_s), [&] { return done; })) return;
    const std::string text =
        "loom: error: " + (rank >= 0 ? "rank " + std::to_string(rank) + ": " : std::string()) +
        why + "\n";
    std::fputs(text.c_str(), stderr);
    std::fflush(stderr);
    std::_Exit(1);
  });
  const int rc = call();
  {
    std::lock_guard<std::mutex> lock(mu);
    done = true;
  }
  cv.notify_one();
  watchdog.join();
  return rc;
}

int init_within_deadline(int* provided) {
  const double limit_s = std::max(Communicator::default_timeout_s(), kInitFloorS);
  std::ostringstream why;
  why << "MPI initialisation did not complete within " << limit_s
      << " s: another rank of this job exited or stopped before initialising MPI "
         "(LOOM_TIMEOUT_S, at least "
      << kInitFloorS << " s, sets the limit)";
  return within_deadline(limit_s, why.str(), [&] {
    return MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, provided);
  });
}

// LOOM_FINALIZE_TIMEOUT_S: by default 10 communication timeouts but at least 10 minutes (rank 0
// may still be checking or writing files for a long time, whatever LOOM_TIMEOUT_S says).
double finalize_limit_s() {
  try {
    const double fallback = std::max(10 * Communicator::default_timeout_s(), 600.0);
    return env_seconds("LOOM_FINALIZE_TIMEOUT_S", fallback, 1e-3, 1e9);
  } catch (const Error&) {  // checked at start-up (mpi_world); here only the default is left
    return 600;
  }
}

// Prints "loom: error: rank N: <why>" and ends the job (MPI_Abort) unless another rank has
// printed its line first (another_rank_printed, waiting until `deadline`); then this rank waits
// to be ended with the job, and after 10 s ends the job itself, silently. Never returns.
[[noreturn]] void print_once_and_abort(double deadline, const std::string& why) {
  const bool quiet = another_rank_printed(deadline);
  if (quiet) std::this_thread::sleep_for(std::chrono::seconds(10));
  const long rank = launcher_rank();
  if (!quiet) {
    const std::string text =
        "loom: error: " + (rank >= 0 ? "rank " + std::to_string(rank) + ": " : std::string()) +
        why + "\n";
    std::fputs(text.c_str(), stderr);
    std::fflush(stderr);
  }
  {
    Lock lock(mpi_mutex());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  std::_Exit(1);
}

// Before MPI_Finalize: rank 0 tells the others that it is done; the others wait for that word
// (polled, so that they can still end the job with one line), limit_s from their own exit or
// from rank 0's latest word that it is still working alone (mpi_rank0_alone). Past it: one line
// and the job ends. A healthy --check longer than LOOM_FINALIZE_TIMEOUT_S ended the job as if
// rank 0 had stopped, with no report.
void wait_for_rank0(double limit_s) {
  int rank = 0, size = 0;
  {
    Lock lock(mpi_mutex());
    if (!control_rank(&rank, &size) || size < 2) return;
    if (rank == 0) {
      tell_others(&kDone, 1, kFinalTag, rank, size);
      return;
    }
  }
  const double start = now_s();
  double deadline = start + limit_s, heard = -1;  // heard: when rank 0 last said it was working
  int word = 0;
  MPI_Request request = MPI_REQUEST_NULL;
  for (;;) {
    int flag = 0, rc = MPI_SUCCESS;
    {
      Lock lock(mpi_mutex());
      if (request == MPI_REQUEST_NULL)
        rc = MPI_Irecv(&word, 1, MPI_INT, 0, kFinalTag, g_ctl, &request);
      if (rc == MPI_SUCCESS) rc = MPI_Test(&request, &flag, MPI_STATUS_IGNORE);
    }
    if (rc != MPI_SUCCESS) return;  // MPI_Finalize's own watchdog is left
    const double now = now_s();
    if (flag) {
      request = MPI_REQUEST_NULL;
      if (word == kDone) return;
      heard = now;
      deadline = now + limit_s;
      continue;
    }
    if (now >= deadline) break;
    // Rarely awake once rank 0 is evidently busy: these ranks share its cores.
    std::this_thread::sleep_for(std::chrono::milliseconds(now - start < 0.1 ? 1 : 20));
  }
  std::ostringstream why;
  why << "the other ranks did not finish within " << limit_s
      << " s after this one (LOOM_FINALIZE_TIMEOUT_S)";
  if (heard >= 0)
    why << ", nor within " << limit_s << " s of rank 0's latest word that it was still working "
        << "alone (which came " << static_cast<int64_t>(heard - start)
        << " s after this one finished)";
  why << ": rank 0 stopped or is still busy (the other ranks wait for it before MPI_Finalize)";
  // The ranks above 0 reach this deadline together: one prints, in rank order 0.1 s apart.
  print_once_and_abort(now_s() + 0.1 * std::min(rank - 1, 15), why.str());
}

// MPI_Finalize waits for every rank of the job to reach it, with no timeout: a rank that stopped
// after the last collective (during rank 0's --check, its writes) held the others there for
// ever. They wait for rank 0 first (wait_for_rank0), then LOOM_FINALIZE_TIMEOUT_S seconds in
// MPI_Finalize, then end the job with one line.
void finalize_at_exit() {
  const double limit_s = finalize_limit_s();
  wait_for_rank0(limit_s);
  Lock lock(mpi_mutex());
  if (mpi_finalized()) return;
  std::ostringstream why;
  why << "the other ranks did not finish within " << limit_s
      << " s after this one (LOOM_FINALIZE_TIMEOUT_S): one of them stopped or is still busy "
         "(MPI_Finalize waits for every rank)";
  within_deadline(limit_s, why.str(), [] { return MPI_Finalize(); });
}

// ReduceOp::max for float and double as the other backends compute it (detail::max_of): a NaN
// on any rank makes the result NaN on every rank. MPI_MAX leaves NaN unspecified (Open MPI's
// keeps whichever operand its order compares last), so a NaN a rank > 0 held could vanish.
// Integers use MPI_MAX. Created once, after MPI_Init (ensure_initialized).
MPI_Op g_max_nan = MPI_OP_NULL;

template <typename T>
void max_carrying_nan(const T* in, T* inout, int n) {
  for (int i = 0; i < n; ++i) inout[i] = detail::max_of(inout[i], in[i]);
}

void max_nan_op(void* in, void* inout, int* len, MPI_Datatype* type) {
  if (*type == MPI_FLOAT)
    max_carrying_nan(static_cast<const float*>(in), static_cast<float*>(inout), *len);
  else
    max_carrying_nan(static_cast<const double*>(in), static_cast<double*>(inout), *len);
}

void ensure_initialized() {
  static std::once_flag once;
  std::call_once(once, [] {
    Lock lock(mpi_mutex());
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      const int rc = init_within_deadline(&provided);
      if (rc != MPI_SUCCESS) {
        throw CommError("MPI_Init_thread failed: " + mpi_error_text(rc), __FILE__, __LINE__);
      }
      std::atexit(finalize_at_exit);
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    const int rc = MPI_Op_create(max_nan_op, 1, &g_max_nan);
    if (rc != MPI_SUCCESS)
      throw CommError("MPI_Op_create failed: " + mpi_error_text(rc), __FILE__, __LINE__);
  });
  LOOM_CHECK(!mpi_finalized(), CommError, "mpi_world: MPI has already been finalised");
  // A bad LOOM_FINALIZE_TIMEOUT_S is refused here, while an error can still be reported.
  env_seconds("LOOM_FINALIZE_TIMEOUT_S", 600, 1e-3, 1e9);
}

// Between two MPI_Test polls. MPI moves large messages and non-blocking collectives forward only
// inside MPI calls, so a sleeping poller stalls the transfer: poll again at once, as MPI_Wait
// does, yielding the core first when this node runs more ranks than it has cores (Open MPI's
// yield_when_idle rule). Only after kSpinS without completion, when the peer is evidently busy
// elsewhere, sleep a little between polls.
void back_off(double waited_s) {
  if (waited_s < kSpinS) {
    if (g_oversubscribed) std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(waited_s < 10 * kSpinS ? 50 : 500));
  }
}

// Polls `request` until it completes, the mutex released between polls: CommError when it
// failed, Timeout after timeout_s. describe() names the operation for both. A Timeout marks the
// process's communication as failed (g_comm_failed).
void poll_request(MPI_Request& request, MPI_Status& status, double timeout_s,
                  const std::function<std::string()>& describe) {
  const double deadline = now_s() + timeout_s;
  for (;;) {
    int flag = 0, rc = 0;
    {
      Lock lock(mpi_mutex());
      rc = MPI_Test(&request, &flag, &status);
    }
    if (rc != MPI_SUCCESS) {
      g_comm_failed = true;
      throw CommError(describe() + " failed: " + mpi_error_text(rc), __FILE__, __LINE__);
    }
    if (flag) return;
    const double now = now_s();
    if (now >= deadline) {
      g_comm_failed = true;
      std::ostringstream os;
      os << describe() << " timed out after " << timeout_s << " s";
      throw Timeout(os.str(), __FILE__, __LINE__);
    }
    back_off(now - (deadline - timeout_s));
  }
}

class MpiComm;

class MpiP2PWork final : public Work {
 public:
  MpiP2PWork(MpiComm& comm, MPI_Request request, bool is_send, int peer, int tag, size_t bytes)
      : comm_(comm), request_(request), is_send_(is_send), peer_(peer), tag_(tag), bytes_(bytes) {}
  ~MpiP2PWork() override;
  bool test() override;
  void wait(double timeout_s) override;

 private:
  std::string describe() const;
  void finish(const MPI_Status& status);
  bool test_once();

  MpiComm& comm_;
  MPI_Request request_;
  bool is_send_;
  int peer_, tag_;
  size_t bytes_;
  bool done_ = false;
};

class MpiComm final : public Communicator {
 public:
  // Takes ownership of `comm` (freed on destruction). health: the tree's, for a split; none: a
  // new tree (mpi_world).
  explicit MpiComm(MPI_Comm comm, std::shared_ptr<detail::Health> health = nullptr)
      : comm_(comm),
        health_(health ? std::move(health)
                       : std::make_shared<detail::Health>("a new mpi_world()")) {
    Lock lock(mpi_mutex());
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    // World ranks of the members, for error messages.
    MPI_Group group, world_group;
    MPI_Comm_group(comm_, &group);
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    std::vector<int> mine(size_);
    for (int p = 0; p < size_; ++p) mine[p] = p;
    world_ranks_.resize(size_);
    MPI_Group_translate_ranks(group, size_, mine.data(), world_group, world_ranks_.data());
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
    int world_size = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    is_world_ = size_ == world_size;
    for (int p = 0; p < size_; ++p) is_world_ = is_world_ && world_ranks_[p] == p;
    void* value = nullptr;
    int found = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &value, &found);
    tag_ub_ = found ? *static_cast<int*>(value) : 32767;
  }

  ~MpiComm() override {
    Lock lock(mpi_mutex());
    if (!mpi_finalized()) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }

  std::string who(int p) const {
    std::string s = "rank " + std::to_string(p);
    if (!is_world_) s += " (world rank " + std::to_string(world_ranks_[p]) + ")";
    return s;
  }
  std::string group() const {
    return "the group of " + std::to_string(size_) + " ranks" +
           (is_world_ ? std::string() : " (split)");
  }

  // Throws CommError for a failed MPI call.
  void check(int rc, const std::string& what) const {
    if (rc != MPI_SUCCESS) {
      throw CommError(who(rank_) + ": " + what + " failed: " + mpi_error_text(rc), __FILE__,
                      __LINE__);
    }
  }

  // Polls `request` until it completes; Timeout after `timeout` seconds.
  void poll(MPI_Request& request, MPI_Status& status, double timeout,
            const std::function<std::string()>& describe) {
    ScopedTimer timer(stats_.wait_s);
    poll_request(request, status, timeout, describe);
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    // Exchange (color, key) with a timed all_gather first: once it completes every rank has
    // reached split. MPI_Comm_split, which has no non-blocking form, then waits only for ranks
    // that are already there; one stopped or killed in between (or inside it) would hold the
    // others for ever, so it runs under a watchdog: past the timeout this process prints one
    // line and exits with status 1 (nothing can be thrown into the blocked call), which ends the
    // job under mpirun.
    const double timeout = resolve_timeout(-1);
    const int mine[2] = {color, key};
    std::vector<int> all(2 * size_);
    collective("split", timeout, [&](MPI_Request* r) {
      return MPI_Iallgather(mine, 2, MPI_INT, all.data(), 2, MPI_INT, comm_, r);
    });
    detail::add_traffic(stats_, detail::traffic_all_gather(size_, sizeof mine));
    MPI_Comm sub = MPI_COMM_NULL;
    std::ostringstream why;
    why << "split: MPI_Comm_split over " << group() << " did not complete within " << timeout
        << " s after every rank had reached it: a rank of the group stopped or exited inside "
           "it (it has no timeout of its own; the communicator's timeout, LOOM_TIMEOUT_S, "
           "sets the limit)";
    health_->guard([&] {
      Lock lock(mpi_mutex());
      const int c = color < 0 ? MPI_UNDEFINED : color;
      const int rc =
          within_deadline(timeout, why.str(), [&] { return MPI_Comm_split(comm_, c, key, &sub); });
      check(rc, "MPI_Comm_split");
    });
    if (sub == MPI_COMM_NULL) return nullptr;
    auto result = std::make_unique<MpiComm>(sub, health_);
    result->set_timeout_s(timeout_s_);
    return result;
  }

  WorkPtr isend(const void* buf, size_t bytes, int peer, int tag) override {
    alive("isend");
    check_p2p("isend", buf, bytes, peer, tag);
    MPI_Request request;
    health_->guard([&] {
      Lock lock(mpi_mutex());
      check(MPI_Isend(buf, static_cast<int>(bytes), MPI_BYTE, peer, tag, comm_, &request),
            "MPI_Isend to " + who(peer));
    });
    stats_.bytes_sent += static_cast<int64_t>(bytes);
    stats_.messages_sent += 1;
    return std::make_unique<MpiP2PWork>(*this, request, true, peer, tag, bytes);
  }

  WorkPtr irecv(void* buf, size_t bytes, int peer, int tag) override {
    alive("irecv");
    check_p2p("irecv", buf, bytes, peer, tag);
    MPI_Request request;
    health_->guard([&] {
      Lock lock(mpi_mutex());
      check(MPI_Irecv(buf, static_cast<int>(bytes), MPI_BYTE, peer, tag, comm_, &request),
            "MPI_Irecv from " + who(peer));
    });
    return std::make_unique<MpiP2PWork>(*this, request, false, peer, tag, bytes);
  }

  void all_to_all(const void* send, const size_t* send_bytes, const size_t* send_offsets,
                  void* recv, const size_t* recv_bytes, const size_t* recv_offsets,
                  double timeout_s) override {
    detail::check_all_to_all(rank_, send_bytes, send_offsets, recv_bytes, recv_offsets);
    std::vector<int> sc(size_), sd(size_), rc(size_), rd(size_);
    for (int p = 0; p < size_; ++p) {
      sc[p] = as_int(send_bytes[p], "all_to_all send size");
      sd[p] = as_int(send_offsets[p], "all_to_all send offset");
      rc[p] = as_int(recv_bytes[p], "all_to_all receive size");
      rd[p] = as_int(recv_offsets[p], "all_to_all receive offset");
    }
    collective("all_to_all", resolve_timeout(timeout_s), [&](MPI_Request* r) {
      return MPI_Ialltoallv(send, sc.data(), sd.data(), MPI_BYTE, recv, rc.data(), rd.data(),
                            MPI_BYTE, comm_, r);
    });
    detail::add_traffic(stats_, detail::traffic_all_to_all(rank_, size_, send_bytes, recv_bytes));
  }

  void all_gather(const void* send, size_t bytes, void* recv, double timeout_s) override {
    detail::check_buffers("all_gather", send, recv, bytes, "bytes");
    const int n = as_int(bytes, "all_gather size");
    as_int(bytes * size_, "all_gather receive size");
    const bool in_place = bytes > 0 && send == static_cast<char*>(recv) + rank_ * bytes;
    collective("all_gather", resolve_timeout(timeout_s), [&](MPI_Request* r) {
      return MPI_Iallgather(in_place ? MPI_IN_PLACE : send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_,
                            r);
    });
    detail::add_traffic(stats_, detail::traffic_all_gather(size_, bytes));
  }

  void reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                      double timeout_s) override {
    detail::check_buffers("reduce_scatter", send, recv, count, "elements");
    detail::check_reduction("reduce_scatter", dtype, op);
    const int n = as_int(count, "reduce_scatter count");
    as_int(count * size_, "reduce_scatter send count");
    collective("reduce_scatter", resolve_timeout(timeout_s), [&](MPI_Request* r) {
      return MPI_Ireduce_scatter_block(send, recv, n, mpi_type(dtype), mpi_op(op, dtype), comm_, r);
    });
    detail::add_traffic(stats_, detail::traffic_reduce_scatter(size_, count, dtype));
  }

  void all_reduce(void* buf, size_t count, DType dtype, ReduceOp op, double timeout_s) override {
    detail::check_buffers("all_reduce", buf, buf, count, "elements");
    detail::check_reduction("all_reduce", dtype, op);
    const int n = as_int(count, "all_reduce count");
    collective("all_reduce", resolve_timeout(timeout_s), [&](MPI_Request* r) {
      return MPI_Iallreduce(MPI_IN_PLACE, buf, n, mpi_type(dtype), mpi_op(op, dtype), comm_, r);
    });
    detail::add_traffic(stats_, detail::traffic_all_reduce(rank_, size_, count, dtype));
  }

  void barrier(double timeout_s) override {
    collective("barrier", resolve_timeout(timeout_s),
               [&](MPI_Request* r) { return MPI_Ibarrier(comm_, r); });
    detail::add_traffic(stats_, detail::traffic_barrier(size_));
  }

  double timeout_for(double t) const { return resolve_timeout(t); }
  int world_rank(int p) const { return world_ranks_[p]; }
  bool is_world() const { return is_world_; }
  detail::Health& health() { return *health_; }
  // CommError at once when this communicator's tree failed earlier (detail::Health).
  void alive(const char* op) const {
    if (health_->failed()) health_->refuse(who(rank_), op);
  }

 private:
  static MPI_Datatype mpi_type(DType t) {
    switch (t) {
      case DType::f32:
        return MPI_FLOAT;
      case DType::f64:
        return MPI_DOUBLE;
      case DType::i64:
        return MPI_INT64_T;
    }
    return MPI_DATATYPE_NULL;
  }
  static MPI_Op mpi_op(ReduceOp op, DType t) {
    if (op == ReduceOp::sum) return MPI_SUM;
    return t == DType::i64 ? MPI_MAX : g_max_nan;  // a NaN on any rank carried (g_max_nan)
  }

  int as_int(size_t v, const char* what) const {
    LOOM_CHECK(v <= static_cast<size_t>(INT_MAX), NotSupported,
               who(rank_) << ": " << what << " of " << v << " is over the MPI backend's limit of "
                          << INT_MAX << " (MPI-3 int counts)");
    return static_cast<int>(v);
  }

  void check_p2p(const char* what, const void* buf, size_t bytes, int peer, int tag) const {
    detail::check_p2p(what, who(rank_), size_, buf, bytes, peer, tag, tag_ub_);
    as_int(bytes, "message size");
  }

  // Starts a non-blocking collective and polls it to completion (every collective and split
  // goes through here: the one place that checks and fails the tree's health).
  void collective(const char* op, double timeout, const std::function<int(MPI_Request*)>& start) {
    alive(op);
    health_->guard([&] {
      MPI_Request request = MPI_REQUEST_NULL;
      {
        Lock lock(mpi_mutex());
        check(start(&request), op);
      }
      MPI_Status status;
      try {
        poll(request, status, timeout, [&] { return who(rank_) + ": " + op + " over " + group(); });
      } catch (const Timeout&) {
        note_timeout(-1, world_ranks_, is_world_);
        throw;
      }
    });
  }

  MPI_Comm comm_;
  std::shared_ptr<detail::Health> health_;  // shared with the splits of this communicator
  int rank_ = 0, size_ = 0, tag_ub_ = 32767;
  bool is_world_ = true;
  std::vector<int> world_ranks_;
};

std::string MpiP2PWork::describe() const {
  std::ostringstream os;
  os << comm_.who(comm_.rank()) << ": " << (is_send_ ? "send to " : "recv from ")
     << comm_.who(peer_) << " (tag " << tag_ << ", " << bytes_ << " bytes)";
  return os.str();
}

void MpiP2PWork::finish(const MPI_Status& status) {
  done_ = true;
  if (!is_send_) {
    int count = 0;
    MPI_Get_count(&status, MPI_BYTE, &count);
    comm_.stats().bytes_recv += count;
  }
}

bool MpiP2PWork::test() {
  comm_.alive("test of a request");
  if (done_) return true;
  return comm_.health().guard([&] { return test_once(); });
}

bool MpiP2PWork::test_once() {
  int flag = 0, rc = 0;
  MPI_Status status;
  {
    Lock lock(mpi_mutex());
    rc = MPI_Test(&request_, &flag, &status);
  }
  if (rc != MPI_SUCCESS) {
    done_ = true;  // a failed request is complete (and freed)
    g_comm_failed = true;
    throw CommError(describe() + " failed: " + mpi_error_text(rc), __FILE__, __LINE__);
  }
  if (flag) finish(status);
  return flag != 0;
}

void MpiP2PWork::wait(double timeout_s) {
  comm_.alive("wait of a request");
  if (done_) return;
  MPI_Status status;
  try {
    comm_.poll(request_, status, comm_.timeout_for(timeout_s), [&] { return describe(); });
  } catch (const Timeout& e) {
    note_timeout(comm_.world_rank(peer_), {}, comm_.is_world());
    comm_.health().fail(e.what());
    throw;
  } catch (const CommError& e) {
    done_ = true;
    comm_.health().fail(e.what());
    throw;
  }
  finish(status);
}

MpiP2PWork::~MpiP2PWork() {
  if (done_) return;
  std::unique_lock<std::mutex> lock(mpi_mutex());
  if (mpi_finalized() || request_ == MPI_REQUEST_NULL) return;
  // A receive can be cancelled; a send is given until the timeout to finish, then let go. Once
  // a wait of this process has timed out or failed, a send's peer is gone or stopped: it is let
  // go at once (each pending send of a ring waited its own timeout while the error unwound, and
  // a stopped rank was reported after 2 to 4 timeouts).
  if (!is_send_) MPI_Cancel(&request_);
  const double start = now_s();
  const double deadline = start + (g_comm_failed ? 0.0 : comm_.timeout_for(-1));
  while (request_ != MPI_REQUEST_NULL) {
    int flag = 0;
    if (MPI_Test(&request_, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag) return;
    const double now = now_s();
    if (now >= deadline) {
      MPI_Request_free(&request_);
      return;
    }
    lock.unlock();
    back_off(now - start);
    lock.lock();
  }
}

}  // namespace

bool mpi_available() {
  return true;
}

namespace {

std::string world_rank_text() {
  int rank = 0;
  Lock lock(mpi_mutex());
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return "rank " + std::to_string(rank);
}

// A duplicate of MPI_COMM_WORLD, waited for at most limit_s: MPI_Comm_dup blocks until every
// rank calls it, so a new mpi_world() after a Timeout (as comm.h advises) never returned when the
// rank that caused it had stopped. Timeout or CommError.
MPI_Comm dup_world(double limit_s) {
  // MPI writes the new handle when the request completes, which may still happen after a
  // timeout (a late rank joins): the handle then stays allocated, as the request stays pending.
  auto comm = std::make_unique<MPI_Comm>(MPI_COMM_NULL);
  MPI_Request request = MPI_REQUEST_NULL;
  const std::string who = world_rank_text();
  {
    Lock lock(mpi_mutex());
    const int rc = MPI_Comm_idup(MPI_COMM_WORLD, comm.get(), &request);
    if (rc != MPI_SUCCESS)
      throw CommError(who + ": mpi_world: MPI_Comm_idup failed: " + mpi_error_text(rc), __FILE__,
                      __LINE__);
  }
  MPI_Status status;
  try {
    poll_request(request, status, limit_s, [&] {
      return who +
             ": mpi_world: MPI_Comm_idup of MPI_COMM_WORLD (every rank must call mpi_world; "
             "one that stopped or exited never does)";
    });
  } catch (const Timeout&) {
    comm.release();  // left allocated: MPI may still write it
    note_timeout(-1, {}, true);
    throw;
  }
  return *comm;
}

// The ranks of `comm` on this node, from a timed all-gather of the processor names over `comm`
// (MPI_Comm_split_type, which counted them, has no timeout).
int count_node_ranks(MPI_Comm comm, double limit_s) {
  int size = 0, length = 0;
  MPI_Comm_size(comm, &size);
  // As in dup_world, the buffers outlive a timed-out request.
  auto mine = std::make_unique<std::vector<char>>(MPI_MAX_PROCESSOR_NAME + 1, '\0');
  auto all = std::make_unique<std::vector<char>>(
      static_cast<size_t>(size) * (MPI_MAX_PROCESSOR_NAME + 1), '\0');
  MPI_Request request = MPI_REQUEST_NULL;
  const std::string who = world_rank_text();
  {
    Lock lock(mpi_mutex());
    MPI_Get_processor_name(mine->data(), &length);
    const int rc = MPI_Iallgather(mine->data(), MPI_MAX_PROCESSOR_NAME + 1, MPI_CHAR, all->data(),
                                  MPI_MAX_PROCESSOR_NAME + 1, MPI_CHAR, comm, &request);
    if (rc != MPI_SUCCESS)
      throw CommError(who + ": mpi_world: MPI_Iallgather failed: " + mpi_error_text(rc), __FILE__,
                      __LINE__);
  }
  MPI_Status status;
  try {
    poll_request(request, status, limit_s, [&] {
      return who + ": mpi_world: the all-gather of processor names over every rank";
    });
  } catch (const Timeout&) {
    mine.release();  // left allocated: MPI may still use them
    all.release();
    note_timeout(-1, {}, true);
    throw;
  }
  const std::string me(mine->data());
  int here = 0;
  for (int p = 0; p < size; ++p)
    here += me == std::string(all->data() + static_cast<size_t>(p) * (MPI_MAX_PROCESSOR_NAME + 1));
  return here;
}

}  // namespace

int mpi_ranks_on_this_node() {
  return g_node_ranks;
}

std::unique_ptr<Communicator> mpi_world() {
  ensure_initialized();
  // The first call is part of starting the job: the ranks leave MPI_Init at different times on a
  // loaded machine, so it waits as long as MPI_Init may (at least kInitFloorS); later calls wait
  // the communication timeout.
  static std::atomic<bool> started{false};
  const double timeout = Communicator::default_timeout_s();
  const double limit_s = started ? timeout : std::max(timeout, kInitFloorS);
  const MPI_Comm comm = dup_world(limit_s);
  static std::once_flag counted;
  try {
    std::call_once(counted, [&] {
      // The control communicator (loom's own messages about the job), once. A Timeout here
      // leaves comm allocated, as below.
      if (g_ctl == MPI_COMM_NULL) {
        const MPI_Comm ctl = dup_world(limit_s);
        Lock lock(mpi_mutex());
        MPI_Comm_set_errhandler(ctl, MPI_ERRORS_RETURN);
        g_ctl = ctl;
      }
      // Whether this node runs more ranks than it has cores (for back_off).
      const int here = count_node_ranks(comm, limit_s);
      const unsigned cores = std::thread::hardware_concurrency();
      g_oversubscribed = cores == 0 || static_cast<unsigned>(here) > cores;
      g_node_ranks = here;
    });
  } catch (const Timeout&) {
    throw;  // comm stays allocated: the timed-out all-gather may still use it
  } catch (...) {
    Lock lock(mpi_mutex());
    MPI_Comm c = comm;
    MPI_Comm_free(&c);
    throw;
  }
  started = true;
  return std::make_unique<MpiComm>(comm);
}

void mpi_abort(int code) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized && !mpi_finalized()) MPI_Abort(MPI_COMM_WORLD, code);
}

namespace {

// A failing rank's report (mpi_report_error), as sent: {timed out (0/1), peer, world (0/1),
// members...} (Waited).
std::vector<int> encode(const Waited& w) {
  std::vector<int> words = {w.timed_out ? 1 : 0, w.peer, w.world ? 1 : 0};
  words.insert(words.end(), w.members.begin(), w.members.end());
  return words;
}
Waited decode(const std::vector<int>& words) {
  Waited w;
  if (words.size() < 3) return w;
  w.timed_out = words[0] == 1;
  w.peer = words[1];
  w.world = words[2] == 1;
  w.members.assign(words.begin() + 3, words.end());
  return w;
}

// The ranks that rank `who`'s wait w waited on: its peer, or the other members of its group.
std::vector<int> waited_on(int who, const Waited& w, int size) {
  if (w.peer >= 0) return {w.peer};
  std::vector<int> out;
  if (w.members.empty()) {
    for (int p = 0; p < size; ++p)
      if (p != who) out.push_back(p);
  } else {
    for (int p : w.members)
      if (p != who) out.push_back(p);
  }
  return out;
}

std::string rank_list(const std::string& rank, const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? rank : rank + "s";
  const size_t shown = std::min<size_t>(ranks.size(), 8);
  for (size_t i = 0; i < shown; ++i)
    s += (i == 0 ? " " : i + 1 == ranks.size() ? " and " : ", ") + std::to_string(ranks[i]);
  if (shown < ranks.size()) s += " and " + std::to_string(ranks.size() - shown) + " more";
  return s;
}

// The clause for a timed-out wait when no rank it leads to is known: its peer may itself be
// waiting on another ("rank 0: send to rank 1 ... timed out" when rank 4 had stopped).
std::string waited_hint(const Waited& mine) {
  if (!mine.timed_out) return "";
  if (mine.peer >= 0)
    return std::string("; ") + (mine.world ? "rank " : "world rank ") + std::to_string(mine.peer) +
           ", or a rank it waits on, stopped or is slow";
  return "; a rank of the group stopped or is slow";
}

// The clause that mpi_report_error adds to this rank's line: the ranks that this rank's timed-out
// wait leads to, following the waits that the other ranks reported (`reports`, by world rank),
// which reported no timeout of their own.
std::string silent_hint(int me, int size, const Waited& mine,
                        const std::map<int, Waited>& reports) {
  if (!mine.timed_out) return "";
  const std::string rank = mine.world ? "rank" : "world rank";
  std::vector<int> silent, parent(size, -1);
  std::vector<bool> seen(size, false);
  std::vector<int> queue = {me};
  seen[me] = true;
  bool by_peers = true;  // every wait followed was a point-to-point one
  for (size_t i = 0; i < queue.size(); ++i) {
    const int r = queue[i];
    const Waited& w = r == me ? mine : reports.at(r);
    by_peers = by_peers && w.peer >= 0;
    for (int t : waited_on(r, w, size)) {
      if (t < 0 || t >= size || seen[t]) continue;
      seen[t] = true;
      parent[t] = r;
      const auto it = reports.find(t);
      if (it == reports.end()) {
        silent.push_back(t);
      } else if (it->second.timed_out) {
        queue.push_back(t);
      }  // else it failed with its own error, and reported it: not the one that went silent
    }
  }
  if (silent.empty()) return waited_hint(mine);
  std::sort(silent.begin(), silent.end());
  std::string hint = "; " + rank_list(rank, silent) +
                     (silent.size() == 1 ? " stopped or is slow: it reported no timeout of its own"
                                         : " stopped or are slow: they reported no timeout of "
                                           "their own");
  // A chain of point-to-point waits to one silent rank: name its links.
  if (silent.size() == 1 && by_peers && parent[silent[0]] != me) {
    std::vector<int> chain;
    for (int r = silent[0]; r != me; r = parent[r]) chain.push_back(r);
    std::reverse(chain.begin(), chain.end());  // my peer ... the silent rank
    hint += ", and " + rank + " " + std::to_string(chain[0]) + " waited on " + rank + " " +
            std::to_string(chain[1]);
    for (size_t i = 1; i + 1 < chain.size(); ++i) {
      if (chain.size() > 6 && i == 2) {
        hint += ", ...";
        i = chain.size() - 3;
        continue;
      }
      hint += (i + 2 == chain.size() ? " and " : ", ") + rank + " " + std::to_string(chain[i]) +
              " on " + rank + " " + std::to_string(chain[i + 1]);
    }
  }
  return hint;
}

// The work of mpi_rank0_alone's handle: a thread that tells the other ranks every `period`
// seconds that rank 0 is still working, until the handle goes.
class StillWorking {
 public:
  explicit StillWorking(double period)
      : thread_([this, period] {
          std::unique_lock<std::mutex> lock(mu_);
          do {
            Lock mpi(mpi_mutex());
            int rank = 0, n = 0;
            if (!control_rank(&rank, &n)) return;
            tell_others(&kStillWorking, 1, kFinalTag, rank, n);
          } while (
              !cv_.wait_for(lock, std::chrono::duration<double>(period), [&] { return stop_; }));
        }) {}
  ~StillWorking() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;  // last: started once the members it uses exist
};

}  // namespace

bool mpi_report_error(double wait_s, std::string* hint) {
  if (hint) hint->clear();
  const double deadline = now_s() + std::max(0.0, std::min(wait_s, 1e9));
  int me = 0, size = 0;
  bool running = false;
  Waited mine;
  {
    std::lock_guard<std::mutex> lock(g_waited_mu);
    mine = g_waited;
  }
  {
    Lock lock(mpi_mutex());
    running = control_rank(&me, &size) && size > 1;
    if (running) {
      // Kept until the process ends (the job is ending): the sends may still read it.
      const std::vector<int>* words = new std::vector<int>(encode(mine));
      tell_others(words->data(), static_cast<int>(words->size()), kReportTag, me, size);
    }
  }
  if (!running) {
    std::this_thread::sleep_for(std::chrono::duration<double>(std::max(0.0, deadline - now_s())));
    if (hint) *hint = waited_hint(mine);
    return true;
  }
  std::map<int, Waited> reports;
  const auto read_reports = [&] {
    for (;;) {
      int flag = 0, count = 0;
      MPI_Message message;
      MPI_Status status;
      if (MPI_Improbe(MPI_ANY_SOURCE, kReportTag, g_ctl, &flag, &message, &status) != MPI_SUCCESS ||
          !flag)
        return;
      MPI_Get_count(&status, MPI_INT, &count);
      std::vector<int> words(static_cast<size_t>(std::max(count, 0)));
      if (MPI_Mrecv(words.data(), count, MPI_INT, &message, MPI_STATUS_IGNORE) == MPI_SUCCESS &&
          status.MPI_SOURCE >= 0 && status.MPI_SOURCE < size)
        reports[status.MPI_SOURCE] = decode(words);
    }
  };
  if (another_rank_printed(deadline, read_reports)) return false;
  if (hint) *hint = silent_hint(me, size, mine, reports);
  return true;
}

std::shared_ptr<void> mpi_rank0_alone() {
  int rank = 0, size = 0;
  {
    Lock lock(mpi_mutex());
    if (!control_rank(&rank, &size) || rank != 0 || size < 2) return nullptr;
  }
  // Four words within each LOOM_FINALIZE_TIMEOUT_S, at most 5 s apart, at most 100 a second.
  const double period = std::clamp(finalize_limit_s() / 4, 0.01, 5.0);
  try {
    return std::make_shared<StillWorking>(period);
  } catch (const std::system_error&) {  // no thread: the others wait LOOM_FINALIZE_TIMEOUT_S
    return nullptr;
  }
}

}  // namespace loom
