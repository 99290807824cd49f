// Tile operations of the blockwise kernels (internal to src/kernels): a small GEMM on packed tiles,
// the softmax steps and a vectorised 2^x, once per instruction-set target. The kernels compute
// their scores in base 2 (scale log2 e q k^T), so the softmax's exp(s - m) is 2^(s2 - m2).
//
// The GEMM works on tiles already packed into contiguous, padded buffers: rows padded to a
// multiple of kMr, columns to a multiple of kNr, so its inner loops have no remainders. The A
// operand is read through two strides, so one routine computes A B, A^T B and (with B packed
// transposed) A B^T. The implementation is one Highway source (tile_ops_hwy.cc), compiled for
// every target Highway knows for the build's architecture and chosen at run time.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace loom::kernels {

constexpr int64_t kMr = 4;   // rows of the GEMM register block
constexpr int64_t kNr = 16;  // columns of the GEMM register block

constexpr int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

constexpr float kExp2Min = -125.0f;  // below this 2^x < 2^-125 (2.4e-38): returned as 0

// rows rows of bytes bytes each, stride bytes apart, from p (p null or rows or bytes <= 0: empty).
struct PrefetchRegion {
  const void* p = nullptr;
  int64_t rows = 0, bytes = 0, stride = 0;
  bool empty() const { return p == nullptr || rows <= 0 || bytes <= 0; }
};

