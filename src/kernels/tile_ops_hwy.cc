// The tile operations of the blockwise kernels (tile_ops.h) in one Highway source, compiled once
// per instruction-set target by hwy/foreach_target.h and chosen at run time (select_ops below,
// HWY_DYNAMIC_DISPATCH for "auto").
//
// GEMM. C[M, N] = alpha A B (+ C), M % 4 == 0, N % 16 == 0 (the packing pads to that). The
// register block is R rows x 2 vectors of C: R = 8 on targets with 32 vector registers (AVX-512,
// NEON), R = 6 on those with 16 (AVX2, SSE4, SSSE3; 12 accumulators, 2 B vectors and one
// broadcast fit), 4 and 2 rows at the bottom edge (4 + 4 rather than kRows + 2). For each step k of
// the reduction it loads two vectors of row k of B and broadcasts a(i, k) of each of its rows: 2R
// multiply-adds for 2 + R loads, so the FMA pipes stay the bound. Columns are the outer loop: a
// panel of B (K x 2 vectors: 8 KiB on AVX2, 16 KiB on AVX-512 for K = 128) stays in L1 while the
// row blocks of A pass over it. Each C element is a sequential multiply-add chain over k from 0
// (fused where the target has FMA: MulAdd), which dot() reproduces for compute_delta. Vectors are
// at most 16 floats (CappedTag), so 16 | N makes every row a whole number of vectors on every
// target.
//
// exp, in base 2. The kernels compute their scores with log2 e folded into the scale (scale log2 e
// q k^T), so the softmax's exp(s - m) is 2^(s2 - m2) and the exp is 2^x (exp2_vn): x = n + f with
// n = round(x) and f = x - n exact, 2^f by a polynomial of degree 5, 2^n added to the exponent
// bits. Bound used by the tests (test_kernels_exp.cc): relative error <= 4 ulp (4.8e-7) of 2^x on
// [-125, 0], exactly 0 for x < -125, -inf and NaN. Base e needed a Cody-Waite reduction (two more
// multiply-adds) and a degree-6 polynomial: docs/performance.md, round 11. hwy/contrib/math's Exp
// was evaluated too: it handles the full range with more steps, which the kernels (arguments
// s - m <= 0) do not need.
//
// SVE. Its vector types are sizeless (the length is the CPU's, 128 to 2048 bits), so no vector
// here is an array element or a class member. Highway uses the largest power of two of lanes that
// fits (SV_POW2) and D caps that at 16: 4, 8 or 16 floats, which divide kNr on every SVE length.

// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "tile_ops_hwy.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
// clang-format on

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "tile_ops.h"

