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
//   ds_ij = p_ij (dp_ij - delta_i),  dq_i = scale sum_j ds_ij k_j,  dk_j += scale ds_ij q_i,
// with dp_ij - delta_i formed relative to the row's top key t as (dp_ij - dp_it) -
// sum_(k != t) p_ik (dp_ik - dp_it), so that no cancellation loses the weights far below t's.
// Nothing here is optimised but where the loops read k and v from (KvHead: one kv head's rows,
// copied together), which changes no result: these loops are what the fast kernels are tested
// against.
// fp32_error_bounds and bf16_error_bounds (loom/tolerance.h) bound the kernels' errors per
// problem.
#include <algorithm>
#include <cmath>
#include <iomanip>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
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

double l2_norm(const std::vector<double>& x) {
  double n = 0;
  for (double e : x) n += e * e;
  return std::sqrt(n);
}

// Kv head g of k and v, copied into contiguous [S, D] rows and seen through views of k's and v's
// shapes whose every head reads the copy (head stride 0), so that the loops below read
// kh.row(j, g) where they read k.row(j, g). In an [S, Hkv, D] tensor a head's rows lie Hkv * D
// doubles apart, each key on a page of its own for Hkv * D >= 512: a row's pass over 32768 keys
// missed the TLB at every key, and loom verify (S = 32768, Hkv = 8, D = 64) spent 41 s in these
// loops on one core. The values are the same doubles, so every result keeps its bits. Without a
// copy to make (one kv head, or a head's rows already adjacent), the views are k and v.
class KvHead {
 public:
  // v may be empty (View3{}): weight_stats without values.
  KvHead(View3<const double> k, View3<const double> v)
      : kh(k), vh(v), k_(k), v_(v), copy_(k.h > 1 && k.ss != k.d) {}
  // Makes kh and vh read kv head g (a no-op when it is already selected or nothing is copied).
  void select(int64_t g) {
    if (!copy_ || g == g_) return;
    g_ = g;
    kh = gather(k_, g, kbuf_);
    if (v_.data) vh = gather(v_, g, vbuf_);
  }
  View3<const double> kh, vh;

 private:
  static View3<const double> gather(View3<const double> x, int64_t g, std::vector<double>& buf) {
    buf.resize(static_cast<size_t>(x.s * x.d));
    for (int64_t j = 0; j < x.s; ++j) std::copy_n(x.row(j, g), x.d, buf.data() + j * x.d);
    return View3<const double>{buf.data(), x.s, x.h, x.d, x.d, 0};
  }
  View3<const double> k_, v_;
  bool copy_;
  int64_t g_ = -1;
  std::vector<double> kbuf_, vbuf_;
};

// The keys of a row that carry weight (p_j != 0), in order, into keys; returns the one with the
// largest p (the first of equals), -1 for none.
int64_t weighted_keys(const std::vector<double>& p, std::vector<int64_t>& keys) {
  keys.clear();
  int64_t t = -1;
  for (int64_t j = 0; j < static_cast<int64_t>(p.size()); ++j) {
    if (p[j] == 0.0) continue;
    keys.push_back(j);
    if (t < 0 || p[j] > p[t]) t = j;
  }
  return t;
}

