// CpAttention: one entry point for the four strategies.
//
// Every strategy reduces to "a ring of R members, each holding the rows of its block for Hl
// heads": ring is U = 1 (R = P); ulysses is U = P (R = 1, no ring traffic); hybrid is U x R with
// the all-to-all inside each group of U consecutive cp ranks and the ring across groups; the
// all-gather strategy gathers every block at once and reduce-scatters dK, dV instead.
#include <algorithm>
#include <cstring>
#include <memory>

#include "engine.h"
#include "loom/timer.h"
#include "ulysses.h"

namespace loom {

using cp_detail::Block;
using cp_detail::UlyssesGroup;

void CpMetrics::clear_counters() {
  compute_s = comm_s = wait_s = 0;
  bytes_sent = bytes_recv = tiles = visible_pairs = 0;
  step_tiles.clear();
  spans.clear();
}

double CpMetrics::comm_window_s() const {
  std::vector<std::pair<double, double>> iv;
  for (const Span& s : spans)
    if (s.kind != "compute" && s.kind != "wait") iv.emplace_back(s.t0, s.t1);
  std::sort(iv.begin(), iv.end());
  double total = 0, a = 0, b = -1e300;
  for (const auto& [x, y] : iv) {
    if (x > b) {
      if (b > a) total += b - a;
      a = x;
      b = y;
    } else {
      b = std::max(b, y);
    }
  }
  if (b > a) total += b - a;
  return total;
}

struct CpAttention::Impl {
  Communicator& cp;
  ShardPlan plan;
  CpConfig cfg;
  int64_t heads, kv_heads, dim;
  int P, me;
  int U = 1, R = 1;
  std::unique_ptr<Communicator> uly_owned, ring_owned;
  Communicator* ring = nullptr;  // nullptr when R == 1
  UlyssesGroup group;            // U > 1 only
  bool replicate_kv = false;
  std::vector<Block> blocks;  // ring members' blocks (allgather: every rank's shard)
  CpMetrics metrics;
  cp_detail::Workspace ws;              // the ring's reused buffers
  std::unique_ptr<SoftmaxState> state;  // reused forward state

  // The forward state for `rows` rows of `heads` heads, empty (m = -inf, l = 0, acc = 0).
  StateView fresh_state(int64_t rows, int64_t heads) {
    if (!state || state->rows() != rows || state->acc.size(1) != heads) {
      state = std::make_unique<SoftmaxState>(rows, heads, dim);
    } else {
      state->reset();
    }
    return state->view();
  }

  Impl(Communicator& c, const ShardPlan& p, const CpConfig& config, int64_t h, int64_t hkv,
       int64_t d)
      : cp(c), plan(p), cfg(config), heads(h), kv_heads(hkv), dim(d), P(c.size()), me(c.rank()) {}

