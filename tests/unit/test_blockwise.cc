// kernels: the blockwise fp32 forward and backward against the fp64 reference.
//
// A case is a problem size (S, D, H, Hkv), a mask (causal, full, window, causal window,
// documents) and a layout of the global positions of the q rows and k rows:
//   contiguous  q and k are the same block 0..S-1;
//   zigzag      shards of P = 4 ranks holding chunks r and 2P-1-r: q from rank 2, k from rank 1
//               (a ring step's block: q positions != k positions);
//   stripe      token t on rank t mod P: q from rank 1, k from rank 2;
//   random      distinct random positions in [0, 3S), unsorted, Sk = S + S/3 + 1 keys.
// Tile sizes that do not divide S (48 x 40, 16 x 24) are mixed in. The forward (out, lse) and
// the backward (dq, dk, dv) must be within kFp32RelTol of the reference (relative norm), and the
// KernelStats must match count_visible_pairs and the tile grid. Further tests: folding KV blocks
// into one state in any order, splitting the backward over KV blocks, rows without any visible
// key, threads 1 vs 2, strided views and sub-states, and the argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "loom/attention.h"
#include "loom/error.h"
#include "loom/tensor.h"
#include "unit/tolerance.h"

namespace loom {
namespace {

using test::kFp32RelTol;
using test::lse_rel_error;
using test::rel_error;

enum class MaskKind { kCausal, kFull, kWindow, kCausalWindow, kDocuments };
enum class Layout { kContiguous, kZigzag, kStripe, kRandom };

const char* mask_name(MaskKind m) {
  switch (m) {
    case MaskKind::kCausal:
      return "causal";
    case MaskKind::kFull:
      return "full";
    case MaskKind::kWindow:
      return "window";
    case MaskKind::kCausalWindow:
      return "causalwindow";
    case MaskKind::kDocuments:
      return "documents";
  }
  return "?";
}

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kContiguous:
      return "contiguous";
    case Layout::kZigzag:
      return "zigzag";
    case Layout::kStripe:
      return "stripe";
    case Layout::kRandom:
      return "random";
  }
  return "?";
}

struct Case {
  int64_t s, d, h, hkv;
  MaskKind mask;
  Layout layout;
  int64_t block_q = 64, block_k = 64;
  int threads = 1;
  std::string name() const {
    std::ostringstream os;
    os << "S" << s << "_D" << d << "_H" << h << "_" << hkv << "_" << mask_name(mask) << "_"
       << layout_name(layout) << "_B" << block_q << "x" << block_k << "_T" << threads;
    return os.str();
  }
};

constexpr int64_t kRanks = 4;  // P of the zigzag and stripe layouts

// Positions of rank r's zigzag shard of n tokens: chunks r and 2P-1-r of size ceil(n/2).
std::vector<int64_t> zigzag_positions(int64_t n, int64_t rank) {
  const int64_t chunk = (n + 1) / 2, first = n / 2;
  std::vector<int64_t> pos;
  for (int64_t i = 0; i < first; ++i) pos.push_back(rank * chunk + i);
  for (int64_t i = 0; i < n - first; ++i) pos.push_back((2 * kRanks - 1 - rank) * chunk + i);
  return pos;
}

std::vector<int64_t> stripe_positions(int64_t n, int64_t rank) {
  std::vector<int64_t> pos(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) pos[t] = rank + kRanks * t;
  return pos;
}

std::vector<int64_t> random_positions(int64_t n, int64_t range, uint32_t seed) {
  std::vector<int64_t> all(static_cast<size_t>(range));
  std::iota(all.begin(), all.end(), 0);
  std::mt19937 gen(seed);
  std::shuffle(all.begin(), all.end(), gen);
  all.resize(static_cast<size_t>(n));
  return all;
}

// A problem: inputs in fp32 (and the same values in fp64 for the reference) and token metadata.
struct Problem {
  int64_t sq = 0, sk = 0, d = 0, h = 0, hkv = 0;
  Mask mask;
  float scale = 0;
  Tensor<float> q, k, v, dout;
  std::vector<int64_t> qpos, kpos;
  std::vector<int32_t> qdoc, kdoc;
  bool documents = false;
  Tokens qt() const { return {qpos.data(), documents ? qdoc.data() : nullptr, sq}; }
  Tokens kt() const { return {kpos.data(), documents ? kdoc.data() : nullptr, sk}; }
};

