// Exact work at tile granularity: the chunks of every layout and the tile count of one kernel
// call, in closed form.
//
// Chunks. The same rule as ShardPlan::make (src/cp/layout.cc): a run of L tokens cut into c
// pieces gives the first L mod c pieces one more token; contiguous cuts every document in P,
// zigzag in 2P (rank r takes pieces r and 2P-1-r), stripe gives token t to rank t mod P (one
// chunk of stride P per document and rank). Nothing per token is built, so S = 1M on 1024 ranks
// costs a few thousand chunks.
//
// Tiles. A kernel call over q rows and k rows cuts them into q-tiles of block_q rows and
// k-tiles of block_k rows (src/kernels/blockwise.cc). A tile is computed unless no (query, key)
// pair in it is visible. Inside one chunk the positions are first + stride * a, so the
// difference of a query row a and a key row b is d = c + stride * (a - b) with c = q.first -
// k.first, and the mask allows d in [d_lo, d_hi] (causal: d >= 0; window W: |d| < W). The pairs
// of a tile realise every integer m = a - b in [a0 - b1, a1 - b0], so a tile is non-empty iff
// that interval meets the allowed m range [m_lo, m_hi], and full iff it lies inside it: the same
// verdict as the kernel's per-element check, for every k-tile of a q-tile at once (the non-empty
// k-tiles of a q-tile are one interval). The cp layer first skips chunk pairs whose documents
// differ or whose position ranges the mask separates (segment_pair_empty in src/cp/ring.cc).
#include <algorithm>
#include <limits>

#include "loom/error.h"
#include "loom/plan.h"
#include "sim.h"

