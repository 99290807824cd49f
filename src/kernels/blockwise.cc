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
// tile's scores in base 2, s = scale log2(e) q k^T (to_base2), the online softmax
// update (softmax_update)
//   m' = max(m, max_j s_j),  p_j = 2^(s_j - m'),  alpha = 2^(m - m'),
//   l' = alpha l + sum_j p_j,  acc' = alpha acc,
// and acc' += p v (TileOps::gemm_panels); 2^(s_j - m') is exp of the natural scores' s_j - m'.
// A row that has seen no visible key keeps m = -inf, l = 0, acc = 0; the update never forms
// 2^(-inf + inf). finish() divides acc by l and converts m to lse in natural units.
//
// Backward (per kv head g and k-tile, over the query heads that read g and all q-tiles):
//   s = scale log2(e) q k^T, p = 2^(s - lse log2(e)), dv += p^T dout, dp = dout v^T,
//   ds = scale p (dp - delta), dk += ds^T q, dq += ds k.
// dk and dv of a (g, k-tile) belong to one task. dq rows are shared by all k-tiles, so each
// thread adds its dq contributions into its own buffer and the buffers are added into dq in
// thread order: race-free and, with the static schedule, deterministic for a given thread count.
// The tasks run one chunk of kv heads at a time on head-major copies of the chunk's q and dout
// rows, with head-major dq buffers (backward_in_head_chunks: in the caller's [Sq, H, D] layout a
// head's rows are H D elements apart). ds = p (dp - delta) cancels when one key carries a row's
// mass; compute_delta sums over d in the order in which the tile GEMM accumulates dp, so that
// cancellation is exact instead of amplified rounding noise (see compute_delta).
//
// Packing. Every tile is copied into contiguous buffers padded to the GEMM register block (rows
// to kMr, columns and head dim to kNr; padding is zero, padded probabilities are zero), so the
// tile GEMM and the softmax loops have no remainders. The forward packs the KV block (k^T and v,
// tile-major) one chunk of kv heads at a time, just before the chunk's tasks read it (see
// ForwardOrder), and each (head, q-tile) task packs its q rows; a backward task packs its k-tile
// once (k, k^T, v^T) and the q and dout rows of each tile it visits (fp32 tiles with full rows and
// D % kNr == 0 are read, and dq accumulated, in place in the head-major copies instead). The
// forward's tile GEMMs prefetch the operand of the step after them while they compute
// (TileOps::gemm_panels_next): the scores GEMM this tile's v, the p v GEMM the next non-empty
// tile's k^T, so the packed KV block (4 MiB per head at S = 4096, D = 128: beyond L2) arrives from
// L3 during arithmetic rather than at the start of each GEMM; a task's last p v GEMM prefetches the
// first k^T tile, q rows and state rows of the task its thread runs next (claimed one ahead). The
// backward's do the same for the rows each pair reads from the head-major copies: the dv and dk
// GEMMs the next pair's q and dout rows, the dp GEMM this pair's dq rows, and a task's last pair
// the k and v rows of the thread's next task (its scores and dq GEMMs).
//
// Paths. The tile arithmetic (GEMM, softmax steps, delta's dot) goes through the TileOps table of
// kernels::select_ops() (tile_ops.h: one Highway source per instruction-set target, chosen per
// call from the CPU and LOOM_KERNEL). It computes on work tiles of at least 128 x 128 made of
// whole config tiles (work_config); KernelStats always counts the config's block_q x block_k
// tiles.
//
// bf16 storage. q and dout are widened to fp32 when packed. The forward packs K and V once per
// call as bf16: on a path with bf16 dot products (avx512bf16) as bf16 pairs (PackedKvPairs), with
// s = q k^T and acc += p v as vdpbf16ps GEMMs and p rounded to bf16 for p v only; on every other
// path in the fp32 tiles' column panels (PackedKvTiles<uint16_t>), each panel widened into an L1
// scratch inside the GEMM (TileOps::gemm_panels_bf16), so the arithmetic is bitwise the fp32
// path's on the widened values with half the packed bytes. The backward, with bf16 dot products,
// runs its five products as vdpbf16ps GEMMs (backward_task_bf16, on q and dout transposed once
// per chunk of kv heads: TransposedRows); elsewhere it widens its k-tile when packing. Every
// accumulation is fp32. The bf16 dot products flush subnormals whatever MXCSR says, so operands
// small enough for that to matter are first multiplied by exact powers of two ("lifting", below).
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "loom/attention.h"
#include "tile_ops.h"

namespace loom {
namespace {

using kernels::kMr;
using kernels::kNr;
using kernels::PrefetchRegion;
using kernels::round_up;
using kernels::TileOps;

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

// a - b saturated to [INT64_MIN, INT64_MAX]: positions are arbitrary int64 values, so the true
// difference may not fit. Saturation keeps every comparison with the allowed range (whose bounds
// lie inside it, or are the bounds themselves for "unlimited") exact.
inline int64_t saturating_sub(int64_t a, int64_t b) {
  int64_t d;
  if (__builtin_sub_overflow(a, b, &d))
    return a < b ? std::numeric_limits<int64_t>::min() : std::numeric_limits<int64_t>::max();
  return d;
}

// ceil(n / block) for n >= 0, block >= 1, without the overflow of (n + block - 1) / block.
inline int64_t tile_count(int64_t n, int64_t block) {
  return n == 0 ? 0 : (n - 1) / block + 1;
}

TilePlan plan_tiles(const Tokens& qt, const Tokens& kt, const Mask& mask, int64_t block_q,
                    int64_t block_k, int threads) {
  TilePlan plan;
  plan.block_q = block_q;
  plan.block_k = block_k;
  plan.q_tiles = tile_count(qt.n, block_q);
  plan.k_tiles = tile_count(kt.n, block_k);
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
      const int64_t diff_lo = saturating_sub(qr.pos_lo, kr.pos_hi),
                    diff_hi = saturating_sub(qr.pos_hi, kr.pos_lo);
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

// A buffer aligned to 64 bytes (one cache line; room for wide vectors), zero-initialised unless
// `zero` is false (then the caller writes every element before reading it).
template <class T>
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(int64_t n, bool zero = true)
      : data_(static_cast<T*>(::operator new[](
            static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T), std::align_val_t{64}))) {
    if (zero) std::fill(data_.get(), data_.get() + n, T{});
  }
  T* get() const { return data_.get(); }

 private:
  struct Free {
    void operator()(T* p) const { ::operator delete[](p, std::align_val_t{64}); }
  };
  std::unique_ptr<T, Free> data_;
};
using AlignedFloats = AlignedBuffer<float>;
using AlignedBf16 = AlignedBuffer<uint16_t>;  // bf16 bit patterns

// Padded tile sizes: bq rows, bk columns, dp head-dim entries.
struct TileDims {
  int64_t bq, bk, dp;
};

// A block longer than its rows (sq query rows, sk key rows) is one tile of those rows, and its
// buffers need no more: a kMaxBlock block on 8 rows would otherwise allocate and zero
// kMaxBlock^2 floats per thread.
TileDims tile_dims(const KernelConfig& cfg, int64_t dim, int64_t sq, int64_t sk) {
  const int64_t bq = std::min(cfg.block_q, std::max<int64_t>(1, sq));
  const int64_t bk = std::min(cfg.block_k, std::max<int64_t>(1, sk));
  return TileDims{round_up(bq, kMr), round_up(bk, kNr), round_up(dim, kNr)};
}

// How the forward keeps its packed KV block: fp32 tiles (PackedKv), bf16 in the same column
// panels (PackedKvTiles<uint16_t>, widened panel by panel inside TileOps::gemm_panels_bf16), or
// bf16 pairs for the vdpbf16ps dot products (PackedKvPairs).
enum class KvStore { kFp32, kBf16Panels, kBf16Pairs };

struct Workspace {
  Workspace(const TileDims& t, bool backward, KvStore kv = KvStore::kFp32)
      : q(t.bq * t.dp),
        s(t.bq * t.bk),
        acc(t.bq * t.dp),
        row_m(t.bq),
        row_l(t.bq),
        q_pos(static_cast<size_t>(t.bq)),
        k_pos(static_cast<size_t>(t.bk)),
        q_doc(static_cast<size_t>(t.bq)),
        k_doc(static_cast<size_t>(t.bk)) {
    if (kv == KvStore::kBf16Pairs) {
      q16 = AlignedBf16(t.bq * t.dp);
      p16 = AlignedBf16(t.bq * t.bk);
    }
    if (kv == KvStore::kBf16Panels) panel = AlignedFloats(2 * std::max(t.bk, t.dp) * kNr);
    if (backward && kv == KvStore::kBf16Pairs) {  // backward_task_bf16
      kt16 = AlignedBf16(t.dp * t.bk);
      vt16 = AlignedBf16(t.dp * t.bk);
      k16 = AlignedBf16(t.bk * t.dp);
      dout16 = AlignedBf16(t.bq * t.dp);
      ds16 = AlignedBf16(t.bq * t.bk);
      dp = AlignedFloats(t.bq * t.bk);
      dk = AlignedFloats(t.bk * t.dp);
      dv = AlignedFloats(t.bk * t.dp);
    } else if (backward) {
      kt = AlignedFloats(t.dp * t.bk);
      v = AlignedFloats(t.bk * t.dp);
      dout = AlignedFloats(t.bq * t.dp);
      k = AlignedFloats(t.bk * t.dp);
      dp = AlignedFloats(t.bq * t.bk);
      dk = AlignedFloats(t.bk * t.dp);
      dv = AlignedFloats(t.bk * t.dp);
      q_pan = AlignedFloats(t.bq * t.dp);
      dout_pan = AlignedFloats(t.bq * t.dp);
    }
  }
  // Forward: q [bq, dp], s [bq, bk], acc [bq, dp], row_m and row_l the tile's m and l [bq].
  // Backward: also kt = k^T [dp, bk], k [bk, dp], v = v^T [dp, bk] (these three in column panels:
  // pack_transposed, pack_kv_rows), dout [bq, dp], dp [bq, bk], dk and dv [bk, dp]; acc holds the
  // tile's dq, row_m the lse, row_l the delta.
  AlignedFloats q, s, acc, row_m, row_l;
  AlignedFloats kt, v, dout, k, dp, dk, dv;
  // Backward: the q and dout rows [bq, dp] again in column panels, as the B operands of
  // dk += ds^T q and dv += p^T dout.
  AlignedFloats q_pan, dout_pan;
  // The bf16-dot forward: q rows [bq, dp] and probabilities [bq, bk] as bf16.
  // The bf16-dot backward (backward_task_bf16): q16 and dout16 the q and dout rows [bq, dp], p16
  // the probabilities and then ds in row pairs [bq / 2, bk, 2], ds16 ds [bq, bk]; kt16, vt16 k
  // and v pairs along d [dp / 2, bk, 2], k16 k pairs along the keys [bk / 2, dp, 2]; dp as for
  // fp32, dk and dv transposed [dp, bk].
  AlignedBf16 q16, p16;
  AlignedBf16 kt16, vt16, k16, dout16, ds16;
  // The forward with bf16 panels: the scratch of gemm_panels_bf16 (two widened panels).
  AlignedFloats panel;
  std::vector<int64_t> q_pos, k_pos;
  std::vector<int32_t> q_doc, k_doc;
};

int thread_count(const KernelConfig& cfg, int64_t tasks) {
  const int64_t wanted = cfg.threads > 0 ? cfg.threads : omp_get_max_threads();
  return static_cast<int>(std::max<int64_t>(1, std::min(wanted, tasks)));
}

// Work tiles. The arithmetic runs on work tiles of whole config tiles: each side is the config's
// block times the smallest factor that reaches ops.work_tile (128 x 128 on every target, where the
// GEMM amortises packing, the C block traffic and the softmax bookkeeping best). KernelStats always
// counts the config's tiles (plan of block_q x block_k), so callers see the same accounting on
// every path; an empty config tile inside a non-empty work tile is still counted as skipped,
// although its pairs are computed (masked).
KernelConfig work_config(const KernelConfig& cfg, const TileOps& ops, int64_t sq, int64_t sk) {
  KernelConfig w = cfg;
  w.block_q = work_tile_side(cfg.block_q, sq, ops.work_tile);
  w.block_k = work_tile_side(cfg.block_k, sk, ops.work_tile);
  return w;
}

KernelStats accounting_stats(const TilePlan& work, const Tokens& qt, const Tokens& kt,
                             const KernelConfig& cfg, int64_t heads) {
  if (work.block_q == cfg.block_q && work.block_k == cfg.block_k) return plan_stats(work, heads);
  return plan_stats(plan_tiles(qt, kt, cfg.mask, cfg.block_q, cfg.block_k, thread_count(cfg, qt.n)),
                    heads);
}

inline float to_f32(float x) {
  return x;
}
inline float to_f32(bf16 x) {
  return to_float(x);
}

// out[0, n) = in[0, n) widened to fp32. The pointers never alias (caller's tensors into tile
// buffers); saying so lets GCC copy in vectors: the scalar copies it emitted otherwise were 10 % of
// a backward call (perf on Zen 3, pack_rows_panels).
inline void widen(const float* __restrict in, int64_t n, float* __restrict out) {
  std::memcpy(out, in, static_cast<size_t>(n) * sizeof(float));
}
inline void widen(const bf16* __restrict in, int64_t n, float* __restrict out) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(in[i].bits) << 16;
    std::memcpy(out + i, &u, 4);
  }
}
// One row piece of a panel: kNr values (a fixed-length copy, in vectors) or the n < kNr at the end
// of a head dim that is not a multiple of kNr.
template <class T>
inline void widen_piece(const T* in, int64_t n, float* out) {
  if (n == kNr) {
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(out, in, kNr * sizeof(float));
    } else {
      widen(in, kNr, out);
    }
  } else {
    widen(in, n, out);
  }
}