HWY_BEFORE_NAMESPACE();
namespace loom::kernels {
namespace HWY_NAMESPACE {
namespace {

namespace hn = hwy::HWY_NAMESPACE;
using D = hn::CappedTag<float, 16>;
using V = hn::Vec<D>;

#if (HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3) || HWY_ARCH_ARM
constexpr int kRows = 8;  // 32 vector registers
#else
constexpr int kRows = 6;  // 16 vector registers
#endif

// c[0, L) = alpha x (+ c[0, L) when accumulate).
HWY_INLINE void store_scaled(D d, V al, bool accumulate, V x, float* HWY_RESTRICT c) {
  hn::StoreU(accumulate ? hn::MulAdd(al, x, hn::LoadU(d, c)) : hn::Mul(al, x), d, c);
}

// B operand of one column block: NV vector columns starting at bcol[v], row k at bcol[v] + k * ldb.
// The accumulators are named variables c<r><v>, not an array: SVE's vector types are sizeless and
// cannot be array elements. Rows r >= R are dead code that the compiler removes.
#define LOOM_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
template <int R, int NV>
HWY_INLINE void gemm_block(D d, int64_t K, const float* HWY_RESTRICT a, int64_t a_rs, int64_t a_ks,
                           const float* const* bcol, int64_t ldb, float alpha, bool accumulate,
                           float* HWY_RESTRICT c, int64_t ldc) {
  static_assert(R >= 1 && R <= 8 && (NV == 1 || NV == 2), "register block out of range");
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
#define LOOM_DECLARE(r) V c##r##0 = hn::Zero(d), c##r##1 = hn::Zero(d);
  LOOM_ROWS(LOOM_DECLARE)
#undef LOOM_DECLARE
  const float* HWY_RESTRICT b0 = bcol[0];
  const float* HWY_RESTRICT b1 = NV > 1 ? bcol[NV - 1] : bcol[0];
  for (int64_t k = 0; k < K; ++k) {
    const float* ak = a + k * a_ks;
    const V bv0 = hn::LoadU(d, b0 + k * ldb);
    const V bv1 = NV > 1 ? hn::LoadU(d, b1 + k * ldb) : bv0;
#define LOOM_MULADD(r)                                            \
  if constexpr (r < R) {                                          \
    const V av = hn::Set(d, ak[r * a_rs]);                        \
    c##r##0 = hn::MulAdd(av, bv0, c##r##0);                       \
    if constexpr (NV > 1) c##r##1 = hn::MulAdd(av, bv1, c##r##1); \
  }
    LOOM_ROWS(LOOM_MULADD)
#undef LOOM_MULADD
  }
  const V al = hn::Set(d, alpha);
#define LOOM_STORE(r)                                                                \
  if constexpr (r < R) {                                                             \
    store_scaled(d, al, accumulate, c##r##0, c + r * ldc);                           \
    if constexpr (NV > 1) store_scaled(d, al, accumulate, c##r##1, c + r * ldc + L); \
  }
  LOOM_ROWS(LOOM_STORE)
#undef LOOM_STORE
}
#undef LOOM_ROWS

// A prefetch stream spread over a GEMM's register blocks: `per_block` cache lines before each
// block, towards L2, through the regions in order, so the lines the caller reads next arrive while
// this GEMM computes, without a burst of prefetches that fills the miss queues.
struct PrefetchStream {
  const PrefetchRegion* region = nullptr;
  const PrefetchRegion* end = nullptr;
  const char* row = nullptr;
  int64_t off = 0, rows = 0, per_block = 0;
  HWY_INLINE void start(const PrefetchRegion* r) {
    for (region = r; region < end && region->empty();) ++region;
    if (region < end) {
      row = static_cast<const char*>(region->p);
      off = 0;
      rows = region->rows;
    }
  }
  HWY_INLINE void step() {
    for (int64_t i = 0; i < per_block && region < end; ++i) {
      __builtin_prefetch(row + off, 0, 2);
      off += 64;
      if (off >= region->bytes) {
        off = 0;
        row += region->stride;
        if (--rows == 0) start(region + 1);
      }
    }
  }
};

template <int NV>
HWY_INLINE void gemm_columns(D d, int64_t M, int64_t K, const float* a, int64_t a_rs, int64_t a_ks,
                             const float* const* bcol, int64_t ldb, float alpha, bool accumulate,
                             float* c, int64_t ldc, PrefetchStream& pf) {
  // A 2-row block has 2 NV multiply-add chains, too few to cover the FMA latency (it runs at
  // about half rate): rows that would end in kRows + 2 (128 = 21 x 6 + 2 on AVX2) end in 4 + 4.
  const int64_t main_end = kRows == 6 && M % kRows == 2 && M >= 8 ? M - 8 : M;
  int64_t i0 = 0;
  for (; i0 + kRows <= main_end; i0 += kRows) {
    pf.step();
    gemm_block<kRows, NV>(d, K, a + i0 * a_rs, a_rs, a_ks, bcol, ldb, alpha, accumulate,
                          c + i0 * ldc, ldc);
  }
  for (; i0 + 4 <= M; i0 += 4) {  // at most two (kRows + 2 rows left), else at most one
    pf.step();
    gemm_block<4, NV>(d, K, a + i0 * a_rs, a_rs, a_ks, bcol, ldb, alpha, accumulate, c + i0 * ldc,
                      ldc);
  }
  if (i0 + 2 <= M) {  // M is even, so this is the last block
    pf.step();
    gemm_block<2, NV>(d, K, a + i0 * a_rs, a_rs, a_ks, bcol, ldb, alpha, accumulate, c + i0 * ldc,
                      ldc);
  }
}

// Prefetches rows x len elements (row stride `stride` elements) towards L2, a cache line at a time.
template <class E>
HWY_INLINE void prefetch_2d(const E* p, int64_t rows, int64_t len, int64_t stride) {
  constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(E));  // elements per 64-byte line
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < len; j += kLine) __builtin_prefetch(p + r * stride + j, 0, 2);
}

// out[0, n) = the bf16 bit patterns in[0, n) widened to fp32 (exact: the bits shifted into the
// high half), n a multiple of the vector length.
HWY_INLINE void widen_bf16(D d, const uint16_t* HWY_RESTRICT in, int64_t n,
                           float* HWY_RESTRICT out) {
  const hn::RebindToUnsigned<D> du;
  const hn::Rebind<uint16_t, D> d16;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t i = 0; i < n; i += L)
    hn::StoreU(hn::BitCast(d, hn::ShiftLeft<16>(hn::PromoteTo(du, hn::LoadU(d16, in + i)))), d,
               out + i);
}

// The first row block of each column panel reads its B rows for the first time; from memory that
// stalls the FMA chain (bench_kernels --tile-ops on Zen 3: 62 instead of 91 GFLOP/s with B
// row-major from memory). Prefetching the operands up front lets the memory system fetch them in
// parallel with the first panel's compute, and panel-major B (gemm_panels) makes B one
// sequential stream per panel.
// B(k, j) = panels ? b[(j / kNr) * b_ps + k * kNr + j % kNr] : b[k * ldb + j], elements of BT
// (fp32, or the bf16 bit patterns of gemm_panels_bf16). With regions of next to prefetch, pf
// becomes their stream, spread over the register blocks of the whole product; without, the
// operands are prefetched here.
template <bool kPanels, class BT>
HWY_INLINE void gemm_prologue(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs,
                              int64_t a_ks, const BT* b, int64_t ldb, int64_t b_ps, bool accumulate,
                              const float* c, int64_t ldc, const PrefetchRegion* next,
                              int64_t regions, PrefetchStream& pf) {
  const int64_t L = static_cast<int64_t>(hn::Lanes(D()));
  int64_t lines = 0;
  for (int64_t i = 0; i < regions; ++i)
    if (!next[i].empty()) lines += next[i].rows * ((next[i].bytes + 63) / 64);
  if (lines == 0) {
    if constexpr (kPanels)
      prefetch_2d(b, N / kNr, K * kNr, b_ps);
    else
      prefetch_2d(b, K, N, ldb);
    if (a_ks == 1)
      prefetch_2d(a, M, K, a_rs);
    else
      prefetch_2d(a, K, M, a_ks);
    if (accumulate) prefetch_2d(c, M, N, ldc);
  } else {
    const int64_t row_blocks = (M + kRows - 1) / kRows + 1;
    const int64_t blocks = (N + 2 * L - 1) / (2 * L) * row_blocks;
    pf.end = next + regions;
    pf.start(next);
    pf.per_block = (lines + blocks - 1) / blocks;
  }
}

// The column blocks of C[M, N] = alpha A B (+ C) for fp32 B in column panels. Not inlined: the
// one copy per target serves gemm_panels, gemm_panels_next and gemm_panels_bf16 (which calls it
// per group of widened panels, pf continuing across the calls).
HWY_NOINLINE void panel_columns(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs,
                                int64_t a_ks, const float* b, int64_t b_ps, float alpha,
                                bool accumulate, float* c, int64_t ldc, PrefetchStream& pf) {
  const D d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  auto col = [&](int64_t j) { return b + (j / kNr) * b_ps + j % kNr; };
  int64_t j0 = 0;
  for (; j0 + 2 * L <= N; j0 += 2 * L) {
    const float* bcol[2] = {col(j0), col(j0 + L)};
    gemm_columns<2>(d, M, K, a, a_rs, a_ks, bcol, kNr, alpha, accumulate, c + j0, ldc, pf);
  }
  for (; j0 < N; j0 += L) {
    const float* bcol[1] = {col(j0)};
    gemm_columns<1>(d, M, K, a, a_rs, a_ks, bcol, kNr, alpha, accumulate, c + j0, ldc, pf);
  }
}

void gemm(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs, int64_t a_ks,
          const float* b, int64_t ldb, float alpha, bool accumulate, float* c, int64_t ldc) {
  const D d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  PrefetchStream pf;
  gemm_prologue<false>(M, N, K, a, a_rs, a_ks, b, ldb, 0, accumulate, c, ldc, nullptr, 0, pf);
  int64_t j0 = 0;
  for (; j0 + 2 * L <= N; j0 += 2 * L) {
    if (j0 + 2 * L < N)  // the next columns towards L1 while these compute
      for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < 2 * L; j += 16)
          __builtin_prefetch(b + k * ldb + j0 + 2 * L + j, 0, 3);
    const float* bcol[2] = {b + j0, b + j0 + L};
    gemm_columns<2>(d, M, K, a, a_rs, a_ks, bcol, ldb, alpha, accumulate, c + j0, ldc, pf);
  }
  for (; j0 < N; j0 += L) {
    const float* bcol[1] = {b + j0};
    gemm_columns<1>(d, M, K, a, a_rs, a_ks, bcol, ldb, alpha, accumulate, c + j0, ldc, pf);
  }
}

void gemm_panels_next(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs, int64_t a_ks,
                      const float* b, int64_t b_ps, float alpha, bool accumulate, float* c,
                      int64_t ldc, const PrefetchRegion* next, int64_t regions) {
  PrefetchStream pf;
  gemm_prologue<true>(M, N, K, a, a_rs, a_ks, b, kNr, b_ps, accumulate, c, ldc, next, regions, pf);
  panel_columns(M, N, K, a, a_rs, a_ks, b, b_ps, alpha, accumulate, c, ldc, pf);
}

void gemm_panels(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs, int64_t a_ks,
                 const float* b, int64_t b_ps, float alpha, bool accumulate, float* c,
                 int64_t ldc) {
  gemm_panels_next(M, N, K, a, a_rs, a_ks, b, b_ps, alpha, accumulate, c, ldc, nullptr, 0);
}

// bf16 panels: a group of them (one register block's columns, one or two panels) is widened into
// scratch, and panel_columns computes that group's columns from it: the same multiply-adds on the
// same (exactly widened) values as gemm_panels_next on fp32 panels.
void gemm_panels_bf16(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs, int64_t a_ks,
                      const uint16_t* b, int64_t b_ps, float alpha, bool accumulate, float* c,
                      int64_t ldc, float* scratch, const PrefetchRegion* next, int64_t regions) {
  const D d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  PrefetchStream pf;
  gemm_prologue<true>(M, N, K, a, a_rs, a_ks, b, kNr, b_ps, accumulate, c, ldc, next, regions, pf);
  const int64_t group = std::max<int64_t>(kNr, 2 * L);  // columns: a whole number of panels
  for (int64_t j0 = 0; j0 < N; j0 += group) {
    const int64_t n = std::min(group, N - j0);
    for (int64_t p = 0; p < n / kNr; ++p)
      widen_bf16(d, b + (j0 / kNr + p) * b_ps, K * kNr, scratch + p * K * kNr);
    panel_columns(M, n, K, a, a_rs, a_ks, scratch, K * kNr, alpha, accumulate, c + j0, ldc, pf);
  }
}

// 2^x of N vectors in place, the N independent chains interleaved step by step (one chain is ~12
// dependent operations; interleaving lets the FP pipes overlap them). The softmax's scores carry
// log2 e in their scale, so exp(s - m) = 2^(s2 - m2). n = round(x) by the magic-number addition
// t = x + 1.5 2^23: t's low mantissa bits are n (two's complement, above a set bit 22), rounded
// to nearest even; f = x - n is exact, |f| <= 1/2, and 2^f = 1 + f Q(f) with Q of degree 4
// (coefficients fitted for the least maximum relative error on |f| <= 1/2: approximation error
// 9.2e-8, 0.77 ulp). y 2^n is n << 23 (t's bits shifted left by 23) added to y's bits: no
// float-to-int conversion, and for x in [kExp2Min, 127] a normal float, so the exact product.
// Five multiply-adds and three additions: the reduction needs no Cody-Waite steps. x must be at
// most 127 (the forward passes s - m <= 0 by construction); kClamp takes x above 127 as 127 (the
// backward's s - lse is <= 0 up to rounding only for the lse of these scores, which the caller
// passes: a wrong one gives 2^127, never a wrapped exponent). x < kExp2Min and -inf give exactly
// 0 (f is NaN for -inf: masked at the end, on the unclamped x); NaN gives NaN, so that a NaN
// score reaches the row's sum and its p v product as the formula's exp would.
// The N (1 or 2) chains are x0 and x1, named variables rather than an array (SVE's sizeless
// vector types cannot be array elements); x1 is untouched when N is 1.
template <int N, bool kClamp = false>
HWY_INLINE void exp2_vn(D d, V& x0, V& x1) {
  static_assert(N == 1 || N == 2, "one or two chains");
  const hn::RebindToSigned<D> di;
  const V magic = hn::Set(d, 12582912.0f);
  V xc0 = x0, xc1 = x1;
  if constexpr (kClamp) {
    xc0 = hn::Min(xc0, hn::Set(d, 127.0f));
    if constexpr (N > 1) xc1 = hn::Min(xc1, hn::Set(d, 127.0f));
  }
  const V t0 = hn::Add(xc0, magic);
  const V f0 = hn::Sub(xc0, hn::Sub(t0, magic));
  const V t1 = N > 1 ? hn::Add(xc1, magic) : t0;
  const V f1 = N > 1 ? hn::Sub(xc1, hn::Sub(t1, magic)) : f0;
  // p = Q(f) by Horner's rule, the two chains step by step.
  V p0 = hn::MulAdd(hn::Set(d, 0.0013264698f), f0, hn::Set(d, 0.009671509f));
  V p1 = N > 1 ? hn::MulAdd(hn::Set(d, 0.0013264698f), f1, hn::Set(d, 0.009671509f)) : p0;
#define LOOM_HORNER(coef)                    \
  p0 = hn::MulAdd(p0, f0, hn::Set(d, coef)); \
  if constexpr (N > 1) p1 = hn::MulAdd(p1, f1, hn::Set(d, coef));
  LOOM_HORNER(0.05550734f)
  LOOM_HORNER(0.24022242f)
  LOOM_HORNER(0.693147f)
  LOOM_HORNER(1.0f)
#undef LOOM_HORNER
  // y 2^n: n << 23 added to y's exponent bits; 0 below kExp2Min (and for -inf); NaN for NaN.
  const V y2n0 =
      hn::BitCast(d, hn::Add(hn::BitCast(di, p0), hn::ShiftLeft<23>(hn::BitCast(di, t0))));
  x0 =
      hn::IfThenElse(hn::IsNaN(x0), x0, hn::IfThenElseZero(hn::Ge(x0, hn::Set(d, kExp2Min)), y2n0));
  if constexpr (N > 1) {
    const V y2n1 =
        hn::BitCast(d, hn::Add(hn::BitCast(di, p1), hn::ShiftLeft<23>(hn::BitCast(di, t1))));
    x1 = hn::IfThenElse(hn::IsNaN(x1), x1,
                        hn::IfThenElseZero(hn::Ge(x1, hn::Set(d, kExp2Min)), y2n1));
  }
}

template <bool kClamp = false>
HWY_INLINE V exp2_v(D d, V x) {
  exp2_vn<1, kClamp>(d, x, x);
  return x;
}

void zero_row(D d, float* x, int64_t n) {
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t j = 0; j < n; j += L) hn::StoreU(hn::Zero(d), d, x + j);
}

