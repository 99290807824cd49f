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

}  // namespace loom::kernels