// The same piece kept as bf16 bit patterns (the forward's bf16 panels).
inline void widen_piece(const bf16* in, int64_t n, uint16_t* out) {
  static_assert(sizeof(bf16) == sizeof(uint16_t));
  std::memcpy(out, in, static_cast<size_t>(n) * sizeof(uint16_t));
}

// An element of a T view as a packed tile of E holds it: fp32 (widened) or bf16 bits (kept).
template <class E, class T>
inline E packed_element(T x) {
  if constexpr (std::is_same_v<E, float>) {
    return to_f32(x);
  } else {
    static_assert(std::is_same_v<E, uint16_t> && std::is_same_v<T, bf16>);
    return x.bits;
  }
}

// rows x d of a view (row r = x.row(begin + r, head)) into a [bq, dp] buffer, zero padded.
template <class T>
void pack_rows(View3<const T> x, int64_t begin, int64_t rows, int64_t head, const TileDims& t,
               float* dst) {
  for (int64_t r = 0; r < t.bq; ++r) {
    float* out = dst + r * t.dp;
    if (r < rows) {
      widen(x.row(begin + r, head), x.d, out);
      std::fill(out + x.d, out + t.dp, 0.0f);
    } else {
      std::fill(out, out + t.dp, 0.0f);
    }
  }
}

// rows x d of a bf16 view as bf16 bits into a [bq, dp] buffer, zero padded (the row-major A
// operands of TileOps::gemm_bf16: pairs along d).
void pack_rows_bits(View3<const bf16> x, int64_t begin, int64_t rows, int64_t head,
                    const TileDims& t, uint16_t* dst) {
  static_assert(sizeof(bf16) == sizeof(uint16_t) && std::is_trivially_copyable_v<bf16>);
  for (int64_t r = 0; r < t.bq; ++r) {
    uint16_t* out = dst + r * t.dp;
    const int64_t copied = r < rows ? x.d : 0;
    if (copied > 0) std::memcpy(out, x.row(begin + r, head), static_cast<size_t>(copied) * 2);
    std::fill(out + copied, out + t.dp, uint16_t{0});
  }
}

// cols rows of a KV view, transposed, into a [dp, bk] buffer in column panels of kNr (the layout
// of TileOps::gemm_panels: element (d, j) at (j / kNr) * dp * kNr + d * kNr + j % kNr), zero
// padded.
template <class T, class E>
void pack_transposed(View3<const T> x, int64_t begin, int64_t cols, int64_t head, const TileDims& t,
                     E* dst) {
  if (cols < t.bk || x.d < t.dp) std::fill(dst, dst + t.dp * t.bk, E{});  // padding
  for (int64_t j = 0; j < cols; ++j) {
    const T* in = x.row(begin + j, head);
    E* out = dst + (j / kNr) * t.dp * kNr + j % kNr;
    for (int64_t d = 0; d < x.d; ++d) out[d * kNr] = packed_element<E>(in[d]);
  }
}

// cols rows of a KV view into a [bk, dp] buffer in column panels of kNr (element (j, d) at
// (d / kNr) * bk * kNr + j * kNr + d % kNr), zero padded.
template <class T, class E>
void pack_kv_rows(View3<const T> x, int64_t begin, int64_t cols, int64_t head, const TileDims& t,
                  E* dst) {
  if (cols < t.bk || x.d < t.dp) std::fill(dst, dst + t.bk * t.dp, E{});  // padding
  for (int64_t j = 0; j < cols; ++j) {
    const T* in = x.row(begin + j, head);
    for (int64_t d0 = 0; d0 < x.d; d0 += kNr)
      widen_piece(in + d0, std::min(kNr, x.d - d0), dst + d0 * t.bk + j * kNr);
  }
}

// rows x d of a view into a [bq, dp] buffer in column panels of kNr (element (r, d) at
// (d / kNr) * bq * kNr + r * kNr + d % kNr), zero padded.
template <class T>
void pack_rows_panels(View3<const T> x, int64_t begin, int64_t rows, int64_t head,
                      const TileDims& t, float* dst) {
  if (rows < t.bq || x.d < t.dp) std::fill(dst, dst + t.bq * t.dp, 0.0f);
  // Panel by panel, so the stores run sequentially through dst.
  for (int64_t d0 = 0; d0 < x.d; d0 += kNr) {
    const int64_t n = std::min(kNr, x.d - d0);
    float* out = dst + d0 * t.bq;
    for (int64_t r = 0; r < rows; ++r) widen_piece(x.row(begin + r, head) + d0, n, out + r * kNr);
  }
}

void pack_tokens(const Tokens& t, int64_t begin, int64_t count, int64_t* pos, int32_t* doc) {
  for (int64_t i = 0; i < count; ++i) {
    pos[i] = t.pos[begin + i];
    doc[i] = t.doc ? t.doc[begin + i] : 0;
  }
}

// The forward's KV block packed once per call, tile-major, one chunk of kv heads [g0, g0 + heads)
// at a time (kv_chunk_heads): tile (g, kj) for kv head g and k-tile kj holds kt(g, kj) and
// v(g, kj), dp x bk elements each. Every (head, q-tile) task of the chunk reads the same packed
// tiles instead of packing them again. E: float (PackedKv) or bf16 bits (panels or pairs).
//
// Storage. A block of at most kKeptBytes reuses one buffer per calling thread, kept between calls:
// a ring of attend() calls on equal KV blocks then writes warm pages instead of faulting in and
// zeroing fresh ones each step (on Zen 3 the page faults were 20 % of a 512 x 512 fp32 ring-step
// forward, D = 128, whose packed block is 4 MiB; docs/performance.md, round 7). A larger block, or
// a second one while a thread's kept buffer is in use, gets a buffer of its own, freed with it.
// So each thread that has called attend() holds at most kKeptBytes until it exits.
class KvStorage {
 public:
  static constexpr size_t kKeptBytes = size_t{16} << 20;
  explicit KvStorage(size_t bytes) {
    Kept& k = kept();
    if (bytes <= kKeptBytes && !k.in_use) {
      if (k.bytes < bytes) {
        k.buf = AlignedBuffer<std::byte>();  // free before allocating the larger one
        k.buf = AlignedBuffer<std::byte>(static_cast<int64_t>(bytes), false);
        k.bytes = bytes;
      }
      k.in_use = true;
      kept_ = true;
      p_ = k.buf.get();
    } else {
      own_ = AlignedBuffer<std::byte>(static_cast<int64_t>(bytes), false);
      p_ = own_.get();
    }
  }
  ~KvStorage() {
    if (kept_) kept().in_use = false;
  }
  KvStorage(const KvStorage&) = delete;
  KvStorage& operator=(const KvStorage&) = delete;
  std::byte* get() const { return p_; }

 private:
  struct Kept {
    AlignedBuffer<std::byte> buf;
    size_t bytes = 0;
    bool in_use = false;
  };
  static Kept& kept() {
    thread_local Kept k;
    return k;
  }
  AlignedBuffer<std::byte> own_;
  std::byte* p_ = nullptr;
  bool kept_ = false;
};

template <class E>
class PackedKvTiles {
 public:
  using Element = E;
  // pack(g, k0, cols, kt, v) fills one tile from key rows [k0, k0 + cols) of kv head g; zero:
  // whether the tiles start zeroed (false: pack writes every element, padding included).
  template <class Pack>
  PackedKvTiles(int64_t g0, int64_t kv_heads, int64_t keys, const TilePlan& plan, const TileDims& t,
                int threads, bool zero, const Pack& pack)
      : g0_(g0),
        tile_elems_(t.dp * t.bk),
        k_tiles_(plan.k_tiles),
        elems_(kv_heads * plan.k_tiles * tile_elems_),
        storage_(static_cast<size_t>(2 * elems_) * sizeof(E)),
        kt_(reinterpret_cast<E*>(storage_.get())),
        v_(kt_ + elems_) {
    if (zero) std::fill(kt_, kt_ + 2 * elems_, E{});
    const int64_t tiles = kv_heads * plan.k_tiles;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < tiles; ++i) {
      const int64_t g = g0 + i / plan.k_tiles, kj = i % plan.k_tiles;
      const int64_t k0 = plan.k_begin(kj), cols = std::min(plan.block_k, keys - k0);
      pack(g, k0, cols, kt_ + i * tile_elems_, v_ + i * tile_elems_);
    }
  }
  // Bytes of the packed k^T and v tiles of one kv head.
  static int64_t head_bytes(const TilePlan& plan, const TileDims& t) {
    return 2 * plan.k_tiles * t.dp * t.bk * static_cast<int64_t>(sizeof(E));
  }
  // g in [g0, g0 + kv_heads).
  const E* kt(int64_t g, int64_t kj) const {
    return kt_ + ((g - g0_) * k_tiles_ + kj) * tile_elems_;
  }
  const E* v(int64_t g, int64_t kj) const {
    return v_ + ((g - g0_) * k_tiles_ + kj) * tile_elems_;
  }

 private:
  int64_t g0_, tile_elems_, k_tiles_, elems_;
  KvStorage storage_;
  E* kt_;
  E* v_;
};

// Tiles in column panels, zero padded: kt(g, kj) is k^T [dp, bk] (pack_transposed), v(g, kj) is
// v [bk, dp] (pack_kv_rows). E = float: fp32 (PackedKv), for gemm_panels; E = uint16_t: bf16 bits
// of a bf16 KV block, for gemm_panels_bf16 (half the bytes to keep and to stream from L3).
using PackedKv = PackedKvTiles<float>;

template <class E, class T>
PackedKvTiles<E> pack_kv(View3<const T> k, View3<const T> v, int64_t g0, int64_t kv_heads,
                         const TilePlan& plan, const TileDims& t, int threads) {
  return PackedKvTiles<E>(g0, kv_heads, k.s, plan, t, threads,
                          false,  // the packs write the padding
                          [&](int64_t g, int64_t k0, int64_t cols, E* kt, E* vt) {
                            pack_transposed(k, k0, cols, g, t, kt);
                            pack_kv_rows(v, k0, cols, g, t, vt);
                          });
}

// Key rows [k0, k0 + cols) of kv head g as operands of the vdpbf16ps GEMM (TileOps::gemm_bf16),
// which multiplies pairs of adjacent bf16 along the reduction; zero padded (dp and bk are even:
// multiples of kNr):
//   pairs along d    [dp/2][bk][2]: element (t, j, e) = x[j, 2t + e]  (B of q k^T, dout v^T)
//   pairs along keys [bk/2][dp][2]: element (u, d, e) = x[2u + e, d]  (B of p v, ds k)
void pack_pairs_along_d(View3<const bf16> x, int64_t k0, int64_t cols, int64_t g, const TileDims& t,
                        uint16_t* dst) {
  // In 32-bit words, one pair each: word (t, j) = x[j, 2t .. 2t + 1] (an odd D's last pair ends
  // in a zero). dst is 64-byte aligned (AlignedBuffer, KvStorage; tiles a multiple of 64 bytes).
  // Blocks of 16 keys: each pair step writes 64 contiguous bytes, reading 16 rows in order (key
  // by key the writes went bk * 4 bytes apart: 5.5 % of the amx forward's samples, now 2.3 %;
  // docs/performance.md round 22).
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  const int64_t pairs = x.d / 2, bk = t.bk;
  std::fill(out, out + t.dp / 2 * bk, uint32_t{0});
  constexpr int64_t kKeys = 16;
  for (int64_t j0 = 0; j0 < cols; j0 += kKeys) {
    const int64_t n = std::min(kKeys, cols - j0);
    const bf16* r[kKeys];
    for (int64_t j = 0; j < n; ++j) r[j] = x.row(k0 + j0 + j, g);
    for (int64_t u = 0; u < pairs; ++u) {
      uint32_t* o = out + u * bk + j0;
      for (int64_t j = 0; j < n; ++j) std::memcpy(o + j, r[j] + 2 * u, 4);
    }
    if (x.d & 1)
      for (int64_t j = 0; j < n; ++j) out[pairs * bk + j0 + j] = r[j][x.d - 1].bits;
  }
}

