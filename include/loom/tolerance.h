// loom/tolerance.h: the written-down tolerances of every comparison with the fp64 reference
// (tests, `loom attn --check`), as normwise relative errors ||x - ref|| / ||ref|| (absolute where
// ref is all zero). They are never loosened to make a comparison pass.
#pragma once

#include <cmath>
#include <iomanip>
#include <limits>
#include <sstream>
#include <string>

#include "loom/attention.h"
#include "loom/bf16.h"

namespace loom {

// fp32 storage and accumulation: the fixed tolerance, for comparisons inside the regime of
// fp32_fixed_tolerance_holds() (below); outside, fp32_error_bounds().
inline constexpr double kFp32RelTol = 1e-5;

// fp32 at large scores. kFp32RelTol holds while the scores s = scale q.k are small; the kernels'
// errors grow with them (S = 256, D = 64, causal: dq 1.4e-5 at scale 10, dv 5.6e-4 at scale 1000,
// docs/cli.md), so there each comparison is held to a first-order bound of its own problem. With
// u = 2^-24 (fp32's unit roundoff), for query row i of head h and a key j that it sees (the
// reference's s_ij, p_ij = exp(s_ij - lse_i), m_i = max_j s_ij, the top key t (s_it = m_i),
// out_i, a_i = sum_j p_ij |v_j|, dp_ij = dout_i.v_j, delta_i = dout_i.out_i; |.|, min and
// products of vectors elementwise):
//  * Scores. The kernels form s (in base 2) as fl(fl(scale log2 e) fl(sum_d q_id k_jd)), the sum
//    one multiply-add chain c_n = c_{n-1} + x_n over n = 0..D-1, x_n = q_in k_jn (TileOps::gemm,
//    fused or not; the bf16-dot path adds pairs of exact products). A step rounds by at most
//    u |c_n|, an unfused product by u |x_n| (a pair's swapped order moves c_n by at most |x_n|):
//       |score error| <= E_ij = u (|scale| sum_n (|c_n| + |x_n|) + 2 |s_ij|),
//    the last term for rounding scale log2 e and its product. A worst case, deterministic:
//    E_ij <= c_s u |scale| sum_d |q_id| |k_jd| with c_s = D + 3, and the partial-sum form
//    evaluated is typically D/2 |s_ij| u for the keys that matter, where random roundings give
//    about |s_ij| u (tests/unit/test_blockwise.cc, Fp32ErrorsWithinTheirBoundsAtAnyScale).
//  * Forward. p = 2^(fl(s2 - m2)) for the running max m2: the roundings of s2 - m2 and of the
//    rescale exponents m_old - m_new telescope to at most u (m_i - s_ij); exp2 adds 8u (4 ulp,
//    test_kernels_exp) and returns 0 below 2^-125. Each weight's log is off by at most
//    F_ij = E_ij + R_ij, R_ij = u (m_i - s_ij + 8), so the normalised weights by
//    |p^_ij / p_ij - 1| <= w_ij = max(e^F_ij / Z-_i - 1, 1 - e^-F_ij / Z+_i) (1 where the
//    weight may fall below 2^-125), Z+-_i = sum_j p_ij e^(+-F_ij) (exact in F, not only first
//    order). out = acc / l adds its own roundings: an add of a running sum is off by at most
//    min(u |sum|, |either operand|) (round to nearest), which over any order and tiling gives
//       acc: sum_j c_a min(u a_i, p_ij |v_j|) + u p_ij |v_j| (1 + r_ij), and 2u |out_i| for 1 / l,
//       l, relative: l_i = sum_j c_l min(u, p_ij) + 9u p_ij r_ij
//    (c_a = 2: the p v chain and the add of a tile into acc; c_l = 7: exp_row's pair and chain
//    adds, a 16-lane reduction of depth 4, the add into l; r_ij = the number of keys with a larger
//    score: acc and l are rescaled, their contents rounded, only at a new running max, and the
//    factor's exp2 is off by 8u). On loom's kernels, where the top key's computed score is
//    surely the largest (m_i - s_ij > E_it + E_ij for every other j), its weight is 2^0 = 1
//    exactly, every rounding is charged to the other keys (the sums run over j != t, c_a = 4,
//    c_l = 9), and 1 / l and acc / l are off by at most min(u, 3 sum_(j != t) p^_ij / p^_it):
//       |out_i error| <= sum_j p_ij w_ij |v_j - out_i| + the roundings  (sum_j p^_ij - p_ij = 0)
//       |lse_i error| <= L_i = max(log Z+_i, -log Z-_i) + l_i + u |lse_i|  (lse rounded to fp32)
//  * Backward. p = 2^(fl(s2 - fl(lse log2 e))) from the fp32 lse, so log p is off by at most
//       B_ij = E_ij + L_i + u |lse_i| + u |s_ij - lse_i| + 8u,  |p^/p - 1| <= b_ij = e^B_ij - 1
//    (1 where it may fall below 2^-125). On loom's kernels the backward recomputes each score
//    bitwise as the forward did (the same GEMM chain and scale), so the scores' errors cancel
//    but for their differences: log p^_ij - log p_ij = -log sum_k p_ik e^(y_k) + the lse's
//    roundings, |y_k| <= E_ij + E_ik (k != j) + R_ik, which replaces E_ij + L_i by the larger
//    of log and -log of sum_k p_ik e^(+-(E_ij + E_ik + R_ik)) plus l_i + u |lse_i|. This
//    recomputation from the fp32 lse is FlashAttention's, which loom and ring-flash-attention
//    share; PyTorch's math attention keeps p from the forward and has no such term in dv:
//       |dv_j error| <= sum_i b_ij p_ij |dout_i|.
//  * ds = p (dp - delta). dp - delta cancels where a row's weight sits on a few keys (large
//    scores), so the absolute errors of dp and delta count. dp's chain over d is bounded as the
//    scores' (u sum_n (|c_n| + |x_n|) of dout_i.v_j); delta (compute_delta, on the fp32 out) by
//    that chain's plus sum_d |dout_id| |out roundings_id| plus sum_j p_ij w_ij |dp_ij - delta_i|
//    (the weights' error: dout.(out^ - out) = sum_j (p^_j - p_j) (dp_j - delta)). On loom's
//    kernels compute_delta sums in the order of the dp GEMM, so in a row whose other keys move
//    neither l (sum_(j != t) p^_ij / p^_it < u) nor any element of acc (by less than half an ulp
//    of v_t) off the top key's, out is exactly v_t, delta exactly dp^_it and ds_it exactly 0:
//    its error is |ds_it| itself, and delta's error that of dp_it plus |dp_it - delta_i|. Then
//       |ds_ij error| <= e_ij = p_ij (b_ij |dp_ij - delta_i| + (1 + b_ij) (dp_ij error +
//                               delta_i error))
//       => |dq_i error| <= |scale| sum_j e_ij |k_j|,  |dk_j error| <= |scale| sum_i e_ij |q_i|
//    (the sums run over the query heads of j's kv head).
// Everything else (the sums of dv, dq and dk, the products in ds) is a relative error of fp32's
// size that no cancellation amplifies: kFp32RelTol, as the fixed tolerance has it (and products
// that underflow fp32's normal range, 1.2e-38, where the norms are larger). fp32_error_bounds()
// computes these bounds for one problem, relative to ||reference||, with a factor 1.01 for the
// first-order approximation, plus kFp32RelTol.
// Measured (tests/unit/test_blockwise.cc, scales 10 to 1e4, S = 96 and 128, D = 16 and 64, six
// seeds, Zen 5, every x86-64 target): bound / error of dq and dk 1.0 to 764 (the worst-case
// scores), of dv 6.5 to 22 (made by the rounding of the fp32 lse, which the kernels meet); out
// and lse stay near fp32's resolution, within kFp32RelTol. Like bf16's per-problem bounds, a
// check against them catches gross errors, not a constant factor of the typical error.
inline constexpr double kFp32Unit = 0x1p-24;

// The regime of the fixed tolerances (fp32's kFp32RelTol; bf16's below), three conditions on the
// weights and keys, and on the values (common_value_ratio, out_cancel_ratio) where the check has
// them:
//  * Scores. |scale| max_i ||q_i|| max_j ||k_j|| (no score |s| is larger; over every head) is at
//    most kFp32FixedTolMaxScore: the errors above grow with the scores. Measured (Zen 5, avx512
//    and sse4, N(0, 1) inputs, D 16 / 64 / 128, S 64 / 256 / 512, causal and full): errors within
//    0.31 kFp32RelTol up to 128 (0.17 up to 100); the first to pass kFp32RelTol had the bound at
//    480 to 550 (dq, dk). The default scale 1 / sqrt(D) gives about 12 to 25 on such inputs.
//  * Spread weights. ds_ij = p_ij (dp_ij - delta_i) sums to zero over a row's keys, so dq_i =
//    scale sum_j ds_ij k_j and the row's terms of dk shrink with the weight off the row's top key
//    (two keys: ds_i1 = -ds_i2 = p_i1 p_i2 (dp_i1 - dp_i2)) and with dp_ij - delta_i, while the
//    roundings of delta_i and of the weights do not shrink with them: a row whose weight sits on
//    one key (1 - p_top from about u to 1e-2, before loom's exact top-key weight makes ds_top
//    exactly 0) or whose dp_i1 - dp_i2 nearly cancels has dq_i and its dk terms off by up to about
//    u / (1 - p_top) or u |dp_i| / |dp_i1 - dp_i2| relative, which no fixed tolerance bounds. A
//    norm over many spread rows averages these out; over few rows, or rows all concentrated
//    (small S, few visible keys, large scores), it does not. bf16 needs more spread than fp32:
//    its tolerances are 2 u, not 168 u, and out's rounding (u |out_i|, with |out_i| about
//    |v| / sqrt(keys) for spread weights) moves delta_i and so every ds_ij of the row. The measure
//    (effective_keys below): 1 / the mean, over the query rows and heads that see a key, of
//    sum_j p_ij^2 (the chance that two keys drawn by a row's weights are the same): n where every
//    row has n equal weights, 1 where every row's weight sits on one key, and, as a mean of
//    sum_j p_ij^2 rather than of its inverse, pulled toward 1 by the concentrated rows however
//    spread the others are. It is at least kFp32FixedTolMinEffectiveKeys (fp32) or
//    kBf16FixedTolMinEffectiveKeys (bf16). On N(0, 1) inputs at S = 256, D = 64, causal: 22 at
//    the default scale 1 / sqrt(D), 6.9 at twice it, 2.3 at 4 times, 1.4 at 8 times (scale 1).
//  * Keys without a large common component. As sum_j ds_ij = 0, dq_i = scale sum_j ds_ij (k_j -
//    kbar_i) with kbar_i = sum_j p_ij k_j (the row's weighted mean key): exact dq sees only the
//    keys' spread about kbar_i, while the roundings of delta_i (out's, through dout_i.out_i) and
//    of the weights move the ds_ij of a row by amounts that do not sum to zero, and so reach dq_i
//    multiplied by kbar_i itself (bf16: scale u c_i ||kbar_i||, the delta term of the bounds
//    below). Keys that share a component large against their spread (a common bias, which the
//    softmax does not see: it moves every score of a row by the same scale q_i.bias; keys along
//    one axis) amplify dq's relative error by about that ratio in any implementation that rounds
//    out or p: on k ~ N(0, 1) + 4 (S = 256, D = 64, causal; 21 effective keys, scores within 47)
//    an fp64 simulation of FlashAttention-style bf16 puts dq at 0.0069 from out's rounding alone
//    and 0.0094 with p's, against 2u = 0.0078, and loom's kernels at 0.0086 (widening paths) and
//    0.0114 (amx). dk_j = scale sum_i ds_ij q_i and dv have no such cancellation (measured below:
//    their errors do not grow with the ratio). The measure (common_key_ratio below):
//    sqrt(sum_i ||kbar_i||^2 / sum_i sum_j p_ij ||k_j - kbar_i||^2) over the query rows and heads
//    that see a key, a ratio of sums as dq's relative error is (a row whose weight sits on one key
//    adds its ||kbar_i||^2 once, not an unbounded ratio; effective_keys sees such rows). It is at
//    most kFp32FixedTolMaxCommonKey (fp32) or kBf16FixedTolMaxCommonKey (bf16). N(0, 1) keys give
//    about 1 / sqrt(effective keys): 0.25 at S = 256, D = 64, causal, the default scale.
// Measured (Xeon with AMX, paths amx, avx512, avx2 and portable, `loom attn`'s default kernel
// config on one rank, N(0, 1) inputs; 350,000 problems at S 1 to 16, D 8 / 16 / 32 / 64, H 1 to
// 8 with GQA, causal and full, windows, two documents, scale 0.1 to 4 and 1 / sqrt(D), and 7,000
// at S 17 to 400, scale to 12): with only the score condition (and bf16's former 4 visible keys
// per row), 1,758 fp32 problems missed kFp32RelTol (dq and dk up to 3e6 times it, lse at S = 1)
// and 6,225 bf16 problems their tolerances (up to 309 times; 13 at S 17 to 82, scale 3 to 4, up
// to 1.6 times), every one within its per-problem bound. With both conditions none: fp32 within
// 0.14 of kFp32RelTol, bf16 within 0.61 of its tolerances (0.80 from 5 effective keys, at D = 8
// and S 9 to 16). N(0, 1) inputs all meet the third condition (below).
// Measured for the third (Xeon with AMX, paths amx, avx512, avx2 and portable, one rank, the
// default kernel config; 16,800 runs: 2,100 problems in fp32 and bf16 on each path): N(0, 1) at S
// 64 / 256 / 512, D 16 / 64 / 128, H 2 over 1 and 4 over 4, causal and full, scale 1 / sqrt(D)
// times 0.5, 1 and 2; k + b along a random direction (b sqrt(D) long, b 0 to 10, S 32 to 512, D 8
// to 128, scales as N(0, 1)'s), k + b in every element (b 1 to 8, S = 256, D = 64), q + b (b 0.5 to
// 2); queries and keys along one axis, q_i = (+-a, 0.01 N(0, 1) ...), k_j = (a c_j, 0.01 N(0, 1)
// ...), c uniform on (-1, 1) and three keys at 1 (S 100 / 300, D 8 / 16 / 64, scores a^2 scale
// 1 to 56, causal and full). Inside the score and spread conditions 177 fp32 and 1,882 bf16 runs
// missed their fixed tolerances (dq up to 2.6 and 31 times them; the least ratio of a miss 20.9
// and 1.65), every run within its per-problem bounds (within 0.80 of them). The worst error /
// fixed tolerance inside those conditions, by common_key_ratio:
//              [0, 1)  [1, 2)  [2, 4)  [4, 8)  [8, 16)  [16, 32)  32 and more
//   fp32 dq     0.11    0.13    0.19    0.46    0.80     1.52      2.6
//   bf16 dq     0.64    1.27    2.41    4.08    8.22     14.5      31.1
//   bf16 dk     0.38    0.34    0.40    0.39    0.35     0.41      0.33   (dv 0.29, out 0.33)
// (fp32's out, dk and dv reached 0.87, 1.1 and 0.80 past 16, on the axis with scores to 56, and
// 0.21 at most below 8.) With the three conditions none missed: fp32 within 0.46 of kFp32RelTol
// (N(0, 1): 0.10), bf16 within 0.64 of its tolerances (N(0, 1): 0.35), both on the axis. N(0, 1)
// reached a ratio of 0.51 at the default scale and 0.82 at any scale swept, the cases of
// tests/unit/test_blockwise.cc's kernel sweeps 1.05 (fp32) and 0.78 (bf16): all inside.
// The values likewise (common_value_ratio, the same thresholds; checks with v use the overload
// of fixed_tolerance_exclusion that takes it): dp_ij - delta_i = dout_i . (v_j - out_i) cancels a
// component the values share while delta_i's rounding (out's) carries it. A correct fp32 dq of
// v ~ N(0, 1) + 100 missed kFp32RelTol (loom 2.9e-5, PyTorch 1.7e-5), and bf16 with 4 of 64
// channels of v at + 20 (massive-activation style) missed 2u (0.013). Measured (Xeon with AMX,
// avx512 / amx and avx2, one rank; v + b along a random direction b sqrt(D) long, b 0 to 64;
// S / D 256 / 64 causal, 128 / 16 full, 512 / 128 causal; two seeds; 216 runs): dq's error grows
// with the ratio, fp32 about 0.03 kFp32RelTol per unit of it (0.96 at 32.9), bf16 about 0.28 of
// 2u per unit (1.18 at 4.1, 2.2 at 8.2); inside the new condition fp32 within 0.17 of kFp32RelTol,
// bf16 within 0.35 of 2u; outside, every run within 0.22 of its per-problem bounds.
// Gradients of a few rows: with dout given (check_limits, bf16_error_bounds' fp32 part), the
// spread and common-component conditions are also taken over the rows weighted by ||dout_i||^2
// (dq_i and row i's terms of dk scale with dout_i), and the worse of the two decides. A loss mask
// that leaves dout on a few rows makes the gradients those rows' alone: dout on one row of 256
// (N(0, 1), D = 16, causal, scale 1, the row's top key leaving 1e-3 of the weight) put a correct
// fp32 dq at 1.1e-4 with 5.7 effective keys over every row and about 1 over the weighted ones
// (tests/unit/test_api_contracts.cc, GradientsOfFewRowsAreJudgedByThoseRows). On N(0, 1) dout the
// weighted and plain measures differ by the spread of ||dout_i||^2 only.
inline constexpr double kFp32FixedTolMaxScore = 128;
inline constexpr double kFp32FixedTolMinEffectiveKeys = 2;  // effective_keys, fp32
inline constexpr double kFp32FixedTolMaxCommonKey = 8;      // common_key_ratio, fp32
// Values cancelling in out (out_cancel_ratio, the fourth condition): out_i = sum_j p_ij v_j is
// small against its terms where the values a row weighs cancel (their mean over the keys removed,
// weights near uniform), while the roundings of the sum and, on the bf16-dot paths, of p do not
// shrink with it: out's relative error grows with the ratio (values drawn independently: about 1,
// measured 0.93 to 1.02 over S 256 to 4096, D 16 to 128, causal and full, scale 0.01 to 4 times
// the default). A probe's v with its mean over the keys removed and 1e-4 added (S = 256, D = 16,
// q of 0.01 N(0, 1), full; ratio 97) put a correct fp32 out at 1.62e-5 (PyTorch 1.53e-5) and bf16
// at 0.111 on the amx path, "check FAILED". Measured (Xeon with AMX, one rank, avx512 and avx2 for
// fp32, amx, avx512 and avx2 for bf16; 192 problems: v ~ N(0, 1) less its mean over the keys plus
// an offset 1e-4 to 1, S / D 64 / 16, 256 / 64, 1024 / 128, q of 0.01, 0.3 and 1 N(0, 1), causal
// and full; 960 runs): out's error / fixed tolerance by the ratio
//              [0, 2)  [2, 3)  [3, 4)  [4, 8)  [8, 16)  [16, 32)  [32, 64)  [64, 128)
//   fp32        0.06    0.06    0.07    0.15    0.31     0.60      0.87      1.87
//   bf16 amx    0.44    0.64    0.75    1.13    2.31     4.44      7.87      14.7
//   bf16 widening paths 0.30 at most at any ratio (p is not rounded there)
// (fp32 about 0.02 of kFp32RelTol per unit of the ratio, the bf16-dot paths 0.16 of 2u); the first
// misses at 95 (fp32) and 6.8 (bf16). The thresholds 16 and 2 keep fp32 within 0.31 of kFp32RelTol
// and bf16 within 0.44 of 2u; outside, the per-problem bounds (out's acc term sums p_ij |v_j|).
inline constexpr double kFp32FixedTolMaxOutCancel = 16;  // out_cancel_ratio, fp32

// |scale| max_i ||q_i|| max_j ||k_j|| over every row and head of q [Sq, H, D] and k [Sk, Hkv, D]
// (0 for no rows): no score |scale q_i.k_j| is larger.
double fp32_score_bound(View3<const double> q, View3<const double> k, double scale);

// rows / sum over rows of sum_j p_ij^2, over the query rows and heads of q [Sq, H, D] that see
// at least one key of k [Sk, Hkv, D] (qt, kt, mask and scale as reference_forward; p the
// reference's weights): the effective number of keys per row of the regime above. 0 where no row
// sees a key, NaN where a score is NaN. Costs about one reference_forward.
double effective_keys(View3<const double> q, View3<const double> k, Tokens qt, Tokens kt,
                      const Mask& mask, double scale);

// sqrt(sum_i ||kbar_i||^2 / sum_i sum_j p_ij ||k_j - kbar_i||^2), kbar_i = sum_j p_ij k_j (the
// row's weighted mean key), the sums over the query rows and heads of q that see a key
// (arguments as effective_keys): how far the keys the rows weigh share a common component, against
// their spread about it, the amplification of dq's roundings of the regime above. 0 where no row
// sees a key or every weighted key is 0; where every row's weighted keys are equal (and not 0),
// 1e5 or more (+inf, or the rounding of sum_j p_ij ||k_j||^2 - ||kbar_i||^2, the spread's
// one-pass form); NaN where a score is NaN. Costs about one reference_forward.
double common_key_ratio(View3<const double> q, View3<const double> k, Tokens qt, Tokens kt,
                        const Mask& mask, double scale);
// The same of v [Sk, Hkv, Dv]: sqrt(sum_i ||out_i||^2 / sum_i sum_j p_ij ||v_j - out_i||^2), out_i
// = sum_j p_ij v_j. dp_ij - delta_i = dout_i . (v_j - out_i) cancels the values' common component
// while the rounding of delta_i (from out's) carries it: ds, and so dq and dk, err by about this
// ratio times out's rounding (the third condition's values, below). 0, 1e5 or more and NaN as
// common_key_ratio.
double common_value_ratio(View3<const double> q, View3<const double> k, View3<const double> v,
                          Tokens qt, Tokens kt, const Mask& mask, double scale);
// sqrt(sum_i sum_j p_ij^2 ||v_j||^2 / sum_i ||out_i||^2) over the rows that see a key (arguments
// as common_value_ratio): out's size against the spread of its weighted values. Values drawn
// independently give about 1 (out_i is then about sqrt(sum_j p_ij^2 ||v_j||^2) long); values whose
// weighted sum cancels (their mean over the keys a row sees removed) make out small against the
// roundings of p v, which do not cancel: out's relative error grows with the ratio (the fourth
// condition, below). 0 where every weighted value is 0, +inf where out is 0 and they are not, NaN
// as common_key_ratio.
double out_cancel_ratio(View3<const double> q, View3<const double> k, View3<const double> v,
                        Tokens qt, Tokens kt, const Mask& mask, double scale);

// Why the fixed tolerances of a problem (fp32's, or bf16's where bf16) do not hold, as the
// reports print it ("scores up to 1.3e+03 (|scale| max||q|| max||k|| above 128)", "head dim under
// 8", "1.44 effective keys per query row (1 / the rows' mean sum_j p_j^2; under 2)", "keys sharing
// a component 4.06 times their spread (sqrt of the rows' sum ||kbar||^2 / sum_j p_j ||k_j -
// kbar||^2, kbar = sum_j p_j k_j; above 1)"), the first condition missed in that order; "" where
// they hold. Arguments as effective_keys; it computes effective_keys and common_key_ratio (in one
// pass) only where the other conditions hold.
std::string fixed_tolerance_exclusion(View3<const double> q, View3<const double> k, Tokens qt,
                                      Tokens kt, const Mask& mask, double scale, bool bf16);
// The same with the values' conditions too (common_value_ratio at most the keys' threshold, "values
// sharing a component 4.12 times their spread (...)"; out_cancel_ratio at most
// kFp32FixedTolMaxOutCancel or kBf16FixedTolMaxOutCancel, "values cancelling in out, 96.6 (...)"):
// the overload above does not see v. Neither
// sees dout: a check of a backward should use check_limits (below), which also weighs the rows by
// their dout.
std::string fixed_tolerance_exclusion(View3<const double> q, View3<const double> k,
                                      View3<const double> v, Tokens qt, Tokens kt, const Mask& mask,
                                      double scale, bool bf16);
// Whether kFp32RelTol holds for the problem: fixed_tolerance_exclusion(q, k, v, ..., false) is
// "" (v [Sk, Hkv, Dv]: the values' condition too; without it the answer could be yes where the
// values share a component).
bool fp32_fixed_tolerance_holds(View3<const double> q, View3<const double> k, View3<const double> v,
                                Tokens qt, Tokens kt, const Mask& mask, double scale);
// The score condition alone (fp32_score_bound <= kFp32FixedTolMaxScore): necessary, not
// sufficient; kept for tests/unit/test_blockwise.cc's large problems. Use the overload above.
bool fp32_fixed_tolerance_holds(View3<const double> q, View3<const double> k, double scale);

// The fp32 bounds above for one problem, as relative norm errors (absolute where the reference
// tensor is all zero). A bound that was not computed is +inf.
struct Fp32Bounds {
  static constexpr double kNotComputed = std::numeric_limits<double>::infinity();
  double out = kNotComputed, lse = kNotComputed;
  double dq = kNotComputed, dk = kNotComputed, dv = kNotComputed;
};

// Arguments as bf16_error_bounds (q, k, v, dout hold the fp32 input values). dout.data == nullptr:
// the forward's bounds only. loom_kernels: the results are loom's kernels' (the refinements
// above: the top key's exact weight, the backward's scores bitwise the forward's, delta summed as
// dp); false: any implementation whose roundings are each within the bounds above. key_grads
// false: dk and dv are not wanted (q holds a sample of the query rows, which their bounds would
// not cover) and stay kNotComputed, and their four [Sk, Hkv, D] float64 accumulators are not
// allocated. Costs about three times reference_forward plus reference_backward.
Fp32Bounds fp32_error_bounds(View3<const double> q, View3<const double> k, View3<const double> v,
                             View3<const double> dout, Tokens qt, Tokens kt, const Mask& mask,
                             double scale, bool loom_kernels, bool key_grads = true);

// bf16 storage (q, k, v, dout, out in bf16; state, lse, delta and gradients fp32). The fp64
// reference runs on exactly the bf16 input values, so only the kernels' own roundings count.
// u = 2^-8 is the unit roundoff of bf16 (8 significant bits, round to nearest). Where the
// kernels round to bf16, and the first-order error bound it gives (W: the attention weights of
// the reference, p_ij = exp(scale q_i.k_j - lse_i); norms over all rows and heads):
//  * finish() rounds out to bf16: |error| <= u |out| per element.
//  * With bf16 dot products (paths avx512bf16 and amx) the weights p are rounded to bf16 for the
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
// factor 1.01 for the first-order approximation, and adds the fp32 arithmetic's: kFp32RelTol
// within fp32's regime (fp32_fixed_tolerance_holds, above: scores, spread weights, keys without a
// large common component), outside it the fp32_error_bounds() of the same values (kFp32RelTol plus
// the terms that grow with the scores or are amplified by concentrated rows or by kbar: the dq
// term sums |k_j|, not |k_j - kbar_i|), so they hold at any scale and size.
// They are large where the problem amplifies the rounding (rows with one or two keys, where
// dp - delta nearly cancels): there the error of any implementation that stores out in bf16 is
// large too.
inline constexpr double kBf16Unit = 1.0 / 256.0;

// Fixed bf16 tolerances, for comparisons that do not compute the per-problem bounds: valid where
// those bounds' amplification is weak, i.e. random normal inputs in fp32's regime (above: scores
// within kFp32FixedTolMaxScore) with the rows' weights spread over at least
// kBf16FixedTolMinEffectiveKeys effective keys (effective_keys), keys whose common_key_ratio is
// at most kBf16FixedTolMaxCommonKey and a head dim of at least kBf16FixedTolMinHeadDim
// (bf16_fixed_tolerances_hold checks all four). Outside, rows with few effective keys dominate
// the norms of dq and dk, or kbar multiplies delta's rounding in dq, and the fixed tolerances do
// not hold for any implementation that stores out in bf16: use bf16_error_bounds(). Measured
// (above): within 0.61 of them on N(0, 1) inputs, 0.64 on the structured ones; 4 visible keys per
// row on average, the former condition, let S = 4, H = 4 over 2, D = 8, full, at scale 1.41 (`loom
// attn --seed` 1 to 200: 50 seeds) reach 3.7 times them, and S = 8, D = 16, full, at scale 3.6 (1.0
// effective keys) 309 times. At the default scale the kernel sweep of tests/unit/test_blockwise.cc
// (S >= 100) stays within 0.61 of them.
inline constexpr double kBf16OutRelTol = 2 * kBf16Unit;  // out in bf16
inline constexpr double kBf16AccRelTol = kBf16Unit;      // out finished to fp32 (bf16-dot path)
// dq, dk, dv (lse: kFp32RelTol). dv = p^T dout takes p rounded to bf16 on the bf16-dot path
// (avx512bf16, amx), as the forward's p v does; the widening paths keep dv within kFp32RelTol.
inline constexpr double kBf16GradRelTol = 2 * kBf16Unit;
inline constexpr double kBf16FixedTolMinEffectiveKeys = 6;  // effective_keys, bf16
// bf16's tolerances are 2 u, and out's rounding alone moves delta by about u |out|: the ratio
// allowed is 1, where fp32 allows 8 (measured above: bf16's first miss at 1.65, fp32's at 20.9).
inline constexpr double kBf16FixedTolMaxCommonKey = 1;  // common_key_ratio, bf16
inline constexpr double kBf16FixedTolMaxOutCancel = 2;  // out_cancel_ratio, bf16 (above)
// ... and a head dim of at least kBf16FixedTolMinHeadDim: a norm over few elements per row is
// ruled by its worst rows. Measured (Zen 5, avx512bf16, `loom attn --dtype bf16 --backward
// --check`, S 64 / 185 / 500, causal and full, 6 seeds each, default scale): worst dq / 2u at
// D = 1: 2.29 (H = 1), 1.03 (H = 4), 0.76 (H = 8); D = 2: 0.59-0.62; D = 4: 0.78; D = 8: 0.40;
// D = 16: 0.49 (H = 1), every one within the per-problem bounds (D = 1, scale 2: dq 0.009
// against a bound of 0.086). Found by a random sweep of `loom attn --check` (D = 1 failed the
// fixed 2u in 1 of 8 seeds at S = 185).
inline constexpr int64_t kBf16FixedTolMinHeadDim = 8;

// Whether the fixed bf16 tolerances hold for the problem (arguments as fp32_fixed_tolerance_holds):
// fixed_tolerance_exclusion(q, k, v, ..., true) is "".
bool bf16_fixed_tolerances_hold(View3<const double> q, View3<const double> k, View3<const double> v,
                                Tokens qt, Tokens kt, const Mask& mask, double scale);
// The former condition, kept for tests/unit/test_blockwise.cc's large default-scale problems: at
// least kBf16FixedTolMinKeys visible keys per query row on average and head_dim >=
// kBf16FixedTolMinHeadDim (false for no query rows). Necessary (effective_keys is at most the
// mean of the visible keys), not sufficient: it does not see the scale (rows concentrated by
// large scores), cancellation in rows of few keys nor keys sharing a component (common_key_ratio).
// Use the overload above.
inline constexpr double kBf16FixedTolMinKeys = 4;  // mean visible keys per query row
bool bf16_fixed_tolerances_hold(Tokens qt, Tokens kt, const Mask& mask, int64_t head_dim);

// The bounds above for one problem, as relative norm errors (absolute where the reference
// tensor is all zero); lse has the fp32 bound. A bound that was not computed is +inf.
struct Bf16Bounds {
  static constexpr double kNotComputed = std::numeric_limits<double>::infinity();
  double out = kNotComputed;       // out stored in bf16
  double out_fp32 = kNotComputed;  // out finished to fp32
  double dq = kNotComputed, dk = kNotComputed, dv = kNotComputed;
  double lse = kNotComputed;  // fp32's (lse is computed and stored in fp32)
};

// q, dout [Sq,H,D] and k, v [Sk,Hkv,D] hold the bf16 input values (as the reference takes them);
// qt, kt, mask and scale as reference_forward. dots: the bounds of the bf16-dot paths
// (avx512bf16, amx: kernel_path_bf16_dots()); otherwise those of the widening paths. loom_kernels:
// as fp32_error_bounds (false: the fp32 terms of any implementation). dout.data == nullptr: the
// forward's bounds only. The dk and dv bounds count the given query rows only, so they hold for dk
// and dv where q holds every query row; key_grads false: dk and dv stay kNotComputed and nothing
// of [Sk, Hkv, D] is allocated (as fp32_error_bounds). Costs about four times reference_forward
// plus reference_backward.
Bf16Bounds bf16_error_bounds(View3<const double> q, View3<const double> k, View3<const double> v,
                             View3<const double> dout, Tokens qt, Tokens kt, const Mask& mask,
                             double scale, bool dots, bool loom_kernels = false,
                             bool key_grads = true);

// Which condition of the fixed tolerances' regime a problem misses first
// (fixed_tolerance_exclusion's order): kNone inside the regime.
enum class RegimeMiss {
  kNone,
  kScores,
  kHeadDim,
  kEffectiveKeys,
  kCommonKey,
  kCommonValue,
  kOutCancels
};

// Whose results a check compares with the fp64 reference: what sets its limits.
struct CheckedResults {
  bool bf16 = false;  // bf16 storage (q, k, v, dout, out), as bf16_error_bounds
  // bf16: products of bf16 operands, as the amx and avx512bf16 paths (kernel_path_bf16_dots())
  // take them; false for the widening paths, whose dv keeps kFp32RelTol. true where the
  // implementation is not known: its limits cover both.
  bool bf16_dots = true;
  // The results are loom's kernels' (fp32_error_bounds' refinements); false: any implementation
  // whose roundings are each within the bounds above.
  bool loom_kernels = false;
  // dk and dv are compared. false where q holds a sample of the query rows (loom verify above
  // --full-check-max): outside the fixed tolerances' regime their limits are then +inf, and the
  // per-problem bounds allocate nothing of [Sk, Hkv, D].
  bool key_grads = true;
};

// The limits of one comparison, as normwise relative errors (absolute where the reference tensor
// is all zero): out as stored (bf16 where bf16), lse, dq, dk, dv.
struct CheckLimits {
  double out = 0, lse = 0, dq = 0, dk = 0, dv = 0;
  RegimeMiss miss = RegimeMiss::kNone;
  std::string why;  // fixed_tolerance_exclusion's text ("" where miss is kNone)
};

// The limits `loom attn --check`, `loom verify` and bench_kernels' check hold a problem's results
// to: inside the fixed tolerances' regime (fixed_tolerance_exclusion with v) the fixed tolerances
// (fp32: kFp32RelTol; bf16: kBf16OutRelTol for out, kFp32RelTol for lse, kBf16GradRelTol for dq
// and dk, and for dv kBf16GradRelTol with bf16 dots, kFp32RelTol without); outside, the problem's
// own bounds (fp32_error_bounds, bf16_error_bounds with results.bf16_dots), which can be 1 or
// more (a result of zeros would pass them: a caller says it cannot tell). Arguments as
// bf16_error_bounds (dout.data == nullptr: the forward's; dq, dk, dv are then +inf outside the
// regime). Where q holds a sample of the query rows, score_bound is fp32_score_bound over all of
// them (the score condition then covers the rows left out); negative: computed over q.
CheckLimits check_limits(View3<const double> q, View3<const double> k, View3<const double> v,
                         View3<const double> dout, Tokens qt, Tokens kt, const Mask& mask,
                         double scale, const CheckedResults& results, double score_bound = -1);

// What a user can change so that a check whose limit was 1 or more can tell, by the condition
// missed: lower the scale or the magnitude (scores, concentrated rows), or subtract the keys' or
// the values' common component, which leaves the exact gradients as they are. "" for kNone.
std::string check_limits_hint(RegimeMiss miss);

// Exact values below float32's normal range. Rounding an exact tensor to float32 alone errs by
// Float32Floor::rel() (normwise relative, absolute where the tensor is all zero; non-finite
// values left out), and no float32 result can do better. Where that floor exceeds a quarter of
// a tolerance (float32_floor_blocks), a float32 result that misses the tolerance cannot be judged
// wrong: `loom attn --check` says "cannot tell" and `loom verify` "cannot be verified" (q of 1e-42
// made a correct dk "FAIL" at 0.006 against 1e-5). Where the intermediates are what falls below
// (v of 1e-39: dp and ds subnormal, dq not), the floor takes subnormal_reference's values
// (loom/attention.h) in place of the exact ones: add(exact, modelled). A tensor stored in bf16
// (loom's bf16 out; a candidate of `loom verify --dtype bf16`) rounds its values below the normal
// range to bf16, whose subnormals end at 2^-133, not 2^-149: Float32Floor(true) (a correct bf16
// out of v = 3e-39 "failed" at 0.024 where rounding to bf16 alone errs as much). Normal values
// count float32's rounding either way: bf16's 2^-9 there is inside every bf16 tolerance.
class Float32Floor {
 public:
  explicit Float32Floor(bool bf16_stored = false) : bf16_(bf16_stored) {}
  void add(double exact) { add(exact, exact); }
  // An exact value and what float32 arithmetic below the normal range makes of it
  // (subnormal_reference), rounded as stored.
  void add(double exact, double modelled) {
    if (!(exact - exact == 0) || !(modelled - modelled == 0)) return;  // NaN or infinite
    const double stored = bf16_ && std::fabs(modelled) < 0x1p-126
                              ? static_cast<double>(to_float(to_bf16(modelled)))
                              : static_cast<double>(static_cast<float>(modelled));
    const double e = stored - exact;
    num_ += e * e;
    den_ += exact * exact;
    count_ += 1;
  }
  double rel() const { return den_ > 0 ? std::sqrt(num_ / den_) : std::sqrt(num_); }
  double exact_norm() const { return std::sqrt(den_); }  // L2 norm of the exact values added
  double count() const { return count_; }                // how many were added

