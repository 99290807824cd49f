// Internal to src/cp: the pieces the strategies are built from.
//
// A Block is the token metadata of one ring member's rows: for the plain ring it is one cp rank's
// shard; in hybrid it is the union of the shards of the U ranks of one ulysses group, in group
// order (which is the row order the all-to-all produces).
#pragma once

#include <array>
#include <cstddef>
#include <memory>
#include <vector>

#include "loom/cp.h"

namespace loom::cp_detail {

struct Block {
  int64_t rows = 0;
  std::vector<int64_t> pos;
  std::vector<int32_t> doc;  // empty: one document
  std::vector<Segment> segs;
  Tokens info() const { return Tokens{pos.data(), doc.empty() ? nullptr : doc.data(), rows}; }
};

// The union of cp ranks [first, first + count) of the plan, in rank order.
Block make_block(const ShardPlan& plan, int first, int count);

// Scratch buffers reused across calls (the ring's KV double buffer, dK/dV accumulators): a
// strategy allocates (and the OS zero-fills) them once, not at every forward and backward.
// Contents are unspecified on return from get().
class Workspace {
 public:
  template <class T>
  T* get(size_t slot, size_t count) {
    Buf& b = bufs_.at(slot);
    const size_t bytes = count * sizeof(T);
    if (bytes > b.bytes) {
      b.p.reset(new std::byte[bytes]);
      b.bytes = bytes;
    }
    return reinterpret_cast<T*>(b.p.get());
  }

 private:
  struct Buf {
    std::unique_ptr<std::byte[]> p;
    size_t bytes = 0;
  };
  std::array<Buf, 8> bufs_;
};

// The functions below are templates over the storage type T of q, k, v, out, dout: float or
// bf16 (explicitly instantiated in ring.cc). The softmax state, lse, delta and every gradient
// accumulator are fp32 whatever T is.

// Ring of R members (ring == nullptr or size 1: just this block). Blocks are indexed by ring
// member. Forward folds every member's KV block into the state st of q (this member's rows).
template <class T>
void ring_forward(Communicator* ring, const std::vector<Block>& blocks, View3<const T> q,
                  View3<const T> k, View3<const T> v, StateView st, const KernelConfig& kc,
                  CpMetrics& m, Workspace& ws);

// Backward: dq, dk, dv (fp32, overwritten) of this member's rows. lse, delta [H, rows].
template <class T>
void ring_backward(Communicator* ring, const std::vector<Block>& blocks, View3<const T> q,
                   View3<const T> k, View3<const T> v, View3<const T> dout, const float* lse,
                   const float* delta, const KernelConfig& kc, View3<float> dq, View3<float> dk,
                   View3<float> dv, CpMetrics& m, Workspace& ws);

// Attends q rows (block qb) to one KV block (kb) segment pair by segment pair, skipping pairs
// the mask leaves empty.
template <class T>
KernelStats attend_blocks(StateView st, View3<const T> q, const Block& qb, View3<const T> k,
                          View3<const T> v, const Block& kb, const KernelConfig& kc);
template <class T>
KernelStats attend_backward_blocks(View3<const T> q, const Block& qb, View3<const T> k,
                                   View3<const T> v, const Block& kb, View3<const T> dout,
                                   const float* lse, const float* delta, const KernelConfig& kc,
                                   View3<float> dq, View3<float> dk, View3<float> dv);

// Copies a (possibly strided) view into contiguous memory at dst / from src.
template <class T>
void pack(View3<const T> x, T* dst);
template <class T>
void unpack(const T* src, View3<T> x);

// Waits for a Work, accounting the blocked time to m.wait_s and m.comm_s and a "wait" span.
// Returns the time the wait returned.
double timed_wait(Work& w, CpMetrics& m, int step);
// Records a span when m.record_spans.
void add_span(CpMetrics& m, const char* kind, int step, double t0, double t1);

}  // namespace loom::cp_detail
