// The library's contracts at its edges, each found broken by a probe of the C++ API: the fixed
// tolerances claimed only where they hold (loom/tolerance.h), output views that overlap
// themselves refused by the kernels (loom/tensor.h), sizes no memory holds refused as
// OutOfMemory, null pointers and overflowing counts refused as InvalidArgument, and .npy shapes
// read only as the Python tuples numpy writes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "loom/attention.h"
#include "loom/bf16.h"
#include "loom/comm.h"
#include "loom/cp.h"
#include "loom/error.h"
#include "loom/npy.h"
#include "loom/rng.h"
#include "loom/tensor.h"
#include "loom/tolerance.h"
#include "loom/verify.h"

namespace loom {
namespace {

// ---------------------------------------------------------------------------------------------
// The fixed tolerances' regime.

double rel_error(const std::vector<double>& x, const Tensor<double>& ref) {
  double e = 0, n = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    if (std::isinf(ref[i]) && x[i] == ref[i]) continue;  // lse of a row without keys
    e += (x[i] - ref[i]) * (x[i] - ref[i]);
    n += ref[i] * ref[i];
  }
  return n > 0 ? std::sqrt(e / n) : std::sqrt(e);
}

struct Outcome {
  std::string exclusion;  // check_limits' why: "" where the fixed tolerances are claimed
  double err[5] = {};     // out, lse, dq, dk, dv: relative errors against the fp64 reference
  Bf16Bounds bound;       // the problem's own bounds (computed inside the regime too)
  CheckLimits limits;     // as `loom attn --check` holds the results (check_limits)
};

// One problem as `loom attn --input DIR --backward --check` runs it on one rank: the inputs,
// rounded to bf16 for bf16 storage, through CpAttention with the default kernel config, compared
// with the fp64 reference on the values the kernels saw.
template <class T>
Outcome run_attn_on(const Tensor<float>& q, const Tensor<float>& k, const Tensor<float>& v,
                    const Tensor<float>& dout, bool causal, float scale) {
  constexpr bool kBf16 = std::is_same_v<T, bf16>;
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1);
  const ShardPlan plan = ShardPlan::make(Layout::zigzag, S, 1);
  // convert<float, float> is not instantiated: fp32 takes the inputs as they are.
  const auto as_t = [](const Tensor<float>& x) {
    if constexpr (kBf16)
      return convert<bf16>(x);
    else
      return x;
  };
  const Tensor<T> tq = as_t(q), tk = as_t(k), tv = as_t(v), tdout = as_t(dout);
  Tensor<T> out({S, H, D});
  Tensor<float> lse({H, S}), dq({S, H, D}), dk({S, Hkv, D}), dv({S, Hkv, D});
  CpConfig cfg;
  cfg.kernel.mask.causal = causal;
  cfg.kernel.scale = scale;
  cfg.kernel.threads = 1;
  run_local(1, [&](Communicator& comm) {
    CpAttention att(comm, plan, cfg, H, Hkv, D);
    att.forward(tq.view3(), tk.view3(), tv.view3(), out.view3(), lse.data());
    att.backward(tq.view3(), tk.view3(), tv.view3(), out.view3(), tdout.view3(), lse.data(),
                 dq.view3(), dk.view3(), dv.view3());
  });
  // The values the kernels saw, in fp64 (bf16 widens exactly to float).
  const auto as_f64 = [](const Tensor<T>& x) {
    if constexpr (kBf16)
      return convert<double>(convert<float>(x));
    else
      return convert<double>(x);
  };
  const Tensor<double> rq = as_f64(tq), rk = as_f64(tk), rv = as_f64(tv), rdout = as_f64(tdout);
  std::vector<int64_t> pos(static_cast<size_t>(S));
  for (int64_t i = 0; i < S; ++i) pos[i] = i;
  const Tokens t{pos.data(), nullptr, S};
  const Mask mask = cfg.kernel.mask;
  Tensor<double> ref_out({S, H, D}), ref_lse({H, S}), ref_dq({S, H, D}), ref_dk({S, Hkv, D}),
      ref_dv({S, Hkv, D});
  reference_forward(rq.view3(), rk.view3(), rv.view3(), t, t, mask, scale, ref_out.view3(),
                    ref_lse.data());
  reference_backward(rq.view3(), rk.view3(), rv.view3(), rdout.view3(), t, t, mask, scale,
                     ref_dq.view3(), ref_dk.view3(), ref_dv.view3());
  // The kernels' lse is [H, S] in local row order; one zigzag rank holds the tokens in order.
  const auto vec = [](const Tensor<float>& x) {
    return std::vector<double>(x.data(), x.data() + x.numel());
  };
  Outcome o;
  if constexpr (kBf16)
    o.err[0] = rel_error(vec(convert<float>(out)), ref_out);
  else
    o.err[0] = rel_error(vec(out), ref_out);
  o.err[1] = rel_error(vec(lse), ref_lse);
  o.err[2] = rel_error(vec(dq), ref_dq);
  o.err[3] = rel_error(vec(dk), ref_dk);
  o.err[4] = rel_error(vec(dv), ref_dv);
  o.limits = check_limits(rq.view3(), rk.view3(), rv.view3(), rdout.view3(), t, t, mask, scale,
                          CheckedResults{kBf16, kBf16 && kernel_path_bf16_dots(), true});
  o.exclusion = o.limits.why;
  if constexpr (kBf16) {
    o.bound = bf16_error_bounds(rq.view3(), rk.view3(), rv.view3(), rdout.view3(), t, t, mask,
                                scale, kernel_path_bf16_dots(), /*loom_kernels=*/true);
  } else {
    const Fp32Bounds f = fp32_error_bounds(rq.view3(), rk.view3(), rv.view3(), rdout.view3(), t, t,
                                           mask, scale, /*loom_kernels=*/true);
    o.bound = Bf16Bounds{f.out, f.out, f.dq, f.dk, f.dv, f.lse};
  }
  return o;
}

