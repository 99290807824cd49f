// Blockwise attention on one rank: the forward folds KV blocks into a running softmax state, the
// backward accumulates the gradient contributions of one KV block.
//
// Tiles. The query rows are cut into q-tiles of block_q rows and the key rows into k-tiles of
// block_k rows (the last of each may be shorter). A tile is one (q-tile, k-tile) pair of one query
// head. Before any arithmetic, a plan classifies every (q-tile, k-tile) pair from the min and max
// positions and document ids of its rows and columns:
//   empty   no pair can be visible (disjoint document ranges, or the range of pos_i - pos_j lies
//           outside what causal / window allow): skipped;
//   full    one single document on both sides and every pos_i - pos_j allowed: no mask work;
//   partial anything else: the mask is applied per element. Partial tiles are counted exactly
//           once in the plan; one that turns out to have no visible pair becomes empty, one whose
//           pairs are all visible becomes full.
//
// Forward (per query head h and q-tile, on the state's rows): for each non-empty k-tile, the
// tile's scores s = scale q k^T (tile_scores), the online softmax update (softmax_update)
//   m' = max(m, max_j s_j),  p_j = exp(s_j - m'),  alpha = exp(m - m'),
//   l' = alpha l + sum_j p_j,  acc' = alpha acc,
// and acc' += p v (tile_pv). A row that has seen no visible key keeps m = -inf, l = 0, acc = 0;
// the update never forms exp(-inf - -inf). finish() divides acc by l.
//
// Backward (per kv head g and k-tile, over the query heads that read g and all q-tiles):
//   s = scale q k^T, p = exp(s - lse), dv += p^T dout, dp = dout v^T,
//   ds = scale p (dp - delta), dk += ds^T q, dq += ds k.
// dk and dv of a (g, k-tile) belong to one task. dq rows are shared by all k-tiles, so each
// thread adds its dq contributions into its own buffer (thread 0 into the caller's dq) and the
// buffers are summed at the end in thread order: race-free and, with the static schedule,
// deterministic for a given thread count. The cost is (threads - 1) extra fp32 [Sq, H, D]
// buffers per call. ds = p (dp - delta) cancels when one key carries a row's mass; compute_delta
// sums over d in the order in which the tile GEMM accumulates dp, so that cancellation is exact
// instead of amplified rounding noise (see compute_delta).
//
// Packing. Every tile is copied into contiguous buffers padded to the GEMM register block (rows
// to kMr, columns and head dim to kNr; padding is zero, padded probabilities are zero), so the
// tile GEMM and the softmax loops have no remainders. The forward packs the whole KV block once
// per call (k^T and v, tile-major) and each (head, q-tile) task packs its q rows; a backward task
// packs its k-tile once (k, k^T, v^T) and the q and dout rows of each tile it visits.
// All arithmetic is fp32.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <new>
#include <vector>

#include "checks.h"
#include "loom/attention.h"
#include "tile_ops.h"

namespace loom {
namespace {

using kernels::gemm_tile;
using kernels::kMr;
using kernels::kNr;
using kernels::round_up;

// ---------------------------------------------------------------------------------------------
// Plan: classification of the (q-tile, k-tile) pairs.

enum class TileKind : uint8_t { kEmpty, kFull, kPartial };

struct TileRange {
  int64_t pos_lo, pos_hi;
  int32_t doc_lo, doc_hi;
};

TileRange tile_range(const Tokens& t, int64_t begin, int64_t count) {
  TileRange r{std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min(),
              std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min()};
  for (int64_t i = begin; i < begin + count; ++i) {
    r.pos_lo = std::min(r.pos_lo, t.pos[i]);
    r.pos_hi = std::max(r.pos_hi, t.pos[i]);
    const int32_t doc = t.doc ? t.doc[i] : 0;
    r.doc_lo = std::min(r.doc_lo, doc);
    r.doc_hi = std::max(r.doc_hi, doc);
  }
  return r;
}

struct TilePlan {
  int64_t block_q = 0, block_k = 0;
  int64_t q_tiles = 0, k_tiles = 0;
  std::vector<TileKind> kind;  // [q_tiles * k_tiles]
  int64_t pairs = 0;           // visible (query, key) pairs, one head
  int64_t computed = 0;        // non-empty (q-tile, k-tile) pairs

