// Internal to src/cp: the pieces the strategies are built from.
//
// A Block is the token metadata of one ring member's rows: for the plain ring it is one cp rank's
// shard; in hybrid it is the union of the shards of the U ranks of one ulysses group, in group
// order (which is the row order the all-to-all produces).
#pragma once

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

// Ring of R members (ring == nullptr or size 1: just this block). Blocks are indexed by ring
// member. Forward folds every member's KV block into the state st of q (this member's rows).
void ring_forward(Communicator* ring, const std::vector<Block>& blocks, View3<const float> q,
                  View3<const float> k, View3<const float> v, StateView st, const KernelConfig& kc,
                  CpMetrics& m);

// Backward: dq, dk, dv (fp32, overwritten) of this member's rows. lse, delta [H, rows].
void ring_backward(Communicator* ring, const std::vector<Block>& blocks, View3<const float> q,
                   View3<const float> k, View3<const float> v, View3<const float> dout,
                   const float* lse, const float* delta, const KernelConfig& kc, View3<float> dq,
                   View3<float> dk, View3<float> dv, CpMetrics& m);

// Attends q rows (block qb) to one KV block (kb) segment pair by segment pair, skipping pairs
// the mask leaves empty.
KernelStats attend_blocks(StateView st, View3<const float> q, const Block& qb, View3<const float> k,
                          View3<const float> v, const Block& kb, const KernelConfig& kc);
KernelStats attend_backward_blocks(View3<const float> q, const Block& qb, View3<const float> k,
                                   View3<const float> v, const Block& kb, View3<const float> dout,
                                   const float* lse, const float* delta, const KernelConfig& kc,
                                   View3<float> dq, View3<float> dk, View3<float> dv);

// Copies a (possibly strided) view into contiguous memory at dst / from src.
void pack(View3<const float> x, float* dst);
void unpack(const float* src, View3<float> x);

// Waits for a Work, accounting the blocked time to m.wait_s and m.comm_s and a "wait" span.
// Returns the time the wait returned.
double timed_wait(Work& w, CpMetrics& m, int step);
// Records a span when m.record_spans.
void add_span(CpMetrics& m, const char* kind, int step, double t0, double t1);

}  // namespace loom::cp_detail
