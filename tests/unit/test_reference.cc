// kernels: the fp64 reference. Closed-form cases, the mask rule through count_visible_pairs,
// rows that see no key, argument checks, and the analytic gradients against central finite
// differences of the reference's own forward.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "loom/attention.h"
#include "loom/error.h"
#include "loom/tensor.h"
#include "loom/tolerance.h"
#include "unit/tolerance.h"

namespace loom {
namespace {

constexpr double kNegInfD = -std::numeric_limits<double>::infinity();

Tensor<double> random_double(std::vector<int64_t> shape, uint32_t seed) {
  return convert<double>(test::random_normal(std::move(shape), seed));
}

std::vector<int64_t> iota_positions(int64_t n, int64_t first = 0) {
  std::vector<int64_t> pos(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) pos[i] = first + i;
  return pos;
}

TEST(Reference, SingleKeyGivesItsValue) {
  const Tensor<double> q = random_double({1, 2, 5}, 1), k = random_double({1, 1, 5}, 2),
                       v = random_double({1, 1, 5}, 3);
  const std::vector<int64_t> pos = {4};
  Tensor<double> out({1, 2, 5});
  std::vector<double> lse(2);
  reference_forward(q.view3(), k.view3(), v.view3(), {pos.data(), nullptr, 1},
                    {pos.data(), nullptr, 1}, Mask{}, 0.5, out.view3(), lse.data());
  for (int64_t h = 0; h < 2; ++h) {
    double s = 0;
    for (int64_t d = 0; d < 5; ++d) s += q.view3()(0, h, d) * k.view3()(0, 0, d);
    EXPECT_DOUBLE_EQ(lse[h], 0.5 * s);
    for (int64_t d = 0; d < 5; ++d) EXPECT_DOUBLE_EQ(out.view3()(0, h, d), v.view3()(0, 0, d));
  }
}

TEST(Reference, EqualScoresAverageTheVisibleValues) {
  // q = 0 gives every visible key the same score: out is the mean of the visible values and
  // lse = log(number of visible keys). Causal contiguous: row i sees keys 0..i.
  const int64_t s = 6, d = 3;
  Tensor<double> q({s, 1, d}, 0.0);
  const Tensor<double> k = random_double({s, 1, d}, 4), v = random_double({s, 1, d}, 5);
  const std::vector<int64_t> pos = iota_positions(s);
  Tensor<double> out({s, 1, d});
  std::vector<double> lse(s);
  const Tokens t{pos.data(), nullptr, s};
  reference_forward(q.view3(), k.view3(), v.view3(), t, t, Mask{true, 0}, 1.0, out.view3(),
                    lse.data());
  for (int64_t i = 0; i < s; ++i) {
    EXPECT_NEAR(lse[i], std::log(static_cast<double>(i + 1)), 1e-15);
    for (int64_t e = 0; e < d; ++e) {
      double mean = 0;
      for (int64_t j = 0; j <= i; ++j) mean += v.view3()(j, 0, e);
      mean /= static_cast<double>(i + 1);
      EXPECT_NEAR(out.view3()(i, 0, e), mean, 1e-14);
    }
  }
}

TEST(Reference, CountVisiblePairsFollowsTheMaskRule) {
  const int64_t n = 10;
  const std::vector<int64_t> pos = iota_positions(n);
  const Tokens t{pos.data(), nullptr, n};
  EXPECT_EQ(count_visible_pairs(t, t, Mask{false, 0}, 3), n * n * 3);
  EXPECT_EQ(count_visible_pairs(t, t, Mask{true, 0}, 3), n * (n + 1) / 2 * 3);
  // causal, window 3: i sees i, i-1, i-2.
  EXPECT_EQ(count_visible_pairs(t, t, Mask{true, 3}, 1), n + (n - 1) + (n - 2));
  // bidirectional window 3: |i - j| <= 2.
  EXPECT_EQ(count_visible_pairs(t, t, Mask{false, 3}, 1), n + 2 * (n - 1) + 2 * (n - 2));
  // Two documents of 4 and 6 tokens, causal.
  const std::vector<int32_t> doc = {0, 0, 0, 0, 1, 1, 1, 1, 1, 1};
  const Tokens td{pos.data(), doc.data(), n};
  EXPECT_EQ(count_visible_pairs(td, td, Mask{true, 0}, 2), (4 * 5 / 2 + 6 * 7 / 2) * 2);
  // Positions, not offsets: keys at 100.. are all in the future of queries at 0.. (causal).
  const std::vector<int64_t> late = iota_positions(n, 100);
  EXPECT_EQ(count_visible_pairs(t, {late.data(), nullptr, n}, Mask{true, 0}, 1), 0);
  EXPECT_EQ(count_visible_pairs({late.data(), nullptr, n}, t, Mask{true, 0}, 1), n * n);
}

TEST(Reference, RowWithoutVisibleKeyIsZeroWithMinusInfLse) {
  // Query 0 is in document 7, which no key belongs to; query 1 sees keys of document 1.
  const int64_t d = 4;
  const Tensor<double> q = random_double({2, 2, d}, 6), k = random_double({3, 1, d}, 7),
                       v = random_double({3, 1, d}, 8), dout = random_double({2, 2, d}, 9);
  const std::vector<int64_t> qpos = {5, 6}, kpos = {0, 1, 2};
  const std::vector<int32_t> qdoc = {7, 1}, kdoc = {1, 1, 2};
  const Tokens qt{qpos.data(), qdoc.data(), 2}, kt{kpos.data(), kdoc.data(), 3};
  Tensor<double> out({2, 2, d}, 1.0), dq({2, 2, d}, 1.0), dk({3, 1, d}, 1.0), dv({3, 1, d}, 1.0);
  std::vector<double> lse(4);
  reference_forward(q.view3(), k.view3(), v.view3(), qt, kt, Mask{true, 0}, 0.5, out.view3(),
                    lse.data());
  reference_backward(q.view3(), k.view3(), v.view3(), dout.view3(), qt, kt, Mask{true, 0}, 0.5,
                     dq.view3(), dk.view3(), dv.view3());
  for (int64_t h = 0; h < 2; ++h) {
    EXPECT_EQ(lse[h * 2 + 0], kNegInfD);
    EXPECT_TRUE(std::isfinite(lse[h * 2 + 1]));
    for (int64_t e = 0; e < d; ++e) {
      EXPECT_EQ(out.view3()(0, h, e), 0.0);
      EXPECT_EQ(dq.view3()(0, h, e), 0.0);
      EXPECT_TRUE(std::isfinite(out.view3()(1, h, e)));
      EXPECT_NE(dq.view3()(1, h, e), 0.0);
    }
  }
  // Key 2 (document 2) is seen by nobody: zero gradients.
  for (int64_t e = 0; e < d; ++e) {
    EXPECT_EQ(dk.view3()(2, 0, e), 0.0);
    EXPECT_EQ(dv.view3()(2, 0, e), 0.0);
  }
}

TEST(Reference, NanScoreMakesTheRowNanAsTheFormulaDoes) {
  // A NaN in q row 1 and one in key 2: the rows whose scores meet a NaN are NaN (out, lse), the
  // others stay finite. The running max ignored NaN: a NaN row was returned as empty (0, -inf).
  const int64_t d = 4, s = 4;
  Tensor<double> q = random_double({s, 1, d}, 10), k = random_double({s, 1, d}, 11);
  const Tensor<double> v = random_double({s, 1, d}, 12);
  q.view3()(1, 0, 2) = std::numeric_limits<double>::quiet_NaN();
  std::vector<int64_t> pos = {0, 1, 2, 3};
  const Tokens t{pos.data(), nullptr, s};
  Tensor<double> out({s, 1, d});
  std::vector<double> lse(s);
  reference_forward(q.view3(), k.view3(), v.view3(), t, t, Mask{true, 0}, 0.5, out.view3(),
                    lse.data());
  for (int64_t i = 0; i < s; ++i) {
    EXPECT_EQ(std::isnan(lse[i]), i == 1) << "row " << i;
    EXPECT_EQ(std::isnan(out.view3()(i, 0, 0)), i == 1) << "row " << i;
  }
  q.view3()(1, 0, 2) = 0.5;
  k.view3()(2, 0, 0) = std::numeric_limits<double>::quiet_NaN();  // seen by rows 2 and 3 (causal)
  reference_forward(q.view3(), k.view3(), v.view3(), t, t, Mask{true, 0}, 0.5, out.view3(),
                    lse.data());
  for (int64_t i = 0; i < s; ++i) {
    EXPECT_EQ(std::isnan(lse[i]), i >= 2) << "row " << i;
    EXPECT_EQ(std::isnan(out.view3()(i, 0, 0)), i >= 2) << "row " << i;
  }
}

// common_key_ratio (loom/tolerance.h, the regime of the fixed tolerances): sqrt(sum_i ||kbar_i||^2
// / sum_i sum_j p_ij ||k_j - kbar_i||^2), kbar_i = sum_j p_ij k_j. A vector c added to every key
// moves every row's scores by scale q_i.c alone: the weights (and effective_keys) stay, kbar moves
// by c and the spread stays, so the ratio follows ||c||.
TEST(Reference, CommonKeyRatioMeasuresTheComponentTheKeysShare) {
  const int64_t S = 40, D = 16;
  const Tensor<double> q = random_double({S, 2, D}, 11), k = random_double({S, 1, D}, 12);
  const std::vector<int64_t> pos = iota_positions(S);
  const Tokens t{pos.data(), nullptr, S};
  const Mask causal{true, 0};
  const double keys = effective_keys(q.view3(), k.view3(), t, t, causal, 0.25);
  const double base = common_key_ratio(q.view3(), k.view3(), t, t, causal, 0.25);
  EXPECT_GT(base, 0.1);
  EXPECT_LT(base, 1.0);
  double last = base;
  for (const double b : {1.0, 4.0, 16.0}) {
    Tensor<double> kb = k;
    for (int64_t j = 0; j < S; ++j)
      for (int64_t d = 0; d < D; ++d) kb[j * D + d] += b * (d % 2 ? 1.0 : -1.0);
    EXPECT_NEAR(effective_keys(q.view3(), kb.view3(), t, t, causal, 0.25), keys, 1e-9 * keys);
    const double r = common_key_ratio(q.view3(), kb.view3(), t, t, causal, 0.25);
    EXPECT_GT(r, last) << b;
    last = r;
  }
  EXPECT_GT(last, 10.0);  // ||c|| = 64 against a spread of about sqrt(D) = 4 per row
  // Equal keys, not 0: no spread but rounding's, a ratio of 1e5 or more (exact dq is 0: any
  // rounding is all of its error). All keys 0: dq is 0 exactly, the ratio 0. No row sees a key:
  // 0. A NaN score: NaN.
  Tensor<double> same({S, 1, D});
  same.fill(1.0);
  EXPECT_GT(common_key_ratio(q.view3(), same.view3(), t, t, causal, 0.25), 1e5);
  same.fill(0.0);
  EXPECT_EQ(common_key_ratio(q.view3(), same.view3(), t, t, causal, 0.25), 0.0);
  const std::vector<int64_t> late = iota_positions(S, S);
  EXPECT_EQ(common_key_ratio(q.view3(), k.view3(), t, {late.data(), nullptr, S}, causal, 0.25),
            0.0);
  Tensor<double> qn = q;
  qn[5] = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(std::isnan(common_key_ratio(qn.view3(), k.view3(), t, t, causal, 0.25)));
}

// common_value_ratio: the same of the values, whose weighted mean is out_i. A vector c added to
// every value moves every out_i by c (the weights do not read v) and not the spread about it, so
// the ratio follows ||c||; the keys' ratio does not see v.
TEST(Reference, CommonValueRatioMeasuresTheComponentTheValuesShare) {
  const int64_t S = 40, D = 16;
  const Tensor<double> q = random_double({S, 2, D}, 13), k = random_double({S, 1, D}, 14),
                       v = random_double({S, 1, D}, 15);
  const std::vector<int64_t> pos = iota_positions(S);
  const Tokens t{pos.data(), nullptr, S};
  const Mask causal{true, 0};
  const double base = common_value_ratio(q.view3(), k.view3(), v.view3(), t, t, causal, 0.25);
  EXPECT_GT(base, 0.1);
  EXPECT_LT(base, 1.0);
  double last = base;
  Tensor<double> vb = v;
  for (const double b : {1.0, 4.0, 16.0}) {
    vb = v;
    for (int64_t j = 0; j < S; ++j)
      for (int64_t d = 0; d < D; ++d) vb[j * D + d] += b * (d % 2 ? 1.0 : -1.0);
    const double r = common_value_ratio(q.view3(), k.view3(), vb.view3(), t, t, causal, 0.25);
    EXPECT_GT(r, last) << b;
    last = r;
  }
  EXPECT_GT(last, 10.0);
  // fp32's regime: the values' condition (above 8) decides, and the reason names it
  EXPECT_EQ(fixed_tolerance_exclusion(q.view3(), k.view3(), v.view3(), t, t, causal, 0.25, false),
            "");
  EXPECT_EQ(fixed_tolerance_exclusion(q.view3(), k.view3(), t, t, causal, 0.25, false), "");
  EXPECT_NE(fixed_tolerance_exclusion(q.view3(), k.view3(), vb.view3(), t, t, causal, 0.25, false)
                .find("values sharing a component"),
            std::string::npos);
  Tensor<double> vn = v;
  vn[3] = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(std::isnan(common_value_ratio(q.view3(), k.view3(), vn.view3(), t, t, causal, 0.25)));
}

// out_cancel_ratio: about 1 for independent values; large where the values a row weighs cancel
// (their mean over the keys removed, near-uniform weights), and the fourth condition names it.
TEST(Reference, OutCancelRatioGrowsAsOutCancels) {
  const int64_t S = 64, D = 16;
  Tensor<double> q = random_double({S, 1, D}, 21);
  const Tensor<double> k = random_double({S, 1, D}, 22), v = random_double({S, 1, D}, 23);
  const std::vector<int64_t> pos = iota_positions(S);
  const Tokens t{pos.data(), nullptr, S};
  const Mask full{false, 0};
  const double base = out_cancel_ratio(q.view3(), k.view3(), v.view3(), t, t, full, 0.25);
  EXPECT_GT(base, 0.5);
  EXPECT_LT(base, 2.0);
  for (double& x : q.vec()) x *= 0.01;  // near-uniform weights
  Tensor<double> vc = v;                // less its mean over the keys, plus an offset
  for (int64_t d = 0; d < D; ++d) {
    double mean = 0;
    for (int64_t j = 0; j < S; ++j) mean += v[j * D + d] / S;
    for (int64_t j = 0; j < S; ++j) vc[j * D + d] = v[j * D + d] - mean + 1e-3;
  }
  const double cancel = out_cancel_ratio(q.view3(), k.view3(), vc.view3(), t, t, full, 0.25);
  EXPECT_GT(cancel, 50.0);
  EXPECT_EQ(fixed_tolerance_exclusion(q.view3(), k.view3(), v.view3(), t, t, full, 0.25, false),
            "");
  EXPECT_NE(fixed_tolerance_exclusion(q.view3(), k.view3(), vc.view3(), t, t, full, 0.25, false)
                .find("values cancelling in out"),
            std::string::npos);
  Tensor<double> zero({S, 1, D});
  zero.fill(0.0);
  EXPECT_EQ(out_cancel_ratio(q.view3(), k.view3(), zero.view3(), t, t, full, 0.25), 0.0);
  vc[5] = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(std::isnan(out_cancel_ratio(q.view3(), k.view3(), vc.view3(), t, t, full, 0.25)));
}

TEST(Reference, RejectsBadArguments) {
  const Tensor<double> q({2, 4, 8}), k({3, 3, 8}), v({3, 3, 8}), k2({3, 2, 8}), v2({3, 2, 8}),
      k_short_dim({3, 2, 7});
  Tensor<double> out({2, 4, 8});
  std::vector<double> lse(8);
  const std::vector<int64_t> pos = {0, 1, 2};
  const Tokens qt{pos.data(), nullptr, 2}, kt{pos.data(), nullptr, 3};
  EXPECT_THROW(reference_forward(q.view3(), k.view3(), v.view3(), qt, kt, Mask{}, 1.0, out.view3(),
                                 lse.data()),
               InvalidArgument);  // 4 heads over 3 kv heads
  EXPECT_THROW(reference_forward(q.view3(), k_short_dim.view3(), k_short_dim.view3(), qt, kt,
                                 Mask{}, 1.0, out.view3(), lse.data()),
               InvalidArgument);  // head dims differ
  EXPECT_THROW(reference_forward(q.view3(), k2.view3(), v2.view3(), qt, kt, Mask{}, 0.0,
                                 out.view3(), lse.data()),
               InvalidArgument);  // scale 0
  EXPECT_THROW(reference_forward(q.view3(), k2.view3(), v2.view3(), qt, qt, Mask{}, 1.0,
                                 out.view3(), lse.data()),
               InvalidArgument);  // 2 key tokens for 3 keys
  EXPECT_THROW(reference_forward(q.view3(), k2.view3(), v2.view3(), qt, kt, Mask{true, -1}, 1.0,
                                 out.view3(), lse.data()),
               InvalidArgument);  // negative window
  EXPECT_NO_THROW(reference_forward(q.view3(), k2.view3(), v2.view3(), qt, kt, Mask{}, 1.0,
                                    out.view3(), lse.data()));
}

// ---------------------------------------------------------------------------------------------
// Finite differences: L(q, k, v) = sum(out * dout); the analytic gradients of reference_backward
// against central differences (fp64, step 1e-5) on tiny problems with GQA, arbitrary unsorted
// positions, q positions != k positions, and each kind of mask.

struct FdCase {
  std::string name;
  Mask mask;
  bool documents;
};

class ReferenceGradient : public ::testing::TestWithParam<FdCase> {};

double loss(const Tensor<double>& q, const Tensor<double>& k, const Tensor<double>& v,
            const Tensor<double>& dout, const Tokens& qt, const Tokens& kt, const Mask& mask,
            double scale) {
  Tensor<double> out(q.shape());
  std::vector<double> lse(static_cast<size_t>(q.size(0) * q.size(1)));
  reference_forward(q.view3(), k.view3(), v.view3(), qt, kt, mask, scale, out.view3(), lse.data());
  double l = 0.0;
  for (int64_t i = 0; i < out.numel(); ++i) l += out[i] * dout[i];
  return l;
}

TEST_P(ReferenceGradient, MatchesCentralDifferences) {
  const FdCase& c = GetParam();
  const int64_t sq = 5, sk = 6, h = 4, hkv = 2, d = 3;
  const double scale = 0.7;
  Tensor<double> q = random_double({sq, h, d}, 11), k = random_double({sk, hkv, d}, 12),
                 v = random_double({sk, hkv, d}, 13);
  const Tensor<double> dout = random_double({sq, h, d}, 14);
  const std::vector<int64_t> qpos = {6, 0, 9, 4, 3}, kpos = {8, 2, 0, 5, 3, 7};
  const std::vector<int32_t> qdoc = {1, 0, 1, 0, 2}, kdoc = {1, 0, 0, 1, 0, 1};
  const Tokens qt{qpos.data(), c.documents ? qdoc.data() : nullptr, sq};
  const Tokens kt{kpos.data(), c.documents ? kdoc.data() : nullptr, sk};

  Tensor<double> dq({sq, h, d}), dk({sk, hkv, d}), dv({sk, hkv, d});
  reference_backward(q.view3(), k.view3(), v.view3(), dout.view3(), qt, kt, c.mask, scale,
                     dq.view3(), dk.view3(), dv.view3());

  const double step = 1e-5;
  auto numeric = [&](Tensor<double>& x) {
    std::vector<double> g(static_cast<size_t>(x.numel()));
    for (int64_t i = 0; i < x.numel(); ++i) {
      const double keep = x[i];
      x[i] = keep + step;
      const double up = loss(q, k, v, dout, qt, kt, c.mask, scale);
      x[i] = keep - step;
      const double down = loss(q, k, v, dout, qt, kt, c.mask, scale);
      x[i] = keep;
      g[i] = (up - down) / (2 * step);
    }
    return g;
  };
  EXPECT_LT(test::rel_error(dq.vec(), numeric(q)), 1e-6) << "dq";
  EXPECT_LT(test::rel_error(dk.vec(), numeric(k)), 1e-6) << "dk";
  EXPECT_LT(test::rel_error(dv.vec(), numeric(v)), 1e-6) << "dv";
}

INSTANTIATE_TEST_SUITE_P(Masks, ReferenceGradient,
                         ::testing::Values(FdCase{"full", Mask{false, 0}, false},
                                           FdCase{"causal", Mask{true, 0}, false},
                                           FdCase{"window", Mask{false, 3}, false},
                                           FdCase{"causal_window", Mask{true, 4}, false},
                                           FdCase{"documents", Mask{true, 0}, true},
                                           FdCase{"documents_full", Mask{false, 0}, true}),
                         [](const auto& info) { return info.param.name; });

// subnormal_reference where nothing falls below float32's normal range: the references
// themselves, bitwise (so that Float32Floor's model never moves a check in the normal range).
TEST(SubnormalReference, IsTheReferenceBitwiseInTheNormalRange) {
  for (const bool documents : {false, true}) {
    for (const Mask mask : {Mask{false, 0}, Mask{true, 0}, Mask{true, 5}}) {
      const int64_t s = 24, h = 4, hkv = 2, d = 8;
      const Tensor<double> q = random_double({s, h, d}, 21), k = random_double({s, hkv, d}, 22),
                           v = random_double({s, hkv, d}, 23), dout = random_double({s, h, d}, 24);
      const std::vector<int64_t> pos = iota_positions(s);
      std::vector<int32_t> doc(static_cast<size_t>(s));
      for (int64_t i = 0; i < s; ++i) doc[i] = static_cast<int32_t>(i / 10);
      const Tokens t{pos.data(), documents ? doc.data() : nullptr, s};
      Tensor<double> out({s, h, d}), dq({s, h, d}), dk({s, hkv, d}), dv({s, hkv, d});
      std::vector<double> lse(static_cast<size_t>(h * s));
      reference_forward(q.view3(), k.view3(), v.view3(), t, t, mask, 0.4, out.view3(), lse.data());
      reference_backward(q.view3(), k.view3(), v.view3(), dout.view3(), t, t, mask, 0.4, dq.view3(),
                         dk.view3(), dv.view3());
      Tensor<double> mout({s, h, d}), mdq({s, h, d}), mdk({s, hkv, d}), mdv({s, hkv, d});
      subnormal_reference(q.view3(), k.view3(), v.view3(), dout.view3(), t, t, mask, 0.4,
                          mout.view3(), mdq.view3(), mdk.view3(), mdv.view3());
      EXPECT_EQ(mout.vec(), out.vec());
      EXPECT_EQ(mdq.vec(), dq.vec());
      EXPECT_EQ(mdk.vec(), dk.vec());
      EXPECT_EQ(mdv.vec(), dv.vec());
      Tensor<double> fout({s, h, d});  // the forward alone
      subnormal_reference(q.view3(), k.view3(), v.view3(), {}, t, t, mask, 0.4, fout.view3(), {},
                          {}, {});
      EXPECT_EQ(fout.vec(), out.vec());
    }
  }
}

// dk or dv given as an empty view (View3<double>{}) is not computed, and the gradients that are
// computed stay the same, bitwise: loom verify checks dq alone on sampled rows and allocates no
// [Sk, Hkv, D] buffer for dk and dv there. A view with null data but a shape is still refused.
TEST(Reference, EmptyKeyGradientViewsAreNotComputed) {
  const int64_t sq = 7, sk = 24, h = 4, hkv = 2, d = 8;
  const Tensor<double> q = random_double({sq, h, d}, 41), k = random_double({sk, hkv, d}, 42),
                       v = random_double({sk, hkv, d}, 43), dout = random_double({sq, h, d}, 44);
  const std::vector<int64_t> qpos = {0, 3, 7, 11, 15, 19, 23}, kpos = iota_positions(sk);
  const Tokens qt{qpos.data(), nullptr, sq}, kt{kpos.data(), nullptr, sk};
  const Mask mask{true, 0};
  Tensor<double> dq({sq, h, d}), dk({sk, hkv, d}), dv({sk, hkv, d});
  reference_backward(q.view3(), k.view3(), v.view3(), dout.view3(), qt, kt, mask, 0.3, dq.view3(),
                     dk.view3(), dv.view3());
  Tensor<double> mout({sq, h, d}), mdq({sq, h, d}), mdk({sk, hkv, d}), mdv({sk, hkv, d});
  subnormal_reference(q.view3(), k.view3(), v.view3(), dout.view3(), qt, kt, mask, 0.3,
                      mout.view3(), mdq.view3(), mdk.view3(), mdv.view3());
  for (const bool want_dk : {false, true}) {
    for (const bool want_dv : {false, true}) {
      SCOPED_TRACE(std::string("dk ") + (want_dk ? "wanted" : "empty") + ", dv " +
                   (want_dv ? "wanted" : "empty"));
      Tensor<double> dq2({sq, h, d}, 7.0), dk2({sk, hkv, d}, 7.0), dv2({sk, hkv, d}, 7.0);
      reference_backward(q.view3(), k.view3(), v.view3(), dout.view3(), qt, kt, mask, 0.3,
                         dq2.view3(), want_dk ? dk2.view3() : View3<double>{},
                         want_dv ? dv2.view3() : View3<double>{});
      EXPECT_EQ(dq2.vec(), dq.vec());
      if (want_dk) {
        EXPECT_EQ(dk2.vec(), dk.vec());
      }
      if (want_dv) {
        EXPECT_EQ(dv2.vec(), dv.vec());
      }
      Tensor<double> out3({sq, h, d}), dq3({sq, h, d}, 7.0), dk3({sk, hkv, d}, 7.0),
          dv3({sk, hkv, d}, 7.0);
      subnormal_reference(q.view3(), k.view3(), v.view3(), dout.view3(), qt, kt, mask, 0.3,
                          out3.view3(), dq3.view3(), want_dk ? dk3.view3() : View3<double>{},
                          want_dv ? dv3.view3() : View3<double>{});
      EXPECT_EQ(out3.vec(), mout.vec());
      EXPECT_EQ(dq3.vec(), mdq.vec());
      if (want_dk) {
        EXPECT_EQ(dk3.vec(), mdk.vec());
      }
      if (want_dv) {
        EXPECT_EQ(dv3.vec(), mdv.vec());
      }
    }
  }
  // Null data with a shape is a mistake, not "skip": refused as before.
  const View3<double> null_shaped{nullptr, sk, hkv, d, hkv * d, d};
  EXPECT_THROW(reference_backward(q.view3(), k.view3(), v.view3(), dout.view3(), qt, kt, mask, 0.3,
                                  dq.view3(), null_shaped, dv.view3()),
               InvalidArgument);
  EXPECT_THROW(subnormal_reference(q.view3(), k.view3(), v.view3(), dout.view3(), qt, kt, mask, 0.3,
                                   mout.view3(), dq.view3(), dk.view3(), null_shaped),
               InvalidArgument);
  // A dk of the wrong shape still is.
  Tensor<double> short_dk({sk - 1, hkv, d});
  EXPECT_THROW(reference_backward(q.view3(), k.view3(), v.view3(), dout.view3(), qt, kt, mask, 0.3,
                                  dq.view3(), short_dk.view3(), View3<double>{}),
               InvalidArgument);
}

// Values of 1e-39 (subnormal in float32) make dp = dout . v, delta and ds subnormal, while
// dq = scale sum_j ds_ij k_j, a sum of many of them, is not as far down: rounding the exact dq
// to float32 errs 1.7e-6, under a quarter of kFp32RelTol, but float32 arithmetic errs more (the
// plain float32 loops below 2.1e-5; loom's kernels alike, and `loom attn --check` said FAILED of
// a correct result). subnormal_reference's floor (1.5e-5) is within a factor of 4 of what the
// plain loops err, and blocks the comparison.
TEST(SubnormalReference, ModelsWhatFloat32ErrsBelowTheNormalRange) {
  const int64_t s = 128, d = 16;
  const double scale = 0.25;
  Tensor<float> qf = test::random_normal({s, 1, d}, 31), kf = test::random_normal({s, 1, d}, 32),
                vf = test::random_normal({s, 1, d}, 33), dof = test::random_normal({s, 1, d}, 34);
  for (float& x : vf.vec()) x = static_cast<float>(x * 1e-39);
  const Tensor<double> q = convert<double>(qf), k = convert<double>(kf), v = convert<double>(vf),
                       dout = convert<double>(dof);
  const std::vector<int64_t> pos = iota_positions(s);
  const Tokens t{pos.data(), nullptr, s};
  const Mask causal{true, 0};
  Tensor<double> dq({s, 1, d}), dk({s, 1, d}), dv({s, 1, d});
  reference_backward(q.view3(), k.view3(), v.view3(), dout.view3(), t, t, causal, scale, dq.view3(),
                     dk.view3(), dv.view3());
  Tensor<double> mout({s, 1, d}), mdq({s, 1, d}), mdk({s, 1, d}), mdv({s, 1, d});
  subnormal_reference(q.view3(), k.view3(), v.view3(), dout.view3(), t, t, causal, scale,
                      mout.view3(), mdq.view3(), mdk.view3(), mdv.view3());
  // The plain float32 loops: p, out, dp, delta from the stored out, ds, dq.
  std::vector<float> f32dq(static_cast<size_t>(s * d), 0.0f);
  for (int64_t i = 0; i < s; ++i) {
    std::vector<float> sc(static_cast<size_t>(i + 1)), o(static_cast<size_t>(d), 0.0f);
    float m = -std::numeric_limits<float>::infinity(), l = 0;
    for (int64_t j = 0; j <= i; ++j) {
      float x = 0;
      for (int64_t c = 0; c < d; ++c) x += qf[i * d + c] * kf[j * d + c];
      sc[j] = static_cast<float>(scale) * x;
      m = std::max(m, sc[j]);
    }
    for (int64_t j = 0; j <= i; ++j) l += std::exp(sc[j] - m);
    const float lse = m + std::log(l);
    for (int64_t j = 0; j <= i; ++j) {
      sc[j] = std::exp(sc[j] - lse);  // p
      for (int64_t c = 0; c < d; ++c) o[c] += sc[j] * vf[j * d + c];
    }
    float delta = 0;
    for (int64_t c = 0; c < d; ++c) delta += dof[i * d + c] * o[c];
    for (int64_t j = 0; j <= i; ++j) {
      float dp = 0;
      for (int64_t c = 0; c < d; ++c) dp += dof[i * d + c] * vf[j * d + c];
      const float ds = sc[j] * (dp - delta);
      for (int64_t c = 0; c < d; ++c)
        f32dq[i * d + c] += static_cast<float>(scale) * ds * kf[j * d + c];
    }
  }
  Float32Floor result_only, with_terms;
  for (int64_t i = 0; i < dq.numel(); ++i) {
    result_only.add(dq[i]);
    with_terms.add(dq[i], mdq[i]);
  }
  const double plain = test::rel_error(f32dq, dq.vec());
  EXPECT_FALSE(float32_floor_blocks(result_only.rel(), kFp32RelTol)) << result_only.rel();
  EXPECT_TRUE(float32_floor_blocks(with_terms.rel(), kFp32RelTol)) << with_terms.rel();
  EXPECT_GT(plain, kFp32RelTol) << "the plain float32 loops meet the tolerance: no case";
  EXPECT_GT(with_terms.rel(), plain / 4);
  EXPECT_LT(with_terms.rel(), plain * 4);
}

// subnormal_reference_shift bounds |subnormal_reference - the exact arithmetic| per element, on
// inputs of ordinary size (where it is far below anything a check sees, and the model is skipped)
// and on inputs whose terms fall below float32's normal range (where it must not be: the model
// runs). GQA, causal; q, k, v or dout scaled, and a scale that puts most weights p below 2^-126.
TEST(SubnormalReference, ShiftBoundsWhatTheModelMoves) {
  struct Scaled {
    const char* name;
    double q, k, v, dout, scale;
    const char* tiny;  // a result the model can affect at kFp32RelTol ("": none may)
    bool moves;        // the model moves some value (subnormal weights alone do)
  };
  const Scaled cases[] = {{"ordinary", 1, 1, 1, 1, 0.3, "", false},
                          {"v 1e-39", 1, 1, 1e-39, 1, 0.3, "dq", true},
                          {"dout 1e-39", 1, 1, 1, 1e-39, 0.3, "dq", true},
                          {"q 1e-42", 1e-42, 1, 1, 1, 0.3, "dk", true},
                          {"weights below 2^-126", 1, 1, 1, 1, 60, "", true}};
  for (const Scaled& x : cases) {
    SCOPED_TRACE(x.name);
    const int64_t s = 40, h = 4, hkv = 2, d = 8;
    const auto scaled = [](Tensor<double> t, double f) {
      for (double& e : t.vec()) e = static_cast<double>(static_cast<float>(e * f));
      return t;
    };
    const Tensor<double> q = scaled(random_double({s, h, d}, 41), x.q),
                         k = scaled(random_double({s, hkv, d}, 42), x.k),
                         v = scaled(random_double({s, hkv, d}, 43), x.v),
                         dout = scaled(random_double({s, h, d}, 44), x.dout);
    const std::vector<int64_t> pos = iota_positions(s);
    const Tokens t{pos.data(), nullptr, s};
    const Mask causal{true, 0};
    Tensor<double> out({s, h, d}), dq({s, h, d}), dk({s, hkv, d}), dv({s, hkv, d});
    std::vector<double> lse(static_cast<size_t>(h * s));
    reference_forward(q.view3(), k.view3(), v.view3(), t, t, causal, x.scale, out.view3(),
                      lse.data());
    reference_backward(q.view3(), k.view3(), v.view3(), dout.view3(), t, t, causal, x.scale,
                       dq.view3(), dk.view3(), dv.view3());
    Tensor<double> mout({s, h, d}), mdq({s, h, d}), mdk({s, hkv, d}), mdv({s, hkv, d});
    subnormal_reference(q.view3(), k.view3(), v.view3(), dout.view3(), t, t, causal, x.scale,
                        mout.view3(), mdq.view3(), mdk.view3(), mdv.view3());
    const SubnormalShift shift =
        subnormal_reference_shift(q.view3(), k.view3(), v.view3(), dout.view3(), x.scale);
    const std::pair<const char*, std::tuple<const Tensor<double>*, const Tensor<double>*, double>>
        tensors[] = {{"out", {&out, &mout, shift.out}},
                     {"dq", {&dq, &mdq, shift.dq}},
                     {"dk", {&dk, &mdk, shift.dk}},
                     {"dv", {&dv, &mdv, shift.dv}}};
    bool moved = false;
    for (const auto& [name, tm] : tensors) {
      const auto& [exact, model, bound] = tm;
      double norm2 = 0;
      for (int64_t i = 0; i < exact->numel(); ++i) {
        const double e = std::fabs((*model)[i] - (*exact)[i]);
        moved = moved || e > 0;
        norm2 += (*exact)[i] * (*exact)[i];
        // The model's double sums round apart from the reference's where it moved a value.
        ASSERT_LE(e, bound + 1e-12 * std::fabs((*exact)[i])) << name << " element " << i;
      }
      Float32Floor plain, modelled;
      for (int64_t i = 0; i < exact->numel(); ++i) {
        plain.add((*exact)[i]);
        modelled.add((*exact)[i], (*model)[i]);
      }
      const bool may_block = subnormal_model_may_block(bound, plain, kFp32RelTol);
      // Sound: where the model's floor blocks and the plain one does not, the screen says so.
      if (float32_floor_blocks(modelled.rel(), kFp32RelTol) &&
          !float32_floor_blocks(plain.rel(), kFp32RelTol)) {
        EXPECT_TRUE(may_block) << name << ": the model blocks (" << modelled.rel()
                               << ") where the screen skips it (shift " << bound << ")";
      }
      // Useful: inputs of ordinary size (the weights' own underflow included) skip the model.
      if (!*x.tiny) {
        EXPECT_FALSE(may_block) << name << ": shift " << bound << ", norm " << std::sqrt(norm2);
      }
      if (std::string(name) == x.tiny) {
        EXPECT_TRUE(may_block) << name << ": shift " << bound << ", norm " << std::sqrt(norm2);
      }
    }
    EXPECT_EQ(moved, x.moves);
  }
}

}  // namespace
}  // namespace loom