void pack_pairs_along_keys(View3<const bf16> x, int64_t k0, int64_t cols, int64_t g,
                           const TileDims& t, uint16_t* dst) {
  // word (u, d) = x[2u, d] | x[2u + 1, d] << 16 (little-endian: the pair's first element low).
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  const int64_t dp = t.dp, d = x.d;
  std::fill(out, out + t.bk / 2 * dp, uint32_t{0});
  for (int64_t j = 0; j < cols; j += 2) {
    const bf16* r0 = x.row(k0 + j, g);
    uint32_t* o = out + (j / 2) * dp;
    if (j + 1 < cols) {
      const bf16* r1 = x.row(k0 + j + 1, g);
      for (int64_t e = 0; e < d; ++e)
        o[e] = static_cast<uint32_t>(r0[e].bits) | static_cast<uint32_t>(r1[e].bits) << 16;
    } else {
      for (int64_t e = 0; e < d; ++e) o[e] = r0[e].bits;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// bf16 dot products near float32's underflow: lifting.
//
// vdpbf16ps and AMX's TDPBF16PS ignore MXCSR: they take subnormal inputs as zero and flush every
// product and partial sum below FLT_MIN = 2^-126 to zero (vcvtneps2bf16 flushes subnormal results
// too). Where a product's operands are small, much of a result vanished: with v of 1e-36 and
// N(0, 1) q, k and dout (S = 64, D = 32), p v and ds = p (dp - delta), about 1e-36 p, fell below
// 2^-126 for the smaller p and dq came back 9 % off; dq 56 % with dout of 1e-37 instead, 51 %
// with k of 1e-37, dk 57 % with q of 1e-37, out 53 % with q and k of 1e-19 at scale 1e38, where
// the widening paths, fp32 with gradual underflow, stayed within 2^-9. So the bf16-dot paths lift
// such operands by a power of two before the products and take it back out in the GEMM's alpha,
// which multiplies the finished chain in fp32 (TileOps::gemm_bf16: C = alpha chain (+ C)):
//  * q, k, v and dout, per call (bf16_lift): a tensor whose largest |x| is below 2^kLiftFloorExp
//    = 2^-32 is multiplied by 2^e, e = -32 - ilogb(max |x|), at most kMaxLift, so that its
//    largest |x| lies in [2^-32, 2^-31). The alphas: scores scale log2(e) 2^-(eq + ek), p v
//    2^-ev, dout^T p 2^-ed, dout v^T 2^-(ed + ev). compute_delta lifts dout and out by the rule.
//  * ds = scale p (dp - delta) is formed in fp32 by TileOps::ds. Where dout or v was lifted or the
//    scale is below 2^-32, it is formed lifted by 2^eds, eds = -1 - ilogb(scale (D max|dout|
//    max|v| + max|delta|)) (so below 1): up to ed + ev of it kept in dp (and delta multiplied to
//    match), the rest in the scale. (Formed unlifted, ds was subnormal there, and fp32 arithmetic
//    on subnormals is slow on x86: the backward took twice as long again.) Then a tile whose
//    largest |ds| is still below ds_floor = 2^-64 / min(1, max |q'|, max |k'|) (the lifted
//    maxima, or lower bounds of them where the scan stopped: 2^-64 for inputs of ordinary size;
//    at most 2^-32) is multiplied into [ds_floor, 2 ds_floor) (lift_ds). dk's alpha is
//    2^-(eq + eds + tile's), dq's 2^-(eds + tile's + ek).
// Exact. A bf16 or fp32 value times 2^e inside the normal range keeps its significant bits, and
// every alpha is a normal float (each lift is at most 63, the ds lifts leave room for eq and ek,
// and the scores' lifts keep score_scale 2^-(eq + ek) >= 2^-126), so alpha chain is the unlifted
// chain times one. Round to nearest commutes with powers of two while nothing leaves the normal
// range: wherever the unlifted GEMM flushed nothing the lifted one gives bitwise its result.
// Inputs of ordinary size are not lifted (only a ds tile whose every |ds| is below 2^-64), so
// results there are unchanged; the backward's scores stay bitwise the forward's (q and k lifted by
// the same rule from the same tensors) and compute_delta's delta still cancels dp exactly where out
// is one row of v (unless that delta is below 2^-126 with bits below 2^-149, which float32 cannot
// hold: ds then keeps that rounding, scale 2^-150 at most). Enough. After lifting, every bf16
// product has max |a| max |b| >= 2^-64 (a weight p counted at 1, a row's largest; p is never
// subnormal: exp2 returns 0 below 2^-125). A flush changes a sum by less than 2^-126 (a product or
// a partial sum below it), or, for a subnormal operand a_t, by |a_t b_t| < 2^-126 max |b|: each at
// most 2^-62 max |a| max |b|. So an element of an n-term product loses at most 3 n 2^-62 max |a|
// max |b| (a product, an add and an input per term), under 2^-36 of u n max |a| max |b| (u =
// 2^-24), fp32's worst-case rounding of the same sum, which the widening paths make and which the
// tolerances of loom/tolerance.h carry (kFp32RelTol about 2^-16.6; the bf16 ones 2^-8 and 2^-7).
// The ratio does not depend on n (D, the keys, the query rows): it holds at every size loom takes.
// Lifting stops short only for a tensor whose largest |x| is below 2^-95 (lifted by 63, to at least
// 2^-70: its products' flushes stay below 3 u n max |a| max |b|, and its results lie near or below
// float32's normal range, as on the widening paths) and where a tiny scale limits the scores' lifts
// (scale log2 e below 2^(eq + ek - 126): the flushes then move a score by less than 2^-50). Checked
// against the fp64 reference by tests/unit/test_blockwise.cc
// (PerTarget.Bf16SmallOperandsMatchTheReference): amx and avx512bf16 within 0.6 u where they were
// off by up to 1.0. Cost: inputs of ordinary size pay the scans of q, k, v and dout, which stop at
// the first row that reaches 2^-8 (q, k) or 2^-32 (v, dout), and the first block of each ds tile;
// with v of 1e-36 (S = 2048, H = 8, D = 128, causal, one thread) the amx backward took 0.21 s (0.07
// s on N(0, 1) inputs; 0.14 s before, wrong), the widening avx512 path 12.2 s: fp32 arithmetic on
// subnormals (assists), which lifting keeps out of all but the accumulators (docs/performance.md).
constexpr int kLiftFloorExp = -32;
constexpr int kMaxLift = 63;
constexpr uint16_t kBf16InfBits = 0x7f80;  // |x| bits at or above: an infinity or NaN

// bf16 bits of 2^e, e in [-126, 127].
constexpr uint16_t pow2_bits(int e) {
  return static_cast<uint16_t>((e + 127) << 7);
}

inline float bits_value(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The largest |x| of a bf16 view as bits (kBf16InfBits and above: an infinity or NaN), or, found
// first, the largest |x| of a row (d values) that reaches `stop` bits: then a lower bound. Inputs
// of ordinary size stop at their first row; the rows' maxima are vector code (pmaxsw).
uint16_t max_abs_bits(View3<const bf16> x, uint16_t stop) {
  int16_t m = 0;
  for (int64_t i = 0; i < x.s; ++i) {
    for (int64_t h = 0; h < x.h; ++h) {
      const bf16* r = x.row(i, h);
      int16_t row_max = 0;
      for (int64_t d = 0; d < x.d; ++d)
        row_max = std::max(row_max, static_cast<int16_t>(r[d].bits & 0x7fff));
      if (row_max >= static_cast<int16_t>(stop)) return static_cast<uint16_t>(row_max);
      m = std::max(m, row_max);
    }
  }
  return static_cast<uint16_t>(m);
}

// The lift of a tensor whose largest |x| has bf16 bits m (see above): 0 for zero, non-finite or
// at least 2^kLiftFloorExp.
int lift_exponent(uint16_t m) {
  if (m == 0 || m >= kBf16InfBits || m >= pow2_bits(kLiftFloorExp)) return 0;
  return std::min(kLiftFloorExp - std::ilogb(bits_value(m)), kMaxLift);
}

// x[0, n) (bf16 bits) times 2^e, exactly (the float product of a bf16 value and a power of two
// inside float's range has zero low 16 bits). e = 0: unchanged.
void lift_bits(uint16_t* x, int64_t n, int e) {
  if (e == 0) return;
  const float f = std::ldexp(1.0f, e);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u = static_cast<uint32_t>(x[i]) << 16;
    float v;
    std::memcpy(&v, &u, 4);
    v *= f;
    std::memcpy(&u, &v, 4);
    x[i] = static_cast<uint16_t>(u >> 16);
  }
}

// A ds tile ds[0, n) whose largest |ds| is below floor is multiplied by 2^e into [floor,
// 2 floor), e at most max_lift; returns e (0: unchanged: some |ds| reaches floor, or all are
// zero). In blocks of 64, leaving at the first block that reaches floor (an ordinary tile: its
// first).
int lift_ds(float* ds, int64_t n, float floor, int max_lift) {
  constexpr int64_t kBlock = 64;
  float m = 0;
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    float bm = 0;
    for (int64_t i = i0; i < std::min(n, i0 + kBlock); ++i) bm = std::max(bm, std::fabs(ds[i]));
    if (bm >= floor) return 0;  // also an infinity; a NaN is never taken as the maximum
    m = std::max(m, bm);
  }
  if (m == 0 || max_lift <= 0) return 0;
  const int e = std::min(std::ilogb(floor) - std::ilogb(m), max_lift);
  const float f = std::ldexp(1.0f, e);
  for (int64_t i = 0; i < n; ++i) ds[i] *= f;
  return e;
}

// The lifts of one bf16-dot call (all 0, and score_alpha = scale log2(e), for inputs of ordinary
// size).
struct Bf16Lift {
  int q = 0, k = 0, v = 0, dout = 0;
  int k_scores = 0;       // k's lift in q k^T (k's, less where score_scale is tiny)
  float score_alpha = 0;  // scale log2(e) 2^-(q + k_scores)
  // Backward: ds = ds_scale p (dp 2^dp_keep - delta 2^dp_keep) is ds 2^ds (dp_keep of dout's and
  // v's lifts kept in dp, the rest in ds_scale = scale 2^(ds - dp_keep)); tiles below ds_floor
  // are lifted further (lift_ds), by at most ds_max_lift.
  int ds = 0, dp_keep = 0, ds_max_lift = 0;
  float ds_scale = 0, ds_floor = 0;
};

float to_base2(float x);

// The largest |delta| over heads x rows (stride ml_stride between heads); NaN if one is NaN.
float max_abs_delta(const float* delta, int64_t ml_stride, int64_t heads, int64_t rows) {
  float m = 0;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < rows; ++i) {
      const float x = std::fabs(delta[h * ml_stride + i]);
      if (!(x <= m)) m = x;  // also a NaN, which then stays
    }
  return m;
}

// dout == nullptr: the forward's lifts (q, k, v); else also the backward's (dout, ds: delta
// [heads, q.s] with stride ml_stride between heads).
Bf16Lift bf16_lift(View3<const bf16> q, View3<const bf16> k, View3<const bf16> v,
                   const View3<const bf16>* dout, float scale, const float* delta = nullptr,
                   int64_t ml_stride = 0) {
  Bf16Lift l;
  const uint16_t qm = max_abs_bits(q, pow2_bits(-8)), km = max_abs_bits(k, pow2_bits(-8));
  l.q = lift_exponent(qm);
  l.k = lift_exponent(km);
  l.v = lift_exponent(max_abs_bits(v, pow2_bits(kLiftFloorExp)));
  if (dout != nullptr) l.dout = lift_exponent(max_abs_bits(*dout, pow2_bits(kLiftFloorExp)));
  // score_scale 2^-(q + k_scores) must stay normal (>= 2^-126): k's lift gives way first.
  const float score_scale = to_base2(scale);
  const int room = std::ilogb(score_scale) + 126;  // >= 0: scale >= FLT_MIN
  l.k_scores = std::max(0, std::min(l.k, room - l.q));
  if (l.q + l.k_scores > room) l.q = room;
  l.score_alpha = std::ldexp(score_scale, -(l.q + l.k_scores));
  // The lifted maxima of q and k (lower bounds where the scan stopped early; 1 for zero or
  // non-finite, where the products cannot flush anything that matters).
  const auto lifted = [](uint16_t m, int e) {
    return m == 0 || m >= kBf16InfBits ? 1.0f : std::ldexp(bits_value(m), e);
  };
  const float least = std::min({1.0f, lifted(qm, l.q), lifted(km, l.k)});
  l.ds_floor = std::min(std::ldexp(1.0f, kLiftFloorExp), std::ldexp(1.0f, -64) / least);
  // ds = scale p (dp - delta), formed in fp32: where dout or v was lifted, or the scale is
  // small, |ds| <= scale (D max|dout| max|v| + max|delta|) can lie below 2^-126, and fp32
  // arithmetic on subnormals is slow on x86 (the tiles' lifts then tripled the backward). So ds
  // is formed lifted by 2^ds, ds = -1 - ilogb(that bound) (its values below 1): part of it kept
  // in dp (dp_keep, at most dout's and v's lifts) and delta, the rest in the scale. The alphas of
  // dk and dq take it back out, so ds and the tile lifts leave room for q's and k's lifts.
  l.ds_scale = scale;
  l.ds_max_lift = 126 - std::max(l.q, l.k);
  if (dout != nullptr && (l.dout + l.v > 0 || scale < std::ldexp(1.0f, kLiftFloorExp))) {
    const double a = bits_value(max_abs_bits(*dout, 0x7fff));  // exact maxima
    const double b = bits_value(max_abs_bits(v, 0x7fff));
    const double bound = scale * (static_cast<double>(q.d) * a * b +
                                  (q.s > 0 ? max_abs_delta(delta, ml_stride, q.h, q.s) : 0.0));
    if (bound > 0 && std::isfinite(bound)) {
      l.ds = std::clamp(-1 - std::ilogb(bound), 0, l.ds_max_lift);
      l.dp_keep = std::min(l.ds, l.dout + l.v);
      l.ds_scale = std::ldexp(scale, l.ds - l.dp_keep);
      l.ds_max_lift -= l.ds;
    }
  }
  return l;
}

// The bf16-dot forward's tiles: kt(g, kj) is k in pairs along d (B of s = q k^T), v(g, kj) is v
// in pairs along the keys (B of acc += p v).
using PackedKvPairs = PackedKvTiles<uint16_t>;

PackedKvPairs pack_kv_pairs(View3<const bf16> k, View3<const bf16> v, int64_t g0, int64_t kv_heads,
                            const TilePlan& plan, const TileDims& t, int threads,
                            const Bf16Lift& lift) {
  return PackedKvPairs(g0, kv_heads, k.s, plan, t, threads,
                       false,  // the packs write the padding
                       [&](int64_t g, int64_t k0, int64_t cols, uint16_t* kt, uint16_t* vt) {
                         pack_pairs_along_d(k, k0, cols, g, t, kt);
                         lift_bits(kt, t.dp * t.bk, lift.k_scores);
                         pack_pairs_along_keys(v, k0, cols, g, t, vt);
                         lift_bits(vt, t.bk * t.dp, lift.v);
                       });
}

// The bf16-dot backward's q and dout of every head of a chunk transposed, the A operands of
// dk^T += q^T ds and dv^T += dout^T p (pairs along the query rows): [H][dp][ld] bf16 bits,
// element (h, d, i) = x[i, h, d] for i < sp = q_tiles * bq (zero padded past Sq; the ld - sp
// skew columns are not written), in elements(H, sp, t) x 2 bf16 of the caller's memory at dst.
// Every k-tile task reads every q-tile, so they are transposed once per chunk
// (backward_in_head_chunks).
class TransposedRows {
 public:
  // Rows [dp] of sp elements each, ld() = sp + kSkew apart: sp is a multiple of the tile side, so
  // sp * 2 bytes is often a multiple of 4 KiB (8 KiB at Sq = 4096), and the 16 rows of an AMX
  // tile (8 rows of a vdpbf16ps block) would all fall in one L1 set. The skew's 64 bytes move
  // each row to the next set; they are never read.
  static constexpr int64_t kSkew = 32;
  static int64_t elements(int64_t heads, int64_t sp, const TileDims& t) {
    return heads * t.dp * (sp + kSkew);
  }
  TransposedRows(View3<const bf16> q, View3<const bf16> dout, int64_t sp, const TileDims& t,
                 int threads, uint16_t* dst)
      : ld_(sp + kSkew), dp_(t.dp), q_(dst), dout_(dst + elements(q.h, sp, t)) {
    constexpr int64_t kRows = 32;  // rows per block: each d writes 64 contiguous bytes
    const int64_t blocks = (sp + kRows - 1) / kRows;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < q.h * blocks; ++b) {
      const int64_t h = b / blocks, i0 = (b % blocks) * kRows;
      const int64_t n = std::min(kRows, sp - i0);
      transpose_block(q, h, i0, n, q_);
      transpose_block(dout, h, i0, n, dout_);
    }
  }
  // Column q0 of head h's [dp] rows (row stride ld()).
  const uint16_t* q(int64_t h, int64_t q0) const {
    return q_ + h * dp_ * ld_ + q0;
  }
  const uint16_t* dout(int64_t h, int64_t q0) const {
    return dout_ + h * dp_ * ld_ + q0;
  }
  int64_t ld() const {
    return ld_;
  }

 private:
  void transpose_block(View3<const bf16> x, int64_t h, int64_t i0, int64_t n, uint16_t* dst) const {
    uint16_t* base = dst + h * dp_ * ld_ + i0;
    for (int64_t d = 0; d < dp_; ++d) {
      uint16_t* out = base + d * ld_;
      for (int64_t r = 0; r < n; ++r)
        out[r] = i0 + r < x.s && d < x.d ? x.row(i0 + r, h)[d].bits : uint16_t{0};
    }
  }
  int64_t ld_, dp_;
  uint16_t* q_;
  uint16_t* dout_;
};

