// The portable tile GEMM (see tile_ops.h). Kept in its own translation unit so that its code
// generation does not depend on the call sites it would otherwise be inlined into.
//
// The register block is four named rows of kNr accumulators; for each step k of the reduction the
// four values a(r, k) are broadcast against one kNr-wide row of B. GCC turns the jj loop into
// vector multiply-adds over registers (with SSE2: 4 rows x 4 vectors); the same source with
// -march flags uses wider vectors.
#include "tile_ops.h"

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