// Row sr [bk] of a score tile (base-2 units): sr[j] = 2^(sr[j] - shift) for j < cols, 0 for
// cols <= j < bk (bk a whole number of vectors). Returns the lanes' partial sums of the new values.
// kClamp: exp2_vn's, for the backward.
template <bool kClamp>
HWY_INLINE V exp_row(D d, float* sr, int64_t cols, int64_t bk, float shift) {
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  const int64_t whole = cols / L * L;  // columns in whole vectors
  const V sv = hn::Set(d, shift);
  V sum = hn::Zero(d);
  int64_t j = 0;
  for (; j + 2 * L <= whole; j += 2 * L) {  // 2 vectors at a time, their exps interleaved
    V x0 = hn::Sub(hn::LoadU(d, sr + j), sv);
    V x1 = hn::Sub(hn::LoadU(d, sr + j + L), sv);
    exp2_vn<2, kClamp>(d, x0, x1);
    hn::StoreU(x0, d, sr + j);
    hn::StoreU(x1, d, sr + j + L);
    sum = hn::Add(sum, hn::Add(x0, x1));
  }
  for (; j < whole; j += L) {
    const V p = exp2_v<kClamp>(d, hn::Sub(hn::LoadU(d, sr + j), sv));
    hn::StoreU(p, d, sr + j);
    sum = hn::Add(sum, p);
  }
  if (j < cols) {
    const V p = hn::IfThenElseZero(hn::FirstN(d, static_cast<size_t>(cols - j)),
                                   exp2_v<kClamp>(d, hn::Sub(hn::LoadU(d, sr + j), sv)));
    hn::StoreU(p, d, sr + j);
    sum = hn::Add(sum, p);
    j += L;
  }
  for (; j < bk; j += L) hn::StoreU(hn::Zero(d), d, sr + j);
  return sum;
}