// ---------------------------------------------------------------------------------------------
// Tile steps. s is [bq, bk]; only rows < rows and columns < cols are real.

// Sets the scores of the pairs the mask hides to -inf (partial tiles only).
void mask_tile(const Mask& mask, const Workspace& ws, int64_t rows, int64_t cols, const TileDims& t,
               float* s) {
  // visible() written branch-free, so the column loop vectorises; the distance |qpos - kpos| is
  // formed in uint64_t (exact for any two int64 positions) and compared with window - 1
  // (UINT64_MAX: no window).
  const bool causal = mask.causal;
  const uint64_t max_dist = mask.window > 0 ? static_cast<uint64_t>(mask.window) - 1
                                            : std::numeric_limits<uint64_t>::max();
  const int64_t* k_pos = ws.k_pos.data();
  const int32_t* k_doc = ws.k_doc.data();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t qpos = ws.q_pos[r];
    const int32_t qdoc = ws.q_doc[r];
    float* sr = s + r * t.bk;
    for (int64_t j = 0; j < cols; ++j) {
      const bool key_before = k_pos[j] <= qpos;
      const uint64_t diff = static_cast<uint64_t>(qpos) - static_cast<uint64_t>(k_pos[j]);
      const uint64_t dist = key_before ? diff : uint64_t{0} - diff;
      const bool seen = (k_doc[j] == qdoc) & (!causal | key_before) & (dist <= max_dist);
      sr[j] = seen ? sr[j] : kNegInf;
    }
  }
}

// The forward's GEMMs on a packed KV tile b (column panels of fp32 or of bf16 bits, see
// PackedKvTiles), prefetching `regions` regions of next meanwhile (none: its own operands).
void gemm_kv(const TileOps& ops, int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs,
             const float* b, int64_t b_ps, float alpha, bool accumulate, float* c, int64_t ldc,
             Workspace&, const PrefetchRegion* next, int64_t regions) {
  ops.gemm_panels_next(M, N, K, a, a_rs, 1, b, b_ps, alpha, accumulate, c, ldc, next, regions);
}
void gemm_kv(const TileOps& ops, int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs,
             const uint16_t* b, int64_t b_ps, float alpha, bool accumulate, float* c, int64_t ldc,
             Workspace& ws, const PrefetchRegion* next, int64_t regions) {
  ops.gemm_panels_bf16(M, N, K, a, a_rs, 1, b, b_ps, alpha, accumulate, c, ldc, ws.panel.get(),
                       next, regions);
}

// ---------------------------------------------------------------------------------------------
// Forward.

// The state rows [q0, q0 + rows) of head h into the tile buffers acc [bq, dp], m, l [bq]
// (padding: acc 0, m -inf, l 0), and back.
void load_state(const StateView& st, int64_t h, int64_t q0, int64_t rows, const TileDims& t,
                float* acc, float* m, float* l) {
  const int64_t dim = st.dim;
  for (int64_t r = 0; r < t.bq; ++r) {
    float* ar = acc + r * t.dp;
    if (r < rows) {
      const float* in = st.acc + (q0 + r) * st.acc_ss + h * dim;
      std::copy(in, in + dim, ar);
      std::fill(ar + dim, ar + t.dp, 0.0f);
      m[r] = st.m[h * st.ml_stride + q0 + r];
      l[r] = st.l[h * st.ml_stride + q0 + r];
    } else {
      std::fill(ar, ar + t.dp, 0.0f);
      m[r] = kNegInf;
      l[r] = 0.0f;
    }
  }
}

void store_state(const StateView& st, int64_t h, int64_t q0, int64_t rows, const TileDims& t,
                 const float* acc, const float* m, const float* l) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* ar = acc + r * t.dp;
    std::copy(ar, ar + st.dim, st.acc + (q0 + r) * st.acc_ss + h * st.dim);
    st.m[h * st.ml_stride + q0 + r] = m[r];
    st.l[h * st.ml_stride + q0 + r] = l[r];
  }
}

// The kernels compute their scores in base 2, s2 = scale log2(e) q k^T, so that the softmax's
// exp(s - m) is 2^(s2 - m2) (TileOps::softmax_update, probs: a cheaper exp) and the state's m is
// in the same units; the backward converts the lse it is given. Each product is rounded once,
// from double: a relative change below 2^-24 of the scale, and of the lse.
constexpr double kLog2e = 1.4426950408889634;
constexpr double kLn2 = 0.69314718055994531;
// x log2(e), rounded once (-inf stays -inf): the scores' scale, and the backward's lse.
float to_base2(float x) {
  return static_cast<float>(static_cast<double>(x) * kLog2e);
}

// E: the packed KV block's element (float, or uint16_t for bf16 panels or pairs).
template <class T, class E = float>
struct ForwardArgs {
  StateView st;
  View3<const T> q, k, v;
  Tokens qt, kt;
  const KernelConfig* cfg;
  const TilePlan* plan;
  TileDims dims;
  const PackedKvTiles<E>* kv;
  const TileOps* ops;
  Bf16Lift lift;  // the bf16-dot forward's lifts (forward_task_bf16)
};

// Folds every non-empty k-tile into the state rows of q-tile qi, head h. (next_h, next_qi): the
// task this thread runs next (next_qi < 0: none), whose first operands the last tile prefetches.
template <class T, class E>
void forward_task(const ForwardArgs<T, E>& a, int64_t h, int64_t qi, Workspace& ws, int64_t next_h,
                  int64_t next_qi) {
  const TilePlan& plan = *a.plan;
  const TileDims& t = a.dims;
  const int64_t g = h / (a.q.h / a.k.h);
  const int64_t q0 = plan.q_begin(qi), rows = std::min(plan.block_q, a.q.s - q0);

  pack_rows(a.q, q0, rows, h, t, ws.q.get());
  pack_tokens(a.qt, q0, rows, ws.q_pos.data(), ws.q_doc.data());
  float* acc = ws.acc.get();
  float* m = ws.row_m.get();
  float* l = ws.row_l.get();
  load_state(a.st, h, q0, rows, t, acc, m, l);

  const TileOps& ops = *a.ops;
  const float score_scale = to_base2(a.cfg->scale);
  const int64_t tile_bytes = t.dp * t.bk * static_cast<int64_t>(sizeof(E));  // a k^T or v tile
  // The next non-empty k-tile of q-tile i after kj, or k_tiles.
  auto next_tile = [&](int64_t i, int64_t kj) {
    for (++kj; kj < plan.k_tiles && plan.at(i, kj) == TileKind::kEmpty;) ++kj;
    return kj;
  };
  for (int64_t kj = next_tile(qi, -1); kj < plan.k_tiles;) {
    const TileKind kind = plan.at(qi, kj);
    const int64_t k0 = plan.k_begin(kj), cols = std::min(plan.block_k, a.k.s - k0);
    const int64_t kn = next_tile(qi, kj);
    // s = scale log2(e) q k^T (base 2), v of this tile prefetched meanwhile
    const PrefetchRegion this_v{a.kv->v(g, kj), 1, tile_bytes, 0};
    gemm_kv(ops, t.bq, t.bk, t.dp, ws.q.get(), t.dp, a.kv->kt(g, kj), t.dp * kNr, score_scale,
            false, ws.s.get(), t.bk, ws, &this_v, 1);
    if (kind == TileKind::kPartial) {
      pack_tokens(a.kt, k0, cols, ws.k_pos.data(), ws.k_doc.data());
      mask_tile(a.cfg->mask, ws, rows, cols, t, ws.s.get());
    }
    ops.softmax_update(rows, cols, t.bq, t.bk, t.dp, ws.s.get(), m, l, acc);
    // acc += p v, the next tile's k^T prefetched meanwhile; after the last tile, the next task's
    // first k^T tile, its q rows and its state rows
    PrefetchRegion next[3];
    int64_t regions = 0;
    if (kn < plan.k_tiles) {
      next[regions++] = {a.kv->kt(g, kn), 1, tile_bytes, 0};
    } else if (next_qi >= 0) {
      const int64_t ng = next_h / (a.q.h / a.k.h), nq0 = plan.q_begin(next_qi);
      const int64_t nrows = std::min(plan.block_q, a.q.s - nq0);
      const int64_t nk = next_tile(next_qi, -1);
      if (nk < plan.k_tiles) next[regions++] = {a.kv->kt(ng, nk), 1, tile_bytes, 0};
      next[regions++] = {a.q.row(nq0, next_h), nrows, a.q.d * static_cast<int64_t>(sizeof(T)),
                         a.q.ss * static_cast<int64_t>(sizeof(T))};
      next[regions++] = {a.st.acc + nq0 * a.st.acc_ss + next_h * a.st.dim, nrows, a.st.dim * 4,
                         a.st.acc_ss * 4};
    }
    gemm_kv(ops, t.bq, t.dp, t.bk, ws.s.get(), t.bk, a.kv->v(g, kj), t.bk * kNr, 1.0f, true, acc,
            t.dp, ws, next, regions);
    kj = kn;
  }

  store_state(a.st, h, q0, rows, t, acc, m, l);
}

// Hints that bytes bytes from p will be read soon (towards L2).
void prefetch_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 2);
}