// One problem as `loom attn --seed seed --backward --check` makes and runs it on one rank: inputs
// from fill_normal.
template <class T>
Outcome run_attn(int64_t S, int64_t H, int64_t Hkv, int64_t D, bool causal, float scale,
                 uint64_t seed) {
  const ShardPlan plan = ShardPlan::make(Layout::zigzag, S, 1);
  const int64_t* tokens = plan.tokens[0].data();
  Tensor<float> q({S, H, D}), k({S, Hkv, D}), v({S, Hkv, D}), dout({S, H, D});
  fill_normal(q.view3(), tokens, seed, "q");
  fill_normal(k.view3(), tokens, seed, "k");
  fill_normal(v.view3(), tokens, seed, "v");
  fill_normal(dout.view3(), tokens, seed, "dout");
  return run_attn_on<T>(q, k, v, dout, causal, scale);
}

// Every error within the problem's own bound, within check_limits' limits and, where the library
// claims the fixed tolerances (o.exclusion empty), within them.
void expect_within(const Outcome& o, bool bf16, const std::string& what) {
  const double fixed_bf16[5] = {kBf16OutRelTol, kFp32RelTol, kBf16GradRelTol, kBf16GradRelTol,
                                kBf16GradRelTol};
  const char* names[5] = {"out", "lse", "dq", "dk", "dv"};
  const double b[5] = {o.bound.out, o.bound.lse, o.bound.dq, o.bound.dk, o.bound.dv};
  const double l[5] = {o.limits.out, o.limits.lse, o.limits.dq, o.limits.dk, o.limits.dv};
  for (int x = 0; x < 5; ++x) {
    EXPECT_LE(o.err[x], b[x]) << names[x] << ", " << what << ": outside its own bound";
    EXPECT_LE(o.err[x], l[x]) << names[x] << ", " << what << ": outside check_limits'";
    if (o.exclusion.empty()) {
      EXPECT_LE(o.err[x], bf16 ? fixed_bf16[x] : kFp32RelTol)
          << names[x] << ", " << what << ": the fixed tolerance was claimed";
    }
  }
}

// Where the library claims the fixed tolerances, correct results meet them; everywhere, they meet
// the problem's own bounds. The two problems of the probe, 200 seeds each as `loom attn --seed`:
// fp32 S = 2, D = 8, full, scale 2 (59 seeds put dq and dk over kFp32RelTol, up to 800 times:
// seed 93 "check FAILED ... dq 0.0814 > 1e-05") and bf16 S = 4, H = 4 over 2, D = 8, full, scale
// 1.41 (44 seeds over 2u from 4 visible keys per row: seed 2 "dq 0.0199 > 0.00781"). The fixed
// tolerances were claimed for both (scores within 128, and for bf16 4 keys per row and D = 8);
// the rows' weights sit on one or two keys, and the spread condition now sends them to their
// bounds. The default scale at S = 64 stays in the regime.
TEST(FixedTolerances, ClaimedOnlyWhereCorrectResultsMeetThem) {
  const auto check = [](const Outcome& o, bool bf16, uint64_t seed) {
    expect_within(o, bf16, "seed " + std::to_string(seed));
  };
  int fp32_claimed = 0, bf16_claimed = 0;
  for (uint64_t seed = 1; seed <= 200; ++seed) {
    const Outcome a = run_attn<float>(2, 1, 1, 8, /*causal=*/false, 2.0f, seed);
    check(a, false, seed);
    fp32_claimed += a.exclusion.empty();
    const Outcome b = run_attn<bf16>(4, 4, 2, 8, /*causal=*/false, 1.41421f, seed);
    check(b, true, seed);
    bf16_claimed += b.exclusion.empty();
  }
  // Neither problem is in the regime for any seed (one or two effective keys per row).
  EXPECT_EQ(fp32_claimed, 0);
  EXPECT_EQ(bf16_claimed, 0);
  const Outcome seed93 = run_attn<float>(2, 1, 1, 8, false, 2.0f, 93);
  EXPECT_NE(seed93.exclusion.find("effective keys per query row"), std::string::npos)
      << seed93.exclusion;
  // The default scale 1 / sqrt(D) at S = 64, causal: the fixed tolerances, and met.
  for (const uint64_t seed : {1, 2, 3}) {
    const Outcome f = run_attn<float>(64, 2, 1, 64, true, 0.125f, seed);
    EXPECT_EQ(f.exclusion, "");
    check(f, false, seed);
    const Outcome g = run_attn<bf16>(64, 2, 1, 64, true, 0.125f, seed);
    EXPECT_EQ(g.exclusion, "");
    check(g, true, seed);
  }
}

// Keys that share a component. ds_ij = p_ij (dp_ij - delta_i) sums to zero over a row, so
// dq_i = scale sum_j ds_ij (k_j - kbar_i) (kbar_i = sum_j p_ij k_j), while the roundings of delta_i
// and of the weights multiply kbar_i itself: dq's relative error grows with ||kbar|| against the
// keys' spread about it (common_key_ratio). A probe found correct results that missed the fixed
// tolerances inside the regime as it was (scores within 128, spread weights), `loom attn --check`
// saying "check FAILED": bf16, k ~ N(0, 1) + 4 (S = 256, D = 64, causal, 21 effective keys): dq
// 0.0114 > 2^-7, where rounding out to bf16 alone gives 0.0069; bf16, keys and queries on one axis
// (S = 300, D = 16, full, scale 0.25, 18 effective keys): dq 0.057; fp32, the same at 15 times
// the axis (5.5 effective keys): dq 1.18e-5 > 1e-5, PyTorch's fp32 attention 7.1e-6. Now outside
// the regime, within their own bounds; the fp32 of the first stays inside and meets 1e-5.
Tensor<float> normal_tensor(std::vector<int64_t> shape, uint64_t seed, std::string_view name) {
  Tensor<float> x(std::move(shape));
  std::vector<int64_t> tokens(static_cast<size_t>(x.size(0)));
  for (int64_t i = 0; i < x.size(0); ++i) tokens[i] = i;
  fill_normal(x.view3(), tokens.data(), seed, name);
  return x;
}