namespace loom::plan {

namespace {

int64_t piece_begin(int64_t len, int64_t n, int64_t c) {
  const int64_t base = len / n, extra = len % n;
  return c * base + std::min(c, extra);
}

int64_t floor_div(int64_t a, int64_t b) {  // b > 0
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}
int64_t ceil_div(int64_t a, int64_t b) {  // b > 0
  return -floor_div(-a, b);
}

constexpr int64_t kInf = int64_t{1} << 60;
// count_tiles' positions are below this (so their differences, and those of the mask's
// bounds, stay far from kInf and from int64's limits).
constexpr int64_t kMaxPos = int64_t{1} << 56;

}  // namespace

std::vector<std::vector<Chunk>> shard_chunks(Layout layout, int64_t seq, int ranks,
                                             const std::vector<int64_t>& doc_lengths) {
  LOOM_CHECK(seq >= 1, InvalidArgument, "sequence length must be >= 1, got " << seq);
  LOOM_CHECK(ranks >= 1, InvalidArgument, "ranks must be >= 1, got " << ranks);
  // As ShardPlan::make: a Layout outside the enumeration (a cast integer) matched no case below
  // and gave every rank no chunks, which simulated zero work.
  LOOM_CHECK(
      layout == Layout::contiguous || layout == Layout::zigzag || layout == Layout::stripe,
      InvalidArgument,
      "layout must be contiguous, zigzag or stripe, got the value " << static_cast<int>(layout));
  const std::vector<int64_t> docs = checked_doc_lengths(seq, doc_lengths);
  std::vector<std::vector<Chunk>> out(ranks);
  auto add = [&](int r, int64_t first, int64_t stride, int64_t count, int32_t doc) {
    if (count > 0) out[r].push_back(Chunk{first, stride, count, doc});
  };
  int64_t start = 0;
  for (size_t d = 0; d < docs.size(); ++d) {
    const int64_t len = docs[d];
    const int32_t doc = static_cast<int32_t>(d);
    for (int r = 0; r < ranks; ++r) {
      switch (layout) {
        case Layout::contiguous: {
          const int64_t b = piece_begin(len, ranks, r), e = piece_begin(len, ranks, r + 1);
          add(r, start + b, 1, e - b, doc);
          break;
        }
        case Layout::zigzag:
          for (int64_t c : {static_cast<int64_t>(r), static_cast<int64_t>(2 * ranks - 1 - r)}) {
            const int64_t b = piece_begin(len, 2 * ranks, c),
                          e = piece_begin(len, 2 * ranks, c + 1);
            add(r, start + b, 1, e - b, doc);
          }
          break;
        case Layout::stripe: {
          // First g >= start with g mod P == r, then every P-th token up to start + len.
          const int64_t first = start + ((r - start % ranks) % ranks + ranks) % ranks;
          const int64_t count = first < start + len ? (start + len - 1 - first) / ranks + 1 : 0;
          add(r, first, ranks, count, doc);
          break;
        }
      }
    }
    start += len;
  }
  return out;
}

bool count_tiles_or_loop(const Chunk& q, const Chunk& k, const Mask& mask, int64_t block_q,
                         int64_t block_k, TileCount& tc, TileLoop& loop) {
  // block 0 looped forever, stride 0 divided by zero, and positions near 2^63 overflowed.
  LOOM_CHECK(
      block_q >= 1 && block_k >= 1, InvalidArgument,
      "count_tiles: block_q and block_k must be >= 1, got " << block_q << " and " << block_k);
  LOOM_CHECK(mask.window >= 0, InvalidArgument,
             "count_tiles: mask window must be >= 0 (0: unlimited), got " << mask.window);
  for (const auto& [name, c] : {std::pair<const char*, const Chunk*>{"q", &q}, {"k", &k}}) {
    LOOM_CHECK(c->stride >= 1 && c->count >= 0 && c->first >= 0, InvalidArgument,
               "count_tiles: " << name
                               << " chunk needs stride >= 1, count >= 0 and first >= 0, got "
                               << c->first << "+" << c->stride << "x" << c->count);
    LOOM_CHECK(
        c->count == 0 || c->first + static_cast<__int128>(c->stride) * (c->count - 1) < kMaxPos,
        InvalidArgument,
        "count_tiles: " << name << " chunk " << c->first << "+" << c->stride << "x" << c->count
                        << " has positions at or past 2^56 = " << kMaxPos);
  }
  LOOM_CHECK(q.count <= 1 || k.count <= 1 || q.stride == k.stride, InvalidArgument,
             "count_tiles: q and k chunks of more than one row need the same stride, got "
                 << q.stride << " and " << k.stride);
  tc = TileCount{};
  // The cp layer's chunk-pair skip.
  if (q.count == 0 || k.count == 0 || q.doc != k.doc) return false;
  if (mask.causal && k.first > q.last()) return false;
  if (mask.window > 0 && std::max(k.first - q.last(), q.first - k.last()) >= mask.window)
    return false;
  // Allowed d = pos_q - pos_k.
  // A window wider than every position difference is no limit (and would overflow below).
  const int64_t window = mask.window >= kMaxPos ? 0 : mask.window;
  const int64_t d_lo = mask.causal ? 0 : window > 0 ? -(window - 1) : -kInf;
  const int64_t d_hi = window > 0 ? window - 1 : kInf;
  const int64_t stride = q.count > 1 ? q.stride : k.stride;
  const int64_t c = q.first - k.first;
  // Allowed m = a - b: d_lo <= c + stride m <= d_hi.
  const int64_t m_lo = d_lo == -kInf ? -kInf : ceil_div(d_lo - c, stride);
  const int64_t m_hi = d_hi == kInf ? kInf : floor_div(d_hi - c, stride);
  const int64_t qn = q.count, kn = k.count;
  const int64_t k_tiles = (kn + block_k - 1) / block_k;
  // Whole pair full: every m in [-(kn - 1), qn - 1] allowed.
  if (m_lo <= -(kn - 1) && qn - 1 <= m_hi) {
    const int64_t q_tiles = (qn + block_q - 1) / block_q;
    tc.full = q_tiles * k_tiles;
    return false;
  }
  if (m_lo > m_hi) return false;
  loop = TileLoop{qn, kn, m_lo, m_hi, block_q, block_k};
  return true;
}

TileCount tile_loop(const TileLoop& l) {
  const int64_t qn = l.qn, kn = l.kn, m_lo = l.m_lo, m_hi = l.m_hi;
  const int64_t block_q = l.block_q, block_k = l.block_k;
  const int64_t k_tiles = (kn + block_k - 1) / block_k;
  TileCount tc;
  for (int64_t a0 = 0; a0 < qn; a0 += block_q) {
    const int64_t a1 = std::min(a0 + block_q, qn) - 1;
    // Non-empty: b1 >= a0 - m_hi and b0 <= a1 - m_lo.
    const int64_t x = m_hi >= kInf / 2 ? -kInf : a0 - m_hi;
    const int64_t y = m_lo <= -kInf / 2 ? kInf : a1 - m_lo;
    if (x > kn - 1 || y < 0) continue;
    const int64_t j_lo = x <= 0 ? 0 : x / block_k;
    const int64_t j_hi = std::min(y / block_k, k_tiles - 1);
    if (j_hi < j_lo) continue;
    const int64_t nonempty = j_hi - j_lo + 1;
    // Full: b0 >= a1 - m_hi and b1 <= a0 - m_lo.
    const int64_t yf = m_hi >= kInf / 2 ? -kInf : a1 - m_hi;
    const int64_t xf = m_lo <= -kInf / 2 ? kInf : a0 - m_lo;
    int64_t full = 0;
    if (xf >= 0) {
      const int64_t f_lo = yf <= 0 ? 0 : ceil_div(yf, block_k);
      const int64_t f_hi = kn - 1 <= xf ? k_tiles - 1 : (xf + 1) / block_k - 1;
      full = std::max<int64_t>(0, f_hi - f_lo + 1);
    }
    tc.full += full;
    tc.partial += nonempty - full;
  }
  return tc;
}

TileCount count_tiles(const Chunk& q, const Chunk& k, const Mask& mask, int64_t block_q,
                      int64_t block_k) {
  TileCount tc;
  TileLoop loop;
  return count_tiles_or_loop(q, k, mask, block_q, block_k, tc, loop) ? tile_loop(loop) : tc;
}

}  // namespace loom::plan