Problem make_problem(const Case& c, uint32_t seed) {
  Problem p;
  p.sq = c.s;
  p.d = c.d;
  p.h = c.h;
  p.hkv = c.hkv;
  switch (c.layout) {
    case Layout::kContiguous:
      p.qpos.resize(static_cast<size_t>(c.s));
      std::iota(p.qpos.begin(), p.qpos.end(), 0);
      p.kpos = p.qpos;
      break;
    case Layout::kZigzag:
      p.qpos = zigzag_positions(c.s, 2);
      p.kpos = zigzag_positions(c.s, 1);
      break;
    case Layout::kStripe:
      p.qpos = stripe_positions(c.s, 1);
      p.kpos = stripe_positions(c.s, 2);
      break;
    case Layout::kRandom:
      p.qpos = random_positions(c.s, 3 * c.s, seed + 1);
      p.kpos = random_positions(c.s + c.s / 3 + 1, 3 * c.s, seed + 2);
      break;
  }
  p.sk = static_cast<int64_t>(p.kpos.size());
  int64_t span = 1;
  for (int64_t x : p.qpos) span = std::max(span, x + 1);
  for (int64_t x : p.kpos) span = std::max(span, x + 1);
  switch (c.mask) {
    case MaskKind::kCausal:
      p.mask = Mask{true, 0};
      break;
    case MaskKind::kFull:
      p.mask = Mask{false, 0};
      break;
    case MaskKind::kWindow:
      p.mask = Mask{false, std::max<int64_t>(2, span / 5)};
      break;
    case MaskKind::kCausalWindow:
      p.mask = Mask{true, std::max<int64_t>(2, span / 4)};
      break;
    case MaskKind::kDocuments:
      p.mask = Mask{true, 0};
      break;
  }
  if (c.mask == MaskKind::kDocuments) {
    // Documents are ranges of global positions with random boundaries (about 5 per sequence).
    p.documents = true;
    std::mt19937 gen(seed + 3);
    std::uniform_int_distribution<int64_t> boundary(1, span);
    std::vector<int64_t> starts = {0};
    for (int i = 0; i < 4; ++i) starts.push_back(boundary(gen));
    std::sort(starts.begin(), starts.end());
    auto doc_of = [&](int64_t pos) {
      return static_cast<int32_t>(std::upper_bound(starts.begin(), starts.end(), pos) -
                                  starts.begin() - 1);
    };
    for (int64_t x : p.qpos) p.qdoc.push_back(doc_of(x));
    for (int64_t x : p.kpos) p.kdoc.push_back(doc_of(x));
  }
  p.scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  p.q = test::random_normal({p.sq, p.h, p.d}, seed + 10);
  p.k = test::random_normal({p.sk, p.hkv, p.d}, seed + 11);
  p.v = test::random_normal({p.sk, p.hkv, p.d}, seed + 12);
  p.dout = test::random_normal({p.sq, p.h, p.d}, seed + 13);
  return p;
}

struct Result {
  Tensor<float> out, dq, dk, dv;
  std::vector<float> lse;
  KernelStats fwd, bwd;
};

struct RefResult {
  Tensor<double> out, dq, dk, dv;
  std::vector<double> lse;
};

RefResult run_reference(const Problem& p) {
  RefResult r;
  const Tensor<double> q = convert<double>(p.q), k = convert<double>(p.k), v = convert<double>(p.v),
                       dout = convert<double>(p.dout);
  r.out = Tensor<double>({p.sq, p.h, p.d});
  r.lse.resize(static_cast<size_t>(p.h * p.sq));
  reference_forward(q.view3(), k.view3(), v.view3(), p.qt(), p.kt(), p.mask, p.scale, r.out.view3(),
                    r.lse.data());
  r.dq = Tensor<double>({p.sq, p.h, p.d});
  r.dk = Tensor<double>({p.sk, p.hkv, p.d});
  r.dv = Tensor<double>({p.sk, p.hkv, p.d});
  reference_backward(q.view3(), k.view3(), v.view3(), dout.view3(), p.qt(), p.kt(), p.mask, p.scale,
                     r.dq.view3(), r.dk.view3(), r.dv.view3());
  return r;
}

KernelConfig config(const Problem& p, int64_t block_q, int64_t block_k, int threads) {
  KernelConfig cfg;
  cfg.mask = p.mask;
  cfg.scale = p.scale;
  cfg.block_q = block_q;
  cfg.block_k = block_k;
  cfg.threads = threads;
  return cfg;
}