// forward_task with bf16 dot products: s = scale log2(e) q k^T and acc += p v by vdpbf16ps on bf16
// operands (exact products, fp32 sums); the softmax and acc stay fp32. p is rounded to bf16 for
// the p v product only; l sums the unrounded p. (It prefetches nothing of the next task: spread
// over the last tiles, prefetching the next task's q and state rows changed nothing measurable,
// docs/performance.md round 16.)
void forward_task_bf16(const ForwardArgs<bf16, uint16_t>& a, int64_t h, int64_t qi, Workspace& ws) {
  const TilePlan& plan = *a.plan;
  const TileDims& t = a.dims;
  const TileOps& ops = *a.ops;
  const float score_alpha = a.lift.score_alpha;        // scale log2(e), less q's and k's lifts
  const float pv_alpha = std::ldexp(1.0f, -a.lift.v);  // less v's lift
  const int64_t g = h / (a.q.h / a.k.h);
  const int64_t q0 = plan.q_begin(qi), rows = std::min(plan.block_q, a.q.s - q0);

  uint16_t* q16 = ws.q16.get();
  pack_rows_bits(a.q, q0, rows, h, t, q16);
  lift_bits(q16, t.bq * t.dp, a.lift.q);
  pack_tokens(a.qt, q0, rows, ws.q_pos.data(), ws.q_doc.data());
  float* acc = ws.acc.get();
  float* m = ws.row_m.get();
  float* l = ws.row_l.get();
  load_state(a.st, h, q0, rows, t, acc, m, l);

  const int64_t tile_bytes = t.dp * t.bk * static_cast<int64_t>(sizeof(uint16_t));
  for (int64_t kj = 0; kj < plan.k_tiles; ++kj) {
    const TileKind kind = plan.at(qi, kj);
    if (kind == TileKind::kEmpty) continue;
    const int64_t k0 = plan.k_begin(kj), cols = std::min(plan.block_k, a.k.s - k0);
    prefetch_l2(a.kv->v(g, kj), tile_bytes);  // this tile's v, while q k^T computes
    ops.gemm_bf16(t.bq, t.bk, t.dp / 2, q16, t.dp, a.kv->kt(g, kj), 2 * t.bk, score_alpha, false,
                  ws.s.get(), t.bk);
    if (kind == TileKind::kPartial) {
      pack_tokens(a.kt, k0, cols, ws.k_pos.data(), ws.k_doc.data());
      mask_tile(a.cfg->mask, ws, rows, cols, t, ws.s.get());
    }
    if (kj + 1 < plan.k_tiles) prefetch_l2(a.kv->kt(g, kj + 1), tile_bytes);  // the next k^T
    ops.softmax_update(rows, cols, t.bq, t.bk, t.dp, ws.s.get(), m, l, acc);
    ops.to_bf16(ws.s.get(), ws.p16.get(), t.bq * t.bk);
    ops.gemm_bf16(t.bq, t.dp, t.bk / 2, ws.p16.get(), t.bk, a.kv->v(g, kj), 2 * t.dp, pv_alpha,
                  true, acc, t.dp);
  }
  store_state(a.st, h, q0, rows, t, acc, m, l);
}

