// The fp64 reference: attention written as the formulas, in plain loops.
//
// For each query head h (reading kv head g = h / (H / Hkv)) and query row i, the scores of the
// visible keys are s_j = scale * q_i . k_j, the row's log-sum-exp is lse_i = log sum_j exp(s_j)
// (computed as m + log sum exp(s_j - m) with m the row max), the probabilities are
// p_j = exp(s_j - lse_i), and out_i = sum_j p_j v_j. A row with no visible key has out = 0 and
// lse = -inf.
//
// The backward differentiates L = sum(out * dout) exactly:
//   dv_j += p_ij dout_i,  dp_ij = dout_i . v_j,  delta_i = sum_j p_ij dp_ij,
//   ds_ij = p_ij (dp_ij - delta_i),  dq_i = scale sum_j ds_ij k_j,  dk_j += scale ds_ij q_i.
// Nothing here is optimised: these loops are what the fast kernels are tested against.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "checks.h"
#include "loom/attention.h"
#include "loom/tolerance.h"

namespace loom {
namespace {

int32_t doc_of(const Tokens& t, int64_t i) {
  return t.doc ? t.doc[i] : 0;
}

bool pair_visible(const Mask& mask, const Tokens& qt, int64_t i, const Tokens& kt, int64_t j) {
  return visible(mask, qt.pos[i], doc_of(qt, i), kt.pos[j], doc_of(kt, j));
}

double dot(const double* a, const double* b, int64_t n) {
  double s = 0.0;
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

// The probabilities p_j of query row i of head h over all keys (0 where the mask hides a key),
// and the row's lse. Returns false (p all 0, lse = -inf) for a row that sees no key. A NaN
// score makes lse and every visible weight NaN, as the formula does.
bool row_probabilities(View3<const double> q, View3<const double> k, const Tokens& qt,
                       const Tokens& kt, const Mask& mask, double scale, int64_t i, int64_t h,
                       std::vector<double>& p, double& lse) {
  const int64_t g = h / (q.h / k.h);
  const double kNegInfD = -std::numeric_limits<double>::infinity();
  double m = kNegInfD;
  bool nan = false;
  for (int64_t j = 0; j < k.s; ++j) {
    if (pair_visible(mask, qt, i, kt, j)) {
      p[j] = scale * dot(q.row(i, h), k.row(j, g), q.d);
      m = std::max(m, p[j]);
      nan = nan || std::isnan(p[j]);
    } else {
      p[j] = kNegInfD;
    }
  }
  if (nan) {  // as the formula: a NaN score makes the row's lse and every weight NaN
    for (double& x : p) x = x == kNegInfD ? 0.0 : std::numeric_limits<double>::quiet_NaN();
    lse = std::numeric_limits<double>::quiet_NaN();
    return true;
  }
  if (m == kNegInfD) {
    std::fill(p.begin(), p.end(), 0.0);
    lse = kNegInfD;
    return false;
  }
  double l = 0.0;
  for (int64_t j = 0; j < k.s; ++j) l += p[j] == kNegInfD ? 0.0 : std::exp(p[j] - m);
  lse = m + std::log(l);
  for (int64_t j = 0; j < k.s; ++j) p[j] = p[j] == kNegInfD ? 0.0 : std::exp(p[j] - lse);
  return true;
}

}  // namespace

void reference_forward(View3<const double> q, View3<const double> k, View3<const double> v,
                       Tokens qt, Tokens kt, const Mask& mask, double scale, View3<double> out,
                       double* lse) {
  kernels::check_qkv(q, k, v, qt, kt);
  kernels::check_mask(mask);
  kernels::check_scale(scale);
  kernels::check_view(out, "out");
  kernels::check_same_shape(View3<const double>(out), q, "out and q");
  LOOM_CHECK(q.s == 0 || lse != nullptr, InvalidArgument, "lse must not be null");

  std::vector<double> p(static_cast<size_t>(k.s));
  for (int64_t h = 0; h < q.h; ++h) {
    const int64_t g = h / (q.h / k.h);
    for (int64_t i = 0; i < q.s; ++i) {
      double* o = out.row(i, h);
      for (int64_t d = 0; d < q.d; ++d) o[d] = 0.0;
      row_probabilities(q, k, qt, kt, mask, scale, i, h, p, lse[h * q.s + i]);
      for (int64_t j = 0; j < k.s; ++j) {
        if (p[j] == 0.0) continue;
        const double* vj = v.row(j, g);
        for (int64_t d = 0; d < q.d; ++d) o[d] += p[j] * vj[d];
      }
    }
  }
}

void reference_backward(View3<const double> q, View3<const double> k, View3<const double> v,
                        View3<const double> dout, Tokens qt, Tokens kt, const Mask& mask,
                        double scale, View3<double> dq, View3<double> dk, View3<double> dv) {
  kernels::check_qkv(q, k, v, qt, kt);
  kernels::check_mask(mask);
  kernels::check_scale(scale);
  kernels::check_view(dout, "dout");
  kernels::check_view(dq, "dq");
  kernels::check_view(dk, "dk");
  kernels::check_view(dv, "dv");
  kernels::check_same_shape(dout, q, "dout and q");
  kernels::check_same_shape(View3<const double>(dq), q, "dq and q");
  kernels::check_same_shape(View3<const double>(dk), k, "dk and k");
  kernels::check_same_shape(View3<const double>(dv), v, "dv and v");

  for (int64_t i = 0; i < q.s; ++i)
    for (int64_t h = 0; h < q.h; ++h)
      for (int64_t d = 0; d < q.d; ++d) dq(i, h, d) = 0.0;
  for (int64_t j = 0; j < k.s; ++j)
    for (int64_t g = 0; g < k.h; ++g)
      for (int64_t d = 0; d < k.d; ++d) dk(j, g, d) = dv(j, g, d) = 0.0;

  std::vector<double> p(static_cast<size_t>(k.s)), dp(static_cast<size_t>(k.s));
  for (int64_t h = 0; h < q.h; ++h) {
    const int64_t g = h / (q.h / k.h);
    for (int64_t i = 0; i < q.s; ++i) {
      double lse = 0.0;
      if (!row_probabilities(q, k, qt, kt, mask, scale, i, h, p, lse)) continue;
      const double* doi = dout.row(i, h);
      double delta = 0.0;
      for (int64_t j = 0; j < k.s; ++j) {
        dp[j] = p[j] == 0.0 ? 0.0 : dot(doi, v.row(j, g), q.d);
        delta += p[j] * dp[j];
      }
      for (int64_t j = 0; j < k.s; ++j) {
        if (p[j] == 0.0) continue;
        const double ds = p[j] * (dp[j] - delta);
        for (int64_t d = 0; d < q.d; ++d) {
          dv(j, g, d) += p[j] * doi[d];
          dq(i, h, d) += scale * ds * k(j, g, d);
          dk(j, g, d) += scale * ds * q(i, h, d);
        }
      }
    }
  }
}

int64_t count_visible_pairs(Tokens qt, Tokens kt, const Mask& mask, int64_t heads) {
  LOOM_CHECK(qt.n >= 0 && kt.n >= 0, InvalidArgument, "token counts must be >= 0");
  LOOM_CHECK(qt.n == 0 || qt.pos, InvalidArgument, "query positions are required");
  LOOM_CHECK(kt.n == 0 || kt.pos, InvalidArgument, "key positions are required");
  LOOM_CHECK_GE(heads, 0, InvalidArgument, "heads must be >= 0");
  kernels::check_mask(mask);
  int64_t pairs = 0;
  for (int64_t i = 0; i < qt.n; ++i)
    for (int64_t j = 0; j < kt.n; ++j) pairs += pair_visible(mask, qt, i, kt, j) ? 1 : 0;
  return pairs * heads;
}

bool bf16_fixed_tolerances_hold(Tokens qt, Tokens kt, const Mask& mask) {
  if (qt.n <= 0) return false;
  return static_cast<double>(count_visible_pairs(qt, kt, mask, 1)) >=
         kBf16FixedTolMinKeys * static_cast<double>(qt.n);
}

Bf16Bounds bf16_error_bounds(View3<const double> q, View3<const double> k, View3<const double> v,
                             View3<const double> dout, Tokens qt, Tokens kt, const Mask& mask,
                             double scale, bool dots) {
  kernels::check_qkv(q, k, v, qt, kt);
  kernels::check_mask(mask);
  kernels::check_scale(scale);
  const bool backward = dout.data != nullptr;
  if (backward) {
    kernels::check_view(dout, "dout");
    kernels::check_same_shape(dout, q, "dout and q");
  }
  const double u = kBf16Unit;
  const int64_t D = q.d;
  // The reference quantities, row by row: out_i = sum_j p_ij v_j, a_i = sum_j p_ij |v_j|
  // (W |v|), pk_i = sum_j p_ij k_j (W k); the gradients, as reference_backward computes them.
  std::vector<double> p(static_cast<size_t>(k.s));
  std::vector<double> out(static_cast<size_t>(D)), a(static_cast<size_t>(D)),
      pk(static_cast<size_t>(D)), dq(static_cast<size_t>(D)), dq_round(static_cast<size_t>(D));
  const size_t kv_size = static_cast<size_t>(k.s * k.h * D);
  std::vector<double> dk(backward ? kv_size : 0), dv(dk.size()), dk_round(dk.size()),
      dv_round(dk.size()), dk_delta(backward ? static_cast<size_t>(k.s * k.h) : 0);
  double out_n2 = 0, a_n2 = 0, dq_n2 = 0, dq_delta2 = 0, dq_round2 = 0;
  for (int64_t h = 0; h < q.h; ++h) {
    const int64_t g = h / (q.h / k.h);
    for (int64_t i = 0; i < q.s; ++i) {
      double lse = 0;
      if (!row_probabilities(q, k, qt, kt, mask, scale, i, h, p, lse)) continue;
      std::fill(out.begin(), out.end(), 0.0);
      std::fill(a.begin(), a.end(), 0.0);
      std::fill(pk.begin(), pk.end(), 0.0);
      for (int64_t j = 0; j < k.s; ++j) {
        if (p[j] == 0.0) continue;
        for (int64_t e = 0; e < D; ++e) {
          out[e] += p[j] * v(j, g, e);
          a[e] += p[j] * std::fabs(v(j, g, e));
          pk[e] += p[j] * k(j, g, e);
        }
      }
      for (int64_t e = 0; e < D; ++e) {
        out_n2 += out[e] * out[e];
        a_n2 += a[e] * a[e];
      }
      if (!backward) continue;
      // |delta error of row (i, h)| <= u c: out rounded to bf16 (u |out|) and, on the bf16-dot
      // path, the rounding of the weights in p v (u a).
      const double* doi = dout.row(i, h);
      double c = 0, delta = 0, qn = 0, pk2 = 0;
      for (int64_t e = 0; e < D; ++e) {
        c += std::fabs(doi[e]) * (std::fabs(out[e]) + a[e]);
        delta += doi[e] * out[e];
        qn += q(i, h, e) * q(i, h, e);
        pk2 += pk[e] * pk[e];
      }
      qn = std::sqrt(qn);
      dq_delta2 += c * c * pk2;  // dq_i moves by scale * delta error * (W k)_i
      std::fill(dq.begin(), dq.end(), 0.0);
      std::fill(dq_round.begin(), dq_round.end(), 0.0);
      for (int64_t j = 0; j < k.s; ++j) {
        if (p[j] == 0.0) continue;
        const double ds = p[j] * (dot(doi, v.row(j, g), D) - delta);
        const size_t jg = static_cast<size_t>(j * k.h + g);
        dk_delta[jg] += p[j] * c * qn;  // dk_j moves by scale sum_i p_ij (delta error) q_i
        for (int64_t e = 0; e < D; ++e) {
          const size_t x = jg * static_cast<size_t>(D) + static_cast<size_t>(e);
          dv[x] += p[j] * doi[e];
          dk[x] += scale * ds * q(i, h, e);
          dq[e] += scale * ds * k(j, g, e);
          if (!dots) continue;
          // The bf16-dot path rounds p (for dv) and ds (for dk, dq) to bf16 too.
          dv_round[x] += p[j] * std::fabs(doi[e]);
          dk_round[x] += std::fabs(scale * ds) * std::fabs(q(i, h, e));
          dq_round[e] += std::fabs(scale * ds) * std::fabs(k(j, g, e));
        }
      }
      for (int64_t e = 0; e < D; ++e) {
        dq_n2 += dq[e] * dq[e];
        dq_round2 += dq_round[e] * dq_round[e];
      }
    }
  }
  auto norm = [](const std::vector<double>& x) {
    double n = 0;
    for (double e : x) n += e * e;
    return std::sqrt(n);
  };
  // Relative to the reference's norm; absolute where the reference is all zero, as the
  // comparisons measure the error there (tests/unit/tolerance.h rel_error).
  auto rel = [](double err, double ref) { return ref > 0 ? err / ref : err; };
  const double slack = 1.01;  // first order in u
  Bf16Bounds b;
  b.out = rel(slack * u * (std::sqrt(out_n2) + std::sqrt(a_n2)), std::sqrt(out_n2)) + kFp32RelTol;
  b.out_fp32 =
      dots ? rel(slack * u * std::sqrt(a_n2), std::sqrt(out_n2)) + kFp32RelTol : kFp32RelTol;
  if (!backward) return b;
  b.dq = rel(slack * u * (scale * std::sqrt(dq_delta2) + std::sqrt(dq_round2)), std::sqrt(dq_n2)) +
         kFp32RelTol;
  b.dk = rel(slack * u * (scale * norm(dk_delta) + norm(dk_round)), norm(dk)) + kFp32RelTol;
  b.dv = rel(slack * u * norm(dv_round), norm(dv)) + kFp32RelTol;
  return b;
}

}  // namespace loom