  TileKind at(int64_t qi, int64_t kj) const { return kind[qi * k_tiles + kj]; }
  int64_t q_begin(int64_t qi) const { return qi * block_q; }
  int64_t k_begin(int64_t kj) const { return kj * block_k; }
};

KernelStats plan_stats(const TilePlan& plan, int64_t heads) {
  KernelStats st;
  st.tiles = plan.computed * heads;
  st.tiles_skipped = (plan.q_tiles * plan.k_tiles - plan.computed) * heads;
  st.visible_pairs = plan.pairs * heads;
  return st;
}

TilePlan plan_tiles(const Tokens& qt, const Tokens& kt, const Mask& mask, int64_t block_q,
                    int64_t block_k, int threads) {
  TilePlan plan;
  plan.block_q = block_q;
  plan.block_k = block_k;
  plan.q_tiles = (qt.n + block_q - 1) / block_q;
  plan.k_tiles = (kt.n + block_k - 1) / block_k;
  plan.kind.assign(static_cast<size_t>(plan.q_tiles * plan.k_tiles), TileKind::kEmpty);

  std::vector<TileRange> k_ranges(static_cast<size_t>(plan.k_tiles));
  for (int64_t kj = 0; kj < plan.k_tiles; ++kj) {
    const int64_t k0 = plan.k_begin(kj);
    k_ranges[kj] = tile_range(kt, k0, std::min(block_k, kt.n - k0));
  }
  // The allowed range of d = pos_i - pos_j: causal needs d >= 0, a window |d| < window.
  const int64_t d_lo = mask.causal       ? 0
                       : mask.window > 0 ? -(mask.window - 1)
                                         : std::numeric_limits<int64_t>::min();
  const int64_t d_hi = mask.window > 0 ? mask.window - 1 : std::numeric_limits<int64_t>::max();

  int64_t pairs = 0, computed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(+ : pairs, computed)
  for (int64_t qi = 0; qi < plan.q_tiles; ++qi) {
    const int64_t q0 = plan.q_begin(qi), rows = std::min(block_q, qt.n - q0);
    const TileRange qr = tile_range(qt, q0, rows);
    for (int64_t kj = 0; kj < plan.k_tiles; ++kj) {
      const TileRange& kr = k_ranges[kj];
      const int64_t k0 = plan.k_begin(kj), cols = std::min(block_k, kt.n - k0);
      const int64_t diff_lo = qr.pos_lo - kr.pos_hi, diff_hi = qr.pos_hi - kr.pos_lo;
      TileKind kind;
      int64_t visible_here = 0;
      if (qr.doc_hi < kr.doc_lo || kr.doc_hi < qr.doc_lo || diff_hi < d_lo || diff_lo > d_hi) {
        kind = TileKind::kEmpty;
      } else if (qr.doc_lo == qr.doc_hi && kr.doc_lo == kr.doc_hi && qr.doc_lo == kr.doc_lo &&
                 diff_lo >= d_lo && diff_hi <= d_hi) {
        kind = TileKind::kFull;
        visible_here = rows * cols;
      } else {
        for (int64_t i = q0; i < q0 + rows; ++i) {
          const int32_t qdoc = qt.doc ? qt.doc[i] : 0;
          for (int64_t j = k0; j < k0 + cols; ++j)
            visible_here += visible(mask, qt.pos[i], qdoc, kt.pos[j], kt.doc ? kt.doc[j] : 0);
        }
        kind = visible_here == 0             ? TileKind::kEmpty
               : visible_here == rows * cols ? TileKind::kFull
                                             : TileKind::kPartial;
      }
      plan.kind[qi * plan.k_tiles + kj] = kind;
      pairs += visible_here;
      computed += kind == TileKind::kEmpty ? 0 : 1;
    }
  }
  plan.pairs = pairs;
  plan.computed = computed;
  return plan;
}

// ---------------------------------------------------------------------------------------------
// Per-thread tile buffers.

// A zero-initialised float buffer aligned to 64 bytes (one cache line; room for wide vectors).
class AlignedFloats {
 public:
  AlignedFloats() = default;
  explicit AlignedFloats(int64_t n)
      : data_(static_cast<float*>(::operator new[](
            static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float), std::align_val_t{64}))) {
    std::fill(data_.get(), data_.get() + n, 0.0f);
  }
  float* get() const { return data_.get(); }