// The probe's axis family: q_i = (+-a, 0.01 N(0, 1) ...), k_j = (a c_j, 0.01 N(0, 1) ...) with c
// uniform on (-1, 1) and three keys at c = 1: each row's weight sits on the keys near one end.
void put_on_an_axis(Tensor<float>& q, Tensor<float>& k, float a) {
  const int64_t D = q.size(2);
  for (int64_t i = 0; i < q.size(0) * q.size(1); ++i) {
    float* r = q.data() + i * D;
    r[0] = r[0] < 0 ? -a : a;
    for (int64_t d = 1; d < D; ++d) r[d] *= 0.01f;
  }
  const int64_t S = k.size(0), Hkv = k.size(1);
  for (int64_t j = 0; j < S; ++j)
    for (int64_t g = 0; g < Hkv; ++g) {
      float* r = k.data() + (j * Hkv + g) * D;
      const bool end = j == 7 || j == S / 2 || j == S - 3;
      r[0] = a * (end ? 1.0f : std::erf(r[0] / std::sqrt(2.0f)));  // uniform on (-1, 1)
      for (int64_t d = 1; d < D; ++d) r[d] *= 0.01f;
    }
}

TEST(FixedTolerances, KeysSharingAComponentLeaveTheRegime) {
  const auto expect_reason = [](const Outcome& o, const char* what) {
    EXPECT_NE(o.exclusion.find("keys sharing a component"), std::string::npos)
        << what << ": " << o.exclusion;
  };
  {  // k ~ N(0, 1) + 4: bf16 outside (common_key_ratio about 4), fp32 inside (at most 8)
    const int64_t S = 256, H = 2, D = 64;
    const Tensor<float> q = normal_tensor({S, H, D}, 1, "q"), v = normal_tensor({S, H, D}, 1, "v"),
                        dout = normal_tensor({S, H, D}, 1, "dout");
    Tensor<float> k = normal_tensor({S, H, D}, 1, "k");
    for (float& x : k.vec()) x += 4.0f;
    const Outcome b = run_attn_on<bf16>(q, k, v, dout, /*causal=*/true, 0.125f);
    expect_reason(b, "bf16, k + 4");
    expect_within(b, true, "bf16, k + 4");
    const Outcome f = run_attn_on<float>(q, k, v, dout, true, 0.125f);
    EXPECT_EQ(f.exclusion, "");
    expect_within(f, false, "fp32, k + 4");
  }
  for (const float a : {8.0f, 15.0f}) {  // on an axis: outside for bf16 and fp32
    const int64_t S = 300, H = 4, Hkv = 2, D = 16;
    Tensor<float> q = normal_tensor({S, H, D}, 2, "q"), k = normal_tensor({S, Hkv, D}, 2, "k");
    const Tensor<float> v = normal_tensor({S, Hkv, D}, 2, "v"),
                        dout = normal_tensor({S, H, D}, 2, "dout");
    put_on_an_axis(q, k, a);
    const std::string what = "axis " + std::to_string(static_cast<int>(a));
    const Outcome b = run_attn_on<bf16>(q, k, v, dout, /*causal=*/false, 0.25f);
    expect_reason(b, ("bf16, " + what).c_str());
    expect_within(b, true, "bf16, " + what);
    const Outcome f = run_attn_on<float>(q, k, v, dout, false, 0.25f);
    expect_reason(f, ("fp32, " + what).c_str());
    expect_within(f, false, "fp32, " + what);
  }
  // N(0, 1) at the default scale, S = 256, D = 64, causal: inside both (the ratio about 0.25).
  for (const uint64_t seed : {4, 5}) {
    const Outcome f = run_attn<float>(256, 2, 2, 64, true, 0.125f, seed);
    EXPECT_EQ(f.exclusion, "");
    expect_within(f, false, "N(0, 1), seed " + std::to_string(seed));
    const Outcome g = run_attn<bf16>(256, 2, 2, 64, true, 0.125f, seed);
    EXPECT_EQ(g.exclusion, "");
    expect_within(g, true, "N(0, 1), seed " + std::to_string(seed));
  }
}

