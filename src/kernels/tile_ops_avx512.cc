// The AVX-512 path of the tile operations (see tile_ops.h): a register-blocked fp32 GEMM with FMA,
// and the softmax steps with a 16-wide exp.
//
// This file is compiled with AVX-512 flags (src/kernels/CMakeLists.txt) while the rest of loom is
// not, so nothing here may be reached unless cpu_has_avx512() said yes, and this file must not
// emit out-of-line copies of inline functions or templates that other files also use (the linker
// could keep this file's AVX-512 copy for them): it calls no std:: algorithms and none of the
// inline helpers of tile_ops.h, only intrinsics and its own internal-linkage functions.
//
// GEMM. C[M, N] = alpha A B (+ C) with M % 4 == 0 and N % 16 == 0 (the packing pads to that).
// The register block is 8 rows x 32 columns of C (16 zmm accumulators; 4 x 32, 8 x 16, 4 x 16 at
// the edges). For each step k of the reduction it loads two 16-wide vectors of row k of B and
// broadcasts a(i, k) of each of its rows: 16 FMAs for 2 loads and 8 broadcasts, so the one
// 512-bit FMA per cycle of Zen 4 (two 256-bit pipes) stays the bound. Columns are the outer loop:
// a 32-column panel of B (K x 128 bytes: 16 KiB for K = 128) stays in L1 while the row blocks of
// A pass over it. Each C element is a sequential fused multiply-add chain over k, starting from 0
// (what dot() reproduces for compute_delta).
//
// exp. exp_ps is the range reduction and degree-6 polynomial of fast_exp (tile_ops.h) evaluated
// with FMAs, and 2^n applied with vscalefps: x = n ln2 + r, |r| <= ln2/2 (n = round(x log2 e)),
// r = (x - n ln2_hi) - n ln2_lo with ln2_hi exact in 9 bits, so n ln2_hi is exact for |n| <= 128
// and r carries an absolute error below 2^-24 |r|-ish; the Cephes polynomial approximates exp(r)
// to relative 1.2e-7 on that interval, and the Horner steps in fp32 add about 2 ulp. Bound used by
// the tests (test_kernels_exp.cc): relative error <= 4 ulp (4.8e-7) of exp(x) on [-87, 0], exactly
// 0 for x < -87 and for x = -inf.
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

constexpr float kInf = __builtin_huge_valf();

inline __m512 exp_ps(__m512 x) {
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpMin)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 r2 = _mm512_mul_ps(r, r);
  const __m512 y = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpMin), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(y, n));
}

inline float exp_ss(float x) {
  return _mm512_cvtss_f32(exp_ps(_mm512_set1_ps(x)));
}

// Horizontal max and sum (GCC 12's _mm512_reduce_* warn about an uninitialised operand).
inline float hmax(__m512 x) {
  __m256 y = _mm256_max_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
  __m128 z = _mm_max_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
  z = _mm_max_ps(z, _mm_movehl_ps(z, z));
  z = _mm_max_ss(z, _mm_movehdup_ps(z));
  return _mm_cvtss_f32(z);
}

inline float hsum(__m512 x) {
  __m256 y = _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
  __m128 z = _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
  z = _mm_add_ps(z, _mm_movehl_ps(z, z));
  z = _mm_add_ss(z, _mm_movehdup_ps(z));
  return _mm_cvtss_f32(z);
}

// Lanes [0, n) of a 16-wide vector, n clamped to [0, 16].
inline __mmask16 lanes(int64_t n) {
  if (n >= 16) return static_cast<__mmask16>(0xffff);
  if (n <= 0) return 0;
  return static_cast<__mmask16>((1u << n) - 1u);
}

