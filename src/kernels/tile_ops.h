// Tile operations of the blockwise kernels (internal to src/kernels): a small GEMM on packed tiles
// and a vectorisable exp.
//
// The GEMM works on tiles already packed into contiguous, padded buffers: rows padded to a
// multiple of kMr, columns to a multiple of kNr, so its inner loops have no remainders. It keeps a
// kMr x kNr block of C in a local array that GCC holds in vector registers and, for each step k
// of the reduction, adds the outer product of a kMr-column of A and a kNr-row of B. The A operand
// is read through two strides, so one routine computes A B, A^T B and (with B packed transposed)
// A B^T. This is portable C++ that GCC auto-vectorises at -O3; an ISA-specific micro-kernel can
// replace gemm_tile behind the same signature.
//
// fast_exp is exp(x) by range reduction x = n ln2 + r, |r| <= ln2 / 2, and the Cephes degree-6
// polynomial for exp(r) (relative error about 1e-7, a few ulp), scaled by 2^n through the exponent
// bits. It has no branches or library calls, so loops over it vectorise. x < kExpMin (including
// -inf) gives exactly 0; x must not be NaN and x <= 88 (the kernels call it on s - m <= 0 and on
// s - lse, which is <= 0 up to rounding).
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>

namespace loom::kernels {

constexpr int64_t kMr = 4;   // rows of the GEMM register block
constexpr int64_t kNr = 16;  // columns of the GEMM register block

constexpr int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

constexpr float kExpMin = -87.0f;  // below this exp(x) < 1.7e-38: returned as 0

inline float fast_exp(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float xc = std::min(std::max(x, kExpMin), 88.0f);
  const float n = (xc * kLog2e + kRound) - kRound;
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const float pow2n = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return x < kExpMin ? 0.0f : y * pow2n;
}

// C[M, N] = alpha * (A B) (+ C when accumulate), A(i, k) = a[i * a_rs + k * a_ks], B row-major
// [K, N] with row stride ldb, C row-major with row stride ldc. M % kMr == 0, N % kNr == 0.
// C must not alias A or B.
void gemm_tile(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs, int64_t a_ks,
               const float* b, int64_t ldb, float alpha, bool accumulate, float* c, int64_t ldc);

// ---------------------------------------------------------------------------------------------
// Instruction-set paths. The blockwise kernels do all their tile arithmetic through one TileOps
// table, chosen once per kernel call by select_ops():
//   portable  the code above and in tile_ops.cc, plain C++ at the build's baseline ISA;
//   avx512    intrinsics in tile_ops_avx512.cc (compiled with per-file AVX-512 + FMA flags),
//             used only when the CPU reports avx512f, avx512bw, avx512vl, avx512dq and fma;
//   avx512bf16  the same plus vdpbf16ps dot products for bf16 storage (CPU flag avx512_bf16).
// The environment variable LOOM_KERNEL = portable | avx512 | avx512bf16 | auto (unset: auto)
// forces a path; one the CPU lacks falls back to the next best. Both paths give results within the
// fp32 tolerance of the fp64 reference; they are not bitwise equal (FMA vs separate multiply-add).
//
// Tile layout (as in blockwise.cc): s, dp [bq, bk]; acc [bq, dp_]; rows/cols are the real
// extents, the rest is padding.
struct TileOps {
  const char* name;
  // Smallest side of the work tiles the blockwise kernels compute on (0: the config's tiles).
  int64_t work_tile;
  // gemm_tile's contract.
  void (*gemm)(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs, int64_t a_ks,
               const float* b, int64_t ldb, float alpha, bool accumulate, float* c, int64_t ldc);
  // Online softmax update of rows [0, rows) of the scores s: s becomes p = exp(s - m') (zero in
  // the padding and in rows that have seen no visible key), l and acc [bq, dp] are rescaled.
  void (*softmax_update)(int64_t rows, int64_t cols, int64_t bq, int64_t bk, int64_t dp, float* s,
                         float* m, float* l, float* acc);
  // Backward: s becomes p = exp(s - lse) (zero in the padding and in rows with lse = -inf).
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
  // M % 4 == 0, N % 16 == 0.
  void (*gemm_bf16)(int64_t M, int64_t N, int64_t K2, const uint16_t* a, int64_t lda,
                    const uint16_t* b, int64_t ldb, float alpha, bool accumulate, float* c,
                    int64_t ldc);
  // y[i] = x[i] rounded to bf16 (nearest, ties to even), n % 16 == 0.
  void (*to_bf16)(const float* x, uint16_t* y, int64_t n);
  // y[i] = exp(x[i]) by the path's softmax exp (for its test), n % 16 == 0. Bound: relative
  // error <= 4 ulp (4 * 2^-23) for x in [-87, 0]; exactly 0 for x < -87 (and -inf).
  void (*exp)(const float* x, float* y, int64_t n);
};

const TileOps& portable_ops();
// The AVX-512 table (with_bf16: including the AVX512-BF16 dot products), or nullptr when this
// build has no AVX-512 path.
const TileOps* avx512_ops(bool with_bf16);
// True when the CPU running this process supports the AVX-512 path (and AVX512-BF16).
bool cpu_has_avx512();
bool cpu_has_avx512_bf16();
// The table for this call: LOOM_KERNEL, then the CPU. LOOM_KERNEL = portable: the portable
// table; avx512: AVX-512 fp32 (bf16 widened to fp32); avx512bf16 or auto (or unset): the best
// the CPU supports. A path the CPU lacks falls back to the next best one.
const TileOps& select_ops();

}  // namespace loom::kernels