// Values sharing a component leave the regime too (common_value_ratio): dp - delta cancels it
// while delta's rounding carries it. v ~ N(0, 1) + 100 failed fp32's 1e-5 (dq 2.9e-5) and 4 of 64
// channels of v at + 20 bf16's 2u (dq 0.013), correct results within their own bounds.
TEST(FixedTolerances, ValuesSharingAComponentLeaveTheRegime) {
  const int64_t S = 256, H = 2, D = 64;
  const Tensor<float> q = normal_tensor({S, H, D}, 6, "q"), k = normal_tensor({S, H, D}, 6, "k"),
                      dout = normal_tensor({S, H, D}, 6, "dout");
  const auto expect_reason = [](const Outcome& o, const std::string& what) {
    EXPECT_NE(o.exclusion.find("values sharing a component"), std::string::npos)
        << what << ": " << o.exclusion;
  };
  {
    Tensor<float> v = normal_tensor({S, H, D}, 6, "v");
    for (float& x : v.vec()) x += 100.0f;
    const Outcome f = run_attn_on<float>(q, k, v, dout, /*causal=*/true, 0.125f);
    expect_reason(f, "fp32, v + 100");
    expect_within(f, false, "fp32, v + 100");
    EXPECT_GT(f.err[2], kFp32RelTol) << "the case no longer shows what the condition is for";
  }
  {
    Tensor<float> v = normal_tensor({S, H, D}, 6, "v");
    for (int64_t j = 0; j < S; ++j)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < 4; ++d) v.vec()[(j * H + h) * D + d] += 20.0f;
    const Outcome b = run_attn_on<bf16>(q, k, v, dout, true, 0.125f);
    expect_reason(b, "bf16, 4 channels + 20");
    expect_within(b, true, "bf16, 4 channels + 20");
    EXPECT_GT(b.err[2], kBf16GradRelTol) << "the case no longer shows what the condition is for";
  }
  {  // N(0, 1) values: inside both
    const Tensor<float> v = normal_tensor({S, H, D}, 6, "v");
    EXPECT_EQ(run_attn_on<float>(q, k, v, dout, true, 0.125f).exclusion, "");
    EXPECT_EQ(run_attn_on<bf16>(q, k, v, dout, true, 0.125f).exclusion, "");
  }
}

// A loss mask: dout on one query row, 0 elsewhere, so the gradients are that row's alone. N(0, 1)
// q, k and v at 4 times the default scale (S = 256, D = 16, causal) are inside the regime over
// every row (about 5.7 effective keys), but the row whose top key leaves about 1e-3 of the weight
// to the others has about one: a probe found the correct fp32 dq there 1.1e-4 from the reference
// and `loom attn --check` saying "check FAILED" at 1e-5 (PyTorch's fp32 attention misses 1e-5 on
// such rows too). The regime's conditions now also weigh each row by its ||dout||^2.
TEST(FixedTolerances, GradientsOfFewRowsAreJudgedByThoseRows) {
  const int64_t S = 256, D = 16;
  const float scale = 1.0f;
  const Tensor<float> q = normal_tensor({S, 1, D}, 3, "q"), k = normal_tensor({S, 1, D}, 3, "k"),
                      v = normal_tensor({S, 1, D}, 3, "v"),
                      dense = normal_tensor({S, 1, D}, 3, "dout");
  // The row (past the first 16) whose share off its top key is nearest 1e-3.
  int64_t row = 16;
  double best = std::numeric_limits<double>::infinity();
  for (int64_t i = 16; i < S; ++i) {
    std::vector<double> s(static_cast<size_t>(i + 1));
    for (int64_t j = 0; j <= i; ++j) {
      double x = 0;
      for (int64_t d = 0; d < D; ++d) x += double(q[i * D + d]) * double(k[j * D + d]);
      s[j] = scale * x;
    }
    const double m = *std::max_element(s.begin(), s.end());
    double z = 0;
    for (const double x : s) z += std::exp(x - m);
    const double off = std::fabs(std::log((z - 1) / z) - std::log(1e-3));
    if (off < best) best = off, row = i;
  }
  Tensor<float> sparse({S, 1, D});
  sparse.fill(0.0f);
  for (int64_t d = 0; d < D; ++d) sparse[row * D + d] = dense[row * D + d];
  const Outcome f = run_attn_on<float>(q, k, v, sparse, /*causal=*/true, scale);
  EXPECT_NE(f.exclusion.find("each row weighted by its ||dout||^2"), std::string::npos)
      << f.exclusion;
  expect_within(f, false, "fp32, dout on row " + std::to_string(row));
  EXPECT_GT(f.err[2], kFp32RelTol) << "the case no longer shows what the condition is for";
  const Outcome b = run_attn_on<bf16>(q, k, v, sparse, true, scale);
  EXPECT_NE(b.exclusion.find("each row weighted by its ||dout||^2"), std::string::npos)
      << b.exclusion;
  expect_within(b, true, "bf16, dout on row " + std::to_string(row));
  // dout on every row: the same problem is inside fp32's regime, and meets it.
  const Outcome g = run_attn_on<float>(q, k, v, dense, true, scale);
  EXPECT_EQ(g.exclusion, "");
  expect_within(g, false, "fp32, dout on every row");
}

// Values cancelling in out leave the regime too (out_cancel_ratio): a probe's v less its mean over
// the keys plus 1e-4, with near-uniform weights (q of 0.01 N(0, 1), S = 256, D = 16, full; ratio
// about 97) put a correct fp32 out at 1.62e-5 (PyTorch 1.53e-5) and bf16 at 0.111 on the amx
// path: "check FAILED". Now the problem's own bounds, which hold.
TEST(FixedTolerances, ValuesCancellingInOutLeaveTheRegime) {
  const int64_t S = 256, D = 16;
  Tensor<float> q = normal_tensor({S, 1, D}, 8, "q");
  for (float& x : q.vec()) x *= 0.01f;
  const Tensor<float> k = normal_tensor({S, 1, D}, 8, "k"),
                      dout = normal_tensor({S, 1, D}, 8, "dout");
  Tensor<float> v = normal_tensor({S, 1, D}, 8, "v");
  for (int64_t d = 0; d < D; ++d) {
    double mean = 0;
    for (int64_t j = 0; j < S; ++j) mean += v[j * D + d];
    mean /= S;
    for (int64_t j = 0; j < S; ++j) v[j * D + d] = static_cast<float>(v[j * D + d] - mean + 1e-4);
  }
  const Outcome f = run_attn_on<float>(q, k, v, dout, /*causal=*/false, 0.25f);
  EXPECT_NE(f.exclusion.find("values cancelling in out"), std::string::npos) << f.exclusion;
  expect_within(f, false, "fp32, out cancelling");
  EXPECT_GT(f.err[0], kFp32RelTol) << "the case no longer shows what the condition is for";
  const Outcome b = run_attn_on<bf16>(q, k, v, dout, false, 0.25f);
  EXPECT_NE(b.exclusion.find("values cancelling in out"), std::string::npos) << b.exclusion;
  expect_within(b, true, "bf16, out cancelling");
  if (kernel_path_bf16_dots()) {  // p rounded to bf16 in p v: out misses 2u (widening: not)
    EXPECT_GT(b.err[0], kBf16OutRelTol) << "the case no longer shows what the condition is for";
  }
}

