// tests/unit/tolerance.h: the written-down tolerances of the kernel tests, the error measures
// they bound, and the seeded normal inputs the kernel tests share.
//
// The fp32 kernels are compared with the fp64 reference by relative norm error
//   ||x - ref||_2 / ||ref||_2 <= kFp32RelTol
// where the scores are small enough for it (the score condition of
// loom::fp32_fixed_tolerance_holds, which these tests check; the kernel tests' scale 1 / sqrt(D)
// on N(0, 1) inputs spreads each row's weights over many keys and gives keys without a large
// common component, the regime's other conditions: common_key_ratio at most 1.05, 0.78 on the bf16
// sweep, under the thresholds 8 and, for bf16, 1), else <= loom::fp32_error_bounds
// (loom/tolerance.h).
// The tolerance is a property of fp32 storage and fp32 accumulation; it is never loosened to make
// a test pass (a mismatch is a bug). lse arrays hold -inf for rows that see no key: those entries
// must agree exactly, and the finite ones are compared by the same relative norm.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "loom/tensor.h"
#include "loom/tolerance.h"

namespace loom::test {

using loom::kFp32RelTol;  // fp32 kernels vs the fp64 reference (relative norm)

// bf16 storage: the derivation of the bounds, the per-problem bounds (loom::bf16_error_bounds)
// and the regime of the fixed tolerances (loom::fixed_tolerance_exclusion) are in
// loom/tolerance.h. The kernel sweep measured, on its cases with S >= 100: out <= 0.6 u, fp32 out
// <= 0.4 u, dq and dk <= 0.42 u; on the bf16-dot path, Zen 5: dv <= 0.44 u, dq and dk <= 0.58 u.
using loom::kBf16AccRelTol;   // out finished to fp32 (bf16-dot path)
using loom::kBf16GradRelTol;  // dq, dk; dv (kFp32RelTol on the widening paths)
using loom::kBf16OutRelTol;   // out in bf16
using loom::kBf16Unit;

// ||x - ref|| / ||ref||; ||x|| when ref is all zero. Infinite when x holds a NaN or an infinity.
template <class X, class R>
double rel_error(const std::vector<X>& x, const std::vector<R>& ref) {
  if (x.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double err = 0.0, norm = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double xi = static_cast<double>(x[i]);
    if (!std::isfinite(xi)) return std::numeric_limits<double>::infinity();
    const double diff = xi - static_cast<double>(ref[i]);
    err += diff * diff;
    norm += static_cast<double>(ref[i]) * static_cast<double>(ref[i]);
  }
  return norm > 0.0 ? std::sqrt(err / norm) : std::sqrt(err);
}

// As rel_error for lse arrays: infinite unless x and ref are -inf at exactly the same entries;
// the finite entries are compared by relative norm.
template <class X, class R>
double lse_rel_error(const std::vector<X>& x, const std::vector<R>& ref) {
  if (x.size() != ref.size()) return std::numeric_limits<double>::infinity();
  std::vector<double> xf, rf;
  for (size_t i = 0; i < x.size(); ++i) {
    const bool x_empty = std::isinf(x[i]) && x[i] < 0;
    const bool r_empty = std::isinf(ref[i]) && ref[i] < 0;
    if (x_empty != r_empty) return std::numeric_limits<double>::infinity();
    if (!x_empty) {
      xf.push_back(static_cast<double>(x[i]));
      rf.push_back(static_cast<double>(ref[i]));
    }
  }
  return rel_error(xf, rf);
}

// A float tensor of the given shape with N(0, 1) entries from std::mt19937(seed).
inline Tensor<float> random_normal(std::vector<int64_t> shape, uint32_t seed) {
  Tensor<float> x(std::move(shape));
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& e : x.vec()) e = normal(gen);
  return x;
}

}  // namespace loom::test
