// hybrid: Ulysses inside groups of U consecutive cp ranks (the inner axis), ring across the
// P / U groups (the outer axis), as USP and TransformerEngine's a2a+p2p. The all-to-all turns
// "my tokens, all heads" into "the group's tokens, my H / U heads"; the ring pass then runs over
// the groups' blocks; the inverse all-to-all brings out, lse and the gradients home. For
// clusters whose nodes hold U ranks: the all-to-all stays inside a node, the ring crosses nodes.
// ulysses (ulysses.cc) is this with one group.
#include <algorithm>

#include "../ulysses.h"
#include "strategy.h"

namespace loom::cp_detail {

namespace {

class Hybrid : public CpStrategyOf<Hybrid> {
 public:
  explicit Hybrid(Engine& e) : e_(e), group_(UlyssesGroup::of(e)) {
    const int U = e.shape.inner;
    for (int j = 0; j < e.shape.outer; ++j) blocks_.push_back(make_block(e.plan, j * U, U));
    mine_ = e.me / U;
  }

  template <class T>
  void fwd(const ForwardArgs<T>& a) {
    const int U = e_.shape.inner;
    const Tensor<T> ql = seq_to_head<T>(e_, group_, a.q);
    const Tensor<T> kl = kv_to_head<T>(a.k), vl = kv_to_head<T>(a.v);
    const int64_t N = group_.total(), hl = e_.heads / U;
    const StateView st = e_.fresh_state(N, hl);
    e_.rec.steps(e_.shape.outer);
    ring_forward<T>(e_, e_.outer, blocks_[mine_], blocks_, ql.view3(), kl.view3(), vl.view3(), st,
                    0);
    Tensor<T> outl({N, hl, e_.dim});
    std::vector<float> lsel(static_cast<size_t>(hl * N));
    finish(st, outl.view3(), lsel.data(), N);
    head_to_seq<T>(e_, group_, outl, a.out);
    lse_to_seq(e_, group_, lsel, e_.heads, a.lse);
  }

  template <class T>
  void bwd(const BackwardArgs<T>& a) {
    const int U = e_.shape.inner;
    const Tensor<T> ql = seq_to_head<T>(e_, group_, a.q);
    const Tensor<T> kl = kv_to_head<T>(a.k), vl = kv_to_head<T>(a.v);
    const Tensor<T> outl = seq_to_head<T>(e_, group_, a.out);
    const Tensor<T> doutl = seq_to_head<T>(e_, group_, a.dout);
    const std::vector<float> lsel = lse_to_head(e_, group_, a.lse, e_.heads);
    const int64_t N = group_.total(), hl = e_.heads / U;
    float* delta = e_.mem.buffer<float>(kSlotDelta, static_cast<size_t>(hl * N));
    compute_delta(outl.view3(), doutl.view3(), delta, N);
    Tensor<float> dql({N, hl, e_.dim}), dkl(kl.shape()), dvl(vl.shape());
    ring_backward<T>(e_, e_.outer, blocks_[mine_], blocks_, ql.view3(), kl.view3(), vl.view3(),
                     doutl.view3(), lsel.data(), delta, dql.view3(), dkl.view3(), dvl.view3(), 0);
    head_to_seq<float>(e_, group_, dql, a.dq);
    if (e_.shape.replicate_kv) {
      head_to_seq_replicated(e_, group_, dkl, a.dk);
      head_to_seq_replicated(e_, group_, dvl, a.dv);
    } else {
      head_to_seq<float>(e_, group_, dkl, a.dk);
      head_to_seq<float>(e_, group_, dvl, a.dv);
    }
  }

 private:
  // KV heads are scattered like query heads, or replicated when U % Hkv == 0.
  template <class T>
  Tensor<T> kv_to_head(View3<const T> x) {
    return e_.shape.replicate_kv ? seq_to_head_replicated<T>(e_, group_, x)
                                 : seq_to_head<T>(e_, group_, x);
  }