// A causal problem of N(0, 1) inputs in float64 (fill_normal's values), positions 0 to S - 1.
struct NormalProblem {
  NormalProblem(int64_t S, int64_t H, int64_t Hkv, int64_t D, uint64_t seed)
      : q(f64(normal_tensor({S, H, D}, seed, "q"))),
        k(f64(normal_tensor({S, Hkv, D}, seed, "k"))),
        v(f64(normal_tensor({S, Hkv, D}, seed, "v"))),
        dout(f64(normal_tensor({S, H, D}, seed, "dout"))),
        pos(static_cast<size_t>(S)) {
    for (int64_t i = 0; i < S; ++i) pos[i] = i;
  }
  static Tensor<double> f64(const Tensor<float>& x) { return convert<double>(x); }
  Tokens tokens() const { return Tokens{pos.data(), nullptr, static_cast<int64_t>(pos.size())}; }
  Tensor<double> q, k, v, dout;
  std::vector<int64_t> pos;
};

// check_limits: the fixed tolerances inside the regime (dv of bf16 kFp32RelTol on the widening
// paths, 2u with bf16 dots), the problem's own bounds outside, the score condition over the rows
// score_bound covers, and a hint that fits the reason.
TEST(CheckLimits, FixedInsideTheRegimeOwnBoundsOutside) {
  const NormalProblem n(64, 2, 2, 64, 7);
  const Tensor<double>&q = n.q, &k = n.k, &v = n.v, &dout = n.dout;
  const Tokens t = n.tokens();
  const Mask causal{true, 0};
  const auto limits = [&](CheckedResults r, double score_bound = -1, bool backward = true) {
    return check_limits(q.view3(), k.view3(), v.view3(),
                        backward ? View3<const double>(dout.view3()) : View3<const double>{}, t, t,
                        causal, 0.125, r, score_bound);
  };
  const CheckLimits f = limits(CheckedResults{false, false, true});
  EXPECT_EQ(f.miss, RegimeMiss::kNone);
  EXPECT_EQ(f.why, "");
  for (const double x : {f.out, f.lse, f.dq, f.dk, f.dv}) EXPECT_EQ(x, kFp32RelTol);
  const CheckLimits w = limits(CheckedResults{true, false, true});
  EXPECT_EQ(w.out, kBf16OutRelTol);
  EXPECT_EQ(w.lse, kFp32RelTol);
  EXPECT_EQ(w.dq, kBf16GradRelTol);
  EXPECT_EQ(w.dk, kBf16GradRelTol);
  EXPECT_EQ(w.dv, kFp32RelTol);  // widening: p^T dout in fp32
  EXPECT_EQ(limits(CheckedResults{true, true, true}).dv, kBf16GradRelTol);
  // The same problem, sampled out of one whose scores reach 1000: the score condition.
  const CheckLimits o = limits(CheckedResults{false, false, true}, 1000);
  EXPECT_EQ(o.miss, RegimeMiss::kScores);
  EXPECT_EQ(o.why.rfind("scores up to 1e+03", 0), 0u) << o.why;
  const Fp32Bounds b = fp32_error_bounds(q.view3(), k.view3(), v.view3(), dout.view3(), t, t,
                                         causal, 0.125, /*loom_kernels=*/true);
  EXPECT_EQ(o.out, b.out);
  EXPECT_EQ(o.lse, b.lse);
  EXPECT_EQ(o.dq, b.dq);
  EXPECT_EQ(o.dk, b.dk);
  EXPECT_EQ(o.dv, b.dv);
  EXPECT_GT(o.dq, kFp32RelTol);
  const CheckLimits fwd = limits(CheckedResults{false, false, true}, 1000, /*backward=*/false);
  EXPECT_EQ(fwd.out, b.out);
  EXPECT_TRUE(std::isinf(fwd.dq));  // not computed without dout
  // Hints: the keys' or values' mean where they share a component, else the scale.
  EXPECT_NE(check_limits_hint(RegimeMiss::kCommonKey).find("subtracting the keys' mean"),
            std::string::npos);
  EXPECT_NE(check_limits_hint(RegimeMiss::kCommonValue).find("subtracting the values' mean"),
            std::string::npos);
  for (const RegimeMiss m : {RegimeMiss::kScores, RegimeMiss::kEffectiveKeys, RegimeMiss::kHeadDim})
    EXPECT_NE(check_limits_hint(m).find("lower the scale"), std::string::npos);
  EXPECT_EQ(check_limits_hint(RegimeMiss::kNone), "");
}