  // Communicator byte counters of every communicator this strategy uses.
  int64_t bytes(bool sent) const {
    auto get = [&](const Communicator* c) {
      return c ? (sent ? c->stats().bytes_sent : c->stats().bytes_recv) : 0;
    };
    return get(&cp) + get(uly_owned.get()) + get(ring_owned.get());
  }
};

namespace {

void zero(View3<float> x) {
  for (int64_t i = 0; i < x.s; ++i)
    for (int64_t h = 0; h < x.h; ++h) std::fill_n(x.row(i, h), x.d, 0.0f);
}

template <class T>
void check_view(const char* name, View3<const T> x, int64_t rows, int64_t heads, int64_t dim) {
  LOOM_CHECK(x.s == rows && x.h == heads && x.d == dim && (x.data != nullptr || rows == 0),
             InvalidArgument,
             name << " must be [" << rows << ", " << heads << ", " << dim << "] on this rank, got ["
                  << x.s << ", " << x.h << ", " << x.d << "]");
}

}  // namespace

CpAttention::CpAttention(Communicator& cp, const ShardPlan& plan, const CpConfig& cfg,
                         int64_t heads, int64_t kv_heads, int64_t head_dim)
    : impl_(new Impl(cp, plan, cfg, heads, kv_heads, head_dim)) {
  std::unique_ptr<Impl> guard(impl_);
  Impl& s = *impl_;
  LOOM_CHECK(heads >= 1 && kv_heads >= 1 && head_dim >= 1, InvalidArgument,
             "heads, kv-heads and head-dim must be positive (got " << heads << ", " << kv_heads
                                                                   << ", " << head_dim << ")");
  LOOM_CHECK(heads % kv_heads == 0, InvalidArgument,
             "heads (" << heads << ") must be a multiple of kv-heads (" << kv_heads << ")");
  LOOM_CHECK(plan.ranks == s.P, InvalidArgument,
             "the shard plan is for " << plan.ranks << " ranks but the group has " << s.P);
  LOOM_CHECK(cfg.kernel.scale > 0, InvalidArgument, "softmax scale must be positive");
  LOOM_CHECK(cfg.kernel.mask.window >= 0, InvalidArgument,
             "window must be >= 0 (0 = unlimited), got " << cfg.kernel.mask.window);
  switch (cfg.strategy) {
    case Strategy::ring:
      s.U = 1;
      break;
    case Strategy::ulysses:
      s.U = s.P;
      break;
    case Strategy::hybrid:
      LOOM_CHECK(cfg.ulysses >= 1 && s.P % cfg.ulysses == 0, InvalidArgument,
                 "hybrid: --ulysses " << cfg.ulysses << " must divide the number of ranks " << s.P);
      s.U = cfg.ulysses;
      break;
    case Strategy::allgather:
      s.U = 1;
      break;
  }
  s.R = s.P / s.U;
  if (s.U > 1) {
    LOOM_CHECK(heads % s.U == 0, InvalidArgument,
               to_string(cfg.strategy)
                   << ": heads (" << heads << ") must be divisible by the ulysses degree (" << s.U
                   << ")");
    LOOM_CHECK(kv_heads % s.U == 0 || s.U % kv_heads == 0, InvalidArgument,
               to_string(cfg.strategy)
                   << ": kv-heads (" << kv_heads << ") and the ulysses degree (" << s.U
                   << ") must divide one another (scatter KV heads when kv-heads % U == 0, "
                      "replicate them when U % kv-heads == 0); heads = "
                   << heads);
    s.replicate_kv = kv_heads % s.U != 0;
  }
  const int uly_index = s.me % s.U, ring_index = s.me / s.U;
  if (cfg.strategy == Strategy::hybrid) {
    s.uly_owned = cp.split(ring_index, uly_index);
    s.ring_owned = cp.split(uly_index, ring_index);
    s.ring = s.R > 1 ? s.ring_owned.get() : nullptr;
    s.group.comm = s.uly_owned.get();
  } else if (cfg.strategy == Strategy::ulysses) {
    s.group.comm = &cp;
  } else if (cfg.strategy == Strategy::ring) {
    s.ring = s.P > 1 ? &cp : nullptr;
  }
  if (s.U > 1)
    for (int u = 0; u < s.U; ++u) s.group.rows.push_back(plan.rows(ring_index * s.U + u));
  const int nblocks = cfg.strategy == Strategy::allgather ? s.P : s.R;
  const int per = cfg.strategy == Strategy::allgather ? 1 : s.U;
  for (int j = 0; j < nblocks; ++j) s.blocks.push_back(cp_detail::make_block(plan, j * per, per));
  guard.release();
}

CpAttention::~CpAttention() {
  delete impl_;
}

CpMetrics& CpAttention::metrics() {
  return impl_->metrics;
}

namespace {

// The all-gather strategy's padded gather of K and V: [P][2 max_n Hkv D] (k rows, then v rows).
template <class T>
std::vector<T> gather_kv(CpAttention::Impl& s, View3<const T> k, View3<const T> v) {
  const int64_t row = s.kv_heads * s.dim, max_n = s.plan.max_rows(), n = k.s;
  std::vector<T> mine(static_cast<size_t>(2 * max_n * row), T{});
  cp_detail::pack(k, mine.data());
  cp_detail::pack(v, mine.data() + n * row);
  std::vector<T> all(static_cast<size_t>(s.P) * mine.size());
  const double t0 = now_s();
  s.cp.all_gather(mine.data(), mine.size() * sizeof(T), all.data());
  const double t1 = now_s();
  s.metrics.comm_s += t1 - t0;
  s.metrics.wait_s += t1 - t0;
  cp_detail::add_span(s.metrics, "allgather", -1, t0, t1);
  return all;
}

template <class T>
View3<T> rows_view(T* p, int64_t rows, int64_t heads, int64_t dim) {
  return View3<T>{p, rows, heads, dim, heads * dim, dim};
}

}  // namespace

namespace {

template <class T>
void forward_impl(CpAttention::Impl& s, View3<const T> q, View3<const T> k, View3<const T> v,
                  View3<T> out, float* lse) {
  const int64_t n = s.plan.rows(s.me);
  check_view<T>("q", q, n, s.heads, s.dim);
  check_view<T>("k", k, n, s.kv_heads, s.dim);
  check_view<T>("v", v, n, s.kv_heads, s.dim);
  check_view<T>("out", out, n, s.heads, s.dim);
  LOOM_CHECK(lse != nullptr || n == 0, InvalidArgument, "lse must not be null");
  const int64_t sent0 = s.bytes(true), recv0 = s.bytes(false);
  CpMetrics& m = s.metrics;

  if (s.cfg.strategy == Strategy::allgather) {
    const std::vector<T> all = gather_kv<T>(s, k, v);
    const int64_t row = s.kv_heads * s.dim, max_n = s.plan.max_rows();
    const StateView st = s.fresh_state(n, s.heads);
    m.step_tiles.assign(s.P, 0);
    for (int j = 0; j < s.P; ++j) {
      const T* base = all.data() + static_cast<size_t>(j) * 2 * max_n * row;
      const int64_t nj = s.blocks[j].rows;
      const double t0 = now_s();
      const KernelStats ks = cp_detail::attend_blocks<T>(
          st, q, s.blocks[s.me], rows_view<const T>(base, nj, s.kv_heads, s.dim),
          rows_view<const T>(base + nj * row, nj, s.kv_heads, s.dim), s.blocks[j], s.cfg.kernel);
      const double t1 = now_s();
      m.compute_s += t1 - t0;
      cp_detail::add_span(m, "compute", j, t0, t1);
      m.tiles += ks.tiles;
      m.visible_pairs += ks.visible_pairs;
      m.step_tiles[j] = ks.tiles;
    }
    finish(st, out, lse, n);
  } else if (s.U == 1) {
    const StateView st = s.fresh_state(n, s.heads);
    cp_detail::ring_forward<T>(s.ring, s.blocks, q, k, v, st, s.cfg.kernel, m, s.ws);
    finish(st, out, lse, n);
  } else {
    const Tensor<T> ql = cp_detail::seq_to_head<T>(s.group, q, m);
    const Tensor<T> kl = s.replicate_kv ? cp_detail::seq_to_head_replicated<T>(s.group, k, m)
                                        : cp_detail::seq_to_head<T>(s.group, k, m);
    const Tensor<T> vl = s.replicate_kv ? cp_detail::seq_to_head_replicated<T>(s.group, v, m)
                                        : cp_detail::seq_to_head<T>(s.group, v, m);
    const int64_t N = s.group.total(), hl = s.heads / s.U;
    const StateView st = s.fresh_state(N, hl);
    cp_detail::ring_forward<T>(s.ring, s.blocks, ql.view3(), kl.view3(), vl.view3(), st,
                               s.cfg.kernel, m, s.ws);
    Tensor<T> outl({N, hl, s.dim});
    std::vector<float> lsel(static_cast<size_t>(hl * N));
    finish(st, outl.view3(), lsel.data(), N);
    cp_detail::head_to_seq<T>(s.group, outl, out, m);
    cp_detail::lse_to_seq(s.group, lsel, s.heads, lse, m);
  }
  m.bytes_sent += s.bytes(true) - sent0;
  m.bytes_recv += s.bytes(false) - recv0;
}

template <class T>
void backward_impl(CpAttention::Impl& s, View3<const T> q, View3<const T> k, View3<const T> v,
                   View3<const T> out, View3<const T> dout, const float* lse, View3<float> dq,
                   View3<float> dk, View3<float> dv) {
  const int64_t n = s.plan.rows(s.me);
  check_view<T>("q", q, n, s.heads, s.dim);
  check_view<T>("k", k, n, s.kv_heads, s.dim);
  check_view<T>("v", v, n, s.kv_heads, s.dim);
  check_view<T>("out", out, n, s.heads, s.dim);
  check_view<T>("dout", dout, n, s.heads, s.dim);
  check_view<float>("dq", dq, n, s.heads, s.dim);
  check_view<float>("dk", dk, n, s.kv_heads, s.dim);
  check_view<float>("dv", dv, n, s.kv_heads, s.dim);
  LOOM_CHECK(lse != nullptr || n == 0, InvalidArgument, "lse must not be null");
  const int64_t sent0 = s.bytes(true), recv0 = s.bytes(false);
  CpMetrics& m = s.metrics;

  if (s.cfg.strategy == Strategy::allgather) {
    std::vector<float> delta(static_cast<size_t>(s.heads * n));
    compute_delta(out, dout, delta.data(), n);
    const std::vector<T> all = gather_kv<T>(s, k, v);
    const int64_t row = s.kv_heads * s.dim, max_n = s.plan.max_rows();
    const size_t per = static_cast<size_t>(2 * max_n * row);
    std::vector<float> dkv_all(static_cast<size_t>(s.P) * per, 0.0f);
    zero(dq);
    for (int j = 0; j < s.P; ++j) {
      const T* base = all.data() + j * per;
      float* dbase = dkv_all.data() + j * per;
      const int64_t nj = s.blocks[j].rows;
      const double t0 = now_s();
      const KernelStats ks = cp_detail::attend_backward_blocks<T>(
          q, s.blocks[s.me], rows_view<const T>(base, nj, s.kv_heads, s.dim),
          rows_view<const T>(base + nj * row, nj, s.kv_heads, s.dim), s.blocks[j], dout, lse,
          delta.data(), s.cfg.kernel, dq, rows_view<float>(dbase, nj, s.kv_heads, s.dim),
          rows_view<float>(dbase + nj * row, nj, s.kv_heads, s.dim));
      const double t1 = now_s();
      m.compute_s += t1 - t0;
      cp_detail::add_span(m, "compute", j, t0, t1);
      m.tiles += ks.tiles;
    }
    std::vector<float> mine(per);
    const double t0 = now_s();
    s.cp.reduce_scatter(dkv_all.data(), mine.data(), per, DType::f32, ReduceOp::sum);
    const double t1 = now_s();
    m.comm_s += t1 - t0;
    m.wait_s += t1 - t0;
    cp_detail::add_span(m, "reduce_scatter", -1, t0, t1);
    cp_detail::unpack<float>(mine.data(), dk);
    cp_detail::unpack<float>(mine.data() + n * row, dv);
  } else if (s.U == 1) {
    std::vector<float> delta(static_cast<size_t>(s.heads * n));
    compute_delta(out, dout, delta.data(), n);
    cp_detail::ring_backward<T>(s.ring, s.blocks, q, k, v, dout, lse, delta.data(), s.cfg.kernel,
                                dq, dk, dv, m, s.ws);
  } else {
    const Tensor<T> ql = cp_detail::seq_to_head<T>(s.group, q, m);
    const Tensor<T> kl = s.replicate_kv ? cp_detail::seq_to_head_replicated<T>(s.group, k, m)
                                        : cp_detail::seq_to_head<T>(s.group, k, m);
    const Tensor<T> vl = s.replicate_kv ? cp_detail::seq_to_head_replicated<T>(s.group, v, m)
                                        : cp_detail::seq_to_head<T>(s.group, v, m);
    const Tensor<T> outl = cp_detail::seq_to_head<T>(s.group, out, m);
    const Tensor<T> doutl = cp_detail::seq_to_head<T>(s.group, dout, m);
    const std::vector<float> lsel = cp_detail::lse_to_head(s.group, lse, s.heads, m);
    const int64_t N = s.group.total(), hl = s.heads / s.U;
    std::vector<float> delta(static_cast<size_t>(hl * N));
    compute_delta(outl.view3(), doutl.view3(), delta.data(), N);
    Tensor<float> dql({N, hl, s.dim}), dkl(kl.shape()), dvl(vl.shape());
    cp_detail::ring_backward<T>(s.ring, s.blocks, ql.view3(), kl.view3(), vl.view3(), doutl.view3(),
                                lsel.data(), delta.data(), s.cfg.kernel, dql.view3(), dkl.view3(),
                                dvl.view3(), m, s.ws);
    cp_detail::head_to_seq<float>(s.group, dql, dq, m);
    if (s.replicate_kv) {
      cp_detail::head_to_seq_replicated(s.group, dkl, dk, m);
      cp_detail::head_to_seq_replicated(s.group, dvl, dv, m);
    } else {
      cp_detail::head_to_seq<float>(s.group, dkl, dk, m);
      cp_detail::head_to_seq<float>(s.group, dvl, dv, m);
    }
  }
  m.bytes_sent += s.bytes(true) - sent0;
  m.bytes_recv += s.bytes(false) - recv0;
}

}  // namespace

void CpAttention::forward(View3<const float> q, View3<const float> k, View3<const float> v,
                          View3<float> out, float* lse) {
  forward_impl<float>(*impl_, q, k, v, out, lse);
}

void CpAttention::forward(View3<const bf16> q, View3<const bf16> k, View3<const bf16> v,
                          View3<bf16> out, float* lse) {
  forward_impl<bf16>(*impl_, q, k, v, out, lse);
}

void CpAttention::backward(View3<const float> q, View3<const float> k, View3<const float> v,
                           View3<const float> out, View3<const float> dout, const float* lse,
                           View3<float> dq, View3<float> dk, View3<float> dv) {
  backward_impl<float>(*impl_, q, k, v, out, dout, lse, dq, dk, dv);
}

void CpAttention::backward(View3<const bf16> q, View3<const bf16> k, View3<const bf16> v,
                           View3<const bf16> out, View3<const bf16> dout, const float* lse,
                           View3<float> dq, View3<float> dk, View3<float> dv) {
  backward_impl<bf16>(*impl_, q, k, v, out, dout, lse, dq, dk, dv);
}

Tensor<float> gather_rows(Communicator& cp, const ShardPlan& plan, const Tensor<float>& local) {
  LOOM_CHECK(local.dim() == 3, InvalidArgument, "gather_rows needs a 3-d tensor");
  const int me = cp.rank();
  const int64_t w = local.size(1) * local.size(2), max_n = plan.max_rows();
  LOOM_CHECK_EQ(local.size(0), plan.rows(me), InvalidArgument, "gather_rows: local rows");
  std::vector<float> mine(static_cast<size_t>(max_n * w), 0.0f);
  std::copy_n(local.data(), local.numel(), mine.data());
  std::vector<float> all(static_cast<size_t>(plan.ranks) * mine.size());
  cp.all_gather(mine.data(), mine.size() * sizeof(float), all.data());
  Tensor<float> global({plan.seq, local.size(1), local.size(2)});
  for (int r = 0; r < plan.ranks; ++r)
    for (int64_t i = 0; i < plan.rows(r); ++i)
      std::copy_n(all.data() + (r * max_n + i) * w, w, global.data() + plan.tokens[r][i] * w);
  return global;
}

}  // namespace loom
