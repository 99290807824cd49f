// Merge of two finished partial attention results over disjoint key sets.
//
// Each partial i of a query row carries out_i (the softmax-weighted mean of its keys' values) and
// lse_i (the log of its softmax denominator). The combined denominator is exp(lse_a) + exp(lse_b),
// so lse = log(exp(lse_a) + exp(lse_b)) and out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse).
// Written as lse = max + log1p(e) with e = exp(-|lse_a - lse_b|) and weights 1 / (1 + e) and
// e / (1 + e), no exponential of a positive number is ever formed: nothing overflows however
// large the lse values are, and the weights depend only on the difference of the two lse. A side
// with lse = -inf (no visible key) gets weight 0; both sides -inf give out = 0, lse = -inf (never
// NaN).
#include <algorithm>
#include <cmath>

#include "checks.h"
#include "loom/attention.h"

namespace loom {

void merge(View3<float> out_a, float* lse_a, View3<const float> out_b, const float* lse_b,
           int64_t lse_stride) {
  kernels::check_view(out_a, "out_a");
  kernels::check_view(out_b, "out_b");
  kernels::check_same_shape(View3<const float>(out_a), out_b, "out_a and out_b");
  LOOM_CHECK(out_a.s == 0 || (lse_a != nullptr && lse_b != nullptr), InvalidArgument,
             "lse_a and lse_b must not be null");
  LOOM_CHECK_GE(lse_stride, out_a.s, InvalidArgument, "lse stride too small");
  for (int64_t h = 0; h < out_a.h; ++h) {
    for (int64_t i = 0; i < out_a.s; ++i) {
      float& la = lse_a[h * lse_stride + i];
      const float lb = lse_b[h * lse_stride + i];
      float* oa = out_a.row(i, h);
      const float* ob = out_b.row(i, h);
      if (la == kNegInf && lb == kNegInf) {
        for (int64_t d = 0; d < out_a.d; ++d) oa[d] = 0.0f;
        continue;
      }
      // e = exp(-|lse_a - lse_b|) in [0, 1]; the larger side weighs 1 / (1 + e), the other
      // e / (1 + e). Equal to exp(lse_x - lse), but free of the rounding of lse itself (at
      // |lse| ~ 1000 an fp32 lse is only good to 6e-5).
      const float e = std::exp(-std::fabs(la - lb));
      const float w_max = 1.0f / (1.0f + e), w_min = e * w_max;
      const float wa = la >= lb ? w_max : w_min;
      const float wb = la >= lb ? w_min : w_max;
      const float lse = std::max(la, lb) + std::log1p(e);
      for (int64_t d = 0; d < out_a.d; ++d) oa[d] = oa[d] * wa + ob[d] * wb;
      la = lse;
    }
  }
}

}  // namespace loom
