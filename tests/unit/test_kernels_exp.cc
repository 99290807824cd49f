// kernels: the vectorised 2^x of the softmax (its scores are in base 2) on every compiled
// instruction-set target that this CPU runs (the others are named as skipped) against std::exp2
// in fp64, with the bound written in src/kernels/tile_ops.h (TileOps::exp2): relative error at
// most 4 ulp of fp32 on [-125, 0], a little above 0 too, exactly 0 below -125 and at -inf, and
// NaN for NaN (a NaN score must reach the softmax's sum, as the formula's exp carries it).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernel_targets.h"

namespace loom::kernels {
namespace {

constexpr double kExpUlpBound = 4.0 * 0x1p-23;  // 4 ulp of fp32 (relative)

// One test per compiled target: GetParam() is its LOOM_KERNEL name. A target this CPU cannot
// run is skipped with its name and the reason.
using KernelsExp = PerKernelTarget;

// A dense sweep of [-125, 1] (where the kernels call it: s - m <= 0, s - lse <= 0 up to
// rounding, and a little above), the reduction's breakpoints (the half-integers, where round(x)
// changes and |f| = 1/2) and the integers (f = 0: 2^n exactly).
TEST_P(KernelsExp, RelativeErrorWithinFourUlp) {
  const TileOps* ops = ops_or_skip();
  if (ops == nullptr) GTEST_SKIP() << GetParam() << ": this CPU cannot run this target";
  std::vector<float> x;
  const int n = 1 << 20;
  for (int i = 0; i < n; ++i) x.push_back(-125.0f + 126.0f * static_cast<float>(i) / (n - 1));
  for (int k = -125; k <= 1; ++k)
    for (float off : {-0.5f, -0.4999999f, -1e-6f, 0.0f, 1e-6f, 0.4999999f, 0.5f}) {
      const float v = static_cast<float>(k) + off;
      if (v >= -125.0f && v <= 1.0f) x.push_back(v);
    }
  while (x.size() % 16 != 0) x.push_back(0.0f);
  std::vector<float> y(x.size());
  ops->exp2(x.data(), y.data(), static_cast<int64_t>(x.size()));
  double worst = 0.0;
  float worst_x = 0.0f;
  for (size_t i = 0; i < x.size(); ++i) {
    const double ref = std::exp2(static_cast<double>(x[i]));
    const double err = std::fabs(static_cast<double>(y[i]) - ref) / ref;
    if (err > worst) worst = err, worst_x = x[i];
    if (x[i] == std::floor(x[i])) {
      EXPECT_EQ(y[i], static_cast<float>(ref)) << ops->name << ": 2^" << x[i];
    }
  }
  EXPECT_LE(worst, kExpUlpBound) << ops->name << " at x = " << worst_x;
  std::printf("%s: 2^x max relative error %.3e (%.2f ulp) at x = %.7g\n", ops->name, worst,
              worst / 0x1p-23, static_cast<double>(worst_x));
}

TEST_P(KernelsExp, BelowRangeAndMinusInfinityGiveZeroAndNaNGivesNaN) {
  const TileOps* ops = ops_or_skip();
  if (ops == nullptr) GTEST_SKIP() << GetParam() << ": this CPU cannot run this target";
  std::vector<float> x(32);
  const float inf = std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < x.size(); ++i) x[i] = -125.0001f - 10.0f * static_cast<float>(i);
  x[5] = -inf;
  x[7] = std::numeric_limits<float>::quiet_NaN();
  x[31] = -1e30f;
  std::vector<float> y(x.size(), 1.0f);
  ops->exp2(x.data(), y.data(), static_cast<int64_t>(x.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    if (i == 7) {
      EXPECT_TRUE(std::isnan(y[i])) << ops->name << " 2^NaN gave " << y[i];
    } else {
      EXPECT_EQ(y[i], 0.0f) << ops->name << " x " << x[i];
    }
  }
  // A NaN with a payload (here one whose low bits would shift into the exponent) stays NaN too.
  std::vector<float> nans(16, std::numeric_limits<float>::quiet_NaN()), out(16, 0.0f);
  const uint32_t payloads[] = {0x7fc001ffu, 0xffc00001u, 0x7fffffffu, 0x7f800001u};
  for (size_t i = 0; i < 4; ++i) std::memcpy(&nans[i], &payloads[i], 4);
  ops->exp2(nans.data(), out.data(), 16);
  for (size_t i = 0; i < 16; ++i) EXPECT_TRUE(std::isnan(out[i])) << ops->name << " lane " << i;
}

// The backward's probs (TileOps::probs): p = 2^(s - lse) in base-2 units, within the same bound;
// an lse below the row's scores (not these scores' lse: a caller's mistake) gives 2^127, never a
// wrapped exponent; lse = -inf gives zeros and lse = NaN NaNs.
TEST_P(KernelsExp, ProbsClampAWrongLseAndZeroTheEmptyRows) {
  const TileOps* ops = ops_or_skip();
  if (ops == nullptr) GTEST_SKIP() << GetParam() << ": this CPU cannot run this target";
  constexpr int64_t kRows = 5, kCols = 16;
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> lse = {-1e30f, -200.0f, 1.0f, -inf,
                                  std::numeric_limits<float>::quiet_NaN()};
  std::vector<float> s(kRows * kCols);
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t j = 0; j < kCols; ++j) s[r * kCols + j] = 0.5f * static_cast<float>(j) - 3.3f;
  const std::vector<float> scores = s;
  ops->probs(kRows, kCols, kRows, kCols, lse.data(), s.data());
  const float big = std::ldexp(1.0f, 127);
  for (int64_t j = 0; j < kCols; ++j) {
    EXPECT_EQ(s[0 * kCols + j], big) << ops->name << " lse -1e30, column " << j;
    EXPECT_EQ(s[1 * kCols + j], big) << ops->name << " lse -200, column " << j;
    const float x = scores[2 * kCols + j] - lse[2];  // as the kernel forms it, in fp32
    const double ref = std::exp2(static_cast<double>(x));
    EXPECT_LE(std::fabs(s[2 * kCols + j] - ref) / ref, kExpUlpBound) << ops->name << " " << j;
    EXPECT_EQ(s[3 * kCols + j], 0.0f) << ops->name << " lse -inf, column " << j;
    EXPECT_TRUE(std::isnan(s[4 * kCols + j])) << ops->name << " lse NaN, column " << j;
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, KernelsExp, ::testing::ValuesIn(kernel_target_names()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace loom::kernels