template <int R, int NV>
inline __attribute__((always_inline)) void gemm_block(int64_t K, const float* a, int64_t a_rs,
                                                      int64_t a_ks, const float* b, int64_t ldb,
                                                      float alpha, bool accumulate, float* c,
                                                      int64_t ldc) {
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* bk = b + k * ldb;
    const float* ak = a + k * a_ks;
    __m512 bv[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_ps(bk + 16 * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(ak[r * a_rs]);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
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
void gemm_columns(int64_t M, int64_t K, const float* a, int64_t a_rs, int64_t a_ks, const float* b,
                  int64_t ldb, float alpha, bool accumulate, float* c, int64_t ldc) {
  int64_t i0 = 0;
  for (; i0 + 8 <= M; i0 += 8)
    gemm_block<8, NV>(K, a + i0 * a_rs, a_rs, a_ks, b, ldb, alpha, accumulate, c + i0 * ldc, ldc);
  for (; i0 < M; i0 += 4)
    gemm_block<4, NV>(K, a + i0 * a_rs, a_rs, a_ks, b, ldb, alpha, accumulate, c + i0 * ldc, ldc);
}

void gemm_avx512(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs, int64_t a_ks,
                 const float* b, int64_t ldb, float alpha, bool accumulate, float* c, int64_t ldc) {
  int64_t j0 = 0;
  for (; j0 + 32 <= N; j0 += 32)
    gemm_columns<2>(M, K, a, a_rs, a_ks, b + j0, ldb, alpha, accumulate, c + j0, ldc);
  for (; j0 < N; j0 += 16)
    gemm_columns<1>(M, K, a, a_rs, a_ks, b + j0, ldb, alpha, accumulate, c + j0, ldc);
}

void zero_row(float* x, int64_t n) {
  for (int64_t j = 0; j < n; j += 16) _mm512_storeu_ps(x + j, _mm512_setzero_ps());
}

void softmax_update_avx512(int64_t rows, int64_t cols, int64_t bq, int64_t bk, int64_t dp, float* s,
                           float* m, float* l, float* acc) {
  const __m512 neg_inf = _mm512_set1_ps(-kInf);
  for (int64_t r = 0; r < bq; ++r) {
    float* sr = s + r * bk;
    float tile_max = -kInf;
    if (r < rows) {
      __m512 vmax = neg_inf;
      for (int64_t j = 0; j < cols; j += 16)
        vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(neg_inf, lanes(cols - j), sr + j));
      tile_max = hmax(vmax);
    }
    const float m_new = m[r] > tile_max ? m[r] : tile_max;
    if (m_new == -kInf) {  // padding, or no visible key so far: nothing to add
      zero_row(sr, bk);
      continue;
    }
    const float alpha = exp_ss(m[r] - m_new);  // m[r] = -inf: 0
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < bk; j += 16) {
      const __mmask16 k = lanes(cols - j);
      const __m512 p = _mm512_maskz_mov_ps(k, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + j), mv)));
      _mm512_storeu_ps(sr + j, p);
      sum = _mm512_add_ps(sum, p);
    }
    l[r] = alpha * l[r] + hsum(sum);
    m[r] = m_new;
    if (alpha != 1.0f) {
      const __m512 av = _mm512_set1_ps(alpha);
      float* ar = acc + r * dp;
      for (int64_t d = 0; d < dp; d += 16)
        _mm512_storeu_ps(ar + d, _mm512_mul_ps(av, _mm512_loadu_ps(ar + d)));
    }
  }
}

void probs_avx512(int64_t rows, int64_t cols, int64_t bq, int64_t bk, const float* lse, float* s) {
  for (int64_t r = 0; r < bq; ++r) {
    float* sr = s + r * bk;
    if (r >= rows || lse[r] == -kInf) {
      zero_row(sr, bk);
      continue;
    }
    const __m512 lv = _mm512_set1_ps(lse[r]);
    for (int64_t j = 0; j < bk; j += 16) {
      const __m512 p = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + j), lv));
      _mm512_storeu_ps(sr + j, _mm512_maskz_mov_ps(lanes(cols - j), p));
    }
  }
}

void ds_avx512(const float* p, const float* delta, float scale, int64_t bq, int64_t bk, float* dp) {
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < bq; ++r) {
    const float* pr = p + r * bk;
    float* dr = dp + r * bk;
    const __m512 dv = _mm512_set1_ps(delta[r]);
    for (int64_t j = 0; j < bk; j += 16) {
      const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(dr + j), dv);
      _mm512_storeu_ps(dr + j, _mm512_mul_ps(_mm512_mul_ps(sv, _mm512_loadu_ps(pr + j)), x));
    }
  }
}

// One fused multiply-add per term, in order from 0: gemm_block's chain for one element of C.
float dot_avx512(const float* a, const float* b, int64_t n) {
  __m128 sum = _mm_setzero_ps();
  for (int64_t i = 0; i < n; ++i) sum = _mm_fmadd_ss(_mm_set_ss(a[i]), _mm_set_ss(b[i]), sum);
  return _mm_cvtss_f32(sum);
}

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

void exp_avx512(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(y + i, exp_ps(_mm512_loadu_ps(x + i)));
}

}  // namespace

const TileOps* avx512_ops(bool with_bf16) {
  static const TileOps fp32{"avx512",     128,       gemm_avx512, softmax_update_avx512,
                            probs_avx512, ds_avx512, dot_avx512,  nullptr,
                            nullptr,      exp_avx512};
  static const TileOps bf16{"avx512bf16",   128,       gemm_avx512, softmax_update_avx512,
                            probs_avx512,   ds_avx512, dot_avx512,  gemm_bf16_avx512,
                            to_bf16_avx512, exp_avx512};
  return with_bf16 ? &bf16 : &fp32;
}

#else

const TileOps* avx512_ops(bool) {
  return nullptr;
}

#endif

}  // namespace loom::kernels