// Forward as one attend over all keys, then delta and one attend_backward.
Result run_blockwise(const Problem& p, const KernelConfig& cfg) {
  Result r;
  SoftmaxState st(p.sq, p.h, p.d);
  r.fwd = attend(st.view(), p.q.view3(), p.k.view3(), p.v.view3(), p.qt(), p.kt(), cfg);
  r.out = Tensor<float>({p.sq, p.h, p.d});
  r.lse.assign(static_cast<size_t>(p.h * p.sq), 0.0f);
  finish(st.view(), r.out.view3(), r.lse.data(), p.sq);
  std::vector<float> delta(static_cast<size_t>(p.h * p.sq));
  compute_delta(r.out.view3(), p.dout.view3(), delta.data(), p.sq);
  r.dq = Tensor<float>({p.sq, p.h, p.d});
  r.dk = Tensor<float>({p.sk, p.hkv, p.d});
  r.dv = Tensor<float>({p.sk, p.hkv, p.d});
  r.bwd = attend_backward(p.q.view3(), p.k.view3(), p.v.view3(), p.dout.view3(), r.lse.data(),
                          delta.data(), p.sq, p.qt(), p.kt(), cfg, r.dq.view3(), r.dk.view3(),
                          r.dv.view3());
  return r;
}

void expect_matches_reference(const Result& r, const RefResult& ref) {
  EXPECT_LE(rel_error(r.out.vec(), ref.out.vec()), kFp32RelTol) << "out";
  EXPECT_LE(lse_rel_error(r.lse, ref.lse), kFp32RelTol) << "lse";
  EXPECT_LE(rel_error(r.dq.vec(), ref.dq.vec()), kFp32RelTol) << "dq";
  EXPECT_LE(rel_error(r.dk.vec(), ref.dk.vec()), kFp32RelTol) << "dk";
  EXPECT_LE(rel_error(r.dv.vec(), ref.dv.vec()), kFp32RelTol) << "dv";
}

void expect_stats(const KernelStats& st, const Problem& p, const KernelConfig& cfg) {
  const int64_t q_tiles = (p.sq + cfg.block_q - 1) / cfg.block_q;
  const int64_t k_tiles = (p.sk + cfg.block_k - 1) / cfg.block_k;
  EXPECT_EQ(st.tiles + st.tiles_skipped, q_tiles * k_tiles * p.h);
  EXPECT_EQ(st.visible_pairs, count_visible_pairs(p.qt(), p.kt(), p.mask, p.h));
}

// ---------------------------------------------------------------------------------------------
// The sweep.

std::vector<Case> sweep_cases() {
  std::vector<Case> cases;
  const MaskKind masks[] = {MaskKind::kCausal, MaskKind::kFull, MaskKind::kWindow,
                            MaskKind::kCausalWindow, MaskKind::kDocuments};
  const Layout layouts[] = {Layout::kContiguous, Layout::kZigzag, Layout::kStripe, Layout::kRandom};
  const int64_t heads[][2] = {{4, 4}, {8, 2}, {4, 1}};
  const int64_t blocks[][2] = {{64, 64}, {48, 40}, {16, 24}};
  // Small sizes: every D x GQA x mask x layout; the tile sizes rotate.
  int n = 0;
  for (int64_t s : {1, 7, 64}) {
    for (int64_t d : {16, 64, 128}) {
      for (const auto& hh : heads) {
        for (MaskKind m : masks) {
          for (Layout l : layouts) {
            const auto& b = blocks[n % 3];
            cases.push_back(Case{s, d, hh[0], hh[1], m, l, b[0], b[1], 1 + n % 2});
            ++n;
          }
        }
      }
    }
  }
  // S = 1000: a covering subset (each D, GQA shape, mask and layout at least once; the fp64
  // reference is O(S^2 H D)).
  cases.push_back(Case{1000, 64, 8, 2, MaskKind::kCausal, Layout::kZigzag, 48, 40, 2});
  cases.push_back(Case{1000, 128, 4, 1, MaskKind::kCausalWindow, Layout::kStripe, 64, 64, 2});
  cases.push_back(Case{1000, 16, 4, 4, MaskKind::kFull, Layout::kRandom, 64, 64, 2});
  cases.push_back(Case{1000, 64, 4, 4, MaskKind::kDocuments, Layout::kContiguous, 48, 40, 1});
  cases.push_back(Case{1000, 128, 8, 2, MaskKind::kWindow, Layout::kContiguous, 64, 64, 2});
  return cases;
}

