// kernels: merge of finished partial results. Two partials over disjoint key sets merge into what
// one attend over all keys gives (and the fp64 reference); sides without visible keys; lse values
// far past exp's range; argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <vector>

#include "loom/attention.h"
#include "loom/error.h"
#include "loom/tensor.h"
#include "unit/tolerance.h"

namespace loom {
namespace {

using test::kFp32RelTol;
using test::lse_rel_error;
using test::rel_error;

struct Finished {
  Tensor<float> out;
  std::vector<float> lse;
};

Finished attend_finished(View3<const float> q, View3<const float> k, View3<const float> v,
                         Tokens qt, Tokens kt, const KernelConfig& cfg) {
  SoftmaxState st(q.s, q.h, q.d);
  attend(st.view(), q, k, v, qt, kt, cfg);
  Finished f{Tensor<float>({q.s, q.h, q.d}), std::vector<float>(static_cast<size_t>(q.h * q.s))};
  finish(st.view(), f.out.view3(), f.lse.data(), q.s);
  return f;
}

TEST(Merge, TwoFinishedPartialsEqualOneAttend) {
  // Causal, with documents: queries before the split see nothing of the second part (lse_b =
  // -inf), queries of a document with no key at all see nothing on either side.
  const int64_t s = 150, h = 4, hkv = 2, d = 32, split = 70;
  std::vector<int64_t> pos(s);
  std::iota(pos.begin(), pos.end(), 0);
  std::vector<int32_t> qdoc(s), kdoc(s);
  for (int64_t i = 0; i < s; ++i) {
    kdoc[i] = i < 100 ? 0 : 1;
    qdoc[i] = i >= 140 ? 2 : kdoc[i];  // document 2 has no keys
  }
  const Tensor<float> q = test::random_normal({s, h, d}, 1),
                      k = test::random_normal({s, hkv, d}, 2),
                      v = test::random_normal({s, hkv, d}, 3);
  const Tokens qt{pos.data(), qdoc.data(), s}, kt{pos.data(), kdoc.data(), s};
  KernelConfig cfg;
  cfg.scale = 1.0f / std::sqrt(static_cast<float>(d));
  cfg.block_q = 48;
  cfg.block_k = 40;

  const Finished whole = attend_finished(q.view3(), k.view3(), v.view3(), qt, kt, cfg);
  Finished a = attend_finished(q.view3(), k.view3().rows(0, split), v.view3().rows(0, split), qt,
                               kt.sub(0, split), cfg);
  const Finished b =
      attend_finished(q.view3(), k.view3().rows(split, s - split), v.view3().rows(split, s - split),
                      qt, kt.sub(split, s - split), cfg);
  EXPECT_EQ(b.lse[0], kNegInf);  // row 0 sees no key of part b
  merge(a.out.view3(), a.lse.data(), b.out.view3(), b.lse.data(), s);

  const Tensor<double> qd = convert<double>(q), kd = convert<double>(k), vd = convert<double>(v);
  Tensor<double> ref_out({s, h, d});
  std::vector<double> ref_lse(static_cast<size_t>(h * s));
  reference_forward(qd.view3(), kd.view3(), vd.view3(), qt, kt, cfg.mask, cfg.scale,
                    ref_out.view3(), ref_lse.data());
  EXPECT_LE(rel_error(a.out.vec(), ref_out.vec()), kFp32RelTol);
  EXPECT_LE(lse_rel_error(a.lse, ref_lse), kFp32RelTol);
  EXPECT_LE(rel_error(a.out.vec(), whole.out.vec()), kFp32RelTol);
  EXPECT_LE(lse_rel_error(a.lse, whole.lse), kFp32RelTol);
  for (int64_t hh = 0; hh < h; ++hh) {
    for (int64_t i = 140; i < s; ++i) {
      EXPECT_EQ(a.lse[hh * s + i], kNegInf);
      for (int64_t e = 0; e < d; ++e) EXPECT_EQ(a.out.view3()(i, hh, e), 0.0f);
    }
  }
}

TEST(Merge, IsSymmetric) {
  const int64_t s = 33, h = 3, d = 16;
  Tensor<float> oa = test::random_normal({s, h, d}, 4), ob = test::random_normal({s, h, d}, 5);
  const Tensor<float> la = test::random_normal({h, s}, 6), lb = test::random_normal({h, s}, 7);
  Tensor<float> ab = oa, ba = ob;
  std::vector<float> lse_ab = la.vec(), lse_ba = lb.vec();
  merge(ab.view3(), lse_ab.data(), ob.view3(), lb.data(), s);
  merge(ba.view3(), lse_ba.data(), oa.view3(), la.data(), s);
  EXPECT_LE(rel_error(ab.vec(), ba.vec()), 1e-7);
  EXPECT_EQ(lse_ab, lse_ba);
}

TEST(Merge, OverflowFreeAndInfiniteSides) {
  // Rows: (1000, 999): exp(lse) overflows fp32, the merge must not; (-inf, 5): out = out_b
  // exactly; (7, -inf): out = out_a exactly; (-inf, -inf): out = 0, lse = -inf.
  const int64_t s = 4, d = 3;
  Tensor<float> oa({s, 1, d}), ob({s, 1, d});
  for (int64_t i = 0; i < s; ++i) {
    for (int64_t e = 0; e < d; ++e) {
      oa.view3()(i, 0, e) = 1.0f + static_cast<float>(e);
      ob.view3()(i, 0, e) = -2.0f * static_cast<float>(e + 1);
    }
  }
  oa.view3()(1, 0, 0) = oa.view3()(1, 0, 1) = oa.view3()(1, 0, 2) = 0.0f;  // lse_a = -inf rows
  oa.view3()(3, 0, 0) = oa.view3()(3, 0, 1) = oa.view3()(3, 0, 2) = 0.0f;  // hold out = 0
  ob.view3()(2, 0, 0) = ob.view3()(2, 0, 1) = ob.view3()(2, 0, 2) = 0.0f;
  ob.view3()(3, 0, 0) = ob.view3()(3, 0, 1) = ob.view3()(3, 0, 2) = 0.0f;
  const Tensor<float> oa_before = oa;
  std::vector<float> la = {1000.0f, kNegInf, 7.0f, kNegInf};
  const std::vector<float> lb = {999.0f, 5.0f, kNegInf, kNegInf};
  merge(oa.view3(), la.data(), ob.view3(), lb.data(), s);

  const double wa = 1.0 / (1.0 + std::exp(-1.0)), wb = std::exp(-1.0) / (1.0 + std::exp(-1.0));
  EXPECT_NEAR(la[0], 1000.0 + std::log1p(std::exp(-1.0)), 1e-4);
  for (int64_t e = 0; e < d; ++e) {
    const double expect = wa * oa_before.view3()(0, 0, e) + wb * ob.view3()(0, 0, e);
    EXPECT_NEAR(oa.view3()(0, 0, e), expect, 1e-6 * std::fabs(expect) + 1e-7);
    EXPECT_EQ(oa.view3()(1, 0, e), ob.view3()(1, 0, e));
    EXPECT_EQ(oa.view3()(2, 0, e), oa_before.view3()(2, 0, e));
    EXPECT_EQ(oa.view3()(3, 0, e), 0.0f);
  }
  EXPECT_EQ(la[1], 5.0f);
  EXPECT_EQ(la[2], 7.0f);
  EXPECT_EQ(la[3], kNegInf);
  for (float x : oa.vec()) EXPECT_TRUE(std::isfinite(x));
}

TEST(Merge, StridedLse) {
  // lse arrays with a stride larger than the rows: the padding is untouched.
  const int64_t s = 5, h = 2, d = 4, stride = 8;
  Tensor<float> oa = test::random_normal({s, h, d}, 8);
  const Tensor<float> ob = test::random_normal({s, h, d}, 9);
  std::vector<float> la(h * stride, 42.0f), lb(h * stride, -42.0f);
  for (int64_t hh = 0; hh < h; ++hh)
    for (int64_t i = 0; i < s; ++i) {
      la[hh * stride + i] = 0.5f * static_cast<float>(i);
      lb[hh * stride + i] = -0.25f * static_cast<float>(i + hh);
    }
  merge(oa.view3(), la.data(), ob.view3(), lb.data(), stride);
  for (int64_t hh = 0; hh < h; ++hh) {
    for (int64_t i = 0; i < s; ++i) {
      const double a = 0.5 * static_cast<double>(i), b = -0.25 * static_cast<double>(i + hh);
      EXPECT_NEAR(la[hh * stride + i], std::log(std::exp(a) + std::exp(b)), 1e-6);
    }
    for (int64_t i = s; i < stride; ++i) EXPECT_EQ(la[hh * stride + i], 42.0f);
  }
}

TEST(Merge, RejectsBadArguments) {
  Tensor<float> oa({4, 2, 8}), ob({4, 2, 8}), oc({4, 1, 8});
  std::vector<float> la(8), lb(8);
  EXPECT_THROW(merge(oa.view3(), la.data(), oc.view3(), lb.data(), 4), InvalidArgument);
  EXPECT_THROW(merge(oa.view3(), la.data(), ob.view3(), lb.data(), 3), InvalidArgument);
  EXPECT_THROW(merge(oa.view3(), nullptr, ob.view3(), lb.data(), 4), InvalidArgument);
  EXPECT_NO_THROW(merge(oa.view3(), la.data(), ob.view3(), lb.data(), 4));
}

}  // namespace
}  // namespace loom