// ---------------------------------------------------------------------------------------------
// Instruction-set paths. The blockwise kernels do all their tile arithmetic through one TileOps
// table, chosen once per kernel call by select_ops(). The tables come from tile_ops_hwy.cc, one
// per Highway target compiled into this build (x86-64: avx512, avx2, sse4, ssse3 and the
// baseline, scalar with g++ 12.2 and emu128 with a compiler Highway trusts with it; 64-bit Arm:
// sve2_128, sve256, sve2, sve and the baseline neon), plus avx512bf16: the avx512 table with the
// vdpbf16ps dot products of tile_ops_avx512bf16.cc (Highway 1.0.3 has no native bf16 dot product),
// used when the CPU also reports avx512_bf16, and amx: the avx512bf16 table with gemm_bf16 and
// dot_bf16 on Intel's AMX tiles (tile_ops_amx.cc), used when the CPU also reports AMX-TILE and
// AMX-BF16 and Linux grants the process the tile state. sve256 and sve2_128 run only where the SVE
// vectors are exactly 256 and 128 bits; sve and sve2 at any length.
// The environment variable LOOM_KERNEL forces one: auto (or unset or empty) is the first target in
// kernel_targets() that the CPU runs (Highway's order of preference, with amx ahead of
// avx512bf16 ahead of avx512 where the CPU has them, except that on Intel CPUs avx512bf16 comes
// after avx512: its vdpbf16ps kernels ran at 0.64-0.68x fp32 on Intel's Sapphire Rapids, widening
// at 1.0x); portable is the baseline target; any other
// value must be the name of a compiled target the CPU runs, else select_ops() throws
// (InvalidArgument: not a target name; NotSupported: not compiled, or the CPU cannot run it). All
// paths give results within the fp32 tolerance of the fp64 reference; they are not bitwise equal
// (FMA vs separate multiply-add, vector widths).
//
// Tile layout (as in blockwise.cc): s, dp [bq, bk]; acc [bq, dp_]; rows/cols are the real
// extents, the rest is padding.
struct TileOps {
  const char* name;
  // Smallest side of the work tiles the blockwise kernels compute on (0: the config's tiles).
  int64_t work_tile;
  // C[M, N] = alpha * (A B) (+ C when accumulate), A(i, k) = a[i * a_rs + k * a_ks], B row-major
  // [K, N] with row stride ldb, C row-major with row stride ldc. M % kMr == 0, N % kNr == 0.
  // C must not alias A or B.
  void (*gemm)(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs, int64_t a_ks,
               const float* b, int64_t ldb, float alpha, bool accumulate, float* c, int64_t ldc);
  // The same with B packed in column panels of kNr: B(k, j) = b[(j / kNr) * b_ps + k * kNr +
  // j % kNr] (each panel K x kNr contiguous, panels b_ps >= K * kNr apart).
  void (*gemm_panels)(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs, int64_t a_ks,
                      const float* b, int64_t b_ps, float alpha, bool accumulate, float* c,
                      int64_t ldc);
  // gemm_panels that also prefetches towards L2 what the caller reads after this call: the
  // `regions` regions of next, in order, a few cache lines per register block, in place of
  // gemm_panels' up-front prefetch of this call's own operands (which it keeps when there is
  // nothing to prefetch). Prefetches are hints: a region need not be mapped.
  void (*gemm_panels_next)(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs,
                           int64_t a_ks, const float* b, int64_t b_ps, float alpha, bool accumulate,
                           float* c, int64_t ldc, const PrefetchRegion* next, int64_t regions);
  // gemm_panels_next with B in the same column panels as bf16 bit patterns (b_ps in elements):
  // each panel is widened to fp32 (exactly) into scratch, 2 * K * kNr floats that the caller
  // provides (no alignment needed), just before the row blocks pass over it. The product is
  // bitwise gemm_panels_next's on the widened B; B's bytes from memory are halved. regions may be
  // 0 (then it prefetches its own operands, as gemm_panels does).
  void (*gemm_panels_bf16)(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs,
                           int64_t a_ks, const uint16_t* b, int64_t b_ps, float alpha,
                           bool accumulate, float* c, int64_t ldc, float* scratch,
                           const PrefetchRegion* next, int64_t regions);
  // Online softmax update of rows [0, rows) of the scores s, in base-2 units (the scale carries
  // log2 e; m in the same units): s becomes p = 2^(s - m') (zero in the padding and in rows that
  // have seen no visible key), l and acc [bq, dp] are rescaled by 2^(m - m'). A NaN score makes
  // its p, and so the row's l (and acc through p v), NaN, as the formula's exp does.
  void (*softmax_update)(int64_t rows, int64_t cols, int64_t bq, int64_t bk, int64_t dp, float* s,
                         float* m, float* l, float* acc);
  // Backward: s becomes p = 2^(s - lse), s and lse in base-2 units (zero in the padding and in
  // rows with lse = -inf). s - lse above 127 (an lse that is not these scores') gives 2^127; a
  // NaN score or lse gives NaN.
  void (*probs)(int64_t rows, int64_t cols, int64_t bq, int64_t bk, const float* lse, float* s);
  // Backward: dp becomes ds = scale * p (dp - delta).
  void (*ds)(const float* p, const float* delta, float scale, int64_t bq, int64_t bk, float* dp);
  // sum_i a[i] b[i], accumulated in the order (and with the fused or unfused multiply-add) in
  // which `gemm` accumulates one element of C: compute_delta uses it so that dp - delta cancels
  // exactly when a row's probability sits on one key.
  float (*dot)(const float* a, const float* b, int64_t n);
  // bf16 dot products (nullptr on paths without them; the kernels then widen bf16 operands to
  // fp32 when packing and use `gemm`): C[M, N] = alpha sum_t A(i, t) . B(t, j) (+ C), where
  // A(i, t) is the pair a[i * lda + 2t], a[i * lda + 2t + 1] and B(t, j) the pair
  // b[t * ldb + 2j], b[t * ldb + 2j + 1] (bf16 bit patterns; products exact, sums fp32).
  // M % 4 == 0, N % 16 == 0. As vdpbf16ps and TDPBF16PS compute, whatever MXCSR says, subnormal
  // inputs count as zero and products and partial sums below FLT_MIN are flushed to zero (alpha
  // and the add of C are ordinary fp32): the kernels lift small operands first (blockwise.cc,
  // "lifting").
  void (*gemm_bf16)(int64_t M, int64_t N, int64_t K2, const uint16_t* a, int64_t lda,
                    const uint16_t* b, int64_t ldb, float alpha, bool accumulate, float* c,
                    int64_t ldc);
  // y[i] = x[i] rounded to bf16 (nearest, ties to even; vcvtneps2bf16 flushes subnormals to
  // zero), n % 16 == 0.
  void (*to_bf16)(const float* x, uint16_t* y, int64_t n);
  // Rows 2t and 2t + 1 of x [rows, cols] (row stride cols) rounded to bf16 and interleaved into
  // the pairs of gemm_bf16's B: y[t * 2 cols + 2j + e] = bf16(x[(2t + e) cols + j]); rows even,
  // cols % 16 == 0 (nullptr with gemm_bf16).
  void (*to_bf16_pairs)(const float* x, int64_t rows, int64_t cols, uint16_t* y);
  // sum_t a(t) . b(t) over n2 bf16 pairs (a + 2t, b + 2t), in the order and with the roundings in
  // which gemm_bf16 computes one element of C with alpha 1: compute_delta's dot for the
  // backward's bf16 dp GEMM (nullptr with gemm_bf16).
  float (*dot_bf16)(const uint16_t* a, const uint16_t* b, int64_t n2);
  // y[i] = 2^x[i] by the path's softmax exp (for its test), n % 16 == 0, x[i] <= 127. Bound:
  // relative error <= 4 ulp (4 * 2^-23) for x in [-125, 0]; exactly 0 for x < -125 and -inf; NaN
  // for NaN.
  void (*exp2)(const float* x, float* y, int64_t n);
};