class BlockwiseSweep : public ::testing::TestWithParam<Case> {};

TEST_P(BlockwiseSweep, MatchesReference) {
  const Case& c = GetParam();
  const Problem p = make_problem(c, static_cast<uint32_t>(c.s * 131 + c.d * 7 + c.h));
  const KernelConfig cfg = config(p, c.block_q, c.block_k, c.threads);
  const Result r = run_blockwise(p, cfg);
  expect_matches_reference(r, run_reference(p));
  expect_stats(r.fwd, p, cfg);
  expect_stats(r.bwd, p, cfg);
}

INSTANTIATE_TEST_SUITE_P(Cases, BlockwiseSweep, ::testing::ValuesIn(sweep_cases()),
                         [](const auto& info) { return info.param.name(); });

// ---------------------------------------------------------------------------------------------
// Tiles and stats.

TEST(Blockwise, CausalContiguousSkipsTheUpperTriangle) {
  const Case c{256, 16, 2, 2, MaskKind::kCausal, Layout::kContiguous};
  const Problem p = make_problem(c, 1);
  const KernelConfig cfg = config(p, 64, 64, 1);
  SoftmaxState st(p.sq, p.h, p.d);
  const KernelStats s =
      attend(st.view(), p.q.view3(), p.k.view3(), p.v.view3(), p.qt(), p.kt(), cfg);
  // 4 x 4 tiles per head: 6 above the diagonal are empty, 4 on it partial, 6 below full.
  EXPECT_EQ(s.tiles, 10 * 2);
  EXPECT_EQ(s.tiles_skipped, 6 * 2);
  EXPECT_EQ(s.visible_pairs, 256 * 257 / 2 * 2);
}

TEST(Blockwise, DocumentsSkipTilesAcrossDocuments) {
  // Two documents of 128 tokens, full (non-causal) attention inside each: with 64 x 64 tiles the
  // 8 cross-document tiles per head are empty and the 8 inside are full.
  const int64_t s = 256, h = 1, d = 16;
  std::vector<int64_t> pos(s);
  std::iota(pos.begin(), pos.end(), 0);
  std::vector<int32_t> doc(s);
  for (int64_t i = 0; i < s; ++i) doc[i] = i < 128 ? 0 : 1;
  const Tensor<float> q = test::random_normal({s, h, d}, 1), k = test::random_normal({s, h, d}, 2),
                      v = test::random_normal({s, h, d}, 3);
  KernelConfig cfg;
  cfg.mask = Mask{false, 0};
  cfg.scale = 0.25f;
  cfg.threads = 1;
  SoftmaxState st(s, h, d);
  const Tokens t{pos.data(), doc.data(), s};
  const KernelStats stats = attend(st.view(), q.view3(), k.view3(), v.view3(), t, t, cfg);
  EXPECT_EQ(stats.tiles, 8);
  EXPECT_EQ(stats.tiles_skipped, 8);
  EXPECT_EQ(stats.visible_pairs, 2 * 128 * 128);
}

// ---------------------------------------------------------------------------------------------
// Folding KV blocks into one state; splitting the backward over KV blocks.

TEST(Blockwise, FoldingKvBlocksInAnyOrderEqualsOneAttend) {
  for (MaskKind m : {MaskKind::kCausal, MaskKind::kDocuments, MaskKind::kCausalWindow}) {
    const Case c{300, 64, 4, 2, m, Layout::kRandom};
    const Problem p = make_problem(c, 21);
    const KernelConfig cfg = config(p, 48, 40, 2);
    const RefResult ref = run_reference(p);
    const Result whole = run_blockwise(p, cfg);
    // Three uneven KV blocks of the (unsorted) keys.
    const int64_t cut[] = {0, 97, 250, p.sk};
    const int orders[][3] = {{0, 1, 2}, {2, 0, 1}, {1, 2, 0}};
    for (const auto& order : orders) {
      SoftmaxState st(p.sq, p.h, p.d);
      KernelStats total;
      for (int b : order) {
        const int64_t k0 = cut[b], n = cut[b + 1] - cut[b];
        total += attend(st.view(), p.q.view3(), p.k.view3().rows(k0, n), p.v.view3().rows(k0, n),
                        p.qt(), p.kt().sub(k0, n), cfg);
      }
      Tensor<float> out({p.sq, p.h, p.d});
      std::vector<float> lse(static_cast<size_t>(p.h * p.sq));
      finish(st.view(), out.view3(), lse.data(), p.sq);
      EXPECT_LE(rel_error(out.vec(), ref.out.vec()), kFp32RelTol) << mask_name(m);
      EXPECT_LE(lse_rel_error(lse, ref.lse), kFp32RelTol) << mask_name(m);
      EXPECT_LE(rel_error(out.vec(), whole.out.vec()), kFp32RelTol) << mask_name(m);
      EXPECT_EQ(total.visible_pairs, whole.fwd.visible_pairs);
    }
  }
}