// The rows go in chunks of kChunk: first the maxima of all the chunk's rows (independent passes,
// which the out-of-order core overlaps) and their rescale factors alpha in one vector exp, then
// each row's exp pass. Row by row, each row's max, its reduction across lanes and the scalar exp
// of alpha formed a dependency chain of ~130 cycles that its exp pass waited on.
void softmax_update(int64_t rows, int64_t cols, int64_t bq, int64_t bk, int64_t dp, float* s,
                    float* m, float* l, float* acc) {
  const D d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  constexpr float kNegInfF = -std::numeric_limits<float>::infinity();
  constexpr int64_t kChunk = 8;
  const V neg_inf = hn::Set(d, kNegInfF);
  const int64_t whole = cols / L * L;  // columns in whole vectors
  for (int64_t r0 = 0; r0 < bq; r0 += kChunk) {
    const int64_t n = std::min(kChunk, bq - r0);
    // m_new and m - m_new of the chunk's rows (0 where m_new = -inf: those rows are skipped);
    // 16 entries so that whole vectors of any target's width (at most 16 floats) can be read.
    HWY_ALIGN float m_new[16] = {}, dm[16] = {}, alpha[16];
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = r0 + i;
      float tile_max = kNegInfF;
      if (r < rows) {
        const float* sr = s + r * bk;
        V vmax = neg_inf;
        for (int64_t j = 0; j < whole; j += L) vmax = hn::Max(vmax, hn::LoadU(d, sr + j));
        if (whole < cols)
          vmax = hn::Max(vmax, hn::IfThenElse(hn::FirstN(d, static_cast<size_t>(cols - whole)),
                                              hn::LoadU(d, sr + whole), neg_inf));
        tile_max = hn::GetLane(hn::MaxOfLanes(d, vmax));
        // A NaN score may stay out of Max (x86's max returns its second operand when one is
        // NaN): a row whose visible scores are all NaN would read -inf, as if it saw no key, and
        // be skipped. Such rows, and those that see no key here (rare), are read once more.
        if (tile_max == kNegInfF)
          for (int64_t j = 0; j < cols; ++j)
            if (std::isnan(sr[j])) tile_max = std::numeric_limits<float>::quiet_NaN();
      }
      m_new[i] = m[r] > tile_max ? m[r] : tile_max;
      dm[i] = m_new[i] == kNegInfF ? 0.0f : m[r] - m_new[i];  // m[r] = -inf: -inf, alpha 0
    }
    for (int64_t i = 0; i < kChunk; i += L) hn::Store(exp2_v(d, hn::Load(d, dm + i)), d, alpha + i);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = r0 + i;
      float* sr = s + r * bk;
      if (m_new[i] == kNegInfF) {  // padding, or no visible key so far: nothing to add
        zero_row(d, sr, bk);
        continue;
      }
      const V sum = exp_row<false>(d, sr, cols, bk, m_new[i]);
      const float a = alpha[i];
      l[r] = a * l[r] + hn::GetLane(hn::SumOfLanes(d, sum));
      m[r] = m_new[i];
      if (a != 1.0f) {
        const V av = hn::Set(d, a);
        float* ar = acc + r * dp;
        for (int64_t e = 0; e < dp; e += L)
          hn::StoreU(hn::Mul(av, hn::LoadU(d, ar + e)), d, ar + e);
      }
    }
  }
}