 private:
  struct Free {
    void operator()(float* p) const { ::operator delete[](p, std::align_val_t{64}); }
  };
  std::unique_ptr<float, Free> data_;
};

// Padded tile sizes: bq rows, bk columns, dp head-dim entries.
struct TileDims {
  int64_t bq, bk, dp;
};

TileDims tile_dims(const KernelConfig& cfg, int64_t dim) {
  return TileDims{round_up(cfg.block_q, kMr), round_up(cfg.block_k, kNr), round_up(dim, kNr)};
}

struct Workspace {
  explicit Workspace(const TileDims& t, bool backward)
      : q(t.bq * t.dp),
        s(t.bq * t.bk),
        acc(t.bq * t.dp),
        row_m(t.bq),
        row_l(t.bq),
        q_pos(static_cast<size_t>(t.bq)),
        k_pos(static_cast<size_t>(t.bk)),
        q_doc(static_cast<size_t>(t.bq)),
        k_doc(static_cast<size_t>(t.bk)) {
    if (backward) {
      kt = AlignedFloats(t.dp * t.bk);
      v = AlignedFloats(t.bk * t.dp);
      dout = AlignedFloats(t.bq * t.dp);
      k = AlignedFloats(t.bk * t.dp);
      dp = AlignedFloats(t.bq * t.bk);
      dk = AlignedFloats(t.bk * t.dp);
      dv = AlignedFloats(t.bk * t.dp);
    }
  }
  // Forward: q [bq, dp], s [bq, bk], acc [bq, dp], row_m and row_l the tile's m and l [bq].
  // Backward: also kt = k^T [dp, bk], k [bk, dp], v = v^T [dp, bk], dout [bq, dp], dp [bq, bk],
  // dk and dv [bk, dp]; acc holds the tile's dq, row_m the lse, row_l the delta.
  AlignedFloats q, s, acc, row_m, row_l;
  AlignedFloats kt, v, dout, k, dp, dk, dv;
  std::vector<int64_t> q_pos, k_pos;
  std::vector<int32_t> q_doc, k_doc;
};

int thread_count(const KernelConfig& cfg, int64_t tasks) {
  const int64_t wanted = cfg.threads > 0 ? cfg.threads : omp_get_max_threads();
  return static_cast<int>(std::max<int64_t>(1, std::min(wanted, tasks)));
}

// rows x d of a view (row r = x.row(begin + r, head)) into a [bq, dp] buffer, zero padded.
void pack_rows(View3<const float> x, int64_t begin, int64_t rows, int64_t head, const TileDims& t,
               float* dst) {
  for (int64_t r = 0; r < t.bq; ++r) {
    float* out = dst + r * t.dp;
    if (r < rows) {
      const float* in = x.row(begin + r, head);
      std::copy(in, in + x.d, out);
      std::fill(out + x.d, out + t.dp, 0.0f);
    } else {
      std::fill(out, out + t.dp, 0.0f);
    }
  }
}

// cols rows of a KV view, transposed, into a [dp, bk] buffer, zero padded.
void pack_transposed(View3<const float> x, int64_t begin, int64_t cols, int64_t head,
                     const TileDims& t, float* dst) {
  std::fill(dst, dst + t.dp * t.bk, 0.0f);
  for (int64_t j = 0; j < cols; ++j) {
    const float* in = x.row(begin + j, head);
    for (int64_t d = 0; d < x.d; ++d) dst[d * t.bk + j] = in[d];
  }
}

// cols rows of a KV view into a [bk, dp] buffer, zero padded.
void pack_kv_rows(View3<const float> x, int64_t begin, int64_t cols, int64_t head,
                  const TileDims& t, float* dst) {
  for (int64_t j = 0; j < t.bk; ++j) {
    float* out = dst + j * t.dp;
    if (j < cols) {
      const float* in = x.row(begin + j, head);
      std::copy(in, in + x.d, out);
      std::fill(out + x.d, out + t.dp, 0.0f);
    } else {
      std::fill(out, out + t.dp, 0.0f);
    }
  }
}

void pack_tokens(const Tokens& t, int64_t begin, int64_t count, int64_t* pos, int32_t* doc) {
  for (int64_t i = 0; i < count; ++i) {
    pos[i] = t.pos[begin + i];
    doc[i] = t.doc ? t.doc[begin + i] : 0;
  }
}

// The forward's KV block packed once per call, tile-major: for kv head g and k-tile kj,
// kt(g, kj) is k^T [dp, bk] and v(g, kj) is v [bk, dp], zero padded. Every (head, q-tile) task
// reads the same packed tiles instead of packing them again.
class PackedKv {
 public:
  PackedKv(View3<const float> k, View3<const float> v, const TilePlan& plan, const TileDims& t,
           int threads)
      : tile_elems_(t.dp * t.bk),
        k_tiles_(plan.k_tiles),
        kt_(k.h * plan.k_tiles * tile_elems_),
        v_(k.h * plan.k_tiles * tile_elems_) {
    const int64_t tiles = k.h * plan.k_tiles;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < tiles; ++i) {
      const int64_t g = i / plan.k_tiles, kj = i % plan.k_tiles;
      const int64_t k0 = plan.k_begin(kj), cols = std::min(plan.block_k, k.s - k0);
      pack_transposed(k, k0, cols, g, t, kt_.get() + i * tile_elems_);
      pack_kv_rows(v, k0, cols, g, t, v_.get() + i * tile_elems_);
    }
  }
  const float* kt(int64_t g, int64_t kj) const {
    return kt_.get() + (g * k_tiles_ + kj) * tile_elems_;
  }
  const float* v(int64_t g, int64_t kj) const {
    return v_.get() + (g * k_tiles_ + kj) * tile_elems_;
  }