TEST(Blockwise, BackwardSplitOverKvBlocksAddsUp) {
  // A ring's backward: each KV block's attend_backward uses the final lse; dq contributions of
  // all blocks add into one dq, each block's dk/dv is its own.
  const Case c{200, 32, 4, 2, MaskKind::kCausal, Layout::kZigzag};
  const Problem p = make_problem(c, 31);
  const KernelConfig cfg = config(p, 32, 48, 2);
  const RefResult ref = run_reference(p);
  const Result whole = run_blockwise(p, cfg);
  std::vector<float> delta(static_cast<size_t>(p.h * p.sq));
  compute_delta(whole.out.view3(), p.dout.view3(), delta.data(), p.sq);
  Tensor<float> dq({p.sq, p.h, p.d}), dk({p.sk, p.hkv, p.d}), dv({p.sk, p.hkv, p.d});
  const int64_t cut[] = {0, 60, 61, p.sk};
  for (int b : {2, 0, 1}) {
    const int64_t k0 = cut[b], n = cut[b + 1] - cut[b];
    attend_backward(p.q.view3(), p.k.view3().rows(k0, n), p.v.view3().rows(k0, n), p.dout.view3(),
                    whole.lse.data(), delta.data(), p.sq, p.qt(), p.kt().sub(k0, n), cfg,
                    dq.view3(), dk.view3().rows(k0, n), dv.view3().rows(k0, n));
  }
  EXPECT_LE(rel_error(dq.vec(), ref.dq.vec()), kFp32RelTol);
  EXPECT_LE(rel_error(dk.vec(), ref.dk.vec()), kFp32RelTol);
  EXPECT_LE(rel_error(dv.vec(), ref.dv.vec()), kFp32RelTol);
}

TEST(Blockwise, BackwardAccumulatesIntoTheCallersBuffers) {
  const Case c{50, 16, 2, 1, MaskKind::kFull, Layout::kContiguous};
  const Problem p = make_problem(c, 41);
  const KernelConfig cfg = config(p, 16, 16, 2);
  const Result once = run_blockwise(p, cfg);
  std::vector<float> delta(static_cast<size_t>(p.h * p.sq));
  compute_delta(once.out.view3(), p.dout.view3(), delta.data(), p.sq);
  Tensor<float> dq = once.dq, dk = once.dk, dv = once.dv;
  attend_backward(p.q.view3(), p.k.view3(), p.v.view3(), p.dout.view3(), once.lse.data(),
                  delta.data(), p.sq, p.qt(), p.kt(), cfg, dq.view3(), dk.view3(), dv.view3());
  std::vector<float> twice_dq = once.dq.vec(), twice_dk = once.dk.vec();
  for (float& x : twice_dq) x *= 2;
  for (float& x : twice_dk) x *= 2;
  EXPECT_LE(rel_error(dq.vec(), twice_dq), 1e-6);
  EXPECT_LE(rel_error(dk.vec(), twice_dk), 1e-6);
}

// ---------------------------------------------------------------------------------------------
// Rows that see no key.