void probs(int64_t rows, int64_t cols, int64_t bq, int64_t bk, const float* lse, float* s) {
  const D d;
  for (int64_t r = 0; r < bq; ++r) {
    float* sr = s + r * bk;
    if (r >= rows || lse[r] == -std::numeric_limits<float>::infinity()) {
      zero_row(d, sr, bk);
      continue;
    }
    exp_row<true>(d, sr, cols, bk, lse[r]);
  }
}

void ds(const float* p, const float* delta, float scale, int64_t bq, int64_t bk, float* dp) {
  const D d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  const V sv = hn::Set(d, scale);
  for (int64_t r = 0; r < bq; ++r) {
    const float* pr = p + r * bk;
    float* dr = dp + r * bk;
    const V dv = hn::Set(d, delta[r]);
    for (int64_t j = 0; j < bk; j += L) {
      const V x = hn::Sub(hn::LoadU(d, dr + j), dv);
      hn::StoreU(hn::Mul(hn::Mul(sv, hn::LoadU(d, pr + j)), x), d, dr + j);
    }
  }
}

// One multiply-add per term (fused where gemm's is), in order from 0: gemm_block's chain for one
// element of C.
float dot(const float* a, const float* b, int64_t n) {
  const hn::CappedTag<float, 1> d1;
  auto sum = hn::Zero(d1);
  for (int64_t i = 0; i < n; ++i) sum = hn::MulAdd(hn::Set(d1, a[i]), hn::Set(d1, b[i]), sum);
  return hn::GetLane(sum);
}

