// The portable tile GEMM (see tile_ops.h). Kept in its own translation unit so that its code
// generation does not depend on the call sites it would otherwise be inlined into.
//
// The register block is four named rows of kNr accumulators; for each step k of the reduction the
// four values a(r, k) are broadcast against one kNr-wide row of B. GCC turns the jj loop into
// vector multiply-adds over registers (with SSE2: 4 rows x 4 vectors); the same source with
// -march flags uses wider vectors.
#include "tile_ops.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "loom/attention.h"

namespace loom::kernels {

static_assert(kMr == 4, "gemm_tile's register block has four named rows");

void gemm_tile(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs, int64_t a_ks,
               const float* b, int64_t ldb, float alpha, bool accumulate, float* c, int64_t ldc) {
  for (int64_t i0 = 0; i0 < M; i0 += kMr) {
    const float* a_rows = a + i0 * a_rs;
    for (int64_t j0 = 0; j0 < N; j0 += kNr) {
      float c0[kNr] = {}, c1[kNr] = {}, c2[kNr] = {}, c3[kNr] = {};
      for (int64_t k = 0; k < K; ++k) {
        const float* bk = b + k * ldb + j0;
        const float* ak = a_rows + k * a_ks;
        const float a0 = ak[0], a1 = ak[a_rs], a2 = ak[2 * a_rs], a3 = ak[3 * a_rs];
        for (int64_t jj = 0; jj < kNr; ++jj) {
          const float bv = bk[jj];
          c0[jj] += a0 * bv;
          c1[jj] += a1 * bv;
          c2[jj] += a2 * bv;
          c3[jj] += a3 * bv;
        }
      }
      float* const rows[kMr] = {c + i0 * ldc + j0, c + (i0 + 1) * ldc + j0, c + (i0 + 2) * ldc + j0,
                                c + (i0 + 3) * ldc + j0};
      const float* const blk[kMr] = {c0, c1, c2, c3};
      for (int64_t r = 0; r < kMr; ++r) {
        if (accumulate) {
          for (int64_t jj = 0; jj < kNr; ++jj) rows[r][jj] += alpha * blk[r][jj];
        } else {
          for (int64_t jj = 0; jj < kNr; ++jj) rows[r][jj] = alpha * blk[r][jj];
        }
      }
    }
  }
}

}  // namespace loom::kernels

// ---------------------------------------------------------------------------------------------
// Portable softmax steps and the path selection.

namespace loom::kernels {
namespace {

void softmax_update_portable(int64_t rows, int64_t cols, int64_t bq, int64_t bk, int64_t dp,
                             float* s, float* m, float* l, float* acc) {
  for (int64_t r = 0; r < bq; ++r) {
    float* sr = s + r * bk;
    float tile_max = kNegInf;
    if (r < rows) {
#pragma omp simd reduction(max : tile_max)
      for (int64_t j = 0; j < cols; ++j) tile_max = sr[j] > tile_max ? sr[j] : tile_max;
    }
    const float m_new = std::max(m[r], tile_max);
    if (m_new == kNegInf) {  // padding, or no visible key so far: nothing to add
      std::fill(sr, sr + bk, 0.0f);
      continue;
    }
    const float alpha = fast_exp(m[r] - m_new);  // m[r] = -inf: 0
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < cols; ++j) {
      const float p = fast_exp(sr[j] - m_new);
      sr[j] = p;
      sum += p;
    }
    std::fill(sr + cols, sr + bk, 0.0f);
    l[r] = alpha * l[r] + sum;
    m[r] = m_new;
    if (alpha != 1.0f) {
      float* ar = acc + r * dp;
      for (int64_t d = 0; d < dp; ++d) ar[d] *= alpha;
    }
  }
}

void probs_portable(int64_t rows, int64_t cols, int64_t bq, int64_t bk, const float* lse,
                    float* s) {
  for (int64_t r = 0; r < bq; ++r) {
    float* sr = s + r * bk;
    if (r >= rows || lse[r] == kNegInf) {
      std::fill(sr, sr + bk, 0.0f);
      continue;
    }
    const float lse_r = lse[r];
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) sr[j] = fast_exp(sr[j] - lse_r);
    std::fill(sr + cols, sr + bk, 0.0f);
  }
}

void ds_portable(const float* p, const float* delta, float scale, int64_t bq, int64_t bk,
                 float* dp) {
  for (int64_t r = 0; r < bq; ++r) {
    const float* pr = p + r * bk;
    float* dr = dp + r * bk;
    const float delta_r = delta[r];
#pragma omp simd
    for (int64_t j = 0; j < bk; ++j) dr[j] = scale * pr[j] * (dr[j] - delta_r);
  }
}

// Sequential in i, unfused: the order in which gemm_tile accumulates one element of C (no simd
// reduction here).
float dot_portable(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void exp_portable(const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = fast_exp(x[i]);
}

}  // namespace

const TileOps& portable_ops() {
  static const TileOps ops{"portable",     0,           gemm_tile,    softmax_update_portable,
                           probs_portable, ds_portable, dot_portable, nullptr,
                           nullptr,        exp_portable};
  return ops;
}

bool cpu_has_avx512() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool cpu_has_avx512_bf16() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

const TileOps& select_ops() {
  const char* env = std::getenv("LOOM_KERNEL");
  if (env != nullptr && std::strcmp(env, "portable") == 0) return portable_ops();
  const bool fp32_only = env != nullptr && std::strcmp(env, "avx512") == 0;
  if (!cpu_has_avx512()) return portable_ops();
  const TileOps* fast = avx512_ops(!fp32_only && cpu_has_avx512_bf16());
  return fast != nullptr ? *fast : portable_ops();
}

}  // namespace loom::kernels