TEST(Blockwise, RowsWithoutVisibleKeysAreZeroAndNeverNan) {
  // Keys at positions 0..39. Queries: 0..19 (see keys), 1000..1019 (beyond the window: see
  // nothing), and 20 rows in document 9, which no key has.
  const int64_t sk = 40, sq = 60, h = 4, hkv = 2, d = 32;
  std::vector<int64_t> kpos(sk), qpos(sq);
  std::vector<int32_t> kdoc(sk, 0), qdoc(sq, 0);
  std::iota(kpos.begin(), kpos.end(), 0);
  for (int64_t i = 0; i < 20; ++i) {
    qpos[i] = i;
    qpos[20 + i] = 1000 + i;
    qpos[40 + i] = 10 + i;
    qdoc[40 + i] = 9;
  }
  Problem p;
  p.sq = sq;
  p.sk = sk;
  p.h = h;
  p.hkv = hkv;
  p.d = d;
  p.mask = Mask{true, 64};
  p.scale = 0.2f;
  p.qpos = qpos;
  p.kpos = kpos;
  p.qdoc = qdoc;
  p.kdoc = kdoc;
  p.documents = true;
  p.q = test::random_normal({sq, h, d}, 51);
  p.k = test::random_normal({sk, hkv, d}, 52);
  p.v = test::random_normal({sk, hkv, d}, 53);
  p.dout = test::random_normal({sq, h, d}, 54);
  for (int threads : {1, 2}) {
    const KernelConfig cfg = config(p, 16, 16, threads);
    const Result r = run_blockwise(p, cfg);
    for (int64_t i = 20; i < sq; ++i) {
      for (int64_t hh = 0; hh < h; ++hh) {
        EXPECT_EQ(r.lse[hh * sq + i], kNegInf);
        for (int64_t e = 0; e < d; ++e) {
          EXPECT_EQ(r.out.view3()(i, hh, e), 0.0f);
          EXPECT_EQ(r.dq.view3()(i, hh, e), 0.0f);
        }
      }
    }
    for (float x : r.out.vec()) ASSERT_FALSE(std::isnan(x));
    for (float x : r.dq.vec()) ASSERT_FALSE(std::isnan(x));
    for (float x : r.dk.vec()) ASSERT_FALSE(std::isnan(x));
    for (float x : r.dv.vec()) ASSERT_FALSE(std::isnan(x));
    // Keys at positions 20..39 are in the causal future of every query of document 0: nobody
    // sees them, so their gradients are exactly 0.
    for (int64_t j = 20; j < sk; ++j) {
      for (int64_t g = 0; g < hkv; ++g) {
        for (int64_t e = 0; e < d; ++e) {
          EXPECT_EQ(r.dk.view3()(j, g, e), 0.0f);
          EXPECT_EQ(r.dv.view3()(j, g, e), 0.0f);
        }
      }
    }
    expect_matches_reference(r, run_reference(p));
  }
}

TEST(Blockwise, RowsSeeingOneKeyHaveExactlyZeroDsGradients) {
  // Window 1: every query sees exactly its own key, so p = 1 and ds = p (dp - delta) = 0: dq and
  // dk are exactly 0 (the reference's too). This holds in fp32 only because compute_delta sums
  // over d in the order in which the tile GEMM accumulates dp = dout v^T; it guards that
  // pairing, which also keeps dp - delta free of rounding noise for rows dominated by one key.
  for (const int64_t d : {16, 72, 128}) {
    const Case c{100, d, 4, 2, MaskKind::kCausal, Layout::kContiguous};
    Problem p = make_problem(c, 91);
    p.mask = Mask{true, 1};
    const Result r = run_blockwise(p, config(p, 32, 48, 2));
    for (float x : r.dq.vec()) ASSERT_EQ(x, 0.0f) << "D " << d;
    for (float x : r.dk.vec()) ASSERT_EQ(x, 0.0f) << "D " << d;
    EXPECT_LE(rel_error(r.dv.vec(), run_reference(p).dv.vec()), kFp32RelTol);
  }
}

TEST(Blockwise, EmptyStateStaysEmptyAfterInvisibleBlock) {
  // A KV block entirely in the causal future leaves the state empty: finish gives 0 and -inf.
  const int64_t s = 10, h = 2, d = 8;
  std::vector<int64_t> qpos(s), kpos(s);
  std::iota(qpos.begin(), qpos.end(), 0);
  std::iota(kpos.begin(), kpos.end(), 100);
  const Tensor<float> q = test::random_normal({s, h, d}, 1), k = test::random_normal({s, h, d}, 2),
                      v = test::random_normal({s, h, d}, 3);
  KernelConfig cfg;
  cfg.scale = 0.3f;
  SoftmaxState st(s, h, d);
  const KernelStats stats = attend(st.view(), q.view3(), k.view3(), v.view3(),
                                   {qpos.data(), nullptr, s}, {kpos.data(), nullptr, s}, cfg);
  EXPECT_EQ(stats.tiles, 0);
  EXPECT_EQ(stats.tiles_skipped, h);
  Tensor<float> out({s, h, d}, 1.0f);
  std::vector<float> lse(static_cast<size_t>(h * s), 1.0f);
  finish(st.view(), out.view3(), lse.data(), s);
  for (float x : out.vec()) EXPECT_EQ(x, 0.0f);
  for (float x : lse) EXPECT_EQ(x, kNegInf);
}

