// Internal to src/comm: collectives written once over point-to-point messages, and the traffic
// they cause. The local backend runs these algorithms; the MPI backend calls MPI's own
// collectives but books the same traffic (traffic_*), so CommStats mean the same on both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "loom/comm.h"

namespace loom::detail {

// Internal tags: user tags are >= 0, so these never match a user message.
constexpr int kTagAllToAll = -1;
constexpr int kTagAllGather = -2;
constexpr int kTagReduceScatter = -3;
constexpr int kTagAllReduceScatter = -4;
constexpr int kTagAllReduceGather = -5;
constexpr int kTagBarrier = -6;

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
  // next call (a transport runs one collective at a time).
  char* scratch(size_t bytes) {
    if (bytes > scratch_bytes_) {
      scratch_.reset(new char[bytes]);
      scratch_bytes_ = bytes;
    }
    return scratch_.get();
  }

 private:
  std::unique_ptr<char[]> scratch_;
  size_t scratch_bytes_ = 0;
};

// Blocks are [count] elements of dtype; block p of all_reduce's buffer starts at
// block_begin(count, P, p) elements and holds block_begin(.., p + 1) - block_begin(.., p).
size_t block_begin(size_t count, int parts, int p);

// dst[i] = op(dst[i], src[i]) for i < count.
void reduce_into(void* dst, const void* src, size_t count, DType dtype, ReduceOp op);

// The algorithms. `deadline` is an absolute now_s() time; every wait is bounded by it.
void all_to_all(Transport& t, const void* send, const size_t* send_bytes,
                const size_t* send_offsets, void* recv, const size_t* recv_bytes,
                const size_t* recv_offsets, double deadline);
void all_gather(Transport& t, const void* send, size_t bytes, void* recv, double deadline);
void reduce_scatter(Transport& t, const void* send, void* recv, size_t count, DType dtype,
                    ReduceOp op, double deadline);
void all_reduce(Transport& t, void* buf, size_t count, DType dtype, ReduceOp op, double deadline);
void barrier(Transport& t, double deadline);

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