// Where q holds a sample of the query rows (loom verify above --full-check-max), dk and dv are not
// compared: key_grads false leaves their bounds +inf (and allocates none of their [Sk, Hkv, D]
// accumulators), and the other bounds are bitwise those computed with them. Scale 4 puts the
// scores past 128, so the bf16 bounds take fp32_error_bounds' terms too.
TEST(CheckLimits, SampledRowsBoundNoKeyGradients) {
  const NormalProblem n(48, 4, 2, 32, 11);
  const Tensor<double>&q = n.q, &k = n.k, &v = n.v, &dout = n.dout;
  const Tokens t = n.tokens();
  const Mask causal{true, 0};
  const double scale = 4;
  // Computed without dk and dv: the other bounds bitwise the same, dk and dv +inf (not computed).
  const auto expect_without_keys = [](const auto& all, const auto& some) {
    EXPECT_EQ(some.out, all.out);
    EXPECT_EQ(some.lse, all.lse);
    EXPECT_EQ(some.dq, all.dq);
    EXPECT_TRUE(std::isfinite(all.dk) && std::isfinite(all.dv));
    EXPECT_TRUE(std::isinf(some.dk) && std::isinf(some.dv));
  };
  expect_without_keys(
      fp32_error_bounds(q.view3(), k.view3(), v.view3(), dout.view3(), t, t, causal, scale, true),
      fp32_error_bounds(q.view3(), k.view3(), v.view3(), dout.view3(), t, t, causal, scale, true,
                        /*key_grads=*/false));
  for (const bool dots : {false, true}) {
    const Bf16Bounds all = bf16_error_bounds(q.view3(), k.view3(), v.view3(), dout.view3(), t, t,
                                             causal, scale, dots, false),
                     some = bf16_error_bounds(q.view3(), k.view3(), v.view3(), dout.view3(), t, t,
                                              causal, scale, dots, false, /*key_grads=*/false);
    expect_without_keys(all, some);
    EXPECT_EQ(some.out_fp32, all.out_fp32);
  }
  for (const bool bf16 : {false, true}) {
    const auto limits = [&](bool key_grads) {
      return check_limits(q.view3(), k.view3(), v.view3(), dout.view3(), t, t, causal, scale,
                          CheckedResults{bf16, true, false, key_grads});
    };
    const CheckLimits some = limits(false);
    EXPECT_EQ(some.miss, RegimeMiss::kScores);
    expect_without_keys(limits(true), some);
  }
}

// effective_keys: n where every row has n equal weights, 1 where every row's weight sits on one
// key, and pulled toward 1 by concentrated rows; the conditions in their order, common_key_ratio
// last.
TEST(FixedTolerances, EffectiveKeysAndTheReasonsGiven) {
  const int64_t S = 8, D = 8;
  Tensor<double> q({S, 1, D}), k({S, 1, D});
  q.fill(0.0);
  k.fill(0.0);
  std::vector<int64_t> pos(S);
  for (int64_t i = 0; i < S; ++i) pos[i] = i;
  const Tokens t{pos.data(), nullptr, S};
  // Zero scores: every visible key weighs the same. Full mask: 8 keys per row; causal: row i
  // sees i + 1, sum_j p_j^2 = 1 / (i + 1), 8 / (1 + 1/2 + ... + 1/8) = 2.943; one key: 1.
  EXPECT_DOUBLE_EQ(effective_keys(q.view3(), k.view3(), t, t, Mask{false, 0}, 1.0), 8.0);
  EXPECT_NEAR(effective_keys(q.view3(), k.view3(), t, t, Mask{true, 0}, 1.0), 2.943, 1e-3);
  EXPECT_DOUBLE_EQ(effective_keys(q.view3(), k.view3(), t, t, Mask{true, 1}, 1.0), 1.0);
  // Full: both regimes. Causal: fp32's, not bf16's. One key: neither.
  EXPECT_EQ(fixed_tolerance_exclusion(q.view3(), k.view3(), t, t, Mask{false, 0}, 1.0, true), "");
  EXPECT_EQ(fixed_tolerance_exclusion(q.view3(), k.view3(), t, t, Mask{true, 0}, 1.0, false), "");
  EXPECT_EQ(fixed_tolerance_exclusion(q.view3(), k.view3(), t, t, Mask{true, 0}, 1.0, true),
            "2.94 effective keys per query row (1 / the rows' mean sum_j p_j^2; under 6)");
  EXPECT_EQ(fixed_tolerance_exclusion(q.view3(), k.view3(), t, t, Mask{true, 1}, 1.0, false),
            "1.00 effective keys per query row (1 / the rows' mean sum_j p_j^2; under 2)");
  // One row spread over 8 keys does not carry 7 rows of one key: causal, queries 0..6 at
  // position 0 (they see key 0 only) and query 7 at position 7 (every key). A mean of
  // 1 / sum_j p_j^2 would give (7 + 8) / 8 = 1.875; the statistic is 8 / (7 + 1/8) = 1.12.
  std::vector<int64_t> qpos(S, 0);
  qpos[S - 1] = S - 1;
  const Tokens qt{qpos.data(), nullptr, S};
  EXPECT_NEAR(effective_keys(q.view3(), k.view3(), qt, t, Mask{true, 0}, 1.0), 8 / 7.125, 1e-12);
  // A large score: the score condition first.
  q[0] = 100;
  k[0] = 100;
  EXPECT_EQ(fixed_tolerance_exclusion(q.view3(), k.view3(), t, t, Mask{}, 1.0, false),
            "scores up to 1e+04 (|scale| max||q|| max||k|| above 128)");
  // A head dim under 8: bf16 only.
  Tensor<double> q4({S, 1, 4}), k4({S, 1, 4});
  q4.fill(0.0);
  k4.fill(0.0);
  EXPECT_EQ(fixed_tolerance_exclusion(q4.view3(), k4.view3(), t, t, Mask{}, 1.0, true),
            "head dim under 8");
  EXPECT_EQ(fixed_tolerance_exclusion(q4.view3(), k4.view3(), t, t, Mask{}, 1.0, false), "");
  // Keys sharing a component, last: q = 0 weighs the 8 keys equally, k_j = (b + (-1)^j, 0, ...)
  // has kbar = (b, 0, ...) and spread 1 in every row, so common_key_ratio is b. Above 1 bf16 leaves
  // the regime, above 8 fp32 too.
  Tensor<double> kc({S, 1, D});
  kc.fill(0.0);
  q.fill(0.0);
  for (const double b : {2.0, 9.0}) {
    for (int64_t j = 0; j < S; ++j) kc[j * D] = b + (j % 2 ? -1.0 : 1.0);
    EXPECT_DOUBLE_EQ(common_key_ratio(q.view3(), kc.view3(), t, t, Mask{false, 0}, 1.0), b);
  }
  EXPECT_EQ(fixed_tolerance_exclusion(q.view3(), kc.view3(), t, t, Mask{false, 0}, 1.0, false),
            "keys sharing a component 9 times their spread (sqrt of the rows' sum ||kbar||^2 / "
            "sum_j p_j ||k_j - kbar||^2, kbar = sum_j p_j k_j; above 8)");
  for (int64_t j = 0; j < S; ++j) kc[j * D] = 2.0 + (j % 2 ? -1.0 : 1.0);
  EXPECT_EQ(fixed_tolerance_exclusion(q.view3(), kc.view3(), t, t, Mask{false, 0}, 1.0, true),
            "keys sharing a component 2 times their spread (sqrt of the rows' sum ||kbar||^2 / "
            "sum_j p_j ||k_j - kbar||^2, kbar = sum_j p_j k_j; above 1)");
  EXPECT_EQ(fixed_tolerance_exclusion(q.view3(), kc.view3(), t, t, Mask{false, 0}, 1.0, false), "");
}