void exp2_n(const float* x, float* y, int64_t n) {
  const D d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t i = 0; i < n; i += L) hn::StoreU(exp2_v(d, hn::LoadU(d, x + i)), d, y + i);
}

}  // namespace

}  // namespace HWY_NAMESPACE
}  // namespace loom::kernels
HWY_AFTER_NAMESPACE();

// This target's table (name: the LOOM_KERNEL name, see tile_ops.h). Outside HWY_BEFORE_NAMESPACE
// on purpose: it is compiled for the baseline, so building the table of a target the CPU lacks
// (kernel_targets() lists them all) runs none of that target's instructions.
namespace loom::kernels::HWY_NAMESPACE {
const TileOps* target_ops() {
  static const TileOps ops{target_name(HWY_TARGET),
                           128,
                           gemm,
                           gemm_panels,
                           gemm_panels_next,
                           gemm_panels_bf16,
                           softmax_update,
                           probs,
                           ds,
                           dot,
                           nullptr,
                           nullptr,
                           nullptr,
                           nullptr,
                           exp2_n};
  return &ops;
}
}  // namespace loom::kernels::HWY_NAMESPACE

#if HWY_ONCE

#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "loom/error.h"

namespace loom::kernels {

HWY_EXPORT(target_ops);

const char* target_name(int64_t hwy_target) {
  switch (hwy_target) {
    case HWY_AVX3_DL:
      return "avx512dl";
    case HWY_AVX3:
      return "avx512";
    case HWY_AVX2:
      return "avx2";
    case HWY_SSE4:
      return "sse4";
    case HWY_SSSE3:
      return "ssse3";
    case HWY_NEON:
      return "neon";
    case HWY_SVE:
      return "sve";
    case HWY_SVE2:
      return "sve2";
    case HWY_SVE_256:
      return "sve256";
    case HWY_SVE2_128:
      return "sve2_128";
    case HWY_EMU128:
      return "emu128";
    case HWY_SCALAR:
      return "scalar";
    default:
      return "unknown";
  }
}

namespace {

#if HWY_TARGETS & HWY_AVX3
// The avx512 table with the vdpbf16ps dot products of tile_ops_avx512bf16.cc.
const TileOps* avx512bf16_ops() {
  static const TileOps ops = [] {
    TileOps t = *N_AVX3::target_ops();
    t.name = "avx512bf16";
    t.gemm_bf16 = avx512bf16_gemm;
    t.to_bf16 = avx512bf16_to_bf16;
    t.to_bf16_pairs = avx512bf16_to_bf16_pairs;
    t.dot_bf16 = avx512bf16_dot;
    return t;
  }();
  return &ops;
}

bool cpu_has_avx512_bf16_flag() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// Whether the CPU is Intel's (CPUID's vendor). On the one Intel core measured with
// avx512_bf16 (the Sapphire Rapids Xeon of docs/performance.md rounds 22-23) the vdpbf16ps kernels
// ran at 0.64-0.68x fp32 and the widening avx512 table's bf16 at 1.0x; on AMD's Zen 4 and Zen 5 the
// vdpbf16ps ones ran at 1.6-2.0x. So automatic dispatch prefers vdpbf16ps over widening on other
// vendors only (build_targets).
bool cpu_is_intel() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  return __builtin_cpu_is("intel");
#else
  return false;
#endif
}

#if defined(__x86_64__) && defined(__linux__)
// The avx512bf16 table with the bf16 GEMM and its dot chain on AMX tiles (tile_ops_amx.cc).
const TileOps* amx_ops() {
  static const TileOps ops = [] {
    TileOps t = *avx512bf16_ops();
    t.name = "amx";
    t.gemm_bf16 = amx_gemm;
    t.dot_bf16 = amx_dot;
    return t;
  }();
  return &ops;
}

// Whether this process may run AMX-BF16: the CPU reports AMX-TILE and AMX-BF16 (CPUID leaf 7,
// EDX bits 24 and 22) and Linux grants the process the tile data state (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, Linux 5.16 and later). The grant is per process and
// asked for once, when the target list is first built; its one side effect is that Linux then
// needs signal stacks large enough for the tile state (an alternate signal stack smaller than
// the kernel's AT_MINSIGSTKSZ is refused, and a process holding one is refused the grant), as
// for any AMX user such as oneDNN. Without the grant the first tile instruction would fault, so a
// refusal (an older kernel, a hypervisor that hides the state, a small signal stack) leaves the
// path not runnable.
// Called once, by build_targets().
bool amx_bf16_ready() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
  if (((edx >> 24) & 1u) == 0 || ((edx >> 22) & 1u) == 0) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}
