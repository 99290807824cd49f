// Internal to src/comm: collectives written once over point-to-point messages, and the traffic
// they cause. The local backend runs these algorithms; the MPI backend calls MPI's own
// collectives but books the same traffic (traffic_*), so CommStats mean the same on both.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <type_traits>

#include "loom/comm.h"

namespace loom::detail {

// ReduceOp::max of two values, with a NaN on any rank the result on every rank, as a sum carries
// it (std::max(acc, NaN) kept acc, so the answer hung on which rank held the NaN). Every backend
// reduces with it: the local and torch ones here, MPI in its own MPI_Op.
template <typename T>
T max_of(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (std::isnan(b)) return b;
  }
  return std::max(a, b);
}

// Internal tags: user tags are >= 0, so these never match a user message.
constexpr int kTagAllToAll = -1;
constexpr int kTagAllGather = -2;
constexpr int kTagReduceScatter = -3;
constexpr int kTagAllReduceScatter = -4;
constexpr int kTagAllReduceGather = -5;
constexpr int kTagBarrier = -6;

// OutOfMemory: "<op>: could not allocate <bytes> bytes ..." (Transport::scratch).
[[noreturn]] void throw_scratch_alloc(const char* op, size_t bytes);

// What a collective posts through: a communicator's point-to-point layer without the user-tag
// check or fault-injection op counting. `op` names the collective in error messages.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual int transport_rank() const = 0;
  virtual int transport_size() const = 0;
  virtual WorkPtr post_send(const void* buf, size_t bytes, int peer, int tag, const char* op) = 0;
  // exact: the message must be exactly `bytes` long (collectives know every size).
  virtual WorkPtr post_recv(void* buf, size_t bytes, int peer, int tag, const char* op,
                            bool exact) = 0;

  // At least `bytes` of uninitialised memory for one collective's temporaries, kept for the
  // next call (a transport runs one collective at a time). OutOfMemory naming `op` and the size
  // when it cannot be had (it was std::bad_alloc).
  char* scratch(size_t bytes, const char* op) {
    if (bytes > scratch_bytes_) {
      scratch_.reset();
      scratch_bytes_ = 0;
      try {
        scratch_.reset(new char[bytes]);
      } catch (const std::bad_alloc&) {
        throw_scratch_alloc(op, bytes);
      }
      scratch_bytes_ = bytes;
    }
    return scratch_.get();
  }

 private:
  std::unique_ptr<char[]> scratch_;
  size_t scratch_bytes_ = 0;
};

// The faults of one rank's own collective arguments that the local backend finds before it
// posts anything (its agreement then fails the call on every rank): "" when there are none,
// else what is wrong and what to do. Sizes past size_t (a count times the dtype's size times the
// ranks), and overlapping buffers: all_gather's send may overlap its receive only as this rank's
// own block (send = recv + rank * bytes, "in place", as MPI_IN_PLACE); reduce_scatter's send
// (size * count elements) and receive must not overlap at all; all_to_all's receive parts must
// overlap neither each other nor a send part. Any other overlap made a rank send blocks its
// peers had already written (all_gather with send = recv gave 100, 100, 100 for 100, 101, 102).
std::string all_gather_overlap(int size, int rank, const void* send, size_t bytes,
                               const void* recv);
std::string reduce_scatter_overlap(int size, const void* send, const void* recv, size_t count,
                                   DType dtype);
std::string all_reduce_size_problem(size_t count, DType dtype);
std::string all_to_all_overlap(int size, const void* send, const size_t* send_bytes,
                               const size_t* send_offsets, const void* recv,
                               const size_t* recv_bytes, const size_t* recv_offsets);

// Blocks are [count] elements of dtype; block p of all_reduce's buffer starts at
// block_begin(count, P, p) elements and holds block_begin(.., p + 1) - block_begin(.., p).
size_t block_begin(size_t count, int parts, int p);

// dst[i] = op(dst[i], src[i]) for i < count.
void reduce_into(void* dst, const void* src, size_t count, DType dtype, ReduceOp op);

// A collective's deadline: `at`, an absolute now_s() time, which every wait of the collective
// is bounded by, and the limit it was set from (seconds), which a Timeout names: a wait that ran
// out said "timed out after" what was left of the limit (0.4998 s under LOOM_TIMEOUT_S=2).
struct Deadline {
  double at = 0;
  double limit_s = 0;
};

// The algorithms; every wait is bounded by `deadline`.
void all_to_all(Transport& t, const void* send, const size_t* send_bytes,
                const size_t* send_offsets, void* recv, const size_t* recv_bytes,
                const size_t* recv_offsets, Deadline deadline);
void all_gather(Transport& t, const void* send, size_t bytes, void* recv, Deadline deadline);
void reduce_scatter(Transport& t, const void* send, void* recv, size_t count, DType dtype,
                    ReduceOp op, Deadline deadline);
void all_reduce(Transport& t, void* buf, size_t count, DType dtype, ReduceOp op, Deadline deadline);
void barrier(Transport& t, Deadline deadline);

// Traffic of one rank in the algorithms above (messages to other ranks only; the own block is a
// local copy). The MPI backend adds these to CommStats.
struct Traffic {
  int64_t bytes_sent = 0;
  int64_t bytes_recv = 0;
  int64_t messages_sent = 0;
};
Traffic traffic_all_to_all(int rank, int size, const size_t* send_bytes, const size_t* recv_bytes);
Traffic traffic_all_gather(int size, size_t bytes);
Traffic traffic_reduce_scatter(int size, size_t count, DType dtype);
Traffic traffic_all_reduce(int rank, int size, size_t count, DType dtype);
Traffic traffic_barrier(int size);
void add_traffic(CommStats& stats, const Traffic& traffic);

}  // namespace loom::detail
