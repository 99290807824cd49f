// ring2d: the double ring of LoongTrain's 2-D attention. The P cp ranks form O = P / I inner
// rings of I consecutive ranks (the ranks of a node), and rank i of every inner ring belongs to
// the outer ring i, which crosses the nodes.
//
// Forward. Rank (o, i) = cp rank o I + i. At outer step t it holds the "outer block", the KV of
// rank (g, i) with g = o - t (mod O), and runs one inner ring pass with it: the inner ring
// passes the O-th part of the sequence that group g holds around the node, so after the pass
// every rank of group o has attended to all of group g's KV. Before the pass it posts the outer
// transfer of the next outer block (send this one to (o + 1, i), receive (g - 1, i) from
// (o - 1, i)), so the inter-node transfer travels during the whole inner ring: one inter-node
// message per outer step, I inner steps to hide it behind.
//
// Backward. K,V travel the same way. The inner ring pass (the ring pass's backward) returns to
// (o, i) the dK,dV of the outer block summed over group o; (o, i) adds the accumulator of that
// block that arrived over the outer ring (the sum over groups o - t .. o - 1), and sends the sum
// on to (o + 1, i) while the next outer step computes. After O outer steps every accumulator is
// home, in fp32. dQ accumulates locally over all P blocks.
#include "strategy.h"

namespace loom::cp_detail {

namespace {

constexpr int kTagOuterKvForward = 111;
constexpr int kTagOuterKvBackward = 112;
constexpr int kTagOuterDkv = 113;

class Ring2d : public CpStrategyOf<Ring2d> {
 public:
  explicit Ring2d(Engine& e) : e_(e), I_(e.shape.inner), O_(e.shape.outer) {
    o_ = e.me / I_;
    i_ = e.me % I_;
    groups_.resize(O_);
    for (int g = 0; g < O_; ++g)
      for (int j = 0; j < I_; ++j) groups_[g].push_back(ranks_[g * I_ + j]);
    row_ = e.kv_heads * e.dim;
    cap_ = static_cast<size_t>(2 * e.plan.max_rows() * row_);
  }

  template <class T>
  void fwd(const ForwardArgs<T>& a) {
    const Block& qb = ranks_[e_.me];
    const StateView st = e_.fresh_state(qb.rows, e_.heads);
    e_.rec.steps(e_.P);
    T* outer_kv[2] = {e_.mem.buffer<T>(kSlotOwn, cap_), e_.mem.buffer<T>(kSlotOwn + 1, cap_)};
    pack_kv<T>(a.k, a.v, outer_kv[0]);
    const int next = (o_ + 1) % O_, prev = (o_ - 1 + O_) % O_;
    for (int t = 0; t < O_; ++t) {
      const int g = (o_ - t + O_) % O_;
      const int64_t n = rows_of(g);
      T* cur = outer_kv[t & 1];
      std::vector<WorkPtr> works;
      Memory::Event posted = 0;
      if (t < O_ - 1) {
        const int64_t n_next = rows_of((g - 1 + O_) % O_);
        works = e_.rec.post(posted, [&] {
          return e_.outer->batch_p2p(
              {P2POp{P2POp::send, cur, sizeof(T) * 2 * n * row_, next, kTagOuterKvForward},
               P2POp{P2POp::recv, outer_kv[(t + 1) & 1], sizeof(T) * 2 * n_next * row_, prev,
                     kTagOuterKvForward}});
        });
      }
      ring_forward<T>(e_, e_.inner, qb, groups_[g], a.q, e_.rows_view<const T>(cur, n, e_.kv_heads),
                      e_.rows_view<const T>(cur + n * row_, n, e_.kv_heads), st, t * I_);
      if (!works.empty()) {
        e_.rec.wait(*works[0], SpanKind::send, (t + 1) * I_ - 1, posted);
        e_.rec.wait(*works[1], SpanKind::recv, (t + 1) * I_ - 1, posted);
      }
    }
    finish(st, a.out, a.lse, qb.rows);
  }