 private:
  int64_t tile_elems_, k_tiles_;
  AlignedFloats kt_, v_;
};

// ---------------------------------------------------------------------------------------------
// Tile steps. s is [bq, bk]; only rows < rows and columns < cols are real.

// s = scale * q k^T from q [bq, dp] and k^T [dp, bk].
void tile_scores(const float* q, const float* kt, float scale, const TileDims& t, float* s) {
  gemm_tile(t.bq, t.bk, t.dp, q, t.dp, 1, kt, t.bk, scale, false, s, t.bk);
}

// Sets the scores of the pairs the mask hides to -inf (partial tiles only).
void mask_tile(const Mask& mask, const Workspace& ws, int64_t rows, int64_t cols, const TileDims& t,
               float* s) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t qpos = ws.q_pos[r];
    const int32_t qdoc = ws.q_doc[r];
    float* sr = s + r * t.bk;
    for (int64_t j = 0; j < cols; ++j)
      if (!visible(mask, qpos, qdoc, ws.k_pos[j], ws.k_doc[j])) sr[j] = kNegInf;
  }
}

// Online softmax update of rows [0, rows): turns s into p = exp(s - m') in place (zero in the
// padding and in rows that have seen no key yet), and rescales l and acc [bq, dp].
void softmax_update(int64_t rows, int64_t cols, const TileDims& t, float* s, float* m, float* l,
                    float* acc) {
  for (int64_t r = 0; r < t.bq; ++r) {
    float* sr = s + r * t.bk;
    float tile_max = kNegInf;
    if (r < rows) {
#pragma omp simd reduction(max : tile_max)
      for (int64_t j = 0; j < cols; ++j) tile_max = sr[j] > tile_max ? sr[j] : tile_max;
    }
    const float m_new = std::max(m[r], tile_max);
    if (m_new == kNegInf) {  // padding, or no visible key so far: nothing to add
      std::fill(sr, sr + t.bk, 0.0f);
      continue;
    }
    const float alpha = kernels::fast_exp(m[r] - m_new);  // m[r] = -inf: 0
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < cols; ++j) {
      const float p = kernels::fast_exp(sr[j] - m_new);
      sr[j] = p;
      sum += p;
    }
    std::fill(sr + cols, sr + t.bk, 0.0f);
    l[r] = alpha * l[r] + sum;
    m[r] = m_new;
    if (alpha != 1.0f) {
      float* ar = acc + r * t.dp;
      for (int64_t d = 0; d < t.dp; ++d) ar[d] *= alpha;
    }
  }
}

// acc [bq, dp] += p [bq, bk] v [bk, dp].
void tile_pv(const float* p, const float* v, const TileDims& t, float* acc) {
  gemm_tile(t.bq, t.dp, t.bk, p, t.bk, 1, v, t.dp, 1.0f, true, acc, t.dp);
}

