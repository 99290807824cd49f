// ring: K,V blocks travel around all P cp ranks; one attend per step into the softmax state
// (the ring pass, ../ring_pass.cc). For long sequences on ranks linked alike; zigzag keeps every
// step balanced under a causal mask.
#include "strategy.h"

namespace loom::cp_detail {

namespace {

class Ring : public CpStrategyOf<Ring> {
 public:
  explicit Ring(Engine& e) : e_(e), blocks_(e.shards) {}

  template <class T>
  void fwd(const ForwardArgs<T>& a) {
    const int64_t n = blocks_[e_.me].rows;
    const StateView st = e_.fresh_state(n, e_.heads);
    e_.rec.steps(e_.P);
    ring_forward<T>(e_, e_.outer, blocks_[e_.me], blocks_, a.q, a.k, a.v, st, 0);
    finish(st, a.out, a.lse, n);
  }

  template <class T>
  void bwd(const BackwardArgs<T>& a) {
    const int64_t n = blocks_[e_.me].rows;
    float* delta = e_.mem.buffer<float>(kSlotDelta, static_cast<size_t>(e_.heads * n));
    compute_delta(a.out, a.dout, delta, n);
    e_.mem.zero(a.dq);
    ring_backward<T>(e_, e_.outer, blocks_[e_.me], blocks_, a.q, a.k, a.v, a.dout, a.lse, delta,
                     a.dq, a.dk, a.dv, 0);
  }

 private:
  Engine& e_;
  const std::vector<Block>& blocks_;  // every cp rank's shard
};

}  // namespace

constexpr const char* kRingSummary =
    "K,V blocks travel around all ranks while each computes (long sequences, any head count)";
// The softmax state, the ring pass (its KV double buffer and, in backward, the dK,dV partial and
// travelling accumulators), delta, and the kernels' workspace for n x n blocks (a rank's
// segment pairs are within them).
double ring_working_bytes(const CpProblem& p) {
  const int64_t n = p.rows;
  return state_bytes(p, n, p.heads) + ring_pass_bytes(p, p.ranks, n, p.kv_heads) +
         (p.backward ? 4.0 * double(p.heads) * double(n) : 0) +
         kernel_bytes(p, n, n, p.heads, p.kv_heads);
}

extern constinit const StrategyEntry kRingEntry =
    one_axis_entry<Ring>(Strategy::ring, kRingSummary, ring_working_bytes);

}  // namespace loom::cp_detail
