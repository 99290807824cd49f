// The AVX512-BF16 part of the avx512bf16 path (see tile_ops.h): the bf16 dot-product GEMM
// (vdpbf16ps), its one-element chain (for compute_delta) and the fp32 -> bf16 rounding
// (vcvtneps2bf16), row-major and into interleaved row pairs. Highway 1.0.3, which provides every
// other tile operation (tile_ops_hwy.cc), has no native bf16 dot product (its
// ReorderWidenMulAccumulate for bf16 widens with shifts), so these stay hand-written.
//
// This file is compiled with AVX-512 + BF16 flags (src/kernels/CMakeLists.txt) while the rest of
// loom is not, so nothing here may be reached unless the CPU reports avx512f/bw/vl and avx512_bf16
// (kernel_targets() marks the path runnable only then), and this file must not emit out-of-line
// copies of inline functions or templates that other files also use: it calls no std::
// algorithms, only intrinsics and its own internal-linkage functions.
//
// GEMM. C[M, N] = alpha sum_t A(i, t) . B(t, j) (+ C) on bf16 pairs, M % 4 == 0, N % 16 == 0. The
// register block is 8 rows x 32 columns of C (16 zmm accumulators; 4 x 32, 8 x 16, 4 x 16 at the
// edges); for each pair step t it loads two vectors of 16 pairs of row t of B and broadcasts the
// pair a(i, t) of each of its rows. Products are exact, sums fp32.
#include "tile_ops.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// GCC 12's AVX-512 intrinsics pass _mm512_undefined_ps() as the unused merge operand, which
// -Wmaybe-uninitialized reports at every inlined use (GCC bug 105593); the warning is about the
// header, not this file.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace loom::kernels {

#if defined(__x86_64__)
namespace {

// bf16 pairs: a(i, t) is the 32-bit pair at a + i * lda + 2t, broadcast; row t of B holds 16
// pairs per 512-bit vector. Same register block and loop order as gemm_block.
inline __m512bh bcast_pair(const uint16_t* p) {
  uint32_t x;
  __builtin_memcpy(&x, p, 4);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x)));
}

inline __m512bh load_pairs(const uint16_t* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}

template <int R, int NV>
inline __attribute__((always_inline)) void gemm_bf16_block(int64_t K2, const uint16_t* a,
                                                           int64_t lda, const uint16_t* b,
                                                           int64_t ldb, float alpha,
                                                           bool accumulate, float* c, int64_t ldc) {
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t t = 0; t < K2; ++t) {
    const uint16_t* bt = b + t * ldb;
    __m512bh bv[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) bv[v] = load_pairs(bt + 32 * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh av = bcast_pair(a + r * lda + 2 * t);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
    }
  }
  const __m512 al = _mm512_set1_ps(alpha);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float* cr = c + r * ldc;
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      const __m512 x = accumulate ? _mm512_fmadd_ps(al, acc[r][v], _mm512_loadu_ps(cr + 16 * v))
                                  : _mm512_mul_ps(al, acc[r][v]);
      _mm512_storeu_ps(cr + 16 * v, x);
    }
  }
}

template <int NV>
void gemm_bf16_columns(int64_t M, int64_t K2, const uint16_t* a, int64_t lda, const uint16_t* b,
                       int64_t ldb, float alpha, bool accumulate, float* c, int64_t ldc) {
  int64_t i0 = 0;
  for (; i0 + 8 <= M; i0 += 8)
    gemm_bf16_block<8, NV>(K2, a + i0 * lda, lda, b, ldb, alpha, accumulate, c + i0 * ldc, ldc);
  for (; i0 < M; i0 += 4)
    gemm_bf16_block<4, NV>(K2, a + i0 * lda, lda, b, ldb, alpha, accumulate, c + i0 * ldc, ldc);
}

void gemm_bf16_avx512(int64_t M, int64_t N, int64_t K2, const uint16_t* a, int64_t lda,
                      const uint16_t* b, int64_t ldb, float alpha, bool accumulate, float* c,
                      int64_t ldc) {
  int64_t j0 = 0;
  for (; j0 + 32 <= N; j0 += 32)
    gemm_bf16_columns<2>(M, K2, a, lda, b + 2 * j0, ldb, alpha, accumulate, c + j0, ldc);
  for (; j0 < N; j0 += 16)
    gemm_bf16_columns<1>(M, K2, a, lda, b + 2 * j0, ldb, alpha, accumulate, c + j0, ldc);
}

void to_bf16_avx512(const float* x, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), reinterpret_cast<__m256i>(h));
  }
}

// Rows 2t and 2t + 1 of x [rows, cols] (row stride cols) rounded to bf16 and interleaved into
// row t of y: y[t * 2 cols + 2j + e] = bf16(x[(2t + e) cols + j]).
void to_bf16_pairs_avx512(const float* x, int64_t rows, int64_t cols, uint16_t* y) {
  for (int64_t t = 0; 2 * t < rows; ++t) {
    const float* r0 = x + 2 * t * cols;
    const float* r1 = r0 + cols;
    uint16_t* out = y + 2 * t * cols;
    for (int64_t j = 0; j < cols; j += 16) {
      const __m256bh a = _mm512_cvtneps_pbh(_mm512_loadu_ps(r0 + j));
      const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(r1 + j));
      const __m512i lo = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(a));
      const __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(b)), 16);
      _mm512_storeu_si512(out + 2 * j, _mm512_or_si512(lo, hi));
    }
  }
}

// One element of gemm_bf16's C: the same vdpbf16ps per pair, in lane 0, in the same order.
float dot_bf16_avx512(const uint16_t* a, const uint16_t* b, int64_t n2) {
  __m128 acc = _mm_setzero_ps();
  for (int64_t t = 0; t < n2; ++t) {
    uint32_t x, y;
    __builtin_memcpy(&x, a + 2 * t, 4);
    __builtin_memcpy(&y, b + 2 * t, 4);
    const __m128bh av = reinterpret_cast<__m128bh>(_mm_cvtsi32_si128(static_cast<int>(x)));
    const __m128bh bv = reinterpret_cast<__m128bh>(_mm_cvtsi32_si128(static_cast<int>(y)));
    acc = _mm_dpbf16_ps(acc, av, bv);
  }
  return _mm_cvtss_f32(_mm_mul_ss(_mm_set_ss(1.0f), acc));
}

}  // namespace

void avx512bf16_to_bf16_pairs(const float* x, int64_t rows, int64_t cols, uint16_t* y) {
  to_bf16_pairs_avx512(x, rows, cols, y);
}

float avx512bf16_dot(const uint16_t* a, const uint16_t* b, int64_t n2) {
  return dot_bf16_avx512(a, b, n2);
}

void avx512bf16_gemm(int64_t M, int64_t N, int64_t K2, const uint16_t* a, int64_t lda,
                     const uint16_t* b, int64_t ldb, float alpha, bool accumulate, float* c,
                     int64_t ldc) {
  gemm_bf16_avx512(M, N, K2, a, lda, b, ldb, alpha, accumulate, c, ldc);
}

void avx512bf16_to_bf16(const float* x, uint16_t* y, int64_t n) {
  to_bf16_avx512(x, y, n);
}

#endif

}  // namespace loom::kernels