// ---------------------------------------------------------------------------------------------
// Output views that overlap themselves (loom/tensor.h: ss >= (H - 1) hs + D).

// An [S, H, D] buffer read through a view whose head stride is 2D and row stride H x D: row i's
// head 1 is row i + 1's head 0. finish() wrote through it with a relative error of 0.88.
TEST(KernelViews, OverlappingOutputsAreRefusedNamingTheStrides) {
  const int64_t S = 8, H = 2, D = 16;
  Tensor<float> q({S, H, D}), k({S, H, D}), v({S, H, D});
  std::vector<int64_t> tokens(S);
  for (int64_t i = 0; i < S; ++i) tokens[i] = i;
  fill_normal(q.view3(), tokens.data(), 1, "q");
  fill_normal(k.view3(), tokens.data(), 1, "k");
  fill_normal(v.view3(), tokens.data(), 1, "v");
  const Tokens t{tokens.data(), nullptr, S};
  KernelConfig cfg;
  cfg.scale = 0.25f;
  SoftmaxState st(S, H, D);
  attend(st.view(), q.view3(), k.view3(), v.view3(), t, t, cfg);
  std::vector<float> buf(static_cast<size_t>(S * H * D + 2 * D)), lse(H * S), delta(H * S);
  const View3<float> overlapping{buf.data(), S, H, D, H * D, 2 * D};
  const auto expect_refused = [](const auto& call, const char* name) {
    try {
      call();
      ADD_FAILURE() << name << ": an overlapping output was accepted";
    } catch (const InvalidArgument& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(std::string(name) + ": row stride 32 is smaller than (heads - 1) x head "
                                           "stride + head dim = (2 - 1) x 32 + 16"),
                std::string::npos)
          << m;
    }
  };
  expect_refused([&] { finish(st.view(), overlapping, lse.data(), S); }, "out");
  Tensor<float> out({S, H, D}), dq({S, H, D}), dk({S, H, D}), dv({S, H, D});
  finish(st.view(), out.view3(), lse.data(), S);
  expect_refused([&] { merge(overlapping, lse.data(), out.view3(), lse.data(), S); }, "out_a");
  compute_delta(out.view3(), q.view3(), delta.data(), S);
  const auto backward = [&](View3<float> a, View3<float> b, View3<float> c) {
    attend_backward(q.view3(), k.view3(), v.view3(), q.view3(), lse.data(), delta.data(), S, t, t,
                    cfg, a, b, c);
  };
  expect_refused([&] { backward(overlapping, dk.view3(), dv.view3()); }, "dq");
  expect_refused([&] { backward(dq.view3(), overlapping, dv.view3()); }, "dk");
  expect_refused([&] { backward(dq.view3(), dk.view3(), overlapping); }, "dv");
  // The fp64 reference's outputs too.
  std::vector<double> dbuf(buf.size());
  const View3<double> doverlap{dbuf.data(), S, H, D, H * D, 2 * D};
  const Tensor<double> qd = convert<double>(q), kd = convert<double>(k), vd = convert<double>(v);
  std::vector<double> dlse(H * S);
  expect_refused(
      [&] {
        reference_forward(qd.view3(), kd.view3(), vd.view3(), t, t, cfg.mask, cfg.scale, doverlap,
                          dlse.data());
      },
      "out");
  // Inputs may overlap (they are only read): q through the same strides reads the buffer's rows
  // as the overlapping view has them, and gives what a contiguous copy of those rows gives.
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(i % 7) * 0.1f;
  const View3<const float> q_overlapping{buf.data(), S, H, D, H * D, 2 * D};
  Tensor<float> q_copy({S, H, D});
  for (int64_t i = 0; i < S; ++i)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) q_copy.view3()(i, h, d) = q_overlapping(i, h, d);
  SoftmaxState a(S, H, D), b(S, H, D);
  attend(a.view(), q_overlapping, k.view3(), v.view3(), t, t, cfg);
  attend(b.view(), q_copy.view3(), k.view3(), v.view3(), t, t, cfg);
  EXPECT_EQ(a.acc.vec(), b.acc.vec());
}