// dp - delta of query row i without cancellation. For the keys j of the row (those with p_j = 0
// skipped) and its top key t: dp_j = dout_i . v_j into dp, and the return shift = delta - dp_t =
// sum_(j != t) p_j (dp_j - dp_t), so that dp_j - delta = (dp_j - dp_t) - shift (sum_j p_j = 1).
// dp_t - delta computed directly cancels in double where the weight sits on t: with the other
// weights 1e-16 of it, ds_t = -sum_(j != t) ds_j was lost to delta's rounding (at scale 1000, dq
// rows of rounding noise made the whole of dq's norm).
double dp_and_shift(const double* doi, View3<const double> v, int64_t g,
                    const std::vector<double>& p, const std::vector<int64_t>& keys, int64_t t,
                    std::vector<double>& dp) {
  for (int64_t j : keys)
    if (p[j] != 0.0) dp[j] = dot(doi, v.row(j, g), v.d);
  double shift = 0.0;
  for (int64_t j : keys)
    if (p[j] != 0.0 && j != t) shift += p[j] * (dp[j] - dp[t]);
  return shift;
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

// A key gradient the caller does not want: an empty view, View3{} (loom/attention.h).
bool skipped(const View3<double>& g) {
  return g.data == nullptr && g.s == 0 && g.h == 0 && g.d == 0;
}

// dk or dv against k or v where wanted; an unwanted one is not looked at.
void check_key_gradient(const View3<double>& g, const View3<const double>& kv, bool wanted,
                        const char* name, const char* pair) {
  if (!wanted) return;
  kernels::check_view(g, name);
  kernels::check_same_shape(View3<const double>(g), kv, pair);
}

void zero_key_gradient(const View3<double>& g, bool wanted) {
  if (!wanted) return;
  for (int64_t j = 0; j < g.s; ++j)
    for (int64_t h = 0; h < g.h; ++h)
      for (int64_t d = 0; d < g.d; ++d) g(j, h, d) = 0.0;
}

// The backward's arguments checked (q, k, v already) and its outputs zeroed: dq, and dk and dv
// where wanted (not empty views). Returns {want_dk, want_dv}.
std::pair<bool, bool> start_backward(View3<const double> q, View3<const double> k,
                                     View3<const double> v, View3<const double> dout,
                                     View3<double> dq, View3<double> dk, View3<double> dv) {
  kernels::check_view(dout, "dout");
  kernels::check_view(dq, "dq");
  kernels::check_same_shape(dout, q, "dout and q");
  kernels::check_same_shape(View3<const double>(dq), q, "dq and q");
  const bool want_dk = !skipped(dk), want_dv = !skipped(dv);
  check_key_gradient(dk, k, want_dk, "dk", "dk and k");
  check_key_gradient(dv, v, want_dv, "dv", "dv and v");
  for (int64_t i = 0; i < q.s; ++i)
    for (int64_t h = 0; h < q.h; ++h)
      for (int64_t d = 0; d < q.d; ++d) dq(i, h, d) = 0.0;
  zero_key_gradient(dk, want_dk);
  zero_key_gradient(dv, want_dv);
  return {want_dk, want_dv};
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
  KvHead kv(k, v);
  for (int64_t h = 0; h < q.h; ++h) {
    const int64_t g = h / (q.h / k.h);
    kv.select(g);
    for (int64_t i = 0; i < q.s; ++i) {
      double* o = out.row(i, h);
      for (int64_t d = 0; d < q.d; ++d) o[d] = 0.0;
      row_probabilities(q, kv.kh, qt, kt, mask, scale, i, h, p, lse[h * q.s + i]);
      for (int64_t j = 0; j < k.s; ++j) {
        if (p[j] == 0.0) continue;
        const double* vj = kv.vh.row(j, g);
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
  const auto [want_dk, want_dv] = start_backward(q, k, v, dout, dq, dk, dv);

  std::vector<double> p(static_cast<size_t>(k.s)), dp(static_cast<size_t>(k.s));
  std::vector<int64_t> keys;
  KvHead kv(k, v);
  for (int64_t h = 0; h < q.h; ++h) {
    const int64_t g = h / (q.h / k.h);
    kv.select(g);
    for (int64_t i = 0; i < q.s; ++i) {
      double lse = 0.0;
      if (!row_probabilities(q, kv.kh, qt, kt, mask, scale, i, h, p, lse)) continue;
      const double* doi = dout.row(i, h);
      // delta = sum_j p_j dp_j, taken relative to the top key t (the largest p): dp_and_shift.
      const int64_t t = weighted_keys(p, keys);
      const double shift = dp_and_shift(doi, kv.vh, g, p, keys, t, dp);  // delta - dp_t
      for (int64_t j : keys) {
        const double ds = p[j] * ((dp[j] - dp[t]) - shift);
        for (int64_t d = 0; d < q.d; ++d) dq(i, h, d) += scale * ds * kv.kh(j, g, d);
        if (want_dv)
          for (int64_t d = 0; d < q.d; ++d) dv(j, g, d) += p[j] * doi[d];
        if (want_dk)
          for (int64_t d = 0; d < q.d; ++d) dk(j, g, d) += scale * ds * q(i, h, d);
      }
    }
  }
}

namespace {

// x rounded to float32 where it lies below float32's normal range (a multiple of 2^-149 there,
// 0 under 2^-150), x itself elsewhere: subnormal_reference's one rounding.
double round_subnormal(double x) {
  return std::fabs(x) < static_cast<double>(std::numeric_limits<float>::min())
             ? static_cast<double>(static_cast<float>(x))
             : x;
}

// a . b as a float32 fused multiply-add chain rounds it below the normal range (in order).
double dot_subnormal(const double* a, const double* b, int64_t n) {
  double s = 0.0;
  for (int64_t d = 0; d < n; ++d) s = round_subnormal(s + a[d] * b[d]);
  return s;
}

}  // namespace

void subnormal_reference(View3<const double> q, View3<const double> k, View3<const double> v,
                         View3<const double> dout, Tokens qt, Tokens kt, const Mask& mask,
                         double scale, View3<double> out, View3<double> dq, View3<double> dk,
                         View3<double> dv) {
  kernels::check_qkv(q, k, v, qt, kt);
  kernels::check_mask(mask);
  kernels::check_scale(scale);
  kernels::check_view(out, "out");
  kernels::check_same_shape(View3<const double>(out), q, "out and q");
  const bool backward = dout.data != nullptr;
  bool want_dk = false, want_dv = false;
  if (backward) std::tie(want_dk, want_dv) = start_backward(q, k, v, dout, dq, dk, dv);
  const auto r = round_subnormal;
  std::vector<double> p(static_cast<size_t>(k.s)), dp(static_cast<size_t>(k.s));
  std::vector<double> exact(static_cast<size_t>(q.d));
  std::vector<int64_t> keys;
  KvHead kv(k, v);
  for (int64_t h = 0; h < q.h; ++h) {
    const int64_t g = h / (q.h / k.h);
    kv.select(g);
    for (int64_t i = 0; i < q.s; ++i) {
      double* o = out.row(i, h);
      std::fill(o, o + q.d, 0.0);
      std::fill(exact.begin(), exact.end(), 0.0);
      double lse = 0.0;
      if (!row_probabilities(q, kv.kh, qt, kt, mask, scale, i, h, p, lse)) continue;
      const int64_t t = weighted_keys(p, keys);
      for (int64_t j : keys) {  // out as reference_forward sums it, and as float32 does
        const double* vj = kv.vh.row(j, g);
        for (int64_t d = 0; d < q.d; ++d) {
          exact[d] += p[j] * vj[d];
          o[d] = r(o[d] + r(p[j]) * vj[d]);
        }
      }
      if (!backward) continue;
      const double* doi = dout.row(i, h);
      const double shift = dp_and_shift(doi, kv.vh, g, p, keys, t, dp);  // delta - dp_t
      // What rounding below the normal range moves delta = dout_i . out_i by: 0 where it rounds
      // nothing (both sums alike), so that ds keeps reference_backward's cancellation-free form.
      const double delta_moved = dot_subnormal(doi, o, q.d) - dot(doi, exact.data(), q.d);
      for (int64_t j : keys) {
        const double dp_moved = dot_subnormal(doi, kv.vh.row(j, g), q.d) - dp[j];
        const double pj = r(p[j]);
        const double ds = r(pj * (((dp[j] - dp[t]) - shift) + (dp_moved - delta_moved)));
        for (int64_t d = 0; d < q.d; ++d)
          dq(i, h, d) = r(dq(i, h, d) + scale * ds * kv.kh(j, g, d));
        if (want_dv)
          for (int64_t d = 0; d < q.d; ++d) dv(j, g, d) = r(dv(j, g, d) + pj * doi[d]);
        if (want_dk)
          for (int64_t d = 0; d < q.d; ++d) dk(j, g, d) = r(dk(j, g, d) + scale * ds * q(i, h, d));
      }
    }
  }
}

namespace {

double max_abs(View3<const double> x) {
  double m = 0;
  for (int64_t i = 0; i < x.s; ++i)
    for (int64_t h = 0; h < x.h; ++h)
      for (int64_t d = 0; d < x.d; ++d) m = std::max(m, std::fabs(x(i, h, d)));
  return m;
}

}  // namespace

// Each round_subnormal errs at most u = 2^-150; the sums add their terms' errors. With K keys,
// R = Sq H / Hkv query rows per KV head, head dim D and the largest magnitudes Q, Kx, V, O of q,
// k, v, dout (every p_ij <= 1):
//   out:    K steps of o = r(o + r(p) v), each off by at most u + u V:   K u (1 + V);
//   dp_ij:  D steps of a rounded sum:                                    D u;
//   delta:  D steps, and out's shift through dout:                       D u + D O K u (1 + V);
//   ds_ij = r(r(p) (X + moved)), |X| = |dp_ij - delta_i| <= 2 D O V, |moved| <= M, the two
//           lines above added:                                 A = u + u (2 D O V + M) + M;
//   dq:     K steps, each off by u + |scale| Kx A;
//   dk:     R steps, each off by u + |scale| Q A;
//   dv:     R steps of dv = r(dv + r(p) dout), each off by u + u O.
SubnormalShift subnormal_reference_shift(View3<const double> q, View3<const double> k,
                                         View3<const double> v, View3<const double> dout,
                                         double scale) {
  kernels::check_view(q, "q");
  kernels::check_view(k, "k");
  kernels::check_view(v, "v");
  const double u = std::ldexp(1.0, -150);
  const double K = static_cast<double>(k.s), D = static_cast<double>(q.d);
  const double V = max_abs(v);
  SubnormalShift s;
  s.out = K * u * (1 + V);
  if (dout.data == nullptr) return s;
  kernels::check_view(dout, "dout");
  const double R = static_cast<double>(q.s) * static_cast<double>(q.h / std::max<int64_t>(1, k.h));
  const double Q = max_abs(q), Kx = max_abs(k), O = max_abs(dout), sc = std::fabs(scale);
  const double M = 2 * D * u + D * O * K * u * (1 + V);
  const double A = u + u * (2 * D * O * V + M) + M;
  s.dq = K * (u + sc * Kx * A);
  s.dk = R * (u + sc * Q * A);
  s.dv = R * (u + u * O);
  return s;
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
  // pairs <= qt.n kt.n fits (the loops ran); times heads may not (heads = 2^62 wrapped).
  int64_t total = 0;
  LOOM_CHECK(!__builtin_mul_overflow(pairs, heads, &total), InvalidArgument,
             "visible pairs " << pairs << " x heads " << heads << " overflows int64");
  return total;
}

bool bf16_fixed_tolerances_hold(Tokens qt, Tokens kt, const Mask& mask, int64_t head_dim) {
  if (qt.n <= 0 || head_dim < kBf16FixedTolMinHeadDim) return false;
  return static_cast<double>(count_visible_pairs(qt, kt, mask, 1)) >=
         kBf16FixedTolMinKeys * static_cast<double>(qt.n);
}

namespace {

// The statistics of the regime's weight conditions (loom/tolerance.h), in one pass over the
// reference's weights: over the query rows and heads that see a key, their number, the sum of
// sum_j p_ij^2, of ||kbar_i||^2 (kbar_i = sum_j p_ij k_j) and of sum_j p_ij ||k_j||^2, so that
// sum_j p_ij ||k_j - kbar_i||^2 = sum_j p_ij ||k_j||^2 - ||kbar_i||^2 (sum_j p_ij = 1) costs no
// second pass. Its cancellation loses about log10(1 + ratio^2) digits of double's 16, nothing at
// the thresholds (1 and 8).
// The same sums over v (with v given), whose weighted mean is the row's out_i: mean_val2, val2.
struct RowSums {
  double rows = 0;            // the rows' count (or total weight)
  double collisions = 0;      // sum over rows of sum_j p_ij^2
  double mean_key2 = 0;       // sum over rows of ||kbar_i||^2
  double key2 = 0;            // sum over rows of sum_j p_ij ||k_j||^2
  double mean_val2 = 0;       // sum over rows of ||out_i||^2 (out_i = sum_j p_ij v_j)
  double val2 = 0;            // sum over rows of sum_j p_ij ||v_j||^2
  double val_collisions = 0;  // sum over rows of sum_j p_ij^2 ||v_j||^2

  void add(double weight, const RowSums& row) {
    rows += weight;
    collisions += weight * row.collisions;
    mean_key2 += weight * row.mean_key2;
    key2 += weight * row.key2;
    mean_val2 += weight * row.mean_val2;
    val2 += weight * row.val2;
    val_collisions += weight * row.val_collisions;
  }
  double effective_keys() const { return rows > 0 ? rows / collisions : 0.0; }
  static double ratio(double mean2, double all2) {
    if (std::isnan(mean2) || std::isnan(all2)) return std::numeric_limits<double>::quiet_NaN();
    if (!(mean2 > 0)) return 0.0;  // no row, or every weighted row 0: nothing to cancel
    const double spread = all2 - mean2;
    return spread > 0 ? std::sqrt(mean2 / spread) : std::numeric_limits<double>::infinity();
  }
  double common_key_ratio() const { return ratio(mean_key2, key2); }
  double common_value_ratio() const { return ratio(mean_val2, val2); }
  // sqrt(sum_i sum_j p_ij^2 ||v_j||^2 / sum_i ||out_i||^2): about 1 for values drawn
  // independently, large where out cancels (+inf where out is 0 and the values are not).
  double out_cancel_ratio() const {
    if (std::isnan(val_collisions) || std::isnan(mean_val2))
      return std::numeric_limits<double>::quiet_NaN();
    if (!(val_collisions > 0)) return 0.0;  // every weighted value 0: out is exactly 0
    return mean_val2 > 0 ? std::sqrt(val_collisions / mean_val2)
                         : std::numeric_limits<double>::infinity();
  }
};

// The sums with every row counted once, and, with dout given, weighted by ||dout_i||^2: a row's
// share of the gradients (dq_i and row i's terms of dk and dv scale with dout_i). A loss mask
// that leaves dout on a few rows makes the gradients those rows' alone, and a concentrated row
// among many spread ones then rules dq while the plain mean hides it (dout on one row of 256 whose
// top key held 1 - 5e-4 of the weight: a correct fp32 dq 1.1e-4 from the reference, "check
// FAILED" at 1e-5 with 5.7 effective keys counted over every row). The conditions take the
// worse of the two.
struct WeightStats {
  RowSums all, grad;
  double effective_keys() const {
    const double a = all.effective_keys();
    const double b = grad.rows > 0 ? grad.effective_keys() : a;
    return std::isnan(a) || std::isnan(b) ? std::numeric_limits<double>::quiet_NaN()
                                          : std::min(a, b);
  }
  static double worse(double a, double b) {
    return std::isnan(a) || std::isnan(b) ? std::numeric_limits<double>::quiet_NaN()
                                          : std::max(a, b);
  }
  double common_key_ratio() const {
    return grad.rows > 0 ? worse(all.common_key_ratio(), grad.common_key_ratio())
                         : all.common_key_ratio();
  }
  double common_value_ratio() const {
    return grad.rows > 0 ? worse(all.common_value_ratio(), grad.common_value_ratio())
                         : all.common_value_ratio();
  }
};

WeightStats weight_stats(View3<const double> q, View3<const double> k, const View3<const double>* v,
                         Tokens qt, Tokens kt, const Mask& mask, double scale,
                         const View3<const double>* dout = nullptr) {
  kernels::check_qkv(q, k, v ? *v : k, qt,
                     kt);  // without v, k stands in (the weights do not read v)
  kernels::check_mask(mask);
  kernels::check_scale(scale);
  if (dout) kernels::check_same_shape(*dout, q, "dout and q");
  const int64_t D = q.d, Dv = v ? v->d : 0;
  std::vector<double> p(static_cast<size_t>(k.s)), kbar(static_cast<size_t>(D)),
      vbar(static_cast<size_t>(Dv));
  std::vector<double> knorm2(static_cast<size_t>(k.s * k.h)), vnorm2(v ? knorm2.size() : 0);
  for (int64_t j = 0; j < k.s; ++j)
    for (int64_t g = 0; g < k.h; ++g) {
      knorm2[j * k.h + g] = dot(k.row(j, g), k.row(j, g), D);
      if (v) vnorm2[j * k.h + g] = dot(v->row(j, g), v->row(j, g), Dv);
    }
  WeightStats w;
  KvHead kv(k, v ? *v : View3<const double>{});
  for (int64_t h = 0; h < q.h; ++h) {
    const int64_t g = h / (q.h / k.h);
    kv.select(g);
    for (int64_t i = 0; i < q.s; ++i) {
      double lse = 0;
      if (!row_probabilities(q, kv.kh, qt, kt, mask, scale, i, h, p, lse)) continue;
      std::fill(kbar.begin(), kbar.end(), 0.0);
      std::fill(vbar.begin(), vbar.end(), 0.0);
      RowSums row;
      for (int64_t j = 0; j < k.s; ++j) {
        const double x = p[j];
        row.collisions += x * x;  // >= 1 / n^2 > 0 over the row (NaN passes through)
        if (x == 0.0) continue;
        row.key2 += x * knorm2[j * k.h + g];
        const double* kj = kv.kh.row(j, g);
        for (int64_t d = 0; d < D; ++d) kbar[d] += x * kj[d];
        if (!v) continue;
        row.val2 += x * vnorm2[j * k.h + g];
        row.val_collisions += x * x * vnorm2[j * k.h + g];
        const double* vj = kv.vh.row(j, g);
        for (int64_t d = 0; d < Dv; ++d) vbar[d] += x * vj[d];
      }
      row.mean_key2 = dot(kbar.data(), kbar.data(), D);
      if (v) row.mean_val2 = dot(vbar.data(), vbar.data(), Dv);
      w.all.add(1.0, row);
      if (dout) w.grad.add(dot(dout->row(i, h), dout->row(i, h), dout->d), row);
    }
  }
  return w;
}

}  // namespace

double effective_keys(View3<const double> q, View3<const double> k, Tokens qt, Tokens kt,
                      const Mask& mask, double scale) {
  return weight_stats(q, k, nullptr, qt, kt, mask, scale).effective_keys();
}

double common_key_ratio(View3<const double> q, View3<const double> k, Tokens qt, Tokens kt,
                        const Mask& mask, double scale) {
  return weight_stats(q, k, nullptr, qt, kt, mask, scale).common_key_ratio();
}

double common_value_ratio(View3<const double> q, View3<const double> k, View3<const double> v,
                          Tokens qt, Tokens kt, const Mask& mask, double scale) {
  return weight_stats(q, k, &v, qt, kt, mask, scale).common_value_ratio();
}

double out_cancel_ratio(View3<const double> q, View3<const double> k, View3<const double> v,
                        Tokens qt, Tokens kt, const Mask& mask, double scale) {
  return weight_stats(q, k, &v, qt, kt, mask, scale).all.out_cancel_ratio();
}

namespace {

// sum_n (|c_n| + |a_n b_n|) for the chain c_n = c_{n-1} + a_n b_n (c_{-1} = 0) over n = 0..D-1:
// u times it bounds the rounding of the kernels' dot products (loom/tolerance.h, fp32).
double chain_error(const double* a, const double* b, int64_t n) {
  double c = 0, e = 0;
  for (int64_t d = 0; d < n; ++d) {
    const double x = a[d] * b[d];
    c += x;
    e += std::fabs(c) + std::fabs(x);
  }
  return e;
}

// The kernels' exp2 returns 0 below 2^-125 (kernels::kExp2Min): a weight whose computed log is
// below -125 ln 2 (natural units) is lost.
constexpr double kExp2Cut = 125 * 0.69314718055994531;

// The absolute error bounds of loom/tolerance.h's fp32 derivation (norms over every row and
// head, without the first-order factor and kFp32RelTol), with the reference's norms; dk and dv
// (and their [Sk, Hkv, D] accumulators) only where key_grads.
struct Fp32Errors {
  double out = 0, lse = 0, dq = 0, dk = 0, dv = 0;                      // ||error bound||
  double out_ref = 0, lse_ref = 0, dq_ref = 0, dk_ref = 0, dv_ref = 0;  // ||reference||
};

Fp32Errors fp32_errors(View3<const double> q, View3<const double> k, View3<const double> v,
                       View3<const double> dout, Tokens qt, Tokens kt, const Mask& mask,
                       double scale, bool loom_kernels, bool key_grads) {
  const bool backward = dout.data != nullptr;
  const double u = kFp32Unit;
  const double as = std::fabs(scale);
  const int64_t D = q.d;
  const size_t n_k = static_cast<size_t>(k.s), n_d = static_cast<size_t>(D);
  // Per row: the visible keys by decreasing score, their scores s, weights p, score error
  // bounds E, the forward softmax's log-weight roundings R (F = E + R), the normalised weights'
  // bounds w, the ranks r.
  std::vector<int64_t> keys;
  std::vector<double> s(n_k), p(n_k), e(n_k), rs(n_k), w(n_k), rank(n_k), dp(n_k), dmd(n_k);
  std::vector<double> out(n_d), a(n_d), oerr(n_d), werr(n_d), dq(n_d), dq_err(n_d);
  const size_t kv_size = static_cast<size_t>(k.s * k.h * D);
  std::vector<double> dk(backward && key_grads ? kv_size : 0), dv(dk.size()), dk_err(dk.size()),
      dv_err(dk.size());
  double out_e2 = 0, out_r2 = 0, lse_e2 = 0, lse_r2 = 0, dq_e2 = 0, dq_r2 = 0;
  KvHead kv(k, v);
  for (int64_t h = 0; h < q.h; ++h) {
    const int64_t g = h / (q.h / k.h);
    kv.select(g);
    for (int64_t i = 0; i < q.s; ++i) {
      const double* qi = q.row(i, h);
      keys.clear();
      bool nan = false;
      for (int64_t j = 0; j < k.s; ++j) {
        if (!pair_visible(mask, qt, i, kt, j)) continue;
        keys.push_back(j);
        s[j] = scale * dot(qi, kv.kh.row(j, g), D);
        nan = nan || std::isnan(s[j]);
      }
      // No key: out 0, lse -inf exactly. A NaN score: NaN in the reference, nothing to bound.
      if (keys.empty() || nan) continue;
      std::sort(keys.begin(), keys.end(), [&](int64_t x, int64_t y) { return s[x] > s[y]; });
      const int64_t top = keys.front();
      const double m = s[top];
      if (!std::isfinite(m)) continue;
      for (size_t t = 0; t < keys.size(); ++t) {  // ties share the rank of the first of them
        const int64_t j = keys[t];
        rank[j] = t > 0 && s[keys[t - 1]] == s[j] ? rank[keys[t - 1]] : static_cast<double>(t);
      }
      double l = 0;
      for (int64_t j : keys) l += std::exp(s[j] - m);
      const double lse = m + std::log(l);
      for (int64_t j : keys) {
        p[j] = std::exp(s[j] - lse);
        e[j] = u * (as * chain_error(qi, kv.kh.row(j, g), D) + 2 * std::fabs(s[j]));
        rs[j] = u * (m - s[j] + 8);
      }
      // Loom's kernels with a top key whose computed score is surely the largest: its weight is
      // 2^0 = 1 exactly, so every rounding of acc and l is charged to the other keys' terms.
      bool top_exact = loom_kernels;
      for (size_t t = 1; t < keys.size() && top_exact; ++t)
        top_exact = m - s[keys[t]] > e[top] + e[keys[t]];
      const auto charged = [&](int64_t j) { return !top_exact || j != top; };
      // Forward weights: |log error| <= F = E + R; Z+- = sum p e^(+-F), exact in F. l's own
      // roundings, relative: its adds, and the rescales (product, exp2 of alpha).
      double zp = 0, zm = 0, l_rel = 0, others = 0;  // others: sum_(k != top) p^_k / p^_top
      for (int64_t j : keys) {
        if (charged(j)) l_rel += (top_exact ? 9 : 7) * std::min(u, p[j]) + 9 * u * p[j] * rank[j];
        if (p[j] == 0) continue;  // below double's range: no weight, and none computed
        zp += p[j] * std::exp(e[j] + rs[j]);
        zm += p[j] * std::exp(-e[j] - rs[j]);
        if (j != top) others += p[j] / p[top] * std::exp(e[j] + rs[j] + e[top] + rs[top]);
      }
      for (int64_t j : keys) {
        const double f = e[j] + rs[j];
        w[j] = p[j] == 0 ? 0 : std::max(std::exp(f) / zm - 1, 1 - std::exp(-f) / zp);
        if (m - s[j] + f > kExp2Cut) w[j] = std::max(w[j], 1.0);  // may be flushed to 0
      }
      // log Z+ and -log Z- in log space: at scores past about 1e9 the exponents f reach
      // thousands, zp overflows and zm underflows, and lse's bound came out NaN ("not
      // computable") where it is a few ulps of |lse|.
      double fmax = -std::numeric_limits<double>::infinity(), fmin = -fmax;
      for (int64_t j : keys) {
        if (p[j] == 0) continue;
        fmax = std::max(fmax, e[j] + rs[j]);
        fmin = std::min(fmin, e[j] + rs[j]);
      }
      double zp_scaled = 0, zm_scaled = 0;
      for (int64_t j : keys) {
        if (p[j] == 0) continue;
        zp_scaled += p[j] * std::exp(e[j] + rs[j] - fmax);
        zm_scaled += p[j] * std::exp(fmin - e[j] - rs[j]);
      }
      const double lse_err = std::max(fmax + std::log(zp_scaled), fmin - std::log(zm_scaled)) +
                             l_rel + u * std::fabs(lse);
      lse_e2 += lse_err * lse_err;
      lse_r2 += lse * lse;
      // out: the weights' error, acc's roundings (per element), l's, and 1 / l (inv_l = fl(1 / l),
      // then acc inv_l: each off by at most u, or by its distance to 1 where l is near 1).
      std::fill(out.begin(), out.end(), 0.0);
      std::fill(a.begin(), a.end(), 0.0);
      for (int64_t j : keys) {
        const double* vj = kv.vh.row(j, g);
        for (int64_t d = 0; d < D; ++d) {
          out[d] += p[j] * vj[d];
          a[d] += p[j] * std::fabs(vj[d]);
        }
      }
      const double div = top_exact ? 2 * std::min(u, 3 * others) : 2 * u;
      // oerr: the roundings; werr: the weights' error.
      for (int64_t d = 0; d < D; ++d) {
        oerr[d] = std::fabs(out[d]) * (l_rel + div);
        werr[d] = 0;
      }
      const double c_acc = top_exact ? 4 : 2;
      for (int64_t j : keys) {
        if (p[j] == 0) continue;
        const double* vj = kv.vh.row(j, g);
        for (int64_t d = 0; d < D; ++d) {
          const double t = p[j] * std::fabs(vj[d]);
          werr[d] += w[j] * p[j] * std::fabs(vj[d] - out[d]);
          if (charged(j)) oerr[d] += c_acc * std::min(u * a[d], t) + u * t * (1 + rank[j]);
        }
      }
      for (int64_t d = 0; d < D; ++d) {
        out_e2 += (oerr[d] + werr[d]) * (oerr[d] + werr[d]);
        out_r2 += out[d] * out[d];
      }
      if (!backward) continue;
      // delta: compute_delta's chain, out's roundings, and the weights' error through
      // dout.(out^ - out) = sum_j (p^_j - p_j) (dp_j - delta) (sum_j p^_j - p_j = 0).
      const double* doi = dout.row(i, h);
      double delta_err = u * chain_error(doi, out.data(), D);
      for (int64_t d = 0; d < D; ++d) delta_err += std::fabs(doi[d]) * oerr[d];
      // dp_j - delta without cancellation (as reference_backward): (dp_j - dp_t) - shift.
      const double shift = dp_and_shift(doi, kv.vh, g, p, keys, top, dp);
      for (int64_t j : keys) {
        if (p[j] == 0) continue;
        dmd[j] = (dp[j] - dp[top]) - shift;
        delta_err += w[j] * p[j] * std::fabs(dmd[j]);
      }
      // A row whose other keys move no element of acc, nor l, off the top key's: out is exactly
      // v_top, so delta is exactly the top key's dp (compute_delta sums in the dp GEMM's order)
      // and its ds exactly 0.
      // (margin: the sums' own roundings, and bf16 weights on the bf16-dot path)
      const double margin = 1.01 + 10 * u * static_cast<double>(keys.size());
      bool exact_row = top_exact && others * margin < u;
      if (exact_row) {
        const double* vt = kv.vh.row(top, g);
        for (int64_t d = 0; d < D && exact_row; ++d) {
          double moved = 0;
          for (size_t t = 1; t < keys.size(); ++t) {
            const int64_t j = keys[t];
            moved += p[j] / p[top] * std::exp(e[j] + rs[j] + e[top] + rs[top]) *
                     std::fabs(kv.vh(j, g, d));
          }
          exact_row = moved * margin < u * std::fabs(vt[d]) / 2;
        }
      }
      if (exact_row)  // delta^ = dp^_top
        delta_err = u * chain_error(doi, kv.vh.row(top, g), D) + std::fabs(shift);
      // The backward's weights: |log p^ - log p| <= B. Independent scores: E_j + the lse's
      // error. Loom's (the forward's scores, bitwise): -log sum_k p_k e^(y_k) with |y_k| <=
      // E_j + E_k (k != j) + R_k, bounded through Z+-_j = sum_k p_k e^(+-(E_j + E_k + R_k)).
      double sp = 0, sm = 0;
      for (int64_t j : keys) {
        if (p[j] == 0) continue;
        sp += p[j] * std::exp(e[j] + rs[j]);
        sm += p[j] * std::exp(-e[j] - rs[j]);
      }
      const double lse_roundings = l_rel + 2 * u * std::fabs(lse);
      std::fill(dq.begin(), dq.end(), 0.0);
      std::fill(dq_err.begin(), dq_err.end(), 0.0);
      for (int64_t j : keys) {
        if (p[j] == 0) continue;
        double log_err;  // of p^_j, before the backward's own roundings
        if (loom_kernels) {
          const double zpj = p[j] * std::exp(rs[j]) +
                             std::exp(e[j]) * std::max(0.0, sp - p[j] * std::exp(e[j] + rs[j]));
          const double zmj = p[j] * std::exp(-rs[j]) +
                             std::exp(-e[j]) * std::max(0.0, sm - p[j] * std::exp(-e[j] - rs[j]));
          log_err = std::max(std::log(zpj), -std::log(zmj)) + lse_roundings;
        } else {
          log_err = e[j] + lse_err + u * std::fabs(lse);
        }
        const double b_log = log_err + u * std::fabs(s[j] - lse) + 8 * u;
        double bj = std::expm1(b_log);
        if (lse - s[j] + b_log > kExp2Cut) bj = std::max(bj, 1.0);  // may be flushed to 0
        const double* vj = kv.vh.row(j, g);
        const double dp_err = u * chain_error(doi, vj, D);
        const double ds = p[j] * dmd[j];
        const double ds_err =
            exact_row && j == top
                ? std::fabs(ds)  // computed as 0
                : p[j] * (bj * std::fabs(dmd[j]) + (1 + bj) * (dp_err + delta_err));
        for (int64_t d = 0; d < D; ++d) {
          dq[d] += scale * ds * kv.kh(j, g, d);
          dq_err[d] += as * ds_err * std::fabs(kv.kh(j, g, d));
        }
        if (!key_grads) continue;
        const size_t jg = static_cast<size_t>(j * k.h + g) * n_d;
        for (int64_t d = 0; d < D; ++d) {
          const size_t x = jg + static_cast<size_t>(d);
          dv[x] += p[j] * doi[d];
          dv_err[x] += bj * p[j] * std::fabs(doi[d]);
          dk[x] += scale * ds * qi[d];
          dk_err[x] += as * ds_err * std::fabs(qi[d]);
        }
      }
      for (int64_t d = 0; d < D; ++d) {
        dq_e2 += dq_err[d] * dq_err[d];
        dq_r2 += dq[d] * dq[d];
      }
    }
  }
  Fp32Errors r;
  r.out = std::sqrt(out_e2);
  r.out_ref = std::sqrt(out_r2);
  r.lse = std::sqrt(lse_e2);
  r.lse_ref = std::sqrt(lse_r2);
  r.dq = std::sqrt(dq_e2);
  r.dq_ref = std::sqrt(dq_r2);
  r.dk = l2_norm(dk_err);
  r.dk_ref = l2_norm(dk);
  r.dv = l2_norm(dv_err);
  r.dv_ref = l2_norm(dv);
  return r;
}

// Relative to the reference's norm; absolute where the reference is all zero, as the
// comparisons measure the error there (tests/unit/tolerance.h rel_error).
double rel(double err, double ref) {
  return ref > 0 ? err / ref : err;
}

constexpr double kFirstOrderSlack = 1.01;  // first order in u

// The error bounds' arguments, checked as the reference's; whether dout is given (the backward's
// bounds too).
bool check_bounds_args(View3<const double> q, View3<const double> k, View3<const double> v,
                       View3<const double> dout, Tokens qt, Tokens kt, const Mask& mask,
                       double scale) {
  kernels::check_qkv(q, k, v, qt, kt);
  kernels::check_mask(mask);
  kernels::check_scale(scale);
  const bool backward = dout.data != nullptr;
  if (backward) {
    kernels::check_view(dout, "dout");
    kernels::check_same_shape(dout, q, "dout and q");
  }
  return backward;
}

}  // namespace

double fp32_score_bound(View3<const double> q, View3<const double> k, double scale) {
  auto max_row_norm = [](View3<const double> x) {
    double big = 0;
    for (int64_t i = 0; i < x.s; ++i)
      for (int64_t h = 0; h < x.h; ++h) big = std::max(big, dot(x.row(i, h), x.row(i, h), x.d));
    return std::sqrt(big);
  };
  return std::fabs(scale) * max_row_norm(q) * max_row_norm(k);
}

bool fp32_fixed_tolerance_holds(View3<const double> q, View3<const double> k, double scale) {
  return fp32_score_bound(q, k, scale) <= kFp32FixedTolMaxScore;
}

namespace {

// The first condition of the fixed tolerances' regime that the problem misses, and its text.
// score_bound: fp32_score_bound over every query row where q holds a sample of them (negative:
// computed here, over q).
std::pair<RegimeMiss, std::string> exclusion(View3<const double> q, View3<const double> k,
                                             const View3<const double>* v, Tokens qt, Tokens kt,
                                             const Mask& mask, double scale, bool bf16,
                                             double score_bound = -1,
                                             const View3<const double>* dout = nullptr) {
  std::ostringstream why;
  why << std::setprecision(3);
  if (score_bound < 0) score_bound = fp32_score_bound(q, k, scale);
  if (!(score_bound <= kFp32FixedTolMaxScore)) {
    why << "scores up to " << score_bound << " (|scale| max||q|| max||k|| above "
        << kFp32FixedTolMaxScore << ")";
    return {RegimeMiss::kScores, why.str()};
  }
  if (bf16 && q.d < kBf16FixedTolMinHeadDim) {
    why << "head dim under " << kBf16FixedTolMinHeadDim;
    return {RegimeMiss::kHeadDim, why.str()};
  }
  const WeightStats w = weight_stats(q, k, v, qt, kt, mask, scale, dout);
  // The worse of every row's sums and the dout-weighted ones: the text says which.
  const bool by_grad = w.grad.rows > 0;
  const char* weighted = ", each row weighted by its ||dout||^2";
  const double want = bf16 ? kBf16FixedTolMinEffectiveKeys : kFp32FixedTolMinEffectiveKeys;
  const double keys = w.effective_keys();
  if (!(keys >= want)) {  // NaN: not in the regime either
    why << std::fixed << std::setprecision(2) << keys
        << " effective keys per query row (1 / the rows' mean sum_j p_j^2"
        << (by_grad && keys != w.all.effective_keys() ? weighted : "") << "; under "
        << std::defaultfloat << want << ")";
    return {RegimeMiss::kEffectiveKeys, why.str()};
  }
  const double most = bf16 ? kBf16FixedTolMaxCommonKey : kFp32FixedTolMaxCommonKey;
  const double ratio = w.common_key_ratio();
  if (!(ratio <= most)) {  // NaN: not in the regime either
    why << "keys sharing a component " << ratio
        << " times their spread (sqrt of the rows' sum ||kbar||^2 / sum_j p_j ||k_j - kbar||^2, "
           "kbar = sum_j p_j k_j"
        << (by_grad && ratio != w.all.common_key_ratio() ? weighted : "") << "; above " << most
        << ")";
    return {RegimeMiss::kCommonKey, why.str()};
  }
  const double values = v ? w.common_value_ratio() : 0.0;
  if (!(values <= most)) {
    why << "values sharing a component " << values
        << " times their spread (sqrt of the rows' sum ||out||^2 / sum_j p_j ||v_j - out||^2"
        << (by_grad && values != w.all.common_value_ratio() ? weighted : "") << "; above " << most
        << ")";
    return {RegimeMiss::kCommonValue, why.str()};
  }
  const double cancel = v ? w.all.out_cancel_ratio() : 0.0;
  const double most_cancel = bf16 ? kBf16FixedTolMaxOutCancel : kFp32FixedTolMaxOutCancel;
  if (!(cancel <= most_cancel)) {
    why << "values cancelling in out, " << cancel
        << " (sqrt of the rows' sum sum_j p_j^2 ||v_j||^2 / sum ||out||^2; above " << most_cancel
        << ")";
    return {RegimeMiss::kOutCancels, why.str()};
  }
  return {RegimeMiss::kNone, ""};
}

}  // namespace

std::string fixed_tolerance_exclusion(View3<const double> q, View3<const double> k, Tokens qt,
                                      Tokens kt, const Mask& mask, double scale, bool bf16) {
  return exclusion(q, k, nullptr, qt, kt, mask, scale, bf16).second;
}

std::string fixed_tolerance_exclusion(View3<const double> q, View3<const double> k,
                                      View3<const double> v, Tokens qt, Tokens kt, const Mask& mask,
                                      double scale, bool bf16) {
  return exclusion(q, k, &v, qt, kt, mask, scale, bf16).second;
}

bool fp32_fixed_tolerance_holds(View3<const double> q, View3<const double> k, View3<const double> v,
                                Tokens qt, Tokens kt, const Mask& mask, double scale) {
  return fixed_tolerance_exclusion(q, k, v, qt, kt, mask, scale, false).empty();
}

bool bf16_fixed_tolerances_hold(View3<const double> q, View3<const double> k, View3<const double> v,
                                Tokens qt, Tokens kt, const Mask& mask, double scale) {
  return fixed_tolerance_exclusion(q, k, v, qt, kt, mask, scale, true).empty();
}

Fp32Bounds fp32_error_bounds(View3<const double> q, View3<const double> k, View3<const double> v,
                             View3<const double> dout, Tokens qt, Tokens kt, const Mask& mask,
                             double scale, bool loom_kernels, bool key_grads) {
  const bool backward = check_bounds_args(q, k, v, dout, qt, kt, mask, scale);
  const Fp32Errors e = fp32_errors(q, k, v, dout, qt, kt, mask, scale, loom_kernels, key_grads);
  const double c = kFirstOrderSlack;
  Fp32Bounds b;
  b.out = rel(c * e.out, e.out_ref) + kFp32RelTol;
  b.lse = rel(c * e.lse, e.lse_ref) + kFp32RelTol;
  if (!backward) return b;
  b.dq = rel(c * e.dq, e.dq_ref) + kFp32RelTol;
  if (!key_grads) return b;
  b.dk = rel(c * e.dk, e.dk_ref) + kFp32RelTol;
  b.dv = rel(c * e.dv, e.dv_ref) + kFp32RelTol;
  return b;
}

Bf16Bounds bf16_error_bounds(View3<const double> q, View3<const double> k, View3<const double> v,
                             View3<const double> dout, Tokens qt, Tokens kt, const Mask& mask,
                             double scale, bool dots, bool loom_kernels, bool key_grads) {
  const bool backward = check_bounds_args(q, k, v, dout, qt, kt, mask, scale);
  // The fp32 arithmetic's bounds, added to the bf16 roundings' below by the triangle inequality:
  // kFp32RelTol within fp32's regime (scores and spread weights), fp32_error_bounds (the terms
  // that grow with the scores or with concentrated rows) outside. First, so that its [Sk, Hkv, D]
  // accumulators are freed before this function's own are allocated.
  const bool fp32_fixed =
      exclusion(q, k, &v, qt, kt, mask, scale, false, -1, backward ? &dout : nullptr).first ==
      RegimeMiss::kNone;
  const Fp32Bounds f =
      fp32_fixed ? Fp32Bounds{kFp32RelTol, kFp32RelTol, kFp32RelTol, kFp32RelTol, kFp32RelTol}
                 : fp32_error_bounds(q, k, v, dout, qt, kt, mask, scale, loom_kernels, key_grads);
  const double u = kBf16Unit;
  const int64_t D = q.d;
  // The reference quantities, row by row: out_i = sum_j p_ij v_j, a_i = sum_j p_ij |v_j|
  // (W |v|), pk_i = sum_j p_ij k_j (W k); the gradients, as reference_backward computes them.
  std::vector<double> p(static_cast<size_t>(k.s)), dp(p.size());
  std::vector<int64_t> wkeys;  // the keys with weight of a row
  std::vector<double> out(static_cast<size_t>(D)), a(static_cast<size_t>(D)),
      pk(static_cast<size_t>(D)), dq(static_cast<size_t>(D)), dq_round(static_cast<size_t>(D));
  const size_t kv_size = static_cast<size_t>(k.s * k.h * D);
  const bool keys = backward && key_grads;
  std::vector<double> dk(keys ? kv_size : 0), dv(dk.size()), dk_round(dk.size()),
      dv_round(dk.size()), dk_delta(keys ? static_cast<size_t>(k.s * k.h) : 0);
  double out_n2 = 0, a_n2 = 0, dq_n2 = 0, dq_delta2 = 0, dq_round2 = 0;
  KvHead kv(k, v);
  for (int64_t h = 0; h < q.h; ++h) {
    const int64_t g = h / (q.h / k.h);
    kv.select(g);
    for (int64_t i = 0; i < q.s; ++i) {
      double lse = 0;
      if (!row_probabilities(q, kv.kh, qt, kt, mask, scale, i, h, p, lse)) continue;
      std::fill(out.begin(), out.end(), 0.0);
      std::fill(a.begin(), a.end(), 0.0);
      std::fill(pk.begin(), pk.end(), 0.0);
      for (int64_t j = 0; j < k.s; ++j) {
        if (p[j] == 0.0) continue;
        for (int64_t e = 0; e < D; ++e) {
          out[e] += p[j] * kv.vh(j, g, e);
          a[e] += p[j] * std::fabs(kv.vh(j, g, e));
          pk[e] += p[j] * kv.kh(j, g, e);
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
      double c = 0, qn = 0, pk2 = 0;
      for (int64_t e = 0; e < D; ++e) {
        c += std::fabs(doi[e]) * (std::fabs(out[e]) + a[e]);
        qn += q(i, h, e) * q(i, h, e);
        pk2 += pk[e] * pk[e];
      }
      qn = std::sqrt(qn);
      dq_delta2 += c * c * pk2;  // dq_i moves by scale * delta error * (W k)_i
      std::fill(dq.begin(), dq.end(), 0.0);
      std::fill(dq_round.begin(), dq_round.end(), 0.0);
      // dp_j - delta as reference_backward forms it (relative to the top key, no cancellation)
      const int64_t top = weighted_keys(p, wkeys);
      const double shift = dp_and_shift(doi, kv.vh, g, p, wkeys, top, dp);
      for (int64_t j : wkeys) {
        const double ds = p[j] * ((dp[j] - dp[top]) - shift);
        for (int64_t e = 0; e < D; ++e) {
          dq[e] += scale * ds * kv.kh(j, g, e);
          // The bf16-dot path rounds p (for dv) and ds (for dk, dq) to bf16 too.
          if (dots) dq_round[e] += std::fabs(scale * ds) * std::fabs(kv.kh(j, g, e));
        }
        if (!keys) continue;
        const size_t jg = static_cast<size_t>(j * k.h + g);
        dk_delta[jg] += p[j] * c * qn;  // dk_j moves by scale sum_i p_ij (delta error) q_i
        for (int64_t e = 0; e < D; ++e) {
          const size_t x = jg * static_cast<size_t>(D) + static_cast<size_t>(e);
          dv[x] += p[j] * doi[e];
          dk[x] += scale * ds * q(i, h, e);
          if (!dots) continue;
          dv_round[x] += p[j] * std::fabs(doi[e]);
          dk_round[x] += std::fabs(scale * ds) * std::fabs(q(i, h, e));
        }
      }
      for (int64_t e = 0; e < D; ++e) {
        dq_n2 += dq[e] * dq[e];
        dq_round2 += dq_round[e] * dq_round[e];
      }
    }
  }
  // The bf16 roundings' bounds plus the fp32 arithmetic's (f).
  const double slack = kFirstOrderSlack;
  Bf16Bounds b;
  b.out = rel(slack * u * (std::sqrt(out_n2) + std::sqrt(a_n2)), std::sqrt(out_n2)) + f.out;
  b.out_fp32 = dots ? rel(slack * u * std::sqrt(a_n2), std::sqrt(out_n2)) + f.out : f.out;
  b.lse = f.lse;
  if (!backward) return b;
  b.dq = rel(slack * u * (std::fabs(scale) * std::sqrt(dq_delta2) + std::sqrt(dq_round2)),
             std::sqrt(dq_n2)) +
         f.dq;
  if (!keys) return b;
  b.dk = rel(slack * u * (std::fabs(scale) * l2_norm(dk_delta) + l2_norm(dk_round)), l2_norm(dk)) +
         f.dk;
  b.dv = rel(slack * u * l2_norm(dv_round), l2_norm(dv)) + f.dv;
  return b;
}

CheckLimits check_limits(View3<const double> q, View3<const double> k, View3<const double> v,
                         View3<const double> dout, Tokens qt, Tokens kt, const Mask& mask,
                         double scale, const CheckedResults& results, double score_bound) {
  check_bounds_args(q, k, v, dout, qt, kt, mask, scale);
  CheckLimits l;
  std::tie(l.miss, l.why) = exclusion(q, k, &v, qt, kt, mask, scale, results.bf16, score_bound,
                                      dout.data != nullptr ? &dout : nullptr);
  if (l.miss == RegimeMiss::kNone && results.bf16) {
    l.out = kBf16OutRelTol;
    l.lse = kFp32RelTol;
    l.dq = l.dk = kBf16GradRelTol;
    l.dv = results.bf16_dots ? kBf16GradRelTol : kFp32RelTol;
  } else if (l.miss == RegimeMiss::kNone) {
    l.out = l.lse = l.dq = l.dk = l.dv = kFp32RelTol;
  } else {
    const auto take = [&l](const auto& b) {  // Bf16Bounds or Fp32Bounds
      l.out = b.out;
      l.lse = b.lse;
      l.dq = b.dq;
      l.dk = b.dk;
      l.dv = b.dv;
    };
    if (results.bf16)
      take(bf16_error_bounds(q, k, v, dout, qt, kt, mask, scale, results.bf16_dots,
                             results.loom_kernels, results.key_grads));
    else
      take(fp32_error_bounds(q, k, v, dout, qt, kt, mask, scale, results.loom_kernels,
                             results.key_grads));
  }
  return l;
}

std::string check_limits_hint(RegimeMiss miss) {
  switch (miss) {
    case RegimeMiss::kCommonKey:
      return "the keys share a component: subtracting the keys' mean from every key leaves out, "
             "dq, dk and dv as they are (lse shifts), and that problem's check can tell";
    case RegimeMiss::kCommonValue:
      return "the values share a component: subtracting the values' mean from every value leaves "
             "dq, dk and dv as they are (out shifts by it), and that problem's check can tell";
    case RegimeMiss::kOutCancels:
      return "out nearly cancels: adding one small vector to every value (about their norm over "
             "the square root of the keys a row sees) moves out by it and leaves dq, dk and dv "
             "as they are, and that problem's check can tell";
    case RegimeMiss::kNone:
      return "";
    case RegimeMiss::kScores:
    case RegimeMiss::kHeadDim:
    case RegimeMiss::kEffectiveKeys:
      break;
  }
  return "lower the scale or the inputs' magnitude to check it";
}

}  // namespace loom