  template <class T>
  void bwd(const BackwardArgs<T>& a) {
    const Block& qb = ranks_[e_.me];
    float* delta = e_.mem.buffer<float>(kSlotDelta, static_cast<size_t>(e_.heads * qb.rows));
    compute_delta(a.out, a.dout, delta, qb.rows);
    e_.mem.zero(a.dq);
    T* outer_kv[2] = {e_.mem.buffer<T>(kSlotOwn, cap_), e_.mem.buffer<T>(kSlotOwn + 1, cap_)};
    float* group_sum = e_.mem.buffer<float>(kSlotOwn + 2, cap_);
    pack_kv<T>(a.k, a.v, outer_kv[0]);
    const int next = (o_ + 1) % O_, prev = (o_ - 1 + O_) % O_;
    std::unique_ptr<TravellingSum> sum;  // over the outer ring
    if (O_ > 1)
      sum = std::make_unique<TravellingSum>(e_, e_.outer, kSlotOwn + 3, cap_, kTagOuterDkv);
    for (int t = 0; t < O_; ++t) {
      const int g = (o_ - t + O_) % O_;
      const int64_t n = rows_of(g), n_next = rows_of((g - 1 + O_) % O_);
      const int step = (t + 1) * I_ - 1;  // the outer step ends with the inner ring's last step
      T* cur = outer_kv[t & 1];
      std::vector<WorkPtr> works;
      Memory::Event posted = 0;
      if (t < O_ - 1) {
        works = e_.rec.post(posted, [&] {
          return e_.outer->batch_p2p(
              {P2POp{P2POp::send, cur, sizeof(T) * 2 * n * row_, next, kTagOuterKvBackward},
               P2POp{P2POp::recv, outer_kv[(t + 1) & 1], sizeof(T) * 2 * n_next * row_, prev,
                     kTagOuterKvBackward}});
        });
      }
      // Group o's gradient of the outer block (g, i), home after the inner ring's full turn.
      ring_backward<T>(e_, e_.inner, qb, groups_[g], a.q,
                       e_.rows_view<const T>(cur, n, e_.kv_heads),
                       e_.rows_view<const T>(cur + n * row_, n, e_.kv_heads), a.dout, a.lse, delta,
                       a.dq, e_.rows_view<float>(group_sum, n, e_.kv_heads),
                       e_.rows_view<float>(group_sum + n * row_, n, e_.kv_heads), t * I_);
      if (O_ == 1) {
        e_.mem.unpack<float>(group_sum, a.dk);
        e_.mem.unpack<float>(group_sum + n * row_, a.dv);
        return;
      }
      // Add what groups o - t .. o - 1 sent for this block (nothing at t = 0), send the sum on.
      sum->add_and_pass(t, group_sum, static_cast<size_t>(2 * n * row_),
                        static_cast<size_t>(2 * n_next * row_), step);
      if (!works.empty()) {
        e_.rec.wait(*works[0], SpanKind::send, step, posted);
        e_.rec.wait(*works[1], SpanKind::recv, step, posted);
      }
    }
    // The accumulator of my own block, home after a full outer turn.
    const float* home = sum->home(e_.P);
    e_.mem.unpack<float>(home, a.dk);
    e_.mem.unpack<float>(home + qb.rows * row_, a.dv);
  }

 private:
  // Rows of rank (g, i): the outer block of outer step t at group g = o - t.
  int64_t rows_of(int g) const { return ranks_[g * I_ + i_].rows; }
  template <class T>
  void pack_kv(View3<const T> k, View3<const T> v, T* dst) {
    e_.mem.pack<T>(k, dst);
    e_.mem.pack<T>(v, dst + k.s * row_);
  }

  Engine& e_;
  const int I_, O_;  // inner ring size, outer ring size
  int o_ = 0, i_ = 0;
  const std::vector<Block>& ranks_ = e_.shards;  // every cp rank's shard
  std::vector<std::vector<Block>> groups_;       // [g] -> the shards of inner group g
  int64_t row_ = 0;
  size_t cap_ = 0;
};

}  // namespace

// check_cp_config has checked the degree option (1 <= inner, P % inner == 0).
int ring2d_inner(int, const CpConfig& cfg) {
  return cfg.inner;
}

constexpr const char* kRing2dSummary =
    "double ring: inner rings of --inner consecutive ranks (a node), an outer ring across them; "
    "one inter-node transfer per outer step";
// The outer KV double buffer (slots kSlotOwn, +1), in backward delta, the group sum and, with
// more than one inner ring, the outer travelling accumulators (+2 .. +6); the inner ring pass
// over the ranks' shards, the softmax state and the kernels' workspace for n x n blocks. On the
// local backend also the outer ring's messages of one step (a KV block, an accumulator).
double ring2d_working_bytes(const CpProblem& p) {
  const int64_t n = p.rows;
  const int O = p.shape.outer;
  const double cap = 2.0 * double(n) * double(p.kv_heads) * double(p.head_dim);
  double b = 2 * cap * p.dtype_bytes + state_bytes(p, n, p.heads) +
             ring_pass_bytes(p, p.shape.inner, n, p.kv_heads) +
             kernel_bytes(p, n, n, p.heads, p.kv_heads);
  if (p.backward) b += 4.0 * double(p.heads) * double(n) + cap * 4 * (O > 1 ? 5 : 1);
  if (p.local_backend && O > 1) b += cap * p.dtype_bytes + (p.backward ? cap * 4 : 0);
  return b;
}

extern constinit const StrategyEntry kRing2dEntry{
    .id = Strategy::ring2d,
    .summary = kRing2dSummary,
    .degree = {"--inner", "ranks per inner ring; the outer ring is ranks / inner",
               &CpConfig::inner},
    .inner_degree = ring2d_inner,
    .make = make_strategy<Ring2d>,
    .working_bytes = ring2d_working_bytes};

}  // namespace loom::cp_detail
