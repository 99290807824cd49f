// tests/unit/tolerance.h: the written-down tolerances of the kernel tests, the error measures
// they bound, and the seeded normal inputs the kernel tests share.
//
// The fp32 kernels are compared with the fp64 reference by relative norm error
//   ||x - ref||_2 / ||ref||_2 <= kFp32RelTol.
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

// bf16 storage (q, k, v, dout, out in bf16; state, lse, delta and gradients fp32). The fp64
// reference runs on exactly the bf16 input values, so only the kernels' own roundings count.
// u = 2^-8 is the unit roundoff of bf16 (8 significant bits, round to nearest). Where the
// kernels round to bf16, and the first-order error bound it gives (W: the attention weights of
// the reference, p_ij = exp(scale q_i.k_j - lse_i); norms over all rows and heads):
//  * finish() rounds out to bf16: |error| <= u |out| per element.
//  * With AVX512-BF16 dot products (path avx512bf16) the weights p are rounded to bf16 for the
//    product p v only (scores q k^T are exact products of bf16 values summed in fp32, and l sums
//    the unrounded p, so lse keeps fp32 accuracy): out_i moves by sum_j w_ij e_ij v_j with
//    |e_ij| <= u, so |error| <= u (W |v|)_i per element. The portable and avx512 paths widen bf16
//    to fp32 and round nothing here.
//    => out (bf16):            ||error|| <= u (||out|| + ||W |v|||)
//       out finished to fp32:  ||error|| <= u ||W |v|||  (widening paths: kFp32RelTol)
//  * The backward's scores and dp = dout v^T are exact products of the bf16 inputs summed in
//    fp32, with the fp32 lse, on every path. The one bf16-sized error of the widening paths
//    enters through delta_i = sum_d dout_id out_id with out rounded as above:
//    |delta error_i| <= u c_i, c_i = sum_d |dout_id| (|out_id| + (W |v|)_id). It moves
//    ds_ij = p_ij (dp_ij - delta_i) by p_ij u c_i, hence
//       dq_i by scale u c_i |(W k)_i|        => ||dq error|| <= scale u ||c o |W k|||
//       dk_j by scale u sum_i p_ij c_i |q_i| => ||dk error|| <= scale u ||(sum_i p_ij c_i
//       |q_i|)_j||
//    dv = p^T dout does not see delta: kFp32RelTol; lse: kFp32RelTol.
//  * With AVX512-BF16 dot products the backward's other products take their fp32 operands
//    rounded to bf16 too (|e| <= u each): p in dv = p^T dout, ds = scale p (dp - delta) in
//    dk = ds^T q and dq = ds k. Per element, on top of the above:
//       |dv_j error| <= u sum_i p_ij |dout_i|,  |dk_j error| <= u sum_i |ds_ij| |q_i|,
//       |dq_i error| <= u sum_j |ds_ij| |k_j|   (the sums run over the query heads of j's kv head)
//    => dv: u ||(sum_i p_ij |dout_i|)_j|| (not kFp32RelTol); dq, dk: these norms added to the
//       delta terms.
// These bounds are relative to ||reference||, computed per problem by the test (bf16_bounds in
// test_blockwise.cc) with a factor 1.01 for the first-order approximation and kFp32RelTol added
// for the fp32 arithmetic. They are large where the problem amplifies the rounding (rows with
// one or two keys, where dp - delta nearly cancels): there the error of any implementation that
// stores out in bf16 is large too. Like kFp32RelTol they are never loosened to make a test pass.
using loom::kBf16Unit;
// Fixed bf16 tolerances for tests that do not compute the per-problem bounds (the cp tests): valid
// where those bounds' amplification is absent, i.e. random normal inputs with at least ~100 keys
// per row on average (the rows with few keys are then a small part of the norm). The kernel sweep
// checks them on its cases with S >= 100 (measured there: out <= 0.6 u, fp32 out <= 0.4 u,
// dq and dk <= 0.42 u; on the bf16-dot path, Zen 5: dv <= 0.44 u, dq and dk <= 0.58 u); small
// problems can exceed them (S = 7 with documents: dq 4.7 u, within the
// per-problem bound).
using loom::kBf16AccRelTol;   // out finished to fp32 (bf16-dot path)
using loom::kBf16GradRelTol;  // dq, dk; dv (kFp32RelTol on the widening paths)
using loom::kBf16OutRelTol;   // out in bf16

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
