// allgather: all-gather K,V from every cp rank, attend to each rank's block in turn, and
// reduce-scatter the dK,dV partials (the Llama 3 scheme). No ring steps to overlap, but any
// layout and head count, and one collective each way: for short sequences, few ranks, or GQA
// with few KV heads where K,V are small next to Q.
#include "strategy.h"

namespace loom::cp_detail {

namespace {

class Allgather : public CpStrategyOf<Allgather> {
 public:
  explicit Allgather(Engine& e)
      : e_(e),
        blocks_(e.shards),
        per_(static_cast<size_t>(2 * e.plan.max_rows() * e.kv_heads * e.dim)) {}

  template <class T>
  void fwd(const ForwardArgs<T>& a) {
    const T* all = gather_kv<T>(a.k, a.v);
    const int64_t n = blocks_[e_.me].rows, row = e_.kv_heads * e_.dim;
    const StateView st = e_.fresh_state(n, e_.heads);
    e_.rec.steps(e_.P);
    for (int j = 0; j < e_.P; ++j) {
      const T* base = all + static_cast<size_t>(j) * per_;
      const int64_t nj = blocks_[j].rows;
      e_.rec.forward_step(j, [&] {
        return attend_blocks<T>(
            st, a.q, blocks_[e_.me], e_.rows_view<const T>(base, nj, e_.kv_heads),
            e_.rows_view<const T>(base + nj * row, nj, e_.kv_heads), blocks_[j], e_.cfg.kernel);
      });
    }
    finish(st, a.out, a.lse, n);
  }

  template <class T>
  void bwd(const BackwardArgs<T>& a) {
    const int64_t n = blocks_[e_.me].rows, row = e_.kv_heads * e_.dim;
    float* delta = e_.mem.buffer<float>(kSlotDelta, static_cast<size_t>(e_.heads * n));
    compute_delta(a.out, a.dout, delta, n);
    const T* all = gather_kv<T>(a.k, a.v);
    float* dkv_all = e_.mem.buffer<float>(kSlotOwn + 2, e_.P * per_);
    e_.mem.zero(dkv_all, e_.P * per_);
    e_.mem.zero(a.dq);
    for (int j = 0; j < e_.P; ++j) {
      const T* base = all + static_cast<size_t>(j) * per_;
      float* dbase = dkv_all + static_cast<size_t>(j) * per_;
      const int64_t nj = blocks_[j].rows;
      e_.rec.backward_step(j, [&] {
        return attend_backward_blocks<T>(
            a.q, blocks_[e_.me], e_.rows_view<const T>(base, nj, e_.kv_heads),
            e_.rows_view<const T>(base + nj * row, nj, e_.kv_heads), blocks_[j], a.dout, a.lse,
            delta, e_.cfg.kernel, a.dq, e_.rows_view<float>(dbase, nj, e_.kv_heads),
            e_.rows_view<float>(dbase + nj * row, nj, e_.kv_heads));
      });
    }
    float* mine = e_.mem.buffer<float>(kSlotOwn + 3, per_);
    e_.rec.collective(SpanKind::reduce_scatter, [&] {
      e_.cp.reduce_scatter(dkv_all, mine, per_, DType::f32, ReduceOp::sum);
    });
    e_.mem.unpack<float>(mine, a.dk);
    e_.mem.unpack<float>(mine + n * row, a.dv);
  }

 private:
  // The padded gather of K and V: [P][2 max_n Hkv D] (k rows, then v rows; padding unread).
  template <class T>
  const T* gather_kv(View3<const T> k, View3<const T> v) {
    const int64_t row = e_.kv_heads * e_.dim;
    T* mine = e_.mem.buffer<T>(kSlotOwn, per_);
    e_.mem.pack<T>(k, mine);
    e_.mem.pack<T>(v, mine + k.s * row);
    T* all = e_.mem.buffer<T>(kSlotOwn + 1, e_.P * per_);
    e_.rec.collective(SpanKind::allgather, [&] { e_.cp.all_gather(mine, per_ * sizeof(T), all); });
    return all;
  }

  Engine& e_;
  const std::vector<Block>& blocks_;  // every cp rank's shard
  size_t per_ = 0;                    // elements of one rank's padded K,V
};

}  // namespace

constexpr const char* kAllgatherSummary =
    "all-gather K,V, attend, reduce-scatter dK,dV (short sequences, few KV heads)";
// This rank's packed K,V and the whole gathered K,V (slots kSlotOwn, +1), in backward delta,
// every block's dK,dV partials and this rank's reduced part (+2, +3), the softmax state, and the
// kernels' workspace for n x n blocks. On the local backend also the collectives' copies
// (local_messages: the all-gather's and the reduce-scatter's blocks) and the reduce-scatter's
// scratch of P blocks, which the communicator keeps. Under MPI the reduce-scatter's temporary
// buffers instead: Open MPI's non-blocking one reduces over a binomial tree into copies of the
// whole input, up to two on the root (measured: rank 0 peaked 28.6 MiB above the rest at
// --seq 8192 on 4 ranks).
double allgather_working_bytes(const CpProblem& p) {
  const double P = double(p.ranks), T = double(p.dtype_bytes);
  const double per = 2.0 * double(p.rows) * double(p.kv_heads) * double(p.head_dim);
  double b = per * T * (1 + P) + state_bytes(p, p.rows, p.heads) +
             kernel_bytes(p, p.rows, p.rows, p.heads, p.kv_heads);
  if (p.backward) b += 4.0 * double(p.heads) * double(p.rows) + per * 4 * (P + 1);
  if (p.local_backend) {
    b += local_messages(p.ranks, {per * T, p.backward ? per * 4 : 0});
    if (p.backward) b += P * per * 4;
  } else if (p.backward) {
    b += 2 * P * per * 4;
  }
  return b;
}

extern constinit const StrategyEntry kAllgatherEntry =
    one_axis_entry<Allgather>(Strategy::allgather, kAllgatherSummary, allgather_working_bytes);

}  // namespace loom::cp_detail