// A view whose heads x head dim overflows int64 (2^60 x 16 wrapped to 0): the row stride check
// passed it and the kernels read far outside the buffer (SIGSEGV).
TEST(KernelViews, HeadsTimesHeadDimPastInt64IsRefused) {
  std::vector<double> buf(64), out(64), lse(64);
  const int64_t huge = int64_t{1} << 60;
  const View3<const double> x{buf.data(), 2, huge, 16, 0, 16};
  std::vector<int64_t> pos = {0, 1};
  const Tokens t{pos.data(), nullptr, 2};
  try {
    reference_forward(x, x, x, t, t, Mask{}, 0.25, View3<double>{out.data(), 2, huge, 16, 0, 16},
                      lse.data());
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("row stride too small (0 for 1152921504606846976 heads"),
              std::string::npos)
        << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// Sizes, counts and pointers.

// A sequence no memory holds: OutOfMemory naming its size, before any token is listed (they
// threw std::bad_alloc). 2^62 tokens exceed any vector's max_size(); 2^40 (8 TiB of indices) is
// refused by the allocator where the kernel does not overcommit without limit.
TEST(Sizes, SequencesNoMemoryHoldsAreOutOfMemory) {
  const auto expect_oom = [](const auto& call, const std::string& needle) {
    try {
      call();
      ADD_FAILURE() << needle << ": accepted";
    } catch (const OutOfMemory& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const int64_t huge = int64_t{1} << 62;
  expect_oom([&] { ShardPlan::make(Layout::zigzag, huge, 2); },
             "a shard plan of 4611686018427387904 tokens over 2 ranks");
  expect_oom([&] { verify::make_sharding("contiguous", huge, 2); },
             "a shard plan of 4611686018427387904 tokens over 2 ranks");
  expect_oom([&] { verify::make_sharding("te-thd", huge, 2); },
             "the te-thd sharding of 4611686018427387904 tokens over 2 ranks");
  std::ifstream mode("/proc/sys/vm/overcommit_memory");
  int overcommit = 1;
  if (mode >> overcommit && overcommit != 1)
    expect_oom([&] { ShardPlan::make(Layout::zigzag, int64_t{1} << 40, 2); },
               "a shard plan of 1099511627776 tokens over 2 ranks");
  // Small plans are unchanged: every token once, in order within each rank.
  const ShardPlan p = ShardPlan::make(Layout::stripe, 10, 3, {4, 6});
  EXPECT_EQ(p.tokens[0], (std::vector<int64_t>{0, 3, 6, 9}));
  EXPECT_EQ(p.tokens[1], (std::vector<int64_t>{1, 4, 7}));
  EXPECT_EQ(p.tokens[2], (std::vector<int64_t>{2, 5, 8}));
}

// count_visible_pairs' product with the heads is checked (heads = 2^62 wrapped to a small or
// negative count).
TEST(Sizes, VisiblePairsTimesHeadsThatOverflowAreRefused) {
  std::vector<int64_t> pos{0, 1};
  const Tokens t{pos.data(), nullptr, 2};
  EXPECT_EQ(count_visible_pairs(t, t, Mask{true, 0}, 4), 12);
  try {
    count_visible_pairs(t, t, Mask{true, 0}, int64_t{1} << 62);
    ADD_FAILURE() << "overflow accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("visible pairs 3 x heads 4611686018427387904 overflows"),
              std::string::npos)
        << e.what();
  }
}

// fill_normal checks its pointers (a null global_t was dereferenced).
TEST(Rng, FillNormalRefusesNullPointers) {
  Tensor<float> x({2, 1, 4});
  EXPECT_THROW(fill_normal(x.view3(), nullptr, 1, "q"), InvalidArgument);
  const std::vector<int64_t> t{0, 1};
  EXPECT_THROW(fill_normal(View3<float>{nullptr, 2, 1, 4, 4, 4}, t.data(), 1, "q"),
               InvalidArgument);
  fill_normal(View3<float>{nullptr, 0, 1, 4, 4, 4}, nullptr, 1, "q");  // nothing to fill
  fill_normal(x.view3(), t.data(), 1, "q");
  EXPECT_EQ(x[4], normal_at(rng_key(1, "q"), 1, 0, 0));
}

// ---------------------------------------------------------------------------------------------
// .npy shapes: the Python tuples numpy writes, nothing else.

std::string npy_image(const std::string& shape, size_t floats) {
  std::string d = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + ", }";
  while ((10 + d.size() + 1) % 64) d.push_back(' ');
  d.push_back('\n');
  std::string out("\x93NUMPY\x01\x00", 8);
  out.push_back(static_cast<char>(d.size() & 0xff));
  out.push_back(static_cast<char>(d.size() >> 8));
  return out + d + std::string(4 * floats, '\0');
}

std::vector<int64_t> npy_shape(const std::string& shape, size_t floats) {
  const std::string img = npy_image(shape, floats);
  return parse_npy(reinterpret_cast<const uint8_t*>(img.data()), img.size(), "x.npy").shape();
}

TEST(Npy, ShapesAreReadOnlyAsPythonTuples) {
  EXPECT_EQ(npy_shape("(2, 3)", 6), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(npy_shape("(6,)", 6), (std::vector<int64_t>{6}));
  EXPECT_EQ(npy_shape("(2, 3,)", 6), (std::vector<int64_t>{2, 3}));  // a trailing comma is Python
  EXPECT_EQ(npy_shape("( 1 ,2 , 3 )", 6), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(npy_shape("(2L, 3L)", 6), (std::vector<int64_t>{2, 3}));  // Python 2's longs
  // Not tuples numpy reads: "(2 3)" and "(2)" were read as [2, 3] and [2].
  for (const char* bad :
       {"(2 3)", "(2)", "(,)", "(2,,3)", "(2, 3,,)", "(,2)", "(2;3)", "(2 ,3 4)"}) {
    try {
      npy_shape(bad, 6);
      ADD_FAILURE() << bad << " accepted";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("malformed shape ") + bad),
                std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace loom