// Backward: s becomes p = exp(s - lse) (zero in the padding and in rows with lse = -inf).
void tile_probs(int64_t rows, int64_t cols, const TileDims& t, const float* lse, float* s) {
  for (int64_t r = 0; r < t.bq; ++r) {
    float* sr = s + r * t.bk;
    if (r >= rows || lse[r] == kNegInf) {
      std::fill(sr, sr + t.bk, 0.0f);
      continue;
    }
    const float lse_r = lse[r];
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) sr[j] = kernels::fast_exp(sr[j] - lse_r);
    std::fill(sr + cols, sr + t.bk, 0.0f);
  }
}

// Backward: dp becomes ds = scale * p (dp - delta).
void tile_ds(const float* p, const float* delta, float scale, const TileDims& t, float* dp) {
  for (int64_t r = 0; r < t.bq; ++r) {
    const float* pr = p + r * t.bk;
    float* dr = dp + r * t.bk;
    const float delta_r = delta[r];
#pragma omp simd
    for (int64_t j = 0; j < t.bk; ++j) dr[j] = scale * pr[j] * (dr[j] - delta_r);
  }
}

// ---------------------------------------------------------------------------------------------
// Forward.

struct ForwardArgs {
  StateView st;
  View3<const float> q, k, v;
  Tokens qt, kt;
  const KernelConfig* cfg;
  const TilePlan* plan;
  TileDims dims;
  const PackedKv* kv;
};

// Folds every non-empty k-tile into the state rows of q-tile qi, head h.
void forward_task(const ForwardArgs& a, int64_t h, int64_t qi, Workspace& ws) {
  const TilePlan& plan = *a.plan;
  const TileDims& t = a.dims;
  const int64_t g = h / (a.q.h / a.k.h);
  const int64_t q0 = plan.q_begin(qi), rows = std::min(plan.block_q, a.q.s - q0);
  const int64_t dim = a.q.d;

  pack_rows(a.q, q0, rows, h, t, ws.q.get());
  pack_tokens(a.qt, q0, rows, ws.q_pos.data(), ws.q_doc.data());
  float* acc = ws.acc.get();
  float* m = ws.row_m.get();
  float* l = ws.row_l.get();
  for (int64_t r = 0; r < t.bq; ++r) {
    float* ar = acc + r * t.dp;
    if (r < rows) {
      const float* in = a.st.acc + (q0 + r) * a.st.acc_ss + h * dim;
      std::copy(in, in + dim, ar);
      std::fill(ar + dim, ar + t.dp, 0.0f);
      m[r] = a.st.m[h * a.st.ml_stride + q0 + r];
      l[r] = a.st.l[h * a.st.ml_stride + q0 + r];
    } else {
      std::fill(ar, ar + t.dp, 0.0f);
      m[r] = kNegInf;
      l[r] = 0.0f;
    }
  }

  for (int64_t kj = 0; kj < plan.k_tiles; ++kj) {
    const TileKind kind = plan.at(qi, kj);
    if (kind == TileKind::kEmpty) continue;
    const int64_t k0 = plan.k_begin(kj), cols = std::min(plan.block_k, a.k.s - k0);
    tile_scores(ws.q.get(), a.kv->kt(g, kj), a.cfg->scale, t, ws.s.get());
    if (kind == TileKind::kPartial) {
      pack_tokens(a.kt, k0, cols, ws.k_pos.data(), ws.k_doc.data());
      mask_tile(a.cfg->mask, ws, rows, cols, t, ws.s.get());
    }
    softmax_update(rows, cols, t, ws.s.get(), m, l, acc);
    tile_pv(ws.s.get(), a.kv->v(g, kj), t, acc);
  }

  for (int64_t r = 0; r < rows; ++r) {
    const float* ar = acc + r * t.dp;
    std::copy(ar, ar + dim, a.st.acc + (q0 + r) * a.st.acc_ss + h * dim);
    a.st.m[h * a.st.ml_stride + q0 + r] = m[r];
    a.st.l[h * a.st.ml_stride + q0 + r] = l[r];
  }
}

void check_config(const KernelConfig& cfg) {
  kernels::check_mask(cfg.mask);
  kernels::check_scale(cfg.scale);
  LOOM_CHECK_GE(cfg.threads, 0, InvalidArgument, "threads must be >= 0");
  LOOM_CHECK_GE(cfg.block_q, 1, InvalidArgument, "block_q must be >= 1");
  LOOM_CHECK_GE(cfg.block_k, 1, InvalidArgument, "block_k must be >= 1");
}

