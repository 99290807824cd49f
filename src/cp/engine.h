// Internal to src/cp: the engine the strategies are built from. A strategy (strategies/*.cc)
// combines these pieces and the Communicator; it does no raw memory work (memory.h) and no
// timing of its own (recorder.h).
//
// A Block is the token metadata of one ring member's rows: for the plain ring it is one cp rank's
// shard; in hybrid it is the union of the shards of the U ranks of one ulysses group, in group
// order (which is the row order the all-to-all produces).
#pragma once

#include <memory>
#include <vector>

#include "loom/cp.h"
#include "memory.h"
#include "recorder.h"

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

// What a strategy runs on: the plan, the configuration and shapes, the cp group and its two
// axes (from the mesh), the memory seam, the recorder and a reused forward state.
struct Engine {
  const ShardPlan& plan;
  CpConfig cfg;
  CpShape shape;
  int64_t heads, kv_heads, dim;
  Communicator& cp;
  Communicator* inner;  // the inner axis (shape.inner consecutive cp ranks); nullptr if size 1
  Communicator* outer;  // the outer axis (shape.outer ranks); nullptr if size 1
  int P, me;
  std::vector<Block> shards;  // [r] -> cp rank r's shard as a block
  Memory mem;
  Recorder rec;

  Engine(const ShardPlan& p, const CpConfig& c, const CpShape& s, int64_t h, int64_t hkv, int64_t d,
         Communicator& cp_group, Communicator* inner_group, Communicator* outer_group,
         CpMetrics& metrics);
  // The forward state for `rows` rows of `heads` heads, empty (m = -inf, l = 0, acc = 0).
  StateView fresh_state(int64_t rows, int64_t heads);
  // Contiguous [rows, heads, dim] rows at p.
  template <class T>
  View3<T> rows_view(T* p, int64_t rows, int64_t heads) const {
    return contiguous_view(p, rows, heads, dim);
  }

 private:
  std::unique_ptr<SoftmaxState> state_;
};

// The fp32 dK,dV accumulator that follows a KV block around a ring (ring and ring2d backward).
// At step s a member adds its contribution to the sum that arrived from the previous member
// (none at step 0: the sum starts here) and sends it on to the next; after R steps the sum of
// the member's own block has made a full turn and is home. Double-buffered in Memory slots
// slot0 .. slot0 + 3, each of cap floats.
class TravellingSum {
 public:
  TravellingSum(Engine& e, Communicator* ring, size_t slot0, size_t cap, int tag);
  // Step s (recorded as `step`): `part` (count floats) joins the sum travelling with this step's
  // block, which goes on; count_next floats, the next step's block's sum, are received.
  void add_and_pass(int s, const float* part, size_t count, size_t count_next, int step);
  // After the last step: waits for this member's own sum (and the sends); returns it.
  const float* home(int step);

 private:
  Engine& e_;
  Communicator* ring_;
  int tag_, next_, prev_, last_ = -1;
  float* send_[2];
  float* recv_[2];
  WorkPtr send_work_[2], recv_work_;
  Memory::Event t_send_[2] = {0, 0}, t_recv_ = 0;
};

// The functions below are templates over the storage type T of q, k, v, out, dout: float or
// bf16 (explicitly instantiated in ring_pass.cc). The softmax state, lse, delta and every
// gradient accumulator are fp32 whatever T is.

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

// One ring pass over R members (ring == nullptr or size 1: this block alone) for the queries q of
// block qb: blocks[j] is the KV block ring member j starts with, k and v this member's
// [blocks[me].rows, Hkv, D] (qb and blocks[me] are the same block except in ring2d, whose inner
// rings pass other groups' KV blocks). If v follows k in
// one contiguous buffer (k rows then v rows), that buffer is sent as it is; otherwise it is
// packed first. Uses Memory slots 0-6. Steps are numbered from step0 (spans, step_tiles).
//
// Forward folds every member's KV block into the state st of q (this member's rows).
template <class T>
void ring_forward(Engine& e, Communicator* ring, const Block& qb, const std::vector<Block>& blocks,
                  View3<const T> q, View3<const T> k, View3<const T> v, StateView st, int step0);
// Backward: adds this pass's dq to dq (zero it first when it is the only pass), and overwrites
// dk, dv (fp32, [blocks[me].rows, Hkv, D]) with the gradient of this member's KV block summed
// over the ring's members.
// lse, delta [H, rows] of q.
template <class T>
void ring_backward(Engine& e, Communicator* ring, const Block& qb, const std::vector<Block>& blocks,
                   View3<const T> q, View3<const T> k, View3<const T> v, View3<const T> dout,
                   const float* lse, const float* delta, View3<float> dq, View3<float> dk,
                   View3<float> dv, int step0);

}  // namespace loom::cp_detail