#endif
#endif

// Every target of this build, best first. HWY_CHOOSE_<T>(f) is this target's f, or nullptr where
// the build does not compile it. The baseline comes last: emu128 (or scalar) on x86-64; on Arm
// the baseline is neon itself, which has no separate fallback. A target runs here when the CPU
// has it (hwy::SupportedTargets).
std::vector<KernelTarget> build_targets() {
  using Ops = const TileOps* (*)();
  struct Compiled {
    int64_t target;
    Ops ops;
  };
#define LOOM_COMPILED(T)                \
  Compiled {                            \
    HWY_##T, HWY_CHOOSE_##T(target_ops) \
  }
  // clang-format off
  const Compiled compiled[] = {
      LOOM_COMPILED(AVX3_DL), LOOM_COMPILED(AVX3), LOOM_COMPILED(AVX2), LOOM_COMPILED(SSE4),
      LOOM_COMPILED(SSSE3), LOOM_COMPILED(SVE2_128), LOOM_COMPILED(SVE_256), LOOM_COMPILED(SVE2),
      LOOM_COMPILED(SVE), LOOM_COMPILED(NEON),
#if HWY_TARGETS & (HWY_EMU128 | HWY_SCALAR)
      Compiled{(HWY_TARGETS & HWY_EMU128) ? HWY_EMU128 : HWY_SCALAR,
               HWY_CHOOSE_FALLBACK(target_ops)},
#endif
  };
  // clang-format on
#undef LOOM_COMPILED
  const int64_t supported = hwy::SupportedTargets();
  std::vector<KernelTarget> t;
  for (const Compiled& c : compiled) {
    if (c.ops == nullptr) continue;
    const bool runs = (supported & c.target) != 0;
    t.push_back(KernelTarget{c.ops()->name, c.ops(), runs});
#if HWY_TARGETS & HWY_AVX3
    // AVX-512 with native bf16 dot products: the AVX-512 table plus tile_ops_avx512bf16.cc, right
    // before it, or right after it on Intel (cpu_is_intel); amx first (on the AMX Xeon of
    // docs/performance.md round 22 the vdpbf16ps kernels ran at 0.7 of fp32, amx at 3-4x).
    if (c.target == HWY_AVX3) {
      const KernelTarget dots{avx512bf16_ops()->name, avx512bf16_ops(),
                              runs && cpu_has_avx512_bf16_flag()};
      t.insert(cpu_is_intel() ? t.end() : t.end() - 1, dots);
#if defined(__x86_64__) && defined(__linux__)
      t.insert(t.end() - 2, KernelTarget{amx_ops()->name, amx_ops(),
                                         runs && cpu_has_avx512_bf16_flag() && amx_bf16_ready()});
#endif
    }
#endif
  }
  return t;
}