  Engine& e_;
  UlyssesGroup group_;
  std::vector<Block> blocks_;  // every group's block (its ranks' shards, in group order)
  int mine_ = 0;               // this rank's group
};

}  // namespace

std::unique_ptr<CpStrategy> make_hybrid(Engine& e) {
  return std::make_unique<Hybrid>(e);
}

// check_cp_config has checked the degree option (1 <= U, P % U == 0).
int hybrid_inner(int, const CpConfig& cfg) {
  return cfg.ulysses;
}

constexpr const char* kHybridSummary =
    "ulysses inside groups of U consecutive ranks (a node), ring across the groups";
// The softmax state and the ring pass over the groups' blocks (N = U n rows of H / U heads), delta,
// and the largest of the stages between the all-to-alls (src/cp/ulysses.cc): a re-sharding (its
// send and receive vectors, the receive becoming the copy), the ring pass on the re-sharded q, k,
// v (and out, dout, lse and the fp32 dq, dk, dv in backward) with the kernels' workspace for
// N x N blocks, and the return of out or dq (its receive vector). On the local backend also the
// all-to-alls' message copies (local_messages).
double hybrid_working_bytes(const CpProblem& p) {
  const int U = p.shape.inner;
  const bool replicate = p.shape.replicate_kv;
  const int64_t n = p.rows, N = U * n, hl = p.heads / U;
  const int64_t hkv = replicate ? 1 : p.kv_heads / U;
  const double D = double(p.head_dim), T = double(p.dtype_bytes);
  const double q = double(n) * double(p.heads) * D * T;  // q, out or dout, either sharding
  const double kv = double(N) * double(hkv) * D * T;     // k or v re-sharded
  // k or v as sent (replicated: each member's rows once per member) and the dk or dv received
  const double kv_rows = replicate ? double(U) * double(n) : double(n) * double(p.kv_heads);
  const double kv_send = kv_rows * D * T, dkv_home = kv_rows * D * 4;
  const double stat = 4.0 * double(n) * double(p.heads);  // lse, delta: [hl, N] or [H, n]
  const double dq = double(n) * double(p.heads) * D * 4, dkv = double(N) * double(hkv) * D * 4;
  const double fwd =
      std::max({2 * q, q + kv + kv_send + kv, q + 2 * kv + kernel_bytes(p, N, N, hl, hkv),
                2 * q + 2 * kv + stat + std::max(q, 2 * stat)});
  double bwd = 0;
  if (p.backward) {
    const double held = 3 * q + 2 * kv + stat + dq + 2 * dkv;  // ring_backward's operands
    bwd = std::max(
        {4 * q + 2 * kv, held + kernel_bytes(p, N, N, hl, hkv), held + std::max(dq, dkv_home)});
  }
  // The re-sharding vectors are freed and allocated again at every call: glibc's malloc keeps
  // up to its trim threshold, twice the largest block freed (below 32 MiB), of freed memory in
  // the thread's arena.
  const double freed = std::max({q, kv_send, p.backward ? dq : 0});
  double b = state_bytes(p, N, hl) + ring_pass_bytes(p, p.shape.outer, N, hkv) +
             (p.backward ? stat : 0) + std::max(fwd, bwd) +
             (freed < 32.0 * 1024 * 1024 ? 2 * freed : 0);
  if (p.local_backend)  // the all-to-alls' messages: a rank's part for one member
    b += local_messages(
        U, {q / U, kv_send / U, p.backward ? dq / U : 0, p.backward ? dkv_home / U : 0});
  return b;
}

extern constinit const StrategyEntry kHybridEntry{
    .id = Strategy::hybrid,
    .summary = kHybridSummary,
    .degree = {"--ulysses", "ulysses degree U; the ring degree is ranks / U", &CpConfig::ulysses},
    .splits_heads = true,
    .inner_degree = hybrid_inner,
    .make = make_hybrid,
    .working_bytes = hybrid_working_bytes};

}  // namespace loom::cp_detail