// ---------------------------------------------------------------------------------------------
// Threads, views, sub-states.

TEST(Blockwise, OneAndTwoThreadsAgree) {
  const Case c{700, 64, 8, 2, MaskKind::kCausal, Layout::kZigzag};
  const Problem p = make_problem(c, 61);
  const Result one = run_blockwise(p, config(p, 64, 64, 1));
  const Result two = run_blockwise(p, config(p, 64, 64, 2));
  // The forward computes each (head, q-tile) on one thread: identical bits.
  EXPECT_EQ(one.out.vec(), two.out.vec());
  EXPECT_EQ(one.lse, two.lse);
  // dk, dv of a (kv head, k-tile) are one task's: identical. dq sums per-thread partials.
  EXPECT_EQ(one.dk.vec(), two.dk.vec());
  EXPECT_EQ(one.dv.vec(), two.dv.vec());
  EXPECT_LE(rel_error(two.dq.vec(), one.dq.vec()), 1e-6);
  // A second run with two threads reproduces the first (static schedule).
  const Result again = run_blockwise(p, config(p, 64, 64, 2));
  EXPECT_EQ(again.dq.vec(), two.dq.vec());
}

TEST(Blockwise, StridedViewsAndSubStates) {
  // q, k, v are head ranges of wider tensors; the q rows are attended as two sub-states.
  const int64_t s = 90, h = 4, hkv = 2, d = 24;
  const Tensor<float> q_wide = test::random_normal({s, 2 * h, d}, 71);
  const Tensor<float> kv_wide = test::random_normal({s, 3 * hkv, d}, 72);
  const View3<const float> q = q_wide.view3().heads(h, h);
  const View3<const float> k = kv_wide.view3().heads(0, hkv);
  const View3<const float> v = kv_wide.view3().heads(hkv, hkv);
  std::vector<int64_t> pos(s);
  std::iota(pos.begin(), pos.end(), 0);
  const Tokens t{pos.data(), nullptr, s};
  KernelConfig cfg;
  cfg.scale = 0.2f;
  cfg.block_q = 16;
  cfg.block_k = 32;

  // Contiguous copies give the reference.
  Tensor<double> qd({s, h, d}), kd({s, hkv, d}), vd({s, hkv, d});
  for (int64_t i = 0; i < s; ++i)
    for (int64_t e = 0; e < d; ++e) {
      for (int64_t hh = 0; hh < h; ++hh) qd.view3()(i, hh, e) = q(i, hh, e);
      for (int64_t g = 0; g < hkv; ++g) {
        kd.view3()(i, g, e) = k(i, g, e);
        vd.view3()(i, g, e) = v(i, g, e);
      }
    }
  Tensor<double> ref_out({s, h, d});
  std::vector<double> ref_lse(static_cast<size_t>(h * s));
  reference_forward(qd.view3(), kd.view3(), vd.view3(), t, t, cfg.mask, cfg.scale, ref_out.view3(),
                    ref_lse.data());

  SoftmaxState st(s, h, d);
  const int64_t split = 37;
  attend(st.view().sub_rows(0, split), q.rows(0, split), k, v, t.sub(0, split), t, cfg);
  attend(st.view().sub_rows(split, s - split), q.rows(split, s - split), k, v,
         t.sub(split, s - split), t, cfg);
  // out written into a head range of a wider tensor, lse with a padded stride.
  Tensor<float> out_wide({s, h + 1, d});
  const View3<float> out = out_wide.view3().heads(1, h);
  const int64_t lse_stride = s + 5;
  std::vector<float> lse(static_cast<size_t>(h * lse_stride));
  finish(st.view(), out, lse.data(), lse_stride);
  std::vector<float> out_flat, lse_flat;
  for (int64_t i = 0; i < s; ++i)
    for (int64_t hh = 0; hh < h; ++hh)
      for (int64_t e = 0; e < d; ++e) out_flat.push_back(out(i, hh, e));
  for (int64_t hh = 0; hh < h; ++hh)
    for (int64_t i = 0; i < s; ++i) lse_flat.push_back(lse[hh * lse_stride + i]);
  EXPECT_LE(rel_error(out_flat, ref_out.vec()), kFp32RelTol);
  EXPECT_LE(lse_rel_error(lse_flat, ref_lse), kFp32RelTol);
}