std::string names(const std::vector<KernelTarget>& t, bool runnable_only) {
  std::string s;
  for (const KernelTarget& k : t) {
    if (runnable_only && !k.runnable) continue;
    if (!s.empty()) s += ", ";
    s += k.name;
  }
  return s;
}

}  // namespace

const std::vector<KernelTarget>& kernel_targets() {
  static const std::vector<KernelTarget> targets = build_targets();
  return targets;
}

const TileOps* find_target(const std::string& name) {
  const std::vector<KernelTarget>& t = kernel_targets();
  const std::string want = name == "portable" ? std::string(t.back().name) : name;
  for (const KernelTarget& k : t)
    if (want == k.name) return k.ops;
  return nullptr;
}

const TileOps& best_ops() {
  // The first target this CPU runs: the list is in Highway's order of preference (its
  // HWY_DYNAMIC_DISPATCH choice, less SVE lengths that build_targets rules out), with the bf16 dot
  // products ahead of plain AVX-512 where the CPU has them. The baseline always runs.
  static const TileOps* best = [] {
    for (const KernelTarget& k : kernel_targets())
      if (k.runnable) return k.ops;
    return kernel_targets().back().ops;
  }();
  return *best;
}

const TileOps& select_ops() {
  const char* env = std::getenv("LOOM_KERNEL");
  if (env == nullptr || env[0] == '\0' || std::strcmp(env, "auto") == 0) return best_ops();
  const std::vector<KernelTarget>& t = kernel_targets();
  const std::string want = std::strcmp(env, "portable") == 0 ? t.back().name : env;
  for (const KernelTarget& k : t) {
    if (want != k.name) continue;
    LOOM_CHECK(k.runnable, NotSupported,
               "LOOM_KERNEL=" << env << ": this CPU cannot run that target (runnable here: "
                              << names(t, true) << ")");
    return *k.ops;
  }
  static const char* const kKnown[] = {"amx",    "avx512dl", "avx512", "avx512bf16", "avx2",
                                       "sse4",   "ssse3",    "neon",   "sve",        "sve2",
                                       "sve256", "sve2_128", "emu128", "scalar"};
  for (const char* k : kKnown)
    LOOM_CHECK(want != k, NotSupported,
               "LOOM_KERNEL=" << env << ": that target is not compiled into this build (compiled: "
                              << names(t, false) << ")");
  LOOM_CHECK(false, InvalidArgument,
             "LOOM_KERNEL=" << env << " is not a kernel target; accepted: auto, portable, "
                            << names(t, false));
  return best_ops();  // not reached
}

}  // namespace loom::kernels

#endif  // HWY_ONCE