 private:
  bool bf16_ = false;
  double num_ = 0, den_ = 0, count_ = 0;
};
inline bool float32_floor_blocks(double floor, double tolerance) {
  return floor > tolerance / 4;
}

// Whether subnormal_reference's values could lift a comparison's Float32Floor to block it, so
// that the model must run: shift bounds |model - exact| per element (subnormal_reference_shift,
// loom/attention.h), over the compared exact values added to `exact` (its count and norm; a norm
// of 0 makes the floor absolute). Per element |float32(model) - exact| <= 2^-24 |exact| +
// (1 + 2^-24) shift + 2^-150; the model's double sums round apart from the reference's only where
// it moved a value, by far less than 2^-30 of the norm (allowed). NaN: may block.
inline bool subnormal_model_may_block(double shift, const Float32Floor& exact, double tolerance) {
  const double spread =
      ((1 + std::ldexp(1.0, -24)) * shift + std::ldexp(1.0, -150)) * std::sqrt(exact.count());
  const double norm = exact.exact_norm();
  const double floor =
      norm > 0 ? std::ldexp(1.0, -24) + std::ldexp(1.0, -30) + spread / norm : spread;
  return std::isnan(floor) || float32_floor_blocks(floor, tolerance);
}

// A bound as the error messages print it: three significant digits, or, when the inputs' size
// overflowed the bound's own arithmetic (a NaN bound was printed as "-nan", an infinite one as
// "inf"), a phrase saying so.
inline std::string bound_text(double bound) {
  if (!std::isfinite(bound)) return "not computable (the inputs' magnitude overflows it)";
  std::ostringstream os;
  os << std::setprecision(3) << bound;
  return os.str();
}

}  // namespace loom