void check_state(const StateView& st) {
  LOOM_CHECK(st.rows >= 0 && st.heads >= 0 && st.dim >= 0, InvalidArgument,
             "state: negative size [" << st.rows << ", " << st.heads << ", " << st.dim << "]");
  LOOM_CHECK(st.rows == 0 || (st.acc && st.m && st.l), InvalidArgument, "state: null acc, m or l");
  LOOM_CHECK_GE(st.acc_ss, st.heads * st.dim, InvalidArgument, "state: acc row stride too small");
  LOOM_CHECK_GE(st.ml_stride, st.rows, InvalidArgument, "state: m/l head stride too small");
}

// ---------------------------------------------------------------------------------------------
// Backward.

struct BackwardArgs {
  View3<const float> q, k, v, dout;
  const float* lse;
  const float* delta;
  int64_t ml_stride;
  Tokens qt, kt;
  const KernelConfig* cfg;
  const TilePlan* plan;
  TileDims dims;
  View3<float> dk, dv;
};

// dk, dv of k-tile kj of kv head g, and the dq contributions of its pairs (added into dq_sink).
void backward_task(const BackwardArgs& a, int64_t g, int64_t kj, Workspace& ws,
                   View3<float> dq_sink) {
  const TilePlan& plan = *a.plan;
  const TileDims& t = a.dims;
  const int64_t group = a.q.h / a.k.h;
  const int64_t dim = a.q.d;
  const float scale = a.cfg->scale;
  const int64_t k0 = plan.k_begin(kj), cols = std::min(plan.block_k, a.k.s - k0);

  pack_transposed(a.k, k0, cols, g, t, ws.kt.get());
  pack_kv_rows(a.k, k0, cols, g, t, ws.k.get());
  pack_transposed(a.v, k0, cols, g, t, ws.v.get());
  pack_tokens(a.kt, k0, cols, ws.k_pos.data(), ws.k_doc.data());
  std::fill(ws.dk.get(), ws.dk.get() + t.bk * t.dp, 0.0f);
  std::fill(ws.dv.get(), ws.dv.get() + t.bk * t.dp, 0.0f);
  float* lse = ws.row_m.get();
  float* delta = ws.row_l.get();
  float* s = ws.s.get();
  float* dp = ws.dp.get();
  float* dq_tile = ws.acc.get();

  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    for (int64_t qi = 0; qi < plan.q_tiles; ++qi) {
      const TileKind kind = plan.at(qi, kj);
      if (kind == TileKind::kEmpty) continue;
      const int64_t q0 = plan.q_begin(qi), rows = std::min(plan.block_q, a.q.s - q0);
      pack_rows(a.q, q0, rows, h, t, ws.q.get());
      pack_rows(a.dout, q0, rows, h, t, ws.dout.get());
      for (int64_t r = 0; r < rows; ++r) {
        lse[r] = a.lse[h * a.ml_stride + q0 + r];
        delta[r] = a.delta[h * a.ml_stride + q0 + r];
      }
      std::fill(delta + rows, delta + t.bq, 0.0f);

      tile_scores(ws.q.get(), ws.kt.get(), scale, t, s);
      if (kind == TileKind::kPartial) {
        pack_tokens(a.qt, q0, rows, ws.q_pos.data(), ws.q_doc.data());
        mask_tile(a.cfg->mask, ws, rows, cols, t, s);
      }
      tile_probs(rows, cols, t, lse, s);
      // dv [bk, dp] += p^T dout
      gemm_tile(t.bk, t.dp, t.bq, s, 1, t.bk, ws.dout.get(), t.dp, 1.0f, true, ws.dv.get(), t.dp);
      // dp [bq, bk] = dout v^T
      gemm_tile(t.bq, t.bk, t.dp, ws.dout.get(), t.dp, 1, ws.v.get(), t.bk, 1.0f, false, dp, t.bk);
      tile_ds(s, delta, scale, t, dp);
      // dk [bk, dp] += ds^T q
      gemm_tile(t.bk, t.dp, t.bq, dp, 1, t.bk, ws.q.get(), t.dp, 1.0f, true, ws.dk.get(), t.dp);
      // dq tile [bq, dp] = ds k
      gemm_tile(t.bq, t.dp, t.bk, dp, t.bk, 1, ws.k.get(), t.dp, 1.0f, false, dq_tile, t.dp);
      for (int64_t r = 0; r < rows; ++r) {
        float* out = dq_sink.row(q0 + r, h);
        const float* in = dq_tile + r * t.dp;
        for (int64_t d = 0; d < dim; ++d) out[d] += in[d];
      }
    }
  }

  for (int64_t j = 0; j < cols; ++j) {
    float* dk_row = a.dk.row(k0 + j, g);
    float* dv_row = a.dv.row(k0 + j, g);
    const float* dk_in = ws.dk.get() + j * t.dp;
    const float* dv_in = ws.dv.get() + j * t.dp;
    for (int64_t d = 0; d < dim; ++d) {
      dk_row[d] += dk_in[d];
      dv_row[d] += dv_in[d];
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// SoftmaxState

SoftmaxState::SoftmaxState(int64_t rows, int64_t heads, int64_t dim)
    : acc({rows, heads, dim}, 0.0f),
      m({heads, rows}, kNegInf),
      l({heads, rows}, 0.0f),
      rows_(rows) {}

void SoftmaxState::reset() {
  acc.fill(0.0f);
  m.fill(kNegInf);
  l.fill(0.0f);
}

StateView SoftmaxState::view() {
  const int64_t heads = acc.dim() == 3 ? acc.size(1) : 0;
  const int64_t dim = acc.dim() == 3 ? acc.size(2) : 0;
  return StateView{acc.data(), m.data(), l.data(), rows_, heads, dim, heads * dim, rows_};
}

// ---------------------------------------------------------------------------------------------
// Forward entry points.

KernelStats attend(StateView st, View3<const float> q, View3<const float> k, View3<const float> v,
                   Tokens qt, Tokens kt, const KernelConfig& cfg) {
  kernels::check_qkv(q, k, v, qt, kt);
  check_config(cfg);
  check_state(st);
  LOOM_CHECK(st.rows == q.s && st.heads == q.h && st.dim == q.d, InvalidArgument,
             "state [" << st.rows << ", " << st.heads << ", " << st.dim << "] does not match q ["
                       << q.s << ", " << q.h << ", " << q.d << "]");

  const TilePlan plan =
      plan_tiles(qt, kt, cfg.mask, cfg.block_q, cfg.block_k, thread_count(cfg, qt.n));
  const int64_t tasks = q.h * plan.q_tiles;
  const int threads = thread_count(cfg, tasks);
  const TileDims dims = tile_dims(cfg, q.d);
  const PackedKv packed(k, v, plan, dims, threads);
  const ForwardArgs args{st, q, k, v, qt, kt, &cfg, &plan, dims, &packed};
  std::vector<Workspace> ws;
  ws.reserve(static_cast<size_t>(threads));
  for (int i = 0; i < threads; ++i) ws.emplace_back(args.dims, false);

    // Late q-tiles first: under a causal mask they carry the most keys (dynamic balance).
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t qi = plan.q_tiles - 1 - task / q.h, h = task % q.h;
    forward_task(args, h, qi, ws[static_cast<size_t>(omp_get_thread_num())]);
  }
  return plan_stats(plan, q.h);
}

void finish(StateView st, View3<float> out, float* lse, int64_t lse_stride) {
  check_state(st);
  kernels::check_view(out, "out");
  LOOM_CHECK(out.s == st.rows && out.h == st.heads && out.d == st.dim, InvalidArgument,
             "out [" << out.s << ", " << out.h << ", " << out.d << "] does not match the state ["
                     << st.rows << ", " << st.heads << ", " << st.dim << "]");
  LOOM_CHECK(st.rows == 0 || lse != nullptr, InvalidArgument, "lse must not be null");
  LOOM_CHECK_GE(lse_stride, st.rows, InvalidArgument, "lse stride too small");
  for (int64_t i = 0; i < st.rows; ++i) {
    for (int64_t h = 0; h < st.heads; ++h) {
      const float l = st.l[h * st.ml_stride + i];
      const float* acc = st.acc + i * st.acc_ss + h * st.dim;
      float* o = out.row(i, h);
      if (l == 0.0f) {
        std::fill(o, o + st.dim, 0.0f);
        lse[h * lse_stride + i] = kNegInf;
        continue;
      }
      const float inv_l = 1.0f / l;
      for (int64_t d = 0; d < st.dim; ++d) o[d] = acc[d] * inv_l;
      lse[h * lse_stride + i] = st.m[h * st.ml_stride + i] + std::log(l);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward entry points.

void compute_delta(View3<const float> out, View3<const float> dout, float* delta, int64_t stride) {
  kernels::check_view(out, "out");
  kernels::check_view(dout, "dout");
  kernels::check_same_shape(out, dout, "out and dout");
  LOOM_CHECK(out.s == 0 || delta != nullptr, InvalidArgument, "delta must not be null");
  LOOM_CHECK_GE(stride, out.s, InvalidArgument, "delta stride too small");
  for (int64_t i = 0; i < out.s; ++i) {
    for (int64_t h = 0; h < out.h; ++h) {
      const float* o = out.row(i, h);
      const float* g = dout.row(i, h);
      // Sequential in d, the order in which gemm_tile accumulates dp = dout v^T: a row whose
      // probability sits on one key (out = v_j) then gets dp_j - delta = 0 exactly rather than
      // rounding noise that ds = p (dp - delta) would turn into a gradient. Keep the two orders
      // paired (no simd reduction here; an ISA-specific GEMM needs a matching delta).
      float sum = 0.0f;
      for (int64_t d = 0; d < out.d; ++d) sum += o[d] * g[d];
      delta[h * stride + i] = sum;
    }
  }
}

KernelStats attend_backward(View3<const float> q, View3<const float> k, View3<const float> v,
                            View3<const float> dout, const float* lse, const float* delta,
                            int64_t ml_stride, Tokens qt, Tokens kt, const KernelConfig& cfg,
                            View3<float> dq, View3<float> dk, View3<float> dv) {
  kernels::check_qkv(q, k, v, qt, kt);
  check_config(cfg);
  kernels::check_view(dout, "dout");
  kernels::check_view(dq, "dq");
  kernels::check_view(dk, "dk");
  kernels::check_view(dv, "dv");
  kernels::check_same_shape(dout, q, "dout and q");
  kernels::check_same_shape(View3<const float>(dq), q, "dq and q");
  kernels::check_same_shape(View3<const float>(dk), k, "dk and k");
  kernels::check_same_shape(View3<const float>(dv), v, "dv and v");
  LOOM_CHECK(q.s == 0 || (lse != nullptr && delta != nullptr), InvalidArgument,
             "lse and delta must not be null");
  LOOM_CHECK_GE(ml_stride, q.s, InvalidArgument, "lse/delta stride too small");

  const TilePlan plan =
      plan_tiles(qt, kt, cfg.mask, cfg.block_q, cfg.block_k, thread_count(cfg, qt.n));
  const int64_t tasks = k.h * plan.k_tiles;
  const int threads = thread_count(cfg, tasks);
  const BackwardArgs args{
      q, k, v, dout, lse, delta, ml_stride, qt, kt, &cfg, &plan, tile_dims(cfg, q.d), dk, dv};
  std::vector<Workspace> ws;
  ws.reserve(static_cast<size_t>(threads));
  for (int i = 0; i < threads; ++i) ws.emplace_back(args.dims, true);
  // dq partials of threads 1.. (thread 0 adds into dq itself), [Sq, H, D] each.
  const int64_t dq_elems = q.s * q.h * q.d;
  std::vector<AlignedFloats> dq_part;
  for (int i = 1; i < threads; ++i) dq_part.emplace_back(dq_elems);

  int team = 1;
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num();
#pragma omp single
    team = omp_get_num_threads();
    const View3<float> sink =
        tid == 0 ? dq
                 : View3<float>{
                       dq_part[static_cast<size_t>(tid - 1)].get(), q.s, q.h, q.d, q.h * q.d, q.d};
    // Round robin over (k-tile, kv head): causal k-tiles differ in work; a static schedule keeps
    // the dq sums deterministic.
#pragma omp for schedule(static, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      backward_task(args, task % k.h, task / k.h, ws[static_cast<size_t>(tid)], sink);
    }
  }

  if (team > 1) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < q.s; ++i) {
      for (int64_t h = 0; h < q.h; ++h) {
        float* out = dq.row(i, h);
        for (int t = 1; t < team; ++t) {
          const float* in = dq_part[static_cast<size_t>(t - 1)].get() + (i * q.h + h) * q.d;
          for (int64_t d = 0; d < q.d; ++d) out[d] += in[d];
        }
      }
    }
  }
  return plan_stats(plan, q.h);
}

}  // namespace loom