// One compiled target: its table and whether the CPU running this process can run it.
struct KernelTarget {
  const char* name;
  const TileOps* ops;
  bool runnable;
};
// Every target of this build, best first (the last is the baseline).
const std::vector<KernelTarget>& kernel_targets();
// The table of a compiled target by LOOM_KERNEL name ("portable": the baseline), or nullptr.
// The caller must check that it is runnable before calling into it.
const TileOps* find_target(const std::string& name);
// The best table this CPU runs.
const TileOps& best_ops();
// The table for this call (LOOM_KERNEL, then the CPU), see above. Throws loom::InvalidArgument or
// loom::NotSupported for a LOOM_KERNEL it cannot honour.
const TileOps& select_ops();

// The LOOM_KERNEL name of a Highway target bit (HWY_AVX2, ...).
const char* target_name(int64_t hwy_target);
#if defined(__x86_64__)
// tile_ops_avx512bf16.cc (compiled with AVX-512 + BF16 flags): TileOps::gemm_bf16, to_bf16,
// to_bf16_pairs and dot_bf16 of the avx512bf16 path. Only call them when the CPU reports
// avx512_bf16.
void avx512bf16_gemm(int64_t M, int64_t N, int64_t K2, const uint16_t* a, int64_t lda,
                     const uint16_t* b, int64_t ldb, float alpha, bool accumulate, float* c,
                     int64_t ldc);
void avx512bf16_to_bf16(const float* x, uint16_t* y, int64_t n);
void avx512bf16_to_bf16_pairs(const float* x, int64_t rows, int64_t cols, uint16_t* y);
float avx512bf16_dot(const uint16_t* a, const uint16_t* b, int64_t n2);
// tile_ops_amx.cc (compiled with AMX + AVX-512 flags): TileOps::gemm_bf16 and dot_bf16 of the amx
// path on AMX tiles. Only call them when the amx target is runnable (CPU and Linux, see
// kernel_targets()).
void amx_gemm(int64_t M, int64_t N, int64_t K2, const uint16_t* a, int64_t lda, const uint16_t* b,
              int64_t ldb, float alpha, bool accumulate, float* c, int64_t ldc);
float amx_dot(const uint16_t* a, const uint16_t* b, int64_t n2);
#endif

}  // namespace loom::kernels
