// loom/tolerance.h: the written-down tolerances of every comparison with the fp64 reference
// (tests, `loom attn --check`), as normwise relative errors ||x - ref|| / ||ref|| (absolute where
// ref is all zero). They are never loosened to make a comparison pass.
#pragma once

#include <limits>

#include "loom/attention.h"

namespace loom {

// fp32 storage and accumulation.
inline constexpr double kFp32RelTol = 1e-5;

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
// bf16_error_bounds() computes these bounds for one problem, relative to ||reference||, with a
// factor 1.01 for the first-order approximation and kFp32RelTol added for the fp32 arithmetic.
// They are large where the problem amplifies the rounding (rows with one or two keys, where
// dp - delta nearly cancels): there the error of any implementation that stores out in bf16 is
// large too.
inline constexpr double kBf16Unit = 1.0 / 256.0;

// Fixed bf16 tolerances, for comparisons that do not compute the per-problem bounds: valid where
// those bounds' amplification is weak, i.e. random normal inputs with at least
// kBf16FixedTolMinKeys visible keys per query row on average. Below that, rows with one or two
// keys dominate the norms of dq and dk and the fixed tolerances do not hold for any
// implementation that stores out in bf16: use bf16_error_bounds(). Measured (Zen 5, every path):
// from 4 keys per row the errors stay within 0.61 of the fixed tolerances (the kernel sweep of
// tests/unit/test_blockwise.cc, which asserts them on its cases from kBf16FixedTolMinKeys, and
// `loom attn --check` from S = 2); below, S = 7 with documents (0.9 keys per row) gives dq and dk
// 2.2-2.5 times them and S = 2 causal (1.5) dk 1.5 times, within the per-problem bounds.
inline constexpr double kBf16OutRelTol = 2 * kBf16Unit;  // out in bf16
inline constexpr double kBf16AccRelTol = kBf16Unit;      // out finished to fp32 (bf16-dot path)
// dq, dk, dv (lse: kFp32RelTol). dv = p^T dout takes p rounded to bf16 on the bf16-dot path
// (avx512bf16), as the forward's p v does; the widening paths keep dv within kFp32RelTol.
inline constexpr double kBf16GradRelTol = 2 * kBf16Unit;
inline constexpr double kBf16FixedTolMinKeys = 4;  // mean visible keys per query row

// Whether the fixed bf16 tolerances hold for queries qt over keys kt under mask: at least
// kBf16FixedTolMinKeys visible keys per query row on average (false for no query rows).
bool bf16_fixed_tolerances_hold(Tokens qt, Tokens kt, const Mask& mask);

// The bounds above for one problem, as relative norm errors (absolute where the reference
// tensor is all zero); lse keeps kFp32RelTol. A bound that was not computed is +inf.
struct Bf16Bounds {
  static constexpr double kNotComputed = std::numeric_limits<double>::infinity();
  double out = kNotComputed;       // out stored in bf16
  double out_fp32 = kNotComputed;  // out finished to fp32
  double dq = kNotComputed, dk = kNotComputed, dv = kNotComputed;
};

// q, dout [Sq,H,D] and k, v [Sk,Hkv,D] hold the bf16 input values (as the reference takes them);
// qt, kt, mask and scale as reference_forward. dots: the bounds of the bf16-dot path
// (avx512bf16); otherwise those of the widening paths. dout.data == nullptr: the forward's bounds
// only. The dk and dv bounds count the given query rows only, so they hold for dk and dv where q
// holds every query row. Costs about as much as reference_forward plus reference_backward.
Bf16Bounds bf16_error_bounds(View3<const double> q, View3<const double> k, View3<const double> v,
                             View3<const double> dout, Tokens qt, Tokens kt, const Mask& mask,
                             double scale, bool dots);

}  // namespace loom
