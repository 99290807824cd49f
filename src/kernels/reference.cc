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
// and the row's lse. Returns false (p all 0, lse = -inf) for a row that sees no key.
bool row_probabilities(View3<const double> q, View3<const double> k, const Tokens& qt,
                       const Tokens& kt, const Mask& mask, double scale, int64_t i, int64_t h,
                       std::vector<double>& p, double& lse) {
  const int64_t g = h / (q.h / k.h);
  const double kNegInfD = -std::numeric_limits<double>::infinity();
  double m = kNegInfD;
  for (int64_t j = 0; j < k.s; ++j) {
    if (pair_visible(mask, qt, i, kt, j)) {
      p[j] = scale * dot(q.row(i, h), k.row(j, g), q.d);
      m = std::max(m, p[j]);
    } else {
      p[j] = kNegInfD;
    }
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

}  // namespace loom