void check_config(const KernelConfig& cfg) {
  kernels::check_mask(cfg.mask);
  kernels::check_scale(cfg.scale);
  // The scores carry log2 e in their scale (to_base2), which must be finite: the scale must be
  // at most FLT_MAX / log2 e = 2.35865749e38, in float32 at most 2.3586574e38.
  constexpr double kMaxScale = std::numeric_limits<float>::max() / kLog2e;
  if (!(cfg.scale <= kMaxScale)) {
    float largest = static_cast<float>(kMaxScale);
    if (largest > kMaxScale) largest = std::nextafter(largest, 0.0f);
    throw InvalidArgument("softmax scale must be at most " + exact_text(largest) +
                              " (FLT_MAX / log2 e in float32), got " + exact_text(cfg.scale),
                          __FILE__, __LINE__);
  }
  // A subnormal scale holds too few bits: at 1e-44 (9.8e-45 in float32) dq and dk came back 40 %
  // off, silently.
  LOOM_CHECK(cfg.scale >= std::numeric_limits<float>::min(), InvalidArgument,
             "softmax scale must be at least " << exact_text(std::numeric_limits<float>::min())
                                               << " (float32's smallest normal number), got "
                                               << exact_text(cfg.scale));
  LOOM_CHECK(cfg.threads >= 0 && cfg.threads <= kMaxKernelThreads, InvalidArgument,
             "threads must be in [0, " << kMaxKernelThreads << "] (0: the OpenMP default), got "
                                       << cfg.threads);
  LOOM_CHECK(cfg.block_q >= 1 && cfg.block_q <= kMaxBlock, InvalidArgument,
             "block_q must be in [1, " << kMaxBlock << "], got " << cfg.block_q);
  LOOM_CHECK(cfg.block_k >= 1 && cfg.block_k <= kMaxBlock, InvalidArgument,
             "block_k must be in [1, " << kMaxBlock << "], got " << cfg.block_k);
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

template <class T>
struct BackwardArgs {
  View3<const T> q, k, v, dout;
  const float* lse;
  const float* delta;
  int64_t ml_stride;
  Tokens qt, kt;
  const KernelConfig* cfg;
  const TilePlan* plan;
  TileDims dims;
  View3<float> dk, dv;
  const TileOps* ops;
  Bf16Lift lift;  // the bf16-dot backward's lifts (backward_task_bf16; q and dout: their copies)
};

// The tile's rows of the lse (converted to base 2, as the scores) and of delta (0 in the padding).
template <class T>
void load_lse_delta(const BackwardArgs<T>& a, int64_t h, int64_t q0, int64_t rows,
                    const TileDims& t, float* lse, float* delta) {
  for (int64_t r = 0; r < rows; ++r) {
    lse[r] = to_base2(a.lse[h * a.ml_stride + q0 + r]);
    delta[r] = a.delta[h * a.ml_stride + q0 + r];
  }
  std::fill(delta + rows, delta + t.bq, 0.0f);
}

// dst rows [q0, q0 + rows) of head h += the tile's rows (row stride ld; dst.d columns each).
void add_rows(const float* tile, int64_t ld, int64_t rows, View3<float> dst, int64_t q0,
              int64_t h) {
  for (int64_t r = 0; r < rows; ++r) {
    float* out = dst.row(q0 + r, h);
    const float* in = tile + r * ld;
    for (int64_t d = 0; d < dst.d; ++d) out[d] += in[d];
  }
}

// dk, dv of k-tile kj of kv head g, and the dq contributions of its pairs (added into dq_sink).
// (next_g, next_kj): the task this thread runs next (next_kj < 0: none), whose first rows the last
// pair prefetches.
template <class T>
void backward_task(const BackwardArgs<T>& a, int64_t g, int64_t kj, Workspace& ws,
                   View3<float> dq_sink, int64_t next_g, int64_t next_kj) {
  const TilePlan& plan = *a.plan;
  const TileDims& t = a.dims;
  const int64_t group = a.q.h / a.k.h;
  const int64_t dim = a.q.d;
  const float scale = a.cfg->scale;
  const float score_scale = to_base2(scale);
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

  // The pair after (h, qi): (head, first row, rows, whether it is the next task's first), rows = 0
  // when there is none. The pairs of a task run head by head, q-tile by q-tile.
  const auto next_pair = [&](int64_t h, int64_t qi) {
    int64_t task_kj = kj, end = (g + 1) * group;
    int64_t in_next = 0;  // 1 once the scan has moved on to the next task
    for (;;) {
      if (++qi == plan.q_tiles) {
        qi = 0;
        if (++h == end) {
          if (in_next == 1 || next_kj < 0) return std::array<int64_t, 4>{0, 0, 0, 0};
          in_next = 1;
          task_kj = next_kj;
          h = next_g * group;
          end = h + group;
        }
      }
      if (plan.at(qi, task_kj) != TileKind::kEmpty) {
        const int64_t q0 = plan.q_begin(qi);
        return std::array<int64_t, 4>{h, q0, std::min(plan.block_q, a.q.s - q0), in_next};
      }
    }
  };
  const int64_t elem = sizeof(T), row_bytes = dim * elem;
  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    for (int64_t qi = 0; qi < plan.q_tiles; ++qi) {
      const TileKind kind = plan.at(qi, kj);
      if (kind == TileKind::kEmpty) continue;
      const int64_t q0 = plan.q_begin(qi), rows = std::min(plan.block_q, a.q.s - q0);
      const auto [nh, nq0, nrows, last] = next_pair(h, qi);
      const T* next_q = nrows > 0 ? a.q.row(nq0, nh) : nullptr;
      const T* next_dout = nrows > 0 ? a.dout.row(nq0, nh) : nullptr;
      // The last pair before the next task also prefetches that task's k and v rows (its packs).
      const int64_t nk0 = last ? plan.k_begin(next_kj) : 0;
      const int64_t ncols = last ? std::min(plan.block_k, a.k.s - nk0) : 0;
      const T* next_k = last ? a.k.row(nk0, next_g) : nullptr;
      const T* next_v = last ? a.v.row(nk0, next_g) : nullptr;
      // Tiles with full rows and no head-dim padding accumulate dq (fp32 for either storage) in
      // place, and fp32 ones also read q and dout in place, with their views' row strides; the
      // others go through packed buffers.
      const bool whole = rows == t.bq && dim == t.dp;
      const bool direct = std::is_same_v<T, float> && whole;
      const float* qp = ws.q.get();
      const float* doutp = ws.dout.get();
      int64_t q_rs = t.dp, dout_rs = t.dp;
      if constexpr (std::is_same_v<T, float>) {
        if (direct) {
          qp = a.q.row(q0, h);
          doutp = a.dout.row(q0, h);
          q_rs = a.q.ss;
          dout_rs = a.dout.ss;
        }
      }
      // The column panels first: the pack reads q and dout from memory (prefetched towards L2
      // during the previous pair's dv and dk GEMMs, below) and leaves them in L1 / L2 for the
      // direct GEMMs' reads.
      pack_rows_panels(a.dout, q0, rows, h, t, ws.dout_pan.get());
      pack_rows_panels(a.q, q0, rows, h, t, ws.q_pan.get());
      if (!direct) {
        pack_rows(a.q, q0, rows, h, t, ws.q.get());
        pack_rows(a.dout, q0, rows, h, t, ws.dout.get());
      }
      load_lse_delta(a, h, q0, rows, t, lse, delta);

      const TileOps& ops = *a.ops;
      // s [bq, bk] = scale log2(e) q k^T (base 2, as lse here)
      // (its prefetch stream, before another task: that task's v rows)
      const PrefetchRegion v_rows{next_v, ncols, row_bytes, a.v.ss * elem};
      ops.gemm_panels_next(t.bq, t.bk, t.dp, qp, q_rs, 1, ws.kt.get(), t.dp * kNr, score_scale,
                           false, s, t.bk, &v_rows, 1);
      if (kind == TileKind::kPartial) {
        pack_tokens(a.qt, q0, rows, ws.q_pos.data(), ws.q_doc.data());
        mask_tile(a.cfg->mask, ws, rows, cols, t, s);
      }
      ops.probs(rows, cols, t.bq, t.bk, lse, s);
      // dv [bk, dp] += p^T dout
      // (B in column panels: rows of q and dout a view row stride apart would share a few L1
      // sets; bench_kernels --tile-ops measured row-major B 10-15 % slower.)
      // (its prefetch stream: the next pair's q rows)
      const PrefetchRegion q_rows{next_q, nrows, row_bytes, a.q.ss * elem};
      ops.gemm_panels_next(t.bk, t.dp, t.bq, s, 1, t.bk, ws.dout_pan.get(), t.bq * kNr, 1.0f, true,
                           ws.dv.get(), t.dp, &q_rows, 1);
      // dp [bq, bk] = dout v^T
      // (its prefetch stream: this pair's dq rows, which the last GEMM accumulates in place)
      const PrefetchRegion dq_rows{dq_sink.row(q0, h), rows, dim * 4, dq_sink.ss * 4};
      ops.gemm_panels_next(t.bq, t.bk, t.dp, doutp, dout_rs, 1, ws.v.get(), t.dp * kNr, 1.0f, false,
                           dp, t.bk, &dq_rows, 1);
      ops.ds(s, delta, scale, t.bq, t.bk, dp);
      // dk [bk, dp] += ds^T q
      // (its prefetch stream: the next pair's dout rows)
      const PrefetchRegion dout_rows{next_dout, nrows, row_bytes, a.dout.ss * elem};
      ops.gemm_panels_next(t.bk, t.dp, t.bq, dp, 1, t.bk, ws.q_pan.get(), t.bq * kNr, 1.0f, true,
                           ws.dk.get(), t.dp, &dout_rows, 1);
      // dq [bq, dp] += ds k: in place (c + 1 * sum, the same rounding as adding a tile result)
      // (its prefetch stream, before another task: that task's k rows)
      const PrefetchRegion k_rows{next_k, ncols, row_bytes, a.k.ss * elem};
      if (whole) {
        ops.gemm_panels_next(t.bq, t.dp, t.bk, dp, t.bk, 1, ws.k.get(), t.bk * kNr, 1.0f, true,
                             dq_sink.row(q0, h), dq_sink.ss, &k_rows, 1);
        continue;
      }
      ops.gemm_panels_next(t.bq, t.dp, t.bk, dp, t.bk, 1, ws.k.get(), t.bk * kNr, 1.0f, false,
                           dq_tile, t.dp, &k_rows, 1);
      add_rows(dq_tile, t.dp, rows, dq_sink, q0, h);
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

// backward_task with bf16 dot products (the avx512bf16 path, bf16 storage): the five products
// are vdpbf16ps GEMMs (TileOps::gemm_bf16) on bf16 operands, with exact products and fp32 sums;
// the probabilities and ds stay fp32 and are rounded to bf16 only as the operands of the products
// after them (p of dv, ds of dk and dq). dk and dv are accumulated transposed, [dp, bk]:
//   s = scale log2(e) q k^T        A q [bq, dp]               B k pairs along d
//   dv^T += dout^T p               A dout^T (TransposedRows)  B p in row pairs
//   dp = dout v^T                  A dout [bq, dp]            B v pairs along d
//   dk^T += q^T ds                 A q^T (TransposedRows)     B ds in row pairs
//   dq += ds k                     A ds [bq, bk]              B k pairs along the keys
// q and dout are read in place where a tile has full rows and no head-dim padding, and dq is
// accumulated in place there (as backward_task does).
void backward_task_bf16(const BackwardArgs<bf16>& a, const TransposedRows& tr, int64_t g,
                        int64_t kj, Workspace& ws, View3<float> dq_sink) {
  const TilePlan& plan = *a.plan;
  const TileDims& t = a.dims;
  const TileOps& ops = *a.ops;
  const int64_t group = a.q.h / a.k.h;
  const int64_t dim = a.q.d;
  // The alphas take the lifts back out (bf16_lift: q and dout come lifted in their copies).
  const Bf16Lift& lift = a.lift;
  const float dv_alpha = std::ldexp(1.0f, -lift.dout);
  const float dp_alpha = std::ldexp(1.0f, lift.dp_keep - (lift.dout + lift.v));
  const float delta_lift = std::ldexp(1.0f, lift.dp_keep);
  const int64_t k0 = plan.k_begin(kj), cols = std::min(plan.block_k, a.k.s - k0);

  pack_pairs_along_d(a.k, k0, cols, g, t, ws.kt16.get());
  lift_bits(ws.kt16.get(), t.dp * t.bk, lift.k_scores);
  pack_pairs_along_d(a.v, k0, cols, g, t, ws.vt16.get());
  lift_bits(ws.vt16.get(), t.dp * t.bk, lift.v);
  pack_pairs_along_keys(a.k, k0, cols, g, t, ws.k16.get());
  lift_bits(ws.k16.get(), t.bk * t.dp, lift.k);
  pack_tokens(a.kt, k0, cols, ws.k_pos.data(), ws.k_doc.data());
  float* dk_t = ws.dk.get();
  float* dv_t = ws.dv.get();
  std::fill(dk_t, dk_t + t.dp * t.bk, 0.0f);
  std::fill(dv_t, dv_t + t.dp * t.bk, 0.0f);
  float* lse = ws.row_m.get();
  float* delta = ws.row_l.get();
  float* s = ws.s.get();
  float* dp = ws.dp.get();
  float* dq_tile = ws.acc.get();
  uint16_t* pairs = ws.p16.get();  // p, then ds, in row pairs
  uint16_t* ds16 = ws.ds16.get();

  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    for (int64_t qi = 0; qi < plan.q_tiles; ++qi) {
      const TileKind kind = plan.at(qi, kj);
      if (kind == TileKind::kEmpty) continue;
      const int64_t q0 = plan.q_begin(qi), rows = std::min(plan.block_q, a.q.s - q0);
      const bool whole = rows == t.bq && dim == t.dp;
      const uint16_t* q16 = ws.q16.get();
      const uint16_t* dout16 = ws.dout16.get();
      int64_t q_ld = t.dp, dout_ld = t.dp;
      if (whole) {
        static_assert(sizeof(bf16) == sizeof(uint16_t));
        q16 = reinterpret_cast<const uint16_t*>(a.q.row(q0, h));
        dout16 = reinterpret_cast<const uint16_t*>(a.dout.row(q0, h));
        q_ld = a.q.ss;
        dout_ld = a.dout.ss;
      } else {
        pack_rows_bits(a.q, q0, rows, h, t, ws.q16.get());
        pack_rows_bits(a.dout, q0, rows, h, t, ws.dout16.get());
      }
      load_lse_delta(a, h, q0, rows, t, lse, delta);
      if (lift.dp_keep != 0)
        for (int64_t r = 0; r < rows; ++r) delta[r] *= delta_lift;

      ops.gemm_bf16(t.bq, t.bk, t.dp / 2, q16, q_ld, ws.kt16.get(), 2 * t.bk, lift.score_alpha,
                    false, s, t.bk);
      if (kind == TileKind::kPartial) {
        pack_tokens(a.qt, q0, rows, ws.q_pos.data(), ws.q_doc.data());
        mask_tile(a.cfg->mask, ws, rows, cols, t, s);
      }
      ops.probs(rows, cols, t.bq, t.bk, lse, s);
      ops.to_bf16_pairs(s, t.bq, t.bk, pairs);
      ops.gemm_bf16(t.dp, t.bk, t.bq / 2, tr.dout(h, q0), tr.ld(), pairs, 2 * t.bk, dv_alpha, true,
                    dv_t, t.bk);
      ops.gemm_bf16(t.bq, t.bk, t.dp / 2, dout16, dout_ld, ws.vt16.get(), 2 * t.bk, dp_alpha, false,
                    dp, t.bk);
      ops.ds(s, delta, lift.ds_scale, t.bq, t.bk, dp);
      const int ds_lift = lift.ds + lift_ds(dp, t.bq * t.bk, lift.ds_floor, lift.ds_max_lift);
      ops.to_bf16_pairs(dp, t.bq, t.bk, pairs);
      ops.to_bf16(dp, ds16, t.bq * t.bk);
      ops.gemm_bf16(t.dp, t.bk, t.bq / 2, tr.q(h, q0), tr.ld(), pairs, 2 * t.bk,
                    std::ldexp(1.0f, -(lift.q + ds_lift)), true, dk_t, t.bk);
      const float dq_alpha = std::ldexp(1.0f, -(ds_lift + lift.k));
      if (whole) {  // c + alpha * sum: the same rounding as adding a tile result
        ops.gemm_bf16(t.bq, t.dp, t.bk / 2, ds16, t.bk, ws.k16.get(), 2 * t.dp, dq_alpha, true,
                      dq_sink.row(q0, h), dq_sink.ss);
        continue;
      }
      ops.gemm_bf16(t.bq, t.dp, t.bk / 2, ds16, t.bk, ws.k16.get(), 2 * t.dp, dq_alpha, false,
                    dq_tile, t.dp);
      add_rows(dq_tile, t.dp, rows, dq_sink, q0, h);
    }
  }

  for (int64_t j = 0; j < cols; ++j) {
    float* dk_row = a.dk.row(k0 + j, g);
    float* dv_row = a.dv.row(k0 + j, g);
    for (int64_t d = 0; d < dim; ++d) {
      dk_row[d] += dk_t[d * t.bk + j];
      dv_row[d] += dv_t[d * t.bk + j];
    }
  }
}

}  // namespace

void check_kernel_config(const KernelConfig& cfg) {
  check_config(cfg);
}

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

namespace {

void check_attend(const StateView& st, int64_t q_s, int64_t q_h, int64_t q_d,
                  const KernelConfig& cfg) {
  check_config(cfg);
  check_state(st);
  LOOM_CHECK(st.rows == q_s && st.heads == q_h && st.dim == q_d, InvalidArgument,
             "state [" << st.rows << ", " << st.heads << ", " << st.dim << "] does not match q ["
                       << q_s << ", " << q_h << ", " << q_d << "]");
}

// The forward runs one chunk of kv heads at a time: it packs the chunk's KV block, then runs the
// chunk's (query head, q-tile) tasks on it. Every q-tile of a head reads the head's whole packed
// block, 4 MiB at Sk = 4096, D = 128 fp32; packed for all heads at once (32 MiB at H = 8, as large
// as the last-level cache of the CPUs measured) it was written long before it was read and came
// from memory, at 0.72-0.77 of the sgemm where one head read 0.99 (Zen 5, docs/performance.md,
// round 16). A chunk holds as many kv heads as fit in kAttendChunkBytes (at least one), so that a
// small block (a 512-key ring step: 512 KiB per head) is still packed, and its tasks balanced, in
// one go (attend_kv_chunk_heads); it is written just before it is read, into the thread's kept
// KvStorage buffer.

// The task order inside a chunk: kv head outermost, then the q-tiles late first (under a causal
// mask they carry the most keys), then the query heads that read the kv head, so that
// consecutive tasks on every thread read the same kv head's tiles. The smallest tasks of the last
// kv head come last, which keeps the dynamic balance.
struct ForwardOrder {
  int64_t g0, q_tiles, group;  // group: query heads per kv head
  // Task `task` in [0, kv heads of the chunk x group x q_tiles) -> query head h and q-tile qi.
  void at(int64_t task, int64_t& h, int64_t& qi) const {
    const int64_t per_g = q_tiles * group, r = task % per_g;
    h = (g0 + task / per_g) * group + r % group;
    qi = q_tiles - 1 - r / group;
  }
};

// Runs run(w, h, qi, next_h, next_qi) (forward_task or forward_task_bf16 with the thread's
// workspace w) over `tasks` tasks in `order`, dynamic balance, each thread claiming its next task
// before it runs the current one (so that the current one can prefetch the next one's operands;
// next_qi < 0: none).
template <class Run>
void run_forward_tasks(const ForwardOrder& order, std::vector<Workspace>& ws, int64_t tasks,
                       int threads, const Run& run) {
  std::atomic<int64_t> claimed{0};
#pragma omp parallel num_threads(threads)
  {
    Workspace& w = ws[static_cast<size_t>(omp_get_thread_num())];
    for (int64_t task = claimed.fetch_add(1); task < tasks;) {
      const int64_t next = claimed.fetch_add(1);
      int64_t h = 0, qi = 0, next_h = 0, next_qi = -1;
      order.at(task, h, qi);
      if (next < tasks) order.at(next, next_h, next_qi);
      run(w, h, qi, next_h, next_qi);
      task = next;
    }
  }
}

template <class T>
KernelStats attend_impl(StateView st, View3<const T> q, View3<const T> k, View3<const T> v,
                        Tokens qt, Tokens kt, const KernelConfig& cfg) {
  kernels::check_qkv(q, k, v, qt, kt);
  check_attend(st, q.s, q.h, q.d, cfg);

  const TileOps& ops = kernels::select_ops();
  const KernelConfig wcfg = work_config(cfg, ops, q.s, k.s);
  const TilePlan plan =
      plan_tiles(qt, kt, cfg.mask, wcfg.block_q, wcfg.block_k, thread_count(cfg, qt.n));
  const KernelStats stats = accounting_stats(plan, qt, kt, cfg, q.h);
  const int64_t group = q.h / k.h;
  const int threads = thread_count(cfg, q.h * plan.q_tiles);
  const TileDims dims = tile_dims(wcfg, q.d, q.s, k.s);
  // The packed block's element: fp32, or for bf16 storage bf16 bits (pairs or panels).
  using E = std::conditional_t<std::is_same_v<T, bf16>, uint16_t, float>;
  const int64_t chunk =
      attend_kv_chunk_heads(k.h, std::max<int64_t>(1, PackedKvTiles<E>::head_bytes(plan, dims)));
  std::vector<Workspace> ws;
  ws.reserve(static_cast<size_t>(threads));
  // bf16 dot products: q, k and v lifted where they are small (bf16_lift); none otherwise.
  Bf16Lift lift;
  if constexpr (std::is_same_v<T, bf16>) {
    if (ops.gemm_bf16 != nullptr) lift = bf16_lift(q, k, v, nullptr, cfg.scale);
  }
  // Packs each chunk of kv heads with pack(g0, heads, threads) and runs its tasks in ForwardOrder
  // by task(args, w, h, qi, next_h, next_qi) (run_forward_tasks).
  const auto each_chunk = [&](const auto& pack, const auto& task) {
    for (int64_t g0 = 0; g0 < k.h; g0 += chunk) {
      const int64_t heads = std::min(chunk, k.h - g0), tasks = heads * group * plan.q_tiles;
      if (tasks == 0) return;  // no query rows: nothing to pack
      const int team = static_cast<int>(std::min<int64_t>(threads, tasks));
      const auto packed = pack(g0, heads, team);
      const ForwardArgs<T, typename std::decay_t<decltype(packed)>::Element> args{
          st, q, k, v, qt, kt, &wcfg, &plan, dims, &packed, &ops, lift};
      run_forward_tasks(ForwardOrder{g0, plan.q_tiles, group}, ws, tasks, team,
                        [&](Workspace& w, int64_t h, int64_t qi, int64_t nh, int64_t nqi) {
                          task(args, w, h, qi, nh, nqi);
                        });
    }
  };
  if constexpr (std::is_same_v<T, bf16>) {
    if (ops.gemm_bf16 != nullptr) {  // bf16 dot products (vdpbf16ps), fp32 softmax and acc
      for (int i = 0; i < threads; ++i) ws.emplace_back(dims, false, KvStore::kBf16Pairs);
      each_chunk([&](int64_t g0, int64_t heads,
                     int team) { return pack_kv_pairs(k, v, g0, heads, plan, dims, team, lift); },
                 [](const auto& args, Workspace& w, int64_t h, int64_t qi, int64_t, int64_t) {
                   forward_task_bf16(args, h, qi, w);
                 });
      return stats;
    }
  }
  // fp32 tiles, or for bf16 storage bf16 panels widened inside the GEMMs (half the bytes).
  for (int i = 0; i < threads; ++i)
    ws.emplace_back(dims, false, std::is_same_v<T, bf16> ? KvStore::kBf16Panels : KvStore::kFp32);
  each_chunk([&](int64_t g0, int64_t heads,
                 int team) { return pack_kv<E>(k, v, g0, heads, plan, dims, team); },
             [](const auto& args, Workspace& w, int64_t h, int64_t qi, int64_t nh, int64_t nqi) {
               forward_task(args, h, qi, w, nh, nqi);
             });
  return stats;
}

inline void store(float* dst, float x) {
  *dst = x;
}
inline void store(bf16* dst, float x) {
  *dst = to_bf16(x);
}

template <class T>
void finish_impl(StateView st, View3<T> out, float* lse, int64_t lse_stride) {
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
      T* o = out.row(i, h);
      if (l == 0.0f) {
        // A row that saw no key has m = -inf: out 0, lse -inf. A row whose scores overflowed
        // (m = +inf or NaN, so every exp(s - m) was 0 or NaN) has no finite answer in fp32: it
        // is NaN, never a plausible-looking 0, so the callers' non-finite checks see it.
        const bool saw_no_key = st.m[h * st.ml_stride + i] == kNegInf;
        const float fill = saw_no_key ? 0.0f : std::numeric_limits<float>::quiet_NaN();
        for (int64_t d = 0; d < st.dim; ++d) store(o + d, fill);
        lse[h * lse_stride + i] = saw_no_key ? kNegInf : fill;
        continue;
      }
      const float inv_l = 1.0f / l;
      for (int64_t d = 0; d < st.dim; ++d) store(o + d, acc[d] * inv_l);
      // m is in base-2 units (to_base2): lse = m ln 2 + log(l), rounded once.
      const double m = st.m[h * st.ml_stride + i];
      lse[h * lse_stride + i] = static_cast<float>(m * kLn2 + std::log(static_cast<double>(l)));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward entry points.

template <class T>
void compute_delta_impl(View3<const T> out, View3<const T> dout, float* delta, int64_t stride) {
  kernels::check_view(out, "out");
  kernels::check_view(dout, "dout");
  kernels::check_same_shape(out, dout, "out and dout");
  LOOM_CHECK(out.s == 0 || delta != nullptr, InvalidArgument, "delta must not be null");
  LOOM_CHECK_GE(stride, out.s, InvalidArgument, "delta stride too small");
  const TileOps& ops = kernels::select_ops();
  if constexpr (std::is_same_v<T, bf16>) {
    if (ops.dot_bf16 != nullptr) {
      // The bf16-dot backward computes dp = dout v^T by gemm_bf16 on the bf16 values: delta is
      // its chain for one element (TileOps::dot_bf16), on rows padded to an even length, with
      // dout and out lifted as the backward lifts dout and v (bf16_lift: delta cancels dp
      // bitwise where out is one v row and nothing flushes), the lifts taken back out by one
      // exact factor as the dp GEMM's alpha does.
      const int64_t n2 = (out.d + 1) / 2;
      const int g_lift = lift_exponent(max_abs_bits(dout, pow2_bits(kLiftFloorExp)));
      const int o_lift = lift_exponent(max_abs_bits(out, pow2_bits(kLiftFloorExp)));
      const float unlift = std::ldexp(1.0f, -(g_lift + o_lift));
      std::vector<uint16_t> o16(static_cast<size_t>(2 * n2), 0), g16(o16.size(), 0);
      for (int64_t i = 0; i < out.s; ++i) {
        for (int64_t h = 0; h < out.h; ++h) {
          for (int64_t d = 0; d < out.d; ++d) {
            o16[d] = out.row(i, h)[d].bits;
            g16[d] = dout.row(i, h)[d].bits;
          }
          lift_bits(o16.data(), out.d, o_lift);
          lift_bits(g16.data(), out.d, g_lift);
          delta[h * stride + i] = ops.dot_bf16(g16.data(), o16.data(), n2) * unlift;
        }
      }
      return;
    }
  }
  std::vector<float> o_row(static_cast<size_t>(out.d)), g_row(static_cast<size_t>(out.d));
  for (int64_t i = 0; i < out.s; ++i) {
    for (int64_t h = 0; h < out.h; ++h) {
      const float* o;
      const float* g;
      if constexpr (std::is_same_v<T, float>) {
        o = out.row(i, h);
        g = dout.row(i, h);
      } else {  // bf16: widened exactly, as attend_backward widens dout and v
        for (int64_t d = 0; d < out.d; ++d) {
          o_row[d] = to_f32(out.row(i, h)[d]);
          g_row[d] = to_f32(dout.row(i, h)[d]);
        }
        o = o_row.data();
        g = g_row.data();
      }
      // In the order (and with the fusion) in which the selected path's GEMM accumulates
      // dp = dout v^T: a row whose probability sits on one key (out = v_j) then gets
      // dp_j - delta = 0 exactly rather than rounding noise that ds = p (dp - delta) would turn
      // into a gradient. attend_backward must run on the same path (same LOOM_KERNEL).
      delta[h * stride + i] = ops.dot(o, g, out.d);
    }
  }
}

// The backward runs one chunk of kv heads at a time on head-major copies of the chunk's query
// heads' rows: q and dout copied to [heads][Sq][D] (row stride D), and each thread's dq
// contributions accumulated in a zeroed [heads][Sq][D] buffer of its own, added into dq in thread
// order when the chunk's tasks are done. In the caller's [Sq, H, D] tensors one head's rows lie
// H D elements apart (4 KiB at H = 8, D = 128 fp32): every row of a tile is in another 4 KiB
// page. On the caller's rows the fp32 backward read 0.76-0.85 of the sgemm at H = 8 and
// 0.96-1.00 at H = 1 (rows contiguous), at Sq = 1024 to 16384; on the copies 0.94-1.01 at H = 8
// (Zen 5, docs/performance.md, round 17). The copies cost a pass over q, dout and dq per call.
// With bf16 dot products (dots: backward_task_bf16) the chunk's q and dout are also transposed
// (TransposedRows), from the copies. A chunk holds as many kv heads as fit in
// kBackwardChunkBytes (at least one), and at least enough for two tasks per thread
// (attend_backward_chunk_heads); the chunk's buffers are one KvStorage (kept by the calling
// thread between calls where they fit).
template <class T>
void backward_in_head_chunks(const BackwardArgs<T>& a, std::vector<Workspace>& ws, int threads,
                             bool dots, View3<float> dq) {
  const int64_t group = a.q.h / a.k.h, sq = a.q.s, dim = a.q.d, k_tiles = a.plan->k_tiles;
  if (sq == 0 || k_tiles == 0) return;
  const int64_t head_elems = sq * dim;  // one query head's rows
  const int64_t sp = a.plan->q_tiles * a.dims.bq;
  const int64_t transposed_elems = dots ? 2 * TransposedRows::elements(1, sp, a.dims) : 0;
  const int64_t chunk = attend_backward_chunk_heads(
      a.k.h,
      group * (head_elems * static_cast<int64_t>(2 * sizeof(T) + sizeof(float) * threads) +
               transposed_elems * 2),
      k_tiles, threads);
  const int64_t chunk_elems = chunk * group * head_elems;
  // q and dout (T), the threads' dq buffers (fp32), the transposed q and dout (bf16 bits), each
  // 64-byte aligned.
  const int64_t rows_bytes = round_up(chunk_elems * static_cast<int64_t>(sizeof(T)), 64);
  const int64_t dq_bytes = threads * chunk_elems * 4;
  const KvStorage storage(
      static_cast<size_t>(2 * rows_bytes + dq_bytes + chunk * group * transposed_elems * 2));
  T* q_rows = reinterpret_cast<T*>(storage.get());
  T* dout_rows = reinterpret_cast<T*>(storage.get() + rows_bytes);
  float* dq_rows = reinterpret_cast<float*>(storage.get() + 2 * rows_bytes);
  uint16_t* transposed = reinterpret_cast<uint16_t*>(storage.get() + 2 * rows_bytes + dq_bytes);

  for (int64_t g0 = 0; g0 < a.k.h; g0 += chunk) {
    const int64_t heads = std::min(chunk, a.k.h - g0), h0 = g0 * group, nq = heads * group;
    const int64_t tasks = heads * k_tiles;
    const auto head_major = [&](auto* p) {
      return View3<std::remove_pointer_t<decltype(p)>>{p, sq, nq, dim, dim, head_elems};
    };
    BackwardArgs<T> c = a;
    c.q = head_major(q_rows);
    c.dout = head_major(dout_rows);
    c.k = a.k.heads(g0, heads);
    c.v = a.v.heads(g0, heads);
    c.dk = a.dk.heads(g0, heads);
    c.dv = a.dv.heads(g0, heads);
    c.lse = a.lse + h0 * a.ml_stride;
    c.delta = a.delta + h0 * a.ml_stride;
    const int team_size = static_cast<int>(std::min<int64_t>(threads, tasks));
#pragma omp parallel for schedule(static) num_threads(team_size)
    for (int64_t i = 0; i < sq; ++i) {
      for (int64_t h = 0; h < nq; ++h) {
        std::memcpy(q_rows + h * head_elems + i * dim, a.q.row(i, h0 + h), dim * sizeof(T));
        std::memcpy(dout_rows + h * head_elems + i * dim, a.dout.row(i, h0 + h), dim * sizeof(T));
      }
    }
    if constexpr (std::is_same_v<T, bf16>) {  // the bf16-dot backward's lifts (bf16_lift)
      if (dots && (a.lift.q != 0 || a.lift.dout != 0)) {
#pragma omp parallel for schedule(static) num_threads(team_size)
        for (int64_t h = 0; h < nq; ++h) {
          lift_bits(reinterpret_cast<uint16_t*>(q_rows) + h * head_elems, head_elems, a.lift.q);
          lift_bits(reinterpret_cast<uint16_t*>(dout_rows) + h * head_elems, head_elems,
                    a.lift.dout);
        }
      }
    }
    std::optional<TransposedRows> tr;
    if constexpr (std::is_same_v<T, bf16>) {
      if (dots) tr.emplace(c.q, c.dout, sp, a.dims, team_size, transposed);
    }
#pragma omp parallel num_threads(team_size)
    {
      const int tid = omp_get_thread_num(), team = omp_get_num_threads();
      const View3<float> sink = head_major(dq_rows + tid * nq * head_elems);
      std::fill(sink.data, sink.data + nq * head_elems, 0.0f);
      // Round robin over (kv head, k-tile), kv head outermost. Causal k-tiles differ in work, and
      // neighbouring k-tiles go to different threads; a static schedule keeps the dq sums
      // deterministic (thread t runs tasks t, t + team, ...: schedule(static, 1), spelt out so
      // that each task knows the thread's next one).
      Workspace& w = ws[static_cast<size_t>(tid)];
      for (int64_t task = tid; task < tasks; task += team) {
        const int64_t next = task + team;
        if constexpr (std::is_same_v<T, bf16>) {
          if (dots) {
            backward_task_bf16(c, *tr, task / k_tiles, task % k_tiles, w, sink);
            continue;
          }
        }
        backward_task(c, task / k_tiles, task % k_tiles, w, sink, next < tasks ? next / k_tiles : 0,
                      next < tasks ? next % k_tiles : -1);
      }
#pragma omp barrier
#pragma omp for schedule(static)
      for (int64_t i = 0; i < sq; ++i) {
        for (int64_t h = 0; h < nq; ++h) {
          float* out = dq.row(i, h0 + h);
          for (int t = 0; t < team; ++t) {
            const float* in = dq_rows + (t * nq + h) * head_elems + i * dim;
            for (int64_t d = 0; d < dim; ++d) out[d] += in[d];
          }
        }
      }
    }
  }
}

template <class T>
KernelStats attend_backward_impl(View3<const T> q, View3<const T> k, View3<const T> v,
                                 View3<const T> dout, const float* lse, const float* delta,
                                 int64_t ml_stride, Tokens qt, Tokens kt, const KernelConfig& cfg,
                                 View3<float> dq, View3<float> dk, View3<float> dv) {
  kernels::check_qkv(q, k, v, qt, kt);
  check_config(cfg);
  kernels::check_view(dout, "dout");
  kernels::check_view(dq, "dq");
  kernels::check_view(dk, "dk");
  kernels::check_view(dv, "dv");
  kernels::check_same_shape(dout, q, "dout and q");
  const auto shape_of = [](const auto& x) {
    return View3<const float>{nullptr, x.s, x.h, x.d, 0, 0};
  };
  kernels::check_same_shape(View3<const float>(dq), shape_of(q), "dq and q");
  kernels::check_same_shape(View3<const float>(dk), shape_of(k), "dk and k");
  kernels::check_same_shape(View3<const float>(dv), shape_of(v), "dv and v");
  LOOM_CHECK(q.s == 0 || (lse != nullptr && delta != nullptr), InvalidArgument,
             "lse and delta must not be null");
  LOOM_CHECK_GE(ml_stride, q.s, InvalidArgument, "lse/delta stride too small");
  const TileOps& ops = kernels::select_ops();
  const KernelConfig wcfg = work_config(cfg, ops, q.s, k.s);
  const TilePlan plan =
      plan_tiles(qt, kt, cfg.mask, wcfg.block_q, wcfg.block_k, thread_count(cfg, qt.n));
  const KernelStats stats = accounting_stats(plan, qt, kt, cfg, q.h);
  const int threads = thread_count(cfg, k.h * plan.k_tiles);
  // bf16 storage on a path with bf16 dot products: backward_task_bf16, on operands lifted where
  // they are small (bf16_lift).
  const bool dots = std::is_same_v<T, bf16> && ops.gemm_bf16 != nullptr;
  Bf16Lift lift;
  if constexpr (std::is_same_v<T, bf16>) {
    if (dots) lift = bf16_lift(q, k, v, &dout, cfg.scale, delta, ml_stride);
  }
  const BackwardArgs<T> args{q,         k,  v,    dout,  lse,   delta,
                             ml_stride, qt, kt,   &wcfg, &plan, tile_dims(wcfg, q.d, q.s, k.s),
                             dk,        dv, &ops, lift};
  std::vector<Workspace> ws;
  ws.reserve(static_cast<size_t>(threads));
  for (int i = 0; i < threads; ++i)
    ws.emplace_back(args.dims, true, dots ? KvStore::kBf16Pairs : KvStore::kFp32);
  backward_in_head_chunks(args, ws, threads, dots, dq);
  return stats;
}

}  // namespace

int64_t attend_kv_chunk_heads(int64_t kv_heads, int64_t bytes_per_kv_head) {
  LOOM_CHECK_GE(kv_heads, 1, InvalidArgument, "kv_heads must be >= 1");
  LOOM_CHECK_GE(bytes_per_kv_head, 1, InvalidArgument, "bytes_per_kv_head must be >= 1");
  return std::clamp<int64_t>(kAttendChunkBytes / bytes_per_kv_head, 1, kv_heads);
}

int64_t attend_backward_chunk_heads(int64_t kv_heads, int64_t bytes_per_kv_head, int64_t k_tiles,
                                    int threads) {
  LOOM_CHECK_GE(kv_heads, 1, InvalidArgument, "kv_heads must be >= 1");
  LOOM_CHECK_GE(bytes_per_kv_head, 1, InvalidArgument, "bytes_per_kv_head must be >= 1");
  LOOM_CHECK_GE(k_tiles, 1, InvalidArgument, "k_tiles must be >= 1");
  LOOM_CHECK_GE(threads, 1, InvalidArgument, "threads must be >= 1");
  const int64_t by_bytes = kBackwardChunkBytes / bytes_per_kv_head;
  const int64_t by_tasks = (2 * int64_t{threads} + k_tiles - 1) / k_tiles;
  return std::clamp<int64_t>(std::max(by_bytes, by_tasks), 1, kv_heads);
}

// Mirrors what the calls allocate (tests/unit/test_kernel_memory.cc holds it to their measured
// peak): attend_impl's and attend_backward_impl's workspaces and tile plans, and the copies of
// pack_kv (PackedKvTiles) and backward_in_head_chunks, which live in one KvStorage at a time.
// The workspaces, plans and the forward's copy grow with the rows, so a smaller call is bounded
// by the same terms: a chunk function's result times its bytes per kv head is at most the larger
// of its byte budget and one head's bytes. The backward takes more kv heads when a call has few
// k-tiles (two tasks per thread): for every k-tile count up to 2 threads, the most query rows a
// call of at most sq x sk proportions has with that many is counted. In doubles (sizes near 2^63
// saturate instead of overflowing).
int64_t attend_workspace_bytes(int64_t sq, int64_t sk, int64_t heads, int64_t kv_heads, int64_t dim,
                               bool bf16, bool backward, const KernelConfig& cfg) {
  LOOM_CHECK(sq >= 0 && sk >= 0, InvalidArgument,
             "attend_workspace_bytes: rows must be >= 0, got sq " << sq << ", sk " << sk);
  LOOM_CHECK(heads >= 1 && kv_heads >= 1 && heads % kv_heads == 0, InvalidArgument,
             "attend_workspace_bytes: heads " << heads << " must be a multiple of kv_heads "
                                              << kv_heads << " (both >= 1)");
  LOOM_CHECK(dim >= 1 && dim <= kMaxHeadDim, InvalidArgument,
             "attend_workspace_bytes: dim must be in [1, " << kMaxHeadDim << "], got " << dim);
  KernelConfig checked = cfg;  // the sizes only: the mask and scale are not read
  checked.mask = Mask{};
  checked.scale = 1.0f;
  check_config(checked);
  const TileOps& ops = kernels::select_ops();
  const bool dots = bf16 && ops.gemm_bf16 != nullptr;
  const KernelConfig w = work_config(cfg, ops, sq, sk);
  const TileDims t = tile_dims(w, dim, sq, sk);
  const double q_tiles = double(tile_count(sq, w.block_q)),
               k_tiles = double(tile_count(sk, w.block_k));
  const double wanted = cfg.threads > 0 ? cfg.threads : omp_get_max_threads();
  const auto team = [&](double tasks) { return std::max(1.0, std::min(wanted, tasks)); };
  const double H = double(heads), HKV = double(kv_heads), D = double(dim), T = bf16 ? 2 : 4;
  // The work tiles' plan, and the config tiles' one that accounting_stats makes when they differ.
  const double range = double(sizeof(TileRange));
  double plans = q_tiles * k_tiles + k_tiles * range;
  if (w.block_q != cfg.block_q || w.block_k != cfg.block_k) {
    const double cq = double(tile_count(sq, cfg.block_q)), ck = double(tile_count(sk, cfg.block_k));
    plans += cq * ck + ck * range;
  }
  // One Workspace (its constructor's buffers) per thread of the call.
  const auto workspace = [&](bool bw, KvStore kv) {
    const double qd = double(t.bq * t.dp), kd = double(t.bk * t.dp), qk = double(t.bq * t.bk);
    double b =
        double(sizeof(Workspace)) + 4 * (2 * qd + qk + 2 * double(t.bq)) + 12 * double(t.bq + t.bk);
    if (kv == KvStore::kBf16Pairs) b += 2 * (qd + qk);
    if (kv == KvStore::kBf16Panels) b += 4 * 2 * double(std::max(t.bk, t.dp) * kNr);
    if (bw && kv == KvStore::kBf16Pairs) b += 2 * (3 * kd + qd + qk) + 4 * (qk + 2 * kd);
    if (bw && kv != KvStore::kBf16Pairs) b += 4 * (5 * kd + 3 * qd + qk);
    return b;
  };
  const double forward_ws = team(H * q_tiles) * workspace(false, dots   ? KvStore::kBf16Pairs
                                                                 : bf16 ? KvStore::kBf16Panels
                                                                        : KvStore::kFp32);
  // pack_kv's copy: attend_kv_chunk_heads kv heads of head_bytes each.
  const double head_bytes = 2 * k_tiles * double(t.dp * t.bk) * T;
  const double forward_copy =
      std::min(HKV * head_bytes, std::max(double(kAttendChunkBytes), head_bytes));
  double backward_ws = 0, backward_copy = 0;
  if (backward) {
    const double threads = team(HKV * k_tiles), group = H / HKV;
    backward_ws = threads * workspace(true, dots ? KvStore::kBf16Pairs : KvStore::kFp32);
    // backward_in_head_chunks: q and dout, each thread's dq and (dots) the transposed q and dout
    // (padded to whole q-tiles) of a chunk's query heads; q's and dout's parts are each rounded
    // up to 64 bytes.
    const auto per_head = [&](double rows, double thr) {
      // the q-tiles of a call on n rows (rows near 2^63 round up to 2^63 as a double, whose
      // conversion overflowed: sq = 2^63 - 1 was an internal error, "n must be >= 0")
      const int64_t n = rows >= 0x1p63 ? INT64_MAX : static_cast<int64_t>(rows);
      const KernelConfig wn = work_config(cfg, ops, n, sk);
      const double sp = double(tile_count(n, wn.block_q)) * double(tile_dims(wn, dim, n, sk).bq);
      const double transposed = dots ? 2.0 * double(t.dp) * (sp + TransposedRows::kSkew) : 0;
      return group * (rows * D * (2 * T + 4 * thr) + 2 * transposed);
    };
    const auto rounding = [&](double rows) {
      return rows == double(sq) && std::fmod(group * rows * D * T, 64.0) == 0 ? 0.0 : 128.0;
    };
    const double whole = per_head(double(sq), threads);
    backward_copy =
        std::min(HKV * whole, std::max(double(kBackwardChunkBytes), whole)) + rounding(double(sq));
    for (double tiles = 1; tiles <= std::min(k_tiles, 2 * threads); ++tiles) {
      const double rows = std::min(
          double(sq), std::ceil((tiles * double(w.block_k) + 1) * double(sq) / double(sk)));
      const double thr = team(HKV * tiles);
      const double by_tasks = std::min(HKV, std::ceil(2 * thr / tiles));
      backward_copy = std::max(backward_copy, by_tasks * per_head(rows, thr) + rounding(rows));
    }
  }
  // KvStorage: a copy of at most kKeptBytes replaces the thread's kept one if larger (else reuses
  // it); a larger one is allocated besides it. The kept one is the largest such copy so far.
  const double kept_limit = double(KvStorage::kKeptBytes);
  const double kept =
      std::max(std::min(forward_copy, kept_limit), std::min(backward_copy, kept_limit));
  const auto with_copy = [&](double copy) {
    return copy <= kept_limit ? std::max(kept, copy) : kept + copy;
  };
  double peak = plans + forward_ws + with_copy(forward_copy);
  if (backward) peak = std::max(peak, plans + backward_ws + with_copy(backward_copy));
  const double most = double(std::numeric_limits<int64_t>::max());
  return peak >= most ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(peak);
}

namespace {

// The public calls' allocations (workspaces, packed tiles: outside their OpenMP regions) failing:
// OutOfMemory, as error.h promises, not std::bad_alloc (which a caller catching loom::Error did
// not catch).
template <class Call>
KernelStats out_of_memory_named(const char* what, const Call& call) {
  try {
    return call();
  } catch (const std::bad_alloc&) {
    std::ostringstream os;
    os << what << ": out of memory for the kernels' workspace (attend_workspace_bytes gives what "
       << "a call needs)";
    throw OutOfMemory(os.str(), __FILE__, __LINE__);
  }
}

}  // namespace

KernelStats attend(StateView st, View3<const float> q, View3<const float> k, View3<const float> v,
                   Tokens qt, Tokens kt, const KernelConfig& cfg) {
  return out_of_memory_named("attend", [&] { return attend_impl(st, q, k, v, qt, kt, cfg); });
}

KernelStats attend(StateView st, View3<const bf16> q, View3<const bf16> k, View3<const bf16> v,
                   Tokens qt, Tokens kt, const KernelConfig& cfg) {
  return out_of_memory_named("attend", [&] { return attend_impl(st, q, k, v, qt, kt, cfg); });
}

void finish(StateView st, View3<float> out, float* lse, int64_t lse_stride) {
  finish_impl(st, out, lse, lse_stride);
}

void finish(StateView st, View3<bf16> out, float* lse, int64_t lse_stride) {
  finish_impl(st, out, lse, lse_stride);
}

void compute_delta(View3<const float> out, View3<const float> dout, float* delta, int64_t stride) {
  compute_delta_impl(out, dout, delta, stride);
}

void compute_delta(View3<const bf16> out, View3<const bf16> dout, float* delta, int64_t stride) {
  compute_delta_impl(out, dout, delta, stride);
}

KernelStats attend_backward(View3<const float> q, View3<const float> k, View3<const float> v,
                            View3<const float> dout, const float* lse, const float* delta,
                            int64_t ml_stride, Tokens qt, Tokens kt, const KernelConfig& cfg,
                            View3<float> dq, View3<float> dk, View3<float> dv) {
  return out_of_memory_named("attend_backward", [&] {
    return attend_backward_impl(q, k, v, dout, lse, delta, ml_stride, qt, kt, cfg, dq, dk, dv);
  });
}

KernelStats attend_backward(View3<const bf16> q, View3<const bf16> k, View3<const bf16> v,
                            View3<const bf16> dout, const float* lse, const float* delta,
                            int64_t ml_stride, Tokens qt, Tokens kt, const KernelConfig& cfg,
                            View3<float> dq, View3<float> dk, View3<float> dv) {
  return out_of_memory_named("attend_backward", [&] {
    return attend_backward_impl(q, k, v, dout, lse, delta, ml_stride, qt, kt, cfg, dq, dk, dv);
  });
}

int64_t work_tile_side(int64_t block, int64_t n, int64_t want) {
  LOOM_CHECK_GE(block, 1, InvalidArgument, "work_tile_side: block must be >= 1");
  LOOM_CHECK_GE(n, 0, InvalidArgument, "work_tile_side: n must be >= 0");
  if (want <= 0) return block;
  // never more blocks than the n rows have, nor more than int64 holds (want and n near 2^63
  // overflowed block * factor)
  const int64_t factor = std::min(
      {tile_count(want, block), tile_count(n, block), std::numeric_limits<int64_t>::max() / block});
  return block * std::max<int64_t>(1, factor);
}

const char* kernel_path() {
  return kernels::select_ops().name;
}

bool kernel_path_bf16_dots() {
  return kernels::select_ops().gemm_bf16 != nullptr;
}

}  // namespace loom