TEST(Blockwise, ResetEmptiesTheState) {
  const Case c{20, 16, 2, 2, MaskKind::kFull, Layout::kContiguous};
  const Problem p = make_problem(c, 81);
  const KernelConfig cfg = config(p, 64, 64, 1);
  SoftmaxState st(p.sq, p.h, p.d);
  attend(st.view(), p.q.view3(), p.k.view3(), p.v.view3(), p.qt(), p.kt(), cfg);
  st.reset();
  attend(st.view(), p.q.view3(), p.k.view3(), p.v.view3(), p.qt(), p.kt(), cfg);
  Tensor<float> out({p.sq, p.h, p.d});
  std::vector<float> lse(static_cast<size_t>(p.h * p.sq));
  finish(st.view(), out.view3(), lse.data(), p.sq);
  const RefResult ref = run_reference(p);
  EXPECT_LE(rel_error(out.vec(), ref.out.vec()), kFp32RelTol);
  EXPECT_EQ(st.rows(), p.sq);
}

// ---------------------------------------------------------------------------------------------
// Argument checks.

TEST(Blockwise, RejectsBadArguments) {
  const std::vector<int64_t> pos = {0, 1, 2, 3};
  const Tokens t{pos.data(), nullptr, 4};
  auto run = [&](int64_t h, int64_t hkv, int64_t d, float scale, int64_t block_q = 64) {
    const Tensor<float> q({4, h, d}), k({4, hkv, d}), v({4, hkv, d});
    SoftmaxState st(4, h, d);
    KernelConfig cfg;
    cfg.scale = scale;
    cfg.block_q = block_q;
    attend(st.view(), q.view3(), k.view3(), v.view3(), t, t, cfg);
  };
  EXPECT_NO_THROW(run(4, 2, 256, 0.1f));
  EXPECT_THROW(run(4, 2, 257, 0.1f), InvalidArgument);  // D > 256
  EXPECT_THROW(run(4, 2, 0, 0.1f), InvalidArgument);    // D = 0
  EXPECT_THROW(run(4, 3, 16, 0.1f), InvalidArgument);   // H % Hkv != 0
  EXPECT_THROW(run(4, 2, 16, 0.0f), InvalidArgument);   // scale unset
  EXPECT_THROW(run(4, 2, 16, -1.0f), InvalidArgument);
  EXPECT_THROW(run(4, 2, 16, std::numeric_limits<float>::infinity()), InvalidArgument);
  EXPECT_THROW(run(4, 2, 16, std::nanf("")), InvalidArgument);
  EXPECT_THROW(run(4, 2, 16, 0.1f, 0), InvalidArgument);  // block_q = 0

  const Tensor<float> q({4, 2, 8}), k({4, 1, 8}), v5({5, 1, 8});
  KernelConfig cfg;
  cfg.scale = 0.5f;
  SoftmaxState wrong_state(4, 2, 16);
  EXPECT_THROW(attend(wrong_state.view(), q.view3(), k.view3(), k.view3(), t, t, cfg),
               InvalidArgument);
  SoftmaxState st(4, 2, 8);
  EXPECT_THROW(attend(st.view(), q.view3(), k.view3(), v5.view3(), t, t, cfg), InvalidArgument);
  EXPECT_THROW(attend(st.view(), q.view3(), k.view3(), k.view3(), t, t.sub(0, 3), cfg),
               InvalidArgument);
  Tensor<float> out({4, 2, 8}), dq({4, 2, 8}), dk({4, 1, 8}), dv({4, 1, 8}), dq_bad({4, 1, 8});
  std::vector<float> lse(8), delta(8);
  EXPECT_THROW(finish(st.view(), out.view3(), lse.data(), 3), InvalidArgument);  // stride < rows
  EXPECT_THROW(attend_backward(q.view3(), k.view3(), k.view3(), q.view3(), lse.data(), delta.data(),
                               4, t, t, cfg, dq_bad.view3(), dk.view3(), dv.view3()),
               InvalidArgument);
  EXPECT_THROW(compute_delta(out.view3(), dk.view3(), delta.data(), 4), InvalidArgument);
}

}  // namespace
}  // namespace loom
