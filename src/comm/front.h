// Internal to src/comm: the one checking front every backend calls at the top of its public
// operations, so that argument checks and their messages are written once (local, mpi, torch and
// any later backend say the same thing about the same mistake). A backend implements transport
// only; it calls these first and then posts.
//
// `who` is the backend's description of this rank ("rank 3", "rank 3 (world rank 7)"); `group`
// the group it belongs to ("the group of 4 ranks").
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "loom/comm.h"
#include "loom/error.h"

namespace loom::detail {

// isend / irecv: peer in [0, size), tag in [0, max_tag] (user tags; negative ones are reserved
// for collectives), a buffer for any non-zero byte count. Throws InvalidArgument.
void check_p2p(const char* op, const std::string& who, int size, const void* buf, size_t bytes,
               int peer, int tag, int max_tag);

// batch_p2p: every op a send or a recv (another kind was taken as recv, or left a null work).
void check_p2p_kinds(const std::vector<P2POp>& ops);

// all_to_all: the four size/offset arrays present, and what this rank sends to itself equal to
// what it receives from itself.
void check_all_to_all(int rank, const size_t* send_bytes, const size_t* send_offsets,
                      const size_t* recv_bytes, const size_t* recv_offsets);

// all_gather (bytes), reduce_scatter and all_reduce (elements): buffers present when count > 0.
void check_buffers(const char* op, const void* send, const void* recv, size_t count,
                   const char* unit);

// reduce_scatter and all_reduce: a DType and a ReduceOp that exist (a cast integer was taken, and
// any op but sum acted as max).
void check_reduction(const char* op, DType dtype, ReduceOp reduce);

// Whether a tree of communicators (one rank's communicator and every communicator split from it,
// transitively) is still usable. After a Timeout or CommError the operation that failed may have
// left messages in flight (a late peer's send arrives after the receive gave up), and this rank's
// sequence of operations no longer matches its peers': the next receive on that channel took the
// stale message and returned a wrong answer without an error (a ring forward retried after a
// Timeout mixed the previous call's KV block into its result). So the first such error fails the
// tree, and every later operation on any communicator of it throws CommError at once, naming that
// first error. Shared by the tree's communicators, which may be used from different threads.
class Health {
 public:
  // remedy: how to get a new communicator on this backend ("a new run_local", ...).
  explicit Health(std::string remedy) : remedy_(std::move(remedy)) {}

  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // CommError "<who>: <op>: this communicator failed earlier (<first error>) ...".
  [[noreturn]] void refuse(const std::string& who, const char* op) const;
  // Records the first error (later ones are its consequences).
  void fail(const std::string& error);
  // Runs f(); a CommError (Timeout included) it throws fails the tree and is rethrown.
  template <class F>
  decltype(auto) guard(F&& f) {
    try {
      return f();
    } catch (const CommError& e) {
      fail(e.what());
      throw;
    }
  }

 private:
  const std::string remedy_;
  mutable std::mutex mu_;  // guards first_
  std::string first_;
  std::atomic<bool> failed_{false};
};

}  // namespace loom::detail
