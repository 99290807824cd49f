// verify(): compare a candidate's tensors with the fp64 reference and localise what is wrong.
//
// Check. The reference (loom's fp64 reference kernels) runs on the check rows: every query row
// up to options.full_check_max tokens, else 256 evenly spaced ones. Each present tensor is
// compared by normwise relative error against its written tolerance (tolerance()).
//
// Localisation. On the localisation rows (the check rows, at most kLocRows of them) the fp64
// partial attention of every (query chunk a, KV chunk b) pair is computed: O_ib, lse_ib, so that
//     out_i = sum_b w_ib O_ib,  w_ib = exp(lse_ib - lse_i),  lse_i = log sum_b exp(lse_ib),
// and, with a gradient, the pair's share dq_ib of dq_i (dq_i = sum_b dq_ib exactly, because the
// backward uses the final lse). Two things are then built from these pairs:
//  * a heat map: the candidate's error E_i is fitted, per query chunk and head, by least squares
//    to the pair directions (forward: the first-order effect of scaling pair b's weight,
//    w_ib (O_ib - out_i); dq: dq_ib); each pair's share of the explained energy is its cell;
//  * defect models: each known defect predicts the candidate exactly from the pairs (a dropped
//    or doubled ring step changes the multiplicity of one KV block in the merge, a mask offset
//    swaps which pairs are full, causal or empty, a sum without the log-sum-exp merge adds the
//    blocks' normalised outputs, bf16 rounding between steps is simulated step by step, a wrong
//    scale is found by a one-dimensional search). The model with the smallest residual
//    ||candidate - model|| / ||candidate - reference|| is the diagnosis when it explains most of
//    the error.
#include <algorithm>
#include <cmath>
#include <functional>
#include <iomanip>
#include <limits>
#include <numeric>
#include <optional>
#include <sstream>
#include <utility>

#include "loom/bf16.h"
#include "loom/tolerance.h"
#include "loom/verify.h"

namespace loom::verify {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();
// Localisation's work, in row-element visits (about 1e10 a second here): the forward models
// visit 2 P (P + 1) times the rows, heads, chunks and head dims, the heat map 4 nc^2 times the
// rows, heads and head dims (the forward stale-KV and one-token mask models add about a fifth to
// the whole at 64 ranks, inside the estimate's slack: counted, the rows were thinned further and
// the 64-rank report lost cells). Past this the rows are thinned (to at least kMinLocRows), then
// localisation is skipped and said so: 2048 ranks ran for minutes, 128 for 94 s.
constexpr double kLocWork = 3e10;
constexpr int64_t kMinLocRows = 16;
// A defect model is named when it leaves at most this share of the error's norm unexplained.
constexpr double kNameResidual = 0.5;

bool finite(double x) {
  return std::isfinite(x);
}

double lse_add(double a, double b) {
  if (a == kNegInf) return b;
  if (b == kNegInf) return a;
  const double m = std::max(a, b);
  return m + std::log1p(std::exp(-std::fabs(a - b)));
}

double round_bf16(double x) {
  return static_cast<double>(to_float(to_bf16(static_cast<float>(x))));
}

std::string join(const std::vector<int>& v, const std::string& sep = ", ") {
  std::ostringstream os;
  for (size_t i = 0; i < v.size(); ++i) os << (i ? sep : "") << v[i];
  return os.str();
}

std::string chunk_list(const std::vector<int>& v) {
  if (v.size() == 1) return "KV chunk " + std::to_string(v[0]);
  std::string s = "KV chunks ";
  for (size_t i = 0; i < v.size(); ++i)
    s += (i == 0 ? "" : (i + 1 == v.size() ? " and " : ", ")) + std::to_string(v[i]);
  return s;
}

// Everything the check and the models share.
struct Ctx {
  const Problem& p;
  const Options& o;
  Sharding sh;
  int64_t S, H, Hkv, D, group;
  double scale;
  std::vector<int64_t> pos;
  std::vector<int32_t> doc;
  std::vector<int> chunk_of;  // token -> chunk
  int nc = 0;                 // chunks
  std::vector<int64_t> rows;  // check rows (ascending global tokens)
  bool sampled = false;
  std::vector<int64_t> lrows;   // localisation rows (subset of rows)
  std::vector<int> lrow_chunk;  // chunk of each localisation row
  // Outside the fixed tolerances' regime: the problem's own bounds (loom/tolerance.h
  // check_limits, of any implementation; for bf16 those of the bf16-dot path, which cover the
  // widening paths too).
  std::optional<CheckLimits> bounds;

  Ctx(const Problem& p_, const Options& o_) : p(p_), o(o_) {}
  // For a reference run (run_reference) of problem p_ on rows rows_: c's sharding, sizes and
  // tokens; no chunks or localisation rows.
  Ctx(const Problem& p_, const Ctx& c, std::vector<int64_t> rows_)
      : p(p_),
        o(c.o),
        sh(c.sh),
        S(c.S),
        H(c.H),
        Hkv(c.Hkv),
        D(c.D),
        group(c.group),
        scale(c.scale),
        pos(c.pos),
        doc(c.doc),
        rows(std::move(rows_)) {}

  Tokens all_tokens() const { return Tokens{pos.data(), doc.empty() ? nullptr : doc.data(), S}; }
  // The tolerance of a tensor: tolerance(), or the per-problem bound; a gradient may be stored
  // in bf16, which adds u to the bound (as it does to the fixed 2u).
  double tol(const std::string& name) const {
    if (!bounds) return tolerance(name, o.dtype);
    if (name == "lse") return std::max(bounds->lse, kFp32RelTol);
    if (name == "out") return bounds->out;
    const double grad = name == "dq" ? bounds->dq : name == "dk" ? bounds->dk : bounds->dv;
    return grad + (o.dtype == "bf16" ? kBf16Unit : 0.0);
  }
  bool vis(int64_t i, int64_t j) const {
    return visible(p.mask, i, doc.empty() ? 0 : doc[i], j, doc.empty() ? 0 : doc[j]);
  }
  // Steps of the ring: the step at which query chunk a's rank holds KV chunk b's block.
  int step_of(int a, int b) const {
    const int P = sh.ranks;
    return ((sh.chunk_rank[a] - sh.chunk_rank[b]) % P + P) % P;
  }
};

// Reference out, lse (and dq, dk, dv) on the check rows.
struct Reference {
  Tensor<double> out;     // [rows, H, D]
  Tensor<double> lse;     // [H, rows]
  Tensor<double> dq;      // [rows, H, D]
  Tensor<double> dk, dv;  // [S, Hkv, D], only when every row is checked
};

const Tensor<double>& reference_of(const Reference& ref, const std::string& name) {
  return name == "out"   ? ref.out
         : name == "lse" ? ref.lse
         : name == "dq"  ? ref.dq
         : name == "dk"  ? ref.dk
                         : ref.dv;
}

// Positions and documents of the check rows, as Tokens.
struct RowTokens {
  std::vector<int64_t> pos;
  std::vector<int32_t> doc;
  explicit RowTokens(const Ctx& c) : pos(c.rows.begin(), c.rows.end()) {
    if (!c.doc.empty())
      for (int64_t r : c.rows) doc.push_back(c.doc[r]);
  }
  Tokens tokens() const {
    return Tokens{pos.data(), doc.empty() ? nullptr : doc.data(), static_cast<int64_t>(pos.size())};
  }
};

// Whether the check rows of c are every row (ascending and distinct, so then 0, 1, ..., S - 1).
bool every_row(const Ctx& c) {
  return static_cast<int64_t>(c.rows.size()) == c.S;
}

// Rows c.rows of x ([S, A, B]): x itself where they are every row, else a copy gathered into
// `rows` (a gathered copy of every row was a whole tensor more, for nothing).
View3<const double> check_rows(const Ctx& c, const Tensor<double>& x, Tensor<double>& rows) {
  if (every_row(c)) return x.view3();
  rows = gather_rows(x, c.rows);
  return rows.view3();
}

// The reference on the check rows; subnormal: subnormal_reference's values instead (loom/
// attention.h: float32's roundings below its normal range; lse not filled). q_rows: q's check
// rows already given (gqa_model's permuted heads), else read from the problem. dk and dv are
// computed only where every row is checked: on sampled rows they are not compared, and their
// [S, Hkv, D] buffers were allocated and thrown away.
Reference run_reference(const Ctx& c, double scale, bool backward, bool subnormal = false,
                        const Tensor<double>* q_rows = nullptr) {
  Reference ref;
  const int64_t n = static_cast<int64_t>(c.rows.size());
  Tensor<double> q_copy, dout_copy;
  const View3<const double> q = q_rows ? q_rows->view3() : check_rows(c, c.p.q, q_copy);
  const RowTokens rt(c);
  const Tokens qt = rt.tokens();
  ref.out = Tensor<double>({n, c.H, c.D});
  ref.lse = Tensor<double>({c.H, n});
  View3<const double> dout;
  const bool keys = backward && !c.sampled;
  if (backward) {
    dout = check_rows(c, c.p.dout, dout_copy);
    ref.dq = Tensor<double>({n, c.H, c.D});
  }
  if (keys) {
    ref.dk = Tensor<double>({c.S, c.Hkv, c.D});
    ref.dv = Tensor<double>({c.S, c.Hkv, c.D});
  }
  const View3<double> dk = keys ? ref.dk.view3() : View3<double>{},
                      dv = keys ? ref.dv.view3() : View3<double>{};
  if (subnormal) {  // dout empty without gradients: out only
    subnormal_reference(q, c.p.k.view3(), c.p.v.view3(), dout, qt, c.all_tokens(), c.p.mask, scale,
                        ref.out.view3(), backward ? ref.dq.view3() : View3<double>{}, dk, dv);
  } else {
    reference_forward(q, c.p.k.view3(), c.p.v.view3(), qt, c.all_tokens(), c.p.mask, scale,
                      ref.out.view3(), ref.lse.data());
    if (backward)
      reference_backward(q, c.p.k.view3(), c.p.v.view3(), dout, qt, c.all_tokens(), c.p.mask, scale,
                         ref.dq.view3(), dk, dv);
  }
  return ref;
}

// ---------------------------------------------------------------------------------------------
// Comparison of one tensor.

struct Cmp {
  double err2 = 0, ref2 = 0, max_abs = 0;
  int64_t non_finite = 0, inf_mismatch = 0;
  void add(double x, double r) {
    const bool r_inf = std::isinf(r) && r < 0;
    if (!finite(x)) {
      if (r_inf && std::isinf(x) && x < 0) return;  // both -inf (lse of an empty row)
      if (std::isinf(x) && x < 0) {
        ++inf_mismatch;
      } else {
        ++non_finite;
      }
      return;
    }
    if (r_inf) {
      ++inf_mismatch;
      return;
    }
    const double e = x - r;
    err2 += e * e;
    ref2 += r * r;
    max_abs = std::max(max_abs, std::fabs(e));
  }
  double rel() const {
    if (non_finite || inf_mismatch) return std::numeric_limits<double>::infinity();
    return ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  }
};

// One tensor's comparison, whole and per rank, chunk and head of the compared elements.
struct Breakdown {
  const Ctx& c;
  Cmp all;
  std::vector<Cmp> per_rank, per_chunk, per_head;
  std::vector<int> rank_of;  // global token -> its rank

  Breakdown(const Ctx& ctx, int64_t heads)
      : c(ctx), per_rank(ctx.sh.ranks), per_chunk(ctx.nc), per_head(heads), rank_of(ctx.S, 0) {
    for (int r = 0; r < c.sh.ranks; ++r)
      for (int64_t tok : c.sh.tokens[r]) rank_of[tok] = r;
  }
  // Candidate x against reference r, of global token g and head h.
  void add(int64_t g, int64_t h, double x, double r) {
    all.add(x, r);
    per_rank[rank_of[g]].add(x, r);
    per_chunk[c.chunk_of[g]].add(x, r);
    per_head[h].add(x, r);
  }
  TensorCheck result(const std::string& name, bool sampled) const {
    TensorCheck t;
    t.name = name;
    t.present = t.compared = true;
    t.tolerance = c.tol(name);
    t.sampled = sampled;
    t.rel_err = all.rel();
    t.max_abs_err = all.max_abs;
    t.non_finite = all.non_finite;
    t.inf_mismatch = all.inf_mismatch;
    t.passed = t.rel_err <= t.tolerance;
    for (auto& x : per_rank) t.per_rank.push_back(x.rel());
    for (auto& x : per_chunk) t.per_chunk.push_back(x.rel());
    for (auto& x : per_head) t.per_head.push_back(x.rel());
    return t;
  }
};

// Row-major [rows, H, D] comparison of candidate rows (global tensor) against reference rows.
TensorCheck compare_rows(const Ctx& c, const std::string& name, const Tensor<double>& cand,
                         const Tensor<double>& ref, const std::vector<int64_t>& rows,
                         bool kv_rows) {
  const int64_t A = cand.size(1), B = cand.size(2);
  Breakdown b(c, A);
  for (size_t ri = 0; ri < rows.size(); ++ri) {
    const int64_t g = rows[ri];
    for (int64_t h = 0; h < A; ++h)
      for (int64_t d = 0; d < B; ++d)
        b.add(g, h, cand[(g * A + h) * B + d],
              ref[(static_cast<int64_t>(kv_rows ? g : ri) * A + h) * B + d]);
  }
  return b.result(name, c.sampled && !kv_rows);
}

TensorCheck compare_lse(const Ctx& c, const Tensor<double>& cand, const Tensor<double>& ref) {
  Breakdown b(c, c.H);
  const int64_t n = static_cast<int64_t>(c.rows.size());
  for (int64_t h = 0; h < c.H; ++h)
    for (int64_t ri = 0; ri < n; ++ri) {
      const int64_t g = c.rows[ri];
      b.add(g, h, cand[h * c.S + g], ref[h * n + ri]);
    }
  return b.result("lse", c.sampled);
}

// Above full_check_max only the sampled rows are compared: the candidate's other elements are
// still scanned for NaN and Inf (inputs and scores are finite, so the exact values are), which
// passed unseen (a NaN in an unsampled row of out, a dk of NaN). lse_layout: [H, S], else
// [S, A, B]. `all_rows`: scan every row (dk and dv, of which no row is compared).
int64_t non_finite_unsampled(const Ctx& c, const Tensor<double>& t, bool lse_layout,
                             bool all_rows) {
  if (!c.sampled) return 0;
  std::vector<char> skip(static_cast<size_t>(c.S), 0);
  if (!all_rows)
    for (int64_t g : c.rows) skip[static_cast<size_t>(g)] = 1;
  int64_t n = 0;
  if (lse_layout) {
    for (int64_t h = 0; h < t.size(0); ++h)
      for (int64_t g = 0; g < c.S; ++g) n += !skip[g] && !std::isfinite(t[h * c.S + g]);
  } else {
    const int64_t row = t.size(1) * t.size(2);
    for (int64_t g = 0; g < c.S; ++g)
      if (!skip[g])
        for (int64_t i = 0; i < row; ++i) n += !std::isfinite(t[g * row + i]);
  }
  return n;
}

// A compared tensor's count of non-finite elements outside the compared rows: it fails.
void add_unsampled(TensorCheck& t, int64_t n) {
  if (n == 0) return;
  t.non_finite += n;
  t.rel_err = std::numeric_limits<double>::infinity();
  t.passed = false;
}

// ---------------------------------------------------------------------------------------------
// Pair partials on the localisation rows.

struct Pairs {
  int64_t n = 0;  // localisation rows
  int nc = 0;
  int64_t H = 0, D = 0;
  // [b][ri][h][d] and [b][ri][h]: partial attention of row ri over KV chunk b (true mask).
  std::vector<double> o, lse;
  std::vector<double> out, out_lse;  // merged: [ri][h][d], [ri][h]
  // Mask-offset partials for b in {a-1, a, a+1} (slot 0..2): full (every key of b visible, as if
  // b were a past chunk) and tril (key local index <= query local index, as if b were the
  // diagonal chunk). Only when has_alt.
  bool has_alt = false;
  std::vector<double> full_o, full_lse, tril_o, tril_lse;  // [slot][ri][h][d], [slot][ri][h]
  // dq shares: [b][ri][h][d]; only when has_dq.
  bool has_dq = false;
  std::vector<double> dq;
  std::vector<double> dq_sum;  // [ri][h][d]
  size_t oi(int b, int64_t ri, int64_t h) const {
    return ((static_cast<size_t>(b) * n + ri) * H + h) * D;
  }
  size_t li(int b, int64_t ri, int64_t h) const {
    return (static_cast<size_t>(b) * n + ri) * H + h;
  }
};

// Partial over the keys `keys` visible to row i (through `vis`), head h: lse and normalised out.
template <class Vis>
void partial(const Ctx& c, double scale, int64_t i, int64_t h, const std::vector<int64_t>& keys,
             Vis vis, std::vector<double>& s, double* o, double& lse) {
  const int64_t g = h / c.group;
  const double* qi = c.p.q.data() + (i * c.H + h) * c.D;
  double m = kNegInf;
  s.resize(keys.size());
  for (size_t t = 0; t < keys.size(); ++t) {
    const int64_t j = keys[t];
    if (!vis(i, j, t)) {
      s[t] = kNegInf;
      continue;
    }
    const double* kj = c.p.k.data() + (j * c.Hkv + g) * c.D;
    double dot = 0;
    for (int64_t d = 0; d < c.D; ++d) dot += qi[d] * kj[d];
    s[t] = scale * dot;
    m = std::max(m, s[t]);
  }
  std::fill(o, o + c.D, 0.0);
  if (m == kNegInf) {
    lse = kNegInf;
    return;
  }
  double l = 0;
  for (size_t t = 0; t < keys.size(); ++t) {
    if (s[t] == kNegInf) continue;
    const double e = std::exp(s[t] - m);
    l += e;
    const double* vj = c.p.v.data() + (keys[t] * c.Hkv + g) * c.D;
    for (int64_t d = 0; d < c.D; ++d) o[d] += e * vj[d];
  }
  for (int64_t d = 0; d < c.D; ++d) o[d] /= l;
  lse = m + std::log(l);
}

Pairs compute_pairs(const Ctx& c, bool want_alt, bool want_dq) {
  Pairs pr;
  pr.n = static_cast<int64_t>(c.lrows.size());
  pr.nc = c.nc;
  pr.H = c.H;
  pr.D = c.D;
  pr.o.assign(static_cast<size_t>(c.nc) * pr.n * c.H * c.D, 0.0);
  pr.lse.assign(static_cast<size_t>(c.nc) * pr.n * c.H, kNegInf);
  pr.out.assign(static_cast<size_t>(pr.n) * c.H * c.D, 0.0);
  pr.out_lse.assign(static_cast<size_t>(pr.n) * c.H, kNegInf);
  pr.has_alt = want_alt;
  if (want_alt) {
    pr.full_o.assign(3 * static_cast<size_t>(pr.n) * c.H * c.D, 0.0);
    pr.tril_o = pr.full_o;
    pr.full_lse.assign(3 * static_cast<size_t>(pr.n) * c.H, kNegInf);
    pr.tril_lse = pr.full_lse;
  }
  pr.has_dq = want_dq;
  if (want_dq) {
    pr.dq.assign(pr.o.size(), 0.0);
    pr.dq_sum.assign(pr.out.size(), 0.0);
  }
  // Local index of each token inside its chunk (for the tril treatment).
  std::vector<int64_t> local(c.S, 0);
  for (int b = 0; b < c.nc; ++b)
    for (size_t t = 0; t < c.sh.chunks[b].size(); ++t) local[c.sh.chunks[b][t]] = t;

#pragma omp parallel for schedule(dynamic)
  for (int64_t ri = 0; ri < pr.n; ++ri) {
    std::vector<double> s;
    const int64_t i = c.lrows[ri];
    const int a = c.chunk_of[i];
    for (int64_t h = 0; h < c.H; ++h) {
      double L = kNegInf;
      for (int b = 0; b < c.nc; ++b) {
        double* o = pr.o.data() + pr.oi(b, ri, h);
        partial(
            c, c.scale, i, h, c.sh.chunks[b],
            [&](int64_t qi, int64_t kj, size_t) { return c.vis(qi, kj); }, s, o,
            pr.lse[pr.li(b, ri, h)]);
        L = lse_add(L, pr.lse[pr.li(b, ri, h)]);
      }
      pr.out_lse[ri * c.H + h] = L;
      double* out = pr.out.data() + (ri * c.H + h) * c.D;
      if (L != kNegInf)
        for (int b = 0; b < c.nc; ++b) {
          const double w = std::exp(pr.lse[pr.li(b, ri, h)] - L);
          if (w == 0) continue;
          const double* o = pr.o.data() + pr.oi(b, ri, h);
          for (int64_t d = 0; d < c.D; ++d) out[d] += w * o[d];
        }
      if (want_alt) {
        for (int slot = 0; slot < 3; ++slot) {
          const int b = a - 1 + slot;
          if (b < 0 || b >= c.nc) continue;
          const size_t li = (static_cast<size_t>(slot) * pr.n + ri) * c.H + h;
          partial(
              c, c.scale, i, h, c.sh.chunks[b], [&](int64_t, int64_t, size_t) { return true; }, s,
              pr.full_o.data() + li * c.D, pr.full_lse[li]);
          const int64_t qloc = local[i];
          partial(
              c, c.scale, i, h, c.sh.chunks[b],
              [&](int64_t, int64_t, size_t t) { return static_cast<int64_t>(t) <= qloc; }, s,
              pr.tril_o.data() + li * c.D, pr.tril_lse[li]);
        }
      }
      if (want_dq && L != kNegInf) {
        // dq_ib = scale sum_{j in b} p_ij (dout_i . v_j - delta_i) k_j with the final lse.
        const int64_t g = h / c.group;
        const double* qi = c.p.q.data() + (i * c.H + h) * c.D;
        const double* doi = c.p.dout.data() + (i * c.H + h) * c.D;
        double delta = 0;
        for (int64_t d = 0; d < c.D; ++d) delta += doi[d] * out[d];
        double* sum = pr.dq_sum.data() + (ri * c.H + h) * c.D;
        for (int b = 0; b < c.nc; ++b) {
          double* dqb = pr.dq.data() + pr.oi(b, ri, h);
          for (int64_t j : c.sh.chunks[b]) {
            if (!c.vis(i, j)) continue;
            const double* kj = c.p.k.data() + (j * c.Hkv + g) * c.D;
            const double* vj = c.p.v.data() + (j * c.Hkv + g) * c.D;
            double sc = 0, dp = 0;
            for (int64_t d = 0; d < c.D; ++d) {
              sc += qi[d] * kj[d];
              dp += doi[d] * vj[d];
            }
            const double pij = std::exp(c.scale * sc - L);
            const double ds = pij * (dp - delta);
            for (int64_t d = 0; d < c.D; ++d) dqb[d] += c.scale * ds * kj[d];
          }
          for (int64_t d = 0; d < c.D; ++d) sum[d] += dqb[d];
        }
      }
    }
  }
  return pr;
}

// ---------------------------------------------------------------------------------------------
// Defect models. A model predicts the candidate on the localisation rows; residual() compares.

// The candidate on the localisation rows: [ri][h][d] (non-finite values read as 0, the value of
// a row that sees nothing) and the per-chunk error energy against the reference.
struct Observed {
  std::vector<double> x;         // candidate
  std::vector<double> ref;       // reference (merged pairs, or dq_sum)
  std::vector<double> chunk_e2;  // ||x - ref||^2 per query chunk
  double e2 = 0;
};

Observed observe(const Ctx& c, const Tensor<double>& cand, const std::vector<double>& ref) {
  Observed ob;
  const int64_t n = static_cast<int64_t>(c.lrows.size()), w = c.H * c.D;
  ob.x.resize(static_cast<size_t>(n * w));
  ob.ref = ref;
  ob.chunk_e2.assign(c.nc, 0.0);
  for (int64_t ri = 0; ri < n; ++ri)
    for (int64_t e = 0; e < w; ++e) {
      double x = cand[c.lrows[ri] * w + e];
      if (!finite(x)) x = 0;
      ob.x[ri * w + e] = x;
      const double d = x - ref[ri * w + e];
      ob.chunk_e2[c.lrow_chunk[ri]] += d * d;
    }
  for (double e : ob.chunk_e2) ob.e2 += e;
  return ob;
}

// Residual of a model that changes only the rows of `touched` chunks; predict(ri, h, out) fills
// the model's D values of row ri, head h.
double residual(const Ctx& c, const Observed& ob, const std::vector<bool>& touched,
                const std::function<void(int64_t, int64_t, double*)>& predict) {
  double r2 = 0;
  for (int a = 0; a < c.nc; ++a)
    if (!touched[a]) r2 += ob.chunk_e2[a];
  std::vector<double> y(c.D);
  for (size_t ri = 0; ri < c.lrows.size(); ++ri) {
    if (!touched[c.lrow_chunk[ri]]) continue;
    for (int64_t h = 0; h < c.H; ++h) {
      predict(static_cast<int64_t>(ri), h, y.data());
      const double* x = ob.x.data() + (ri * c.H + h) * c.D;
      for (int64_t d = 0; d < c.D; ++d) r2 += (x[d] - y[d]) * (x[d] - y[d]);
    }
  }
  return ob.e2 > 0 ? std::sqrt(r2 / ob.e2) : 0.0;
}

// Forward model from KV-chunk multiplicities: m(a, b) in {0, 1, 2} with the true partials.
double multiplicity_residual(const Ctx& c, const Pairs& pr, const Observed& ob,
                             const std::function<int(int, int)>& mult,
                             const std::vector<bool>& touched) {
  return residual(c, ob, touched, [&](int64_t ri, int64_t h, double* y) {
    const int a = c.lrow_chunk[ri];
    double L = kNegInf;
    for (int b = 0; b < c.nc; ++b) {
      const int m = mult(a, b);
      if (m > 0) L = lse_add(L, pr.lse[pr.li(b, ri, h)] + std::log(static_cast<double>(m)));
    }
    std::fill(y, y + c.D, 0.0);
    if (L == kNegInf) return;
    for (int b = 0; b < c.nc; ++b) {
      const int m = mult(a, b);
      if (m == 0) continue;
      const double w = m * std::exp(pr.lse[pr.li(b, ri, h)] - L);
      const double* o = pr.o.data() + pr.oi(b, ri, h);
      for (int64_t d = 0; d < c.D; ++d) y[d] += w * o[d];
    }
  });
}

void consider(std::vector<Diagnosis>& all, Diagnosis d) {
  if (std::isfinite(d.residual)) all.push_back(std::move(d));
}

// Ranks' KV chunks.
std::vector<std::vector<int>> rank_chunks(const Ctx& c) {
  std::vector<std::vector<int>> rc(c.sh.ranks);
  for (int b = 0; b < c.nc; ++b) rc[c.sh.chunk_rank[b]].push_back(b);
  return rc;
}

void forward_models(const Ctx& c, const Pairs& pr, const Observed& ob,
                    std::vector<Diagnosis>& all) {
  const int P = c.sh.ranks;
  const auto rc = rank_chunks(c);
  std::vector<bool> every(c.nc, true);
  // Dropped and doubled ring steps: every rank, or one rank.
  if (P > 1) {
    // Residuals of the dropped (m = 0) and doubled (m = 2) step models, [m / 2][s][r + 1] (r = -1:
    // every rank), against which the stale-KV models are weighed below.
    std::vector<std::vector<std::vector<double>>> step_res(
        2, std::vector<std::vector<double>>(P, std::vector<double>(P + 1, 1.0)));
    for (int m : {0, 2}) {
      for (int s = 0; s < P; ++s) {
        Diagnosis d;
        d.kind = m == 0 ? "dropped_step" : "doubled_step";
        d.steps = {s};
        d.residual = multiplicity_residual(
            c, pr, ob, [&](int a, int b) { return c.step_of(a, b) == s ? m : 1; }, every);
        std::ostringstream os;
        os << "every rank " << (m == 0 ? "skipped" : "counted twice") << " ring step " << s
           << ": rank r's queries " << (m == 0 ? "lack" : "count twice")
           << " the contribution of the KV block of rank (r - " << s << ") mod " << P;
        d.text = os.str();
        step_res[m / 2][s][0] = d.residual;
        consider(all, d);
        for (int r = 0; r < P; ++r) {
          std::vector<bool> touched(c.nc, false);
          for (int a : rc[r]) touched[a] = true;
          Diagnosis e;
          e.kind = d.kind;
          e.steps = {s};
          e.ranks = {r};
          const int src = ((r - s) % P + P) % P;
          e.kv_chunks = rc[src];
          e.q_chunks = rc[r];
          e.residual = multiplicity_residual(
              c, pr, ob,
              [&](int a, int b) { return c.sh.chunk_rank[a] == r && c.step_of(a, b) == s ? m : 1; },
              touched);
          std::ostringstream es;
          es << "rank " << r << "'s queries " << (m == 0 ? "lack" : "count twice")
             << " the contribution of " << chunk_list(rc[src]) << " (ring step " << s
             << ", the KV block of rank " << src << ")";
          e.text = es.str();
          step_res[m / 2][s][r + 1] = e.residual;
          consider(all, e);
        }
      }
    }
    // Stale KV in the forward: at step s the block of step s - 1 is used again (the received
    // block was not), with its own positions for the mask: step s has weight 0 and step s - 1
    // weight 2 in the merge (a dropped step alone left half the error unexplained). Where its
    // rows see no other step, doubling step s - 1 changes nothing after normalisation (P = 2:
    // out is a dropped step s exactly; only lse differs), and where step s is masked out for
    // them it is a doubled step s - 1: it is named only when it explains clearly more (1 % of
    // the error's norm) than both.
    for (int s = 1; s < P; ++s) {
      for (int r = -1; r < P; ++r) {
        std::vector<bool> touched(c.nc, r < 0);
        if (r >= 0)
          for (int a : rc[r]) touched[a] = true;
        Diagnosis e;
        e.kind = "stale_kv_forward";
        e.steps = {s};
        if (r >= 0) {
          e.ranks = {r};
          e.q_chunks = rc[r];
          e.kv_chunks = rc[((r - s) % P + P) % P];
        }
        e.residual = multiplicity_residual(
            c, pr, ob,
            [&](int a, int b) {
              if (r >= 0 && c.sh.chunk_rank[a] != r) return 1;
              const int st = c.step_of(a, b);
              return st == s ? 0 : (st == s - 1 ? 2 : 1);
            },
            touched);
        std::ostringstream es;
        es << "stale KV in the forward: at ring step " << s << " "
           << (r < 0 ? "every rank" : "rank " + std::to_string(r))
           << " computed with the KV block of step " << s - 1
           << " again (the received block was not used), so out counts step " << s - 1
           << "'s keys twice and lacks step " << s << "'s";
        e.text = es.str();
        if (e.residual < std::min(step_res[0][s][r + 1], step_res[1][s - 1][r + 1]) - 0.01)
          consider(all, e);
      }
    }
  } else {
    // One rank, no ring: a missing or doubled KV chunk for one query chunk.
    for (int m : {0, 2})
      for (int a = 0; a < c.nc; ++a)
        for (int b = 0; b < c.nc; ++b) {
          std::vector<bool> touched(c.nc, false);
          touched[a] = true;
          Diagnosis e;
          e.kind = m == 0 ? "dropped_step" : "doubled_step";
          e.q_chunks = {a};
          e.kv_chunks = {b};
          e.residual = multiplicity_residual(
              c, pr, ob, [&](int qa, int kb) { return qa == a && kb == b ? m : 1; }, touched);
          e.text = "query chunk " + std::to_string(a) + (m == 0 ? " lacks" : " counts twice") +
                   " the contribution of KV chunk " + std::to_string(b);
          consider(all, e);
        }
  }

  // Sum of the blocks' normalised outputs, no log-sum-exp weighting (the first seed's loop:
  // `output += attn_output_chunk`). Blocks: each rank's KV shard, and (a variant) each chunk.
  for (int variant = 0; variant < 2; ++variant) {
    if (variant == 1 && (P == 1 || c.nc == P)) continue;  // blocks are chunks: the same model
    Diagnosis d;
    d.kind = "no_lse_merge";
    d.residual = residual(c, ob, every, [&](int64_t ri, int64_t h, double* y) {
      std::fill(y, y + c.D, 0.0);
      auto add_block = [&](const std::vector<int>& chunks) {
        double L = kNegInf;
        for (int b : chunks) L = lse_add(L, pr.lse[pr.li(b, ri, h)]);
        if (L == kNegInf) return;
        for (int b : chunks) {
          const double w = std::exp(pr.lse[pr.li(b, ri, h)] - L);
          const double* o = pr.o.data() + pr.oi(b, ri, h);
          for (int64_t d2 = 0; d2 < c.D; ++d2) y[d2] += w * o[d2];
        }
      };
      if (variant == 0 && P > 1) {
        for (int r = 0; r < P; ++r) add_block(rc[r]);
      } else {
        for (int b = 0; b < c.nc; ++b) add_block({b});
      }
    });
    d.text = std::string("missing log-sum-exp merge: the partial outputs of the ") +
             (variant == 0 && P > 1 ? "ring steps" : "KV chunks") +
             " were added (out += partial) instead of weighted by exp(lse_step - lse)";
    consider(all, d);
  }

  // Mask offset by one chunk (causal, no window, chunks in position order).
  if (pr.has_alt) {
    for (int delta : {-1, +1}) {
      Diagnosis d;
      d.kind = "mask_offset";
      d.residual = residual(c, ob, every, [&](int64_t ri, int64_t h, double* y) {
        const int a = c.lrow_chunk[ri];
        // Pair treatment by rule(a, b + delta): b' < a full, b' == a causal, b' > a none.
        struct Part {
          const double* o;
          double lse;
        };
        std::vector<Part> parts;
        for (int b = 0; b < c.nc; ++b) {
          const int bp = b + delta;
          if (bp > a) continue;
          const int slot = b - a + 1;
          if (slot >= 0 && slot <= 2) {
            const size_t li = (static_cast<size_t>(slot) * pr.n + ri) * c.H + h;
            if (bp < a)
              parts.push_back({pr.full_o.data() + li * c.D, pr.full_lse[li]});
            else
              parts.push_back({pr.tril_o.data() + li * c.D, pr.tril_lse[li]});
          } else {
            parts.push_back({pr.o.data() + pr.oi(b, ri, h), pr.lse[pr.li(b, ri, h)]});
          }
        }
        double L = kNegInf;
        for (auto& q : parts) L = lse_add(L, q.lse);
        std::fill(y, y + c.D, 0.0);
        if (L == kNegInf) return;
        for (auto& q : parts) {
          const double w = std::exp(q.lse - L);
          for (int64_t d2 = 0; d2 < c.D; ++d2) y[d2] += w * q.o[d2];
        }
      });
      d.value = delta;
      d.text = delta < 0 ? "the diagonal blocks are masked with the wrong offset: each query "
                           "chunk sees its own KV chunk in full and the next chunk causally "
                           "(mask shifted one chunk into the future)"
                         : "the diagonal blocks are masked with the wrong offset: each query "
                           "chunk sees the previous KV chunk causally and its own not at all "
                           "(mask shifted one chunk into the past)";
      consider(all, d);
    }
  }

  // The causal mask wrong by one token, or not applied, where it is applied: on the diagonal step
  // (each rank's own KV block, ring step 0), on the other ranks' blocks, or everywhere. These fit
  // any convention, documents and windows (the chunk-offset models above need none), and name
  // what a heat map cannot point at: keys that a wrong mask lets a query see in a pair the true
  // mask hides entirely, which no pair direction covers (an off-by-one between blocks was "no
  // known defect", a diagonal block without its mask half-right "mask shifted one chunk").
  if (c.p.mask.causal) {
    Mask acausal = c.p.mask;  // the mask but for causality: documents and the window
    acausal.causal = false;
    auto doc_of = [&](int64_t t) { return c.doc.empty() ? 0 : c.doc[t]; };
    auto rank_of = [&](int64_t t) { return c.sh.chunk_rank[c.chunk_of[t]]; };
    std::vector<double> sbuf, own_o(c.D);
    // Own block treated otherwise (0: without the causal mask; 1: strictly, key j < i), merged
    // with the true pairs of the other ranks' chunks.
    for (int variant = 0; variant < 2; ++variant) {
      Diagnosis d;
      d.kind = variant == 0 ? "diagonal_unmasked" : "mask_off_by_one";
      d.value = variant == 0 ? 0 : -1;
      d.residual = residual(c, ob, every, [&](int64_t ri, int64_t h, double* y) {
        const int64_t i = c.lrows[ri];
        const int r = rank_of(i);
        double l = kNegInf;
        partial(
            c, c.scale, i, h, c.sh.tokens[r],
            [&](int64_t qi, int64_t kj, size_t) {
              return variant == 0 ? visible(acausal, qi, doc_of(qi), kj, doc_of(kj))
                                  : kj != qi && c.vis(qi, kj);
            },
            sbuf, own_o.data(), l);
        double L = l;
        for (int b = 0; b < c.nc; ++b)
          if (c.sh.chunk_rank[b] != r) L = lse_add(L, pr.lse[pr.li(b, ri, h)]);
        std::fill(y, y + c.D, 0.0);
        if (L == kNegInf) return;
        if (l != kNegInf)
          for (int64_t k = 0; k < c.D; ++k) y[k] += std::exp(l - L) * own_o[k];
        for (int b = 0; b < c.nc; ++b) {
          if (c.sh.chunk_rank[b] == r || pr.lse[pr.li(b, ri, h)] == kNegInf) continue;
          const double w = std::exp(pr.lse[pr.li(b, ri, h)] - L);
          const double* o = pr.o.data() + pr.oi(b, ri, h);
          for (int64_t k = 0; k < c.D; ++k) y[k] += w * o[k];
        }
      });
      if (variant == 0)
        d.text = P > 1 ? "the diagonal step is attended without the causal mask: at ring step 0 "
                         "(each rank's own KV block) every query also sees the later keys of its "
                         "rank's block"
                       : "the causal mask is not applied: every query also sees the later keys";
      else
        d.text =
            "the causal mask is strict (key j < i instead of j <= i): every query misses its "
            "own key";
      consider(all, d);
    }
    // Key i + 1 visible to query i (j <= i + 1): on every block, on the other ranks' blocks only
    // (a block offset one token off), or on the rank's own block only.
    for (int where = 0; where < 3; ++where) {
      if (where > 0 && P == 1) continue;
      Diagnosis d;
      d.kind = "mask_off_by_one";
      d.value = 1;
      d.residual = residual(c, ob, every, [&](int64_t ri, int64_t h, double* y) {
        const int64_t i = c.lrows[ri], j = i + 1;
        const double* out = pr.out.data() + (ri * c.H + h) * c.D;
        const double L = pr.out_lse[ri * c.H + h];
        std::copy(out, out + c.D, y);
        if (j >= c.S || !visible(acausal, i, doc_of(i), j, doc_of(j))) return;
        const bool own = rank_of(j) == rank_of(i);
        if ((where == 1 && own) || (where == 2 && !own)) return;
        const int64_t g = h / c.group;
        const double* qi = c.p.q.data() + (i * c.H + h) * c.D;
        const double* kj = c.p.k.data() + (j * c.Hkv + g) * c.D;
        const double* vj = c.p.v.data() + (j * c.Hkv + g) * c.D;
        double dot = 0;
        for (int64_t k = 0; k < c.D; ++k) dot += qi[k] * kj[k];
        const double sj = c.scale * dot, Ln = lse_add(L, sj);
        const double wa = L == kNegInf ? 0.0 : std::exp(L - Ln), wb = std::exp(sj - Ln);
        for (int64_t k = 0; k < c.D; ++k) y[k] = wa * out[k] + wb * vj[k];
      });
      const std::string steps = "ring steps 1 to " + std::to_string(P - 1);
      d.text = where == 0 ? "the causal mask is one token off (key j <= i + 1 instead of j <= i): "
                            "every query also sees the next key"
               : where == 1
                   ? "the causal mask is one token off on the other ranks' blocks (" + steps +
                         "; key j <= i + 1 there, as from a block offset one token off): a query "
                         "whose next key is on another rank sees it"
                   : "the causal mask is one token off on the diagonal step (ring step 0, each "
                     "rank's own KV block; key j <= i + 1 there): every query also sees the next "
                     "key where it is on its own rank";
      consider(all, d);
    }
  }

  // bf16 rounding of the running output between ring steps (merge in ring order on each rank;
  // variant 1 also rounds each step's partial output, as a bf16 flash-attention call returns it).
  if (P > 1) {
    for (int variant = 0; variant < 2; ++variant) {
      Diagnosis d;
      d.kind = "bf16_between_steps";
      // The model's relative error of the running output after each step (how it grows).
      std::vector<double> step_e2(P, 0.0), step_r2(P, 0.0);
      d.residual = residual(c, ob, every, [&](int64_t ri, int64_t h, double* y) {
        const int a = c.lrow_chunk[ri];
        const int r = c.sh.chunk_rank[a];
        double L = kNegInf, Lx = kNegInf;
        std::fill(y, y + c.D, 0.0);
        std::vector<double> ob_(c.D), exact(c.D, 0.0);
        for (int s = 0; s < P; ++s) {
          const int src = ((r - s) % P + P) % P;
          double Lb = kNegInf;
          for (int b : rc[src]) Lb = lse_add(Lb, pr.lse[pr.li(b, ri, h)]);
          if (Lb != kNegInf) {
            std::fill(ob_.begin(), ob_.end(), 0.0);
            for (int b : rc[src]) {
              const double w = std::exp(pr.lse[pr.li(b, ri, h)] - Lb);
              const double* o = pr.o.data() + pr.oi(b, ri, h);
              for (int64_t d2 = 0; d2 < c.D; ++d2) ob_[d2] += w * o[d2];
            }
            const double Lxn = lse_add(Lx, Lb);
            const double xa = Lx == kNegInf ? 0.0 : std::exp(Lx - Lxn), xb = std::exp(Lb - Lxn);
            for (int64_t d2 = 0; d2 < c.D; ++d2) exact[d2] = xa * exact[d2] + xb * ob_[d2];
            Lx = Lxn;
            if (variant == 1)
              for (auto& v : ob_) v = round_bf16(v);
            const double Ln = lse_add(L, Lb);
            const double wa = L == kNegInf ? 0.0 : std::exp(L - Ln), wb = std::exp(Lb - Ln);
            for (int64_t d2 = 0; d2 < c.D; ++d2) y[d2] = round_bf16(wa * y[d2] + wb * ob_[d2]);
            L = static_cast<double>(static_cast<float>(Ln));
          }
          for (int64_t d2 = 0; d2 < c.D; ++d2) {
            step_e2[s] += (y[d2] - exact[d2]) * (y[d2] - exact[d2]);
            step_r2[s] += exact[d2] * exact[d2];
          }
        }
      });
      std::ostringstream os;
      os.precision(2);
      std::vector<double> rel(P);
      for (int s = 0; s < P; ++s) rel[s] = step_r2[s] > 0 ? std::sqrt(step_e2[s] / step_r2[s]) : 0;
      const bool grows = rel[P - 1] > 1.2 * rel[0];
      os << (grows ? "the error grows with ring step: " : "")
         << "partial results were rounded to bf16 between steps (the running output is kept in "
            "bf16 while the ring merges; keep it in fp32); relative error of the running output "
            "after ring steps 0.."
         << P - 1 << " in that model:";
      for (int s = 0; s < P; ++s) os << " " << rel[s];
      d.text = os.str();
      consider(all, d);
    }
  }
}

// Chunk-level row order: which reference chunk does each candidate chunk slot hold?
void order_model(const Ctx& c, const Tensor<double>& cand, const Reference& ref,
                 std::vector<Diagnosis>& all) {
  if (c.sampled) return;
  const int64_t w = c.H * c.D;
  std::vector<int> pi(c.nc);
  bool identity = true;
  double r2 = 0, e2 = 0;
  for (int a = 0; a < c.nc; ++a) {
    const auto& ta = c.sh.chunks[a];
    double best = std::numeric_limits<double>::infinity(), self = 0;
    int arg = a;
    for (int b = 0; b < c.nc; ++b) {
      const auto& tb = c.sh.chunks[b];
      if (tb.size() != ta.size()) continue;
      double dist = 0;
      for (size_t t = 0; t < ta.size(); ++t)
        for (int64_t e = 0; e < w; ++e) {
          double x = cand[ta[t] * w + e];
          if (!finite(x)) x = 0;
          const double dd = x - ref.out[tb[t] * w + e];
          dist += dd * dd;
        }
      if (b == a) self = dist;
      if (dist < best) {
        best = dist;
        arg = b;
      }
    }
    pi[a] = arg;
    if (arg != a) identity = false;
    r2 += best;
    e2 += self;
  }
  if (identity || e2 == 0) return;
  Diagnosis d;
  d.kind = "row_order";
  d.residual = std::sqrt(r2 / e2);
  std::ostringstream detail;
  int shown = 0;
  for (int a = 0; a < c.nc; ++a) {
    if (pi[a] == a) continue;
    d.q_chunks.push_back(a);
    if (std::find(d.ranks.begin(), d.ranks.end(), c.sh.chunk_rank[a]) == d.ranks.end())
      d.ranks.push_back(c.sh.chunk_rank[a]);
    if (shown++ < 4)
      detail << (shown > 1 ? "; " : "") << "where " << c.sh.convention << " puts chunk " << a
             << " (rank " << c.sh.chunk_rank[a] << ") the candidate holds chunk " << pi[a];
  }
  if (shown > 4) detail << "; ...";
  std::sort(d.ranks.begin(), d.ranks.end());
  // The common zigzag mistake: a rank's two chunks swapped.
  bool swapped = c.sh.ranks > 1;
  for (int a = 0; a < c.nc && swapped; ++a)
    if (pi[a] != a && c.sh.chunk_rank[pi[a]] != c.sh.chunk_rank[a]) swapped = false;
  std::ostringstream os;
  if (swapped)
    os << "wrong zigzag order: rank" << (d.ranks.size() > 1 ? "s " : " ") << join(d.ranks)
       << (d.ranks.size() > 1 ? " hold their" : " holds its") << " chunks in swapped order ("
       << detail.str() << ")";
  else
    os << "rows are in the wrong order: " << detail.str();
  d.text = os.str();
  consider(all, d);
}

// GQA head mapping: query head h read KV head h mod Hkv (torch's repeat() instead of
// repeat_interleave()) where h / (H / Hkv) is right. Computed with the reference on query heads
// permuted so that its h / group mapping reads the KV head the wrong mapping reads.
void gqa_model(const Ctx& c, const Observed& ob, std::vector<Diagnosis>& all) {
  if (c.Hkv <= 1 || c.Hkv == c.H) return;
  // pi(h') = j * Hkv + kv for h' = kv * group + j: head pi(h') reads kv under h mod Hkv.
  std::vector<int64_t> pi(c.H);
  for (int64_t kv = 0; kv < c.Hkv; ++kv)
    for (int64_t j = 0; j < c.group; ++j) pi[kv * c.group + j] = j * c.Hkv + kv;
  // q's localisation rows with heads permuted (a copy of the whole problem, q, k, v and dout,
  // was made for them).
  const int64_t nl = static_cast<int64_t>(c.lrows.size());
  Tensor<double> q({nl, c.H, c.D});
  for (int64_t ri = 0; ri < nl; ++ri)
    for (int64_t h = 0; h < c.H; ++h)
      std::copy_n(c.p.q.data() + (c.lrows[ri] * c.H + pi[h]) * c.D, c.D,
                  q.data() + (ri * c.H + h) * c.D);
  const Ctx sub(c.p, c, c.lrows);
  const Reference r = run_reference(sub, c.scale, false, false, &q);
  std::vector<double> pred(r.out.numel());
  for (size_t ri = 0; ri < c.lrows.size(); ++ri)
    for (int64_t h = 0; h < c.H; ++h)
      std::copy(r.out.data() + (ri * c.H + h) * c.D, r.out.data() + (ri * c.H + h + 1) * c.D,
                pred.data() + (ri * c.H + pi[h]) * c.D);
  Diagnosis d;
  d.kind = "gqa_mapping";
  std::vector<bool> every(c.nc, true);
  d.residual = residual(c, ob, every, [&](int64_t ri, int64_t h, double* y) {
    std::copy(pred.data() + (ri * c.H + h) * c.D, pred.data() + (ri * c.H + h + 1) * c.D, y);
  });
  std::ostringstream os;
  os << "wrong GQA head mapping: query head h read KV head h mod " << c.Hkv
     << " (KV heads repeated, torch repeat) instead of h / " << c.group
     << " (each KV head shared by " << c.group << " consecutive query heads, repeat_interleave)";
  d.text = os.str();
  consider(all, d);
}

// Softmax scale: one-dimensional search on log(scale) for the scale that best explains out.
void scale_model(const Ctx& c, const Tensor<double>& cand, std::vector<Diagnosis>& all) {
  // Rows for the search: up to 64 of the localisation rows.
  std::vector<int64_t> rows;
  const size_t step = std::max<size_t>(1, c.lrows.size() / 64);
  for (size_t i = 0; i < c.lrows.size(); i += step) rows.push_back(c.lrows[i]);
  const Ctx sub(c.p, c, std::move(rows));
  const int64_t w = c.H * c.D;
  auto err = [&](double sc, double* ref2 = nullptr) {
    const Reference r = run_reference(sub, sc, false);
    double e = 0, n2 = 0;
    for (size_t ri = 0; ri < sub.rows.size(); ++ri)
      for (int64_t k = 0; k < w; ++k) {
        double x = cand[sub.rows[ri] * w + k];
        if (!finite(x)) x = 0;
        const double d = x - r.out[ri * w + k];
        e += d * d;
        n2 += r.out[ri * w + k] * r.out[ri * w + k];
      }
    if (ref2) *ref2 = n2;
    return e;
  };
  const double e_true = err(c.scale);
  if (e_true == 0) return;
  // Coarse grid over [scale / 64, 64 scale], then golden-section refinement.
  double best_t = 0, best = e_true;
  for (int k = -24; k <= 24; ++k) {
    const double t = k * std::log(64.0) / 24;
    const double e = err(c.scale * std::exp(t));
    if (e < best) {
      best = e;
      best_t = t;
    }
  }
  double lo = best_t - std::log(64.0) / 24, hi = best_t + std::log(64.0) / 24;
  const double g = (std::sqrt(5.0) - 1) / 2;
  double x1 = hi - g * (hi - lo), x2 = lo + g * (hi - lo);
  double f1 = err(c.scale * std::exp(x1)), f2 = err(c.scale * std::exp(x2));
  for (int it = 0; it < 30; ++it) {
    if (f1 < f2) {
      hi = x2;
      x2 = x1;
      f2 = f1;
      x1 = hi - g * (hi - lo);
      f1 = err(c.scale * std::exp(x1));
    } else {
      lo = x1;
      x1 = x2;
      f1 = f2;
      x2 = lo + g * (hi - lo);
      f2 = err(c.scale * std::exp(x2));
    }
  }
  const double t = f1 < f2 ? x1 : x2;
  const double fe = std::min(f1, f2);
  if (std::fabs(t) < 1e-3) return;
  Diagnosis d;
  d.kind = "wrong_scale";
  d.value = c.scale * std::exp(t);
  d.residual = std::sqrt(fe / e_true);
  std::ostringstream os;
  os.precision(6);
  os << "wrong softmax scale: the candidate used " << d.value;
  const double D = static_cast<double>(c.D);
  struct Guess {
    double v;
    const char* name;
  };
  for (Guess gs : {Guess{1.0, "1"}, Guess{1.0 / D, "1/D"}, Guess{1.0 / std::sqrt(D), "1/sqrt(D)"},
                   Guess{std::sqrt(D), "sqrt(D)"}})
    if (std::fabs(d.value / gs.v - 1) < 1e-3) os << " (= " << gs.name << ")";
  os << ", the problem's scale is " << c.scale;
  d.text = os.str();
  consider(all, d);
}

// Backward: dq shares with multiplicities (a dropped step) or a stale KV block (the block of
// step s - 1 used again at step s).
void backward_models(const Ctx& c, const Pairs& pr, const Observed& ob,
                     std::vector<Diagnosis>& all) {
  const int P = c.sh.ranks;
  if (P < 2) return;
  const auto rc = rank_chunks(c);
  auto run = [&](const std::function<double(int, int)>& coef, const std::vector<bool>& touched) {
    return residual(c, ob, touched, [&](int64_t ri, int64_t h, double* y) {
      const int a = c.lrow_chunk[ri];
      std::fill(y, y + c.D, 0.0);
      for (int b = 0; b < c.nc; ++b) {
        const double m = coef(a, b);
        if (m == 0) continue;
        const double* g = pr.dq.data() + pr.oi(b, ri, h);
        for (int64_t d = 0; d < c.D; ++d) y[d] += m * g[d];
      }
    });
  };
  for (int s = 0; s < P; ++s) {
    for (int r = -1; r < P; ++r) {
      std::vector<bool> touched(c.nc, r < 0);
      if (r >= 0)
        for (int a : rc[r]) touched[a] = true;
      auto on = [&](int a) { return r < 0 || c.sh.chunk_rank[a] == r; };
      Diagnosis d;
      d.kind = "dropped_step";
      d.steps = {s};
      if (r >= 0) d.ranks = {r};
      d.residual =
          run([&](int a, int b) { return on(a) && c.step_of(a, b) == s ? 0.0 : 1.0; }, touched);
      std::ostringstream os;
      os << "in the backward, " << (r < 0 ? "every rank" : "rank " + std::to_string(r))
         << "'s dq lacks the contribution of ring step " << s;
      d.text = os.str();
      consider(all, d);
      if (s == 0) continue;
      Diagnosis e;
      e.kind = "stale_kv_backward";
      e.steps = {s};
      if (r >= 0) e.ranks = {r};
      e.residual = run(
          [&](int a, int b) {
            if (!on(a)) return 1.0;
            const int st = c.step_of(a, b);
            return st == s ? 0.0 : (st == s - 1 ? 2.0 : 1.0);
          },
          touched);
      std::ostringstream es;
      es << "stale KV in the backward: at ring step " << s << " "
         << (r < 0 ? "every rank" : "rank " + std::to_string(r))
         << " computed with the KV block of step " << s - 1
         << " again (the received block was not used), so dq counts step " << s - 1
         << "'s keys twice and lacks step " << s << "'s";
      e.text = es.str();
      consider(all, e);
    }
  }
}

// Heat map: pair shares of the explained error energy. Direction k (0 <= k < per_pair * nc)
// belongs to pair k % nc; basis(k, ri, h, tmp) returns its D values on row ri, head h.
std::vector<std::vector<double>> heat_map(
    const Ctx& c, const Observed& ob, int per_pair,
    const std::function<const double*(int, int64_t, int64_t, std::vector<double>&)>& basis) {
  std::vector<std::vector<double>> heat(c.nc, std::vector<double>(c.nc, 0.0));
  if (ob.e2 == 0) return heat;
  std::vector<std::vector<int64_t>> rows_of(c.nc);
  for (size_t ri = 0; ri < c.lrows.size(); ++ri) rows_of[c.lrow_chunk[ri]].push_back(ri);
  const int nb = per_pair * c.nc;
  std::vector<double> tmp(c.D);
  for (int a = 0; a < c.nc; ++a) {
    if (rows_of[a].empty()) continue;
    for (int64_t h = 0; h < c.H; ++h) {
      // Pair directions over the rows of chunk a, head h, and the error there.
      std::vector<std::vector<double>> cols(nb);
      for (int b = 0; b < nb; ++b) {
        cols[b].resize(rows_of[a].size() * c.D);
        for (size_t t = 0; t < rows_of[a].size(); ++t) {
          const double* g = basis(b, rows_of[a][t], h, tmp);
          std::copy(g, g + c.D, cols[b].begin() + t * c.D);
        }
      }
      std::vector<double> e(rows_of[a].size() * c.D);
      for (size_t t = 0; t < rows_of[a].size(); ++t)
        for (int64_t d = 0; d < c.D; ++d) {
          const size_t k = (rows_of[a][t] * c.H + h) * c.D + d;
          e[t * c.D + d] = ob.x[k] - ob.ref[k];
        }
      double e0 = 0;
      for (double x : e) e0 += x * x;
      if (e0 == 0) continue;
      // Orthogonal matching pursuit: repeatedly take the pair whose direction (orthogonalised
      // against the pairs already taken) removes the most error energy, and credit it with that
      // energy. The forward directions sum to zero over b, so a plain least-squares fit would
      // spread the credit; pursuit gives it to the pairs that explain the error.
      auto dotp = [](const std::vector<double>& x, const std::vector<double>& y) {
        double s = 0;
        for (size_t k = 0; k < x.size(); ++k) s += x[k] * y[k];
        return s;
      };
      // Modified Gram-Schmidt: each pair's direction is kept orthogonalised against the pairs
      // taken so far, one new basis vector at a time (re-projecting every direction on the
      // whole basis each round cost nb^3 row-vectors per chunk and head: 36 s at 64 ranks).
      std::vector<double> n0(nb);
      for (int b = 0; b < nb; ++b) n0[b] = dotp(cols[b], cols[b]);
      std::vector<bool> taken(nb, false);
      for (int it = 0; it < nb; ++it) {
        int best = -1;
        double best_gain = 0;
        for (int b = 0; b < nb; ++b) {
          if (taken[b] || n0[b] == 0) continue;
          const double nu = dotp(cols[b], cols[b]);
          if (nu <= 1e-12 * n0[b]) continue;
          const double pr = dotp(cols[b], e);
          const double gain = pr * pr / nu;
          if (gain > best_gain) {
            best_gain = gain;
            best = b;
          }
        }
        if (best < 0 || best_gain < 1e-4 * e0) break;
        taken[best] = true;
        std::vector<double>& q = cols[best];
        const double nq = std::sqrt(dotp(q, q));
        for (auto& x : q) x /= nq;
        const double pr = dotp(q, e);
        for (size_t k = 0; k < e.size(); ++k) e[k] -= pr * q[k];
        for (int b = 0; b < nb; ++b) {
          if (taken[b] || n0[b] == 0) continue;
          const double pj = dotp(q, cols[b]);
          for (size_t k = 0; k < q.size(); ++k) cols[b][k] -= pj * q[k];
        }
        heat[a][best % c.nc] += best_gain / ob.e2;
      }
    }
  }
  for (auto& row : heat)
    for (double& v : row) v = std::min(1.0, v);
  return heat;
}

// How the caller selects bf16's tolerances: loom verify's option or loom.torch.verify's keyword.
std::string bf16_option(const Options& o) {
  return o.option_spelling == OptionSpelling::keyword ? "dtype=\"bf16\"" : "--dtype bf16";
}

std::string unexplained_text(const Ctx& c, const std::vector<std::vector<double>>& heat,
                             const TensorCheck& t) {
  std::ostringstream os;
  os << "no known defect explains the " << t.name << " error";
  // Top pairs of the heat map.
  std::vector<std::pair<double, std::pair<int, int>>> cells;
  for (int a = 0; a < c.nc; ++a)
    for (int b = 0; b < c.nc; ++b)
      if (heat[a][b] > 0.05) cells.push_back({heat[a][b], {a, b}});
  std::sort(cells.rbegin(), cells.rend());
  if (!cells.empty()) {
    os << "; it is concentrated in ";
    for (size_t i = 0; i < std::min<size_t>(3, cells.size()); ++i) {
      const int a = cells[i].second.first, b = cells[i].second.second;
      os << (i ? ", " : "") << "query chunk " << a << " x KV chunk " << b;
      if (c.sh.ranks > 1)
        os << " (rank " << c.sh.chunk_rank[a] << ", ring step " << c.step_of(a, b) << ")";
      os << " " << static_cast<int>(std::lround(100 * cells[i].first)) << "%";
    }
  }
  // Heads.
  if (!t.per_head.empty()) {
    const double mx = *std::max_element(t.per_head.begin(), t.per_head.end());
    std::vector<int> bad;
    for (size_t h = 0; h < t.per_head.size(); ++h)
      if (t.per_head[h] > 0.1 * mx && t.per_head[h] > t.tolerance)
        bad.push_back(static_cast<int>(h));
    if (!bad.empty() && bad.size() < t.per_head.size())
      os << "; only head" << (bad.size() > 1 ? "s " : " ") << join(bad)
         << (bad.size() > 1 ? " are" : " is") << " wrong";
  }
  if (c.sh.ranks > 1 && !t.per_rank.empty()) {
    std::vector<int> bad;
    for (size_t r = 0; r < t.per_rank.size(); ++r)
      if (t.per_rank[r] > t.tolerance) bad.push_back(static_cast<int>(r));
    if (!bad.empty() && static_cast<int>(bad.size()) < c.sh.ranks)
      os << "; only rank" << (bad.size() > 1 ? "s " : " ") << join(bad)
         << (bad.size() > 1 ? " are" : " is") << " wrong";
  }
  return os.str();
}

}  // namespace

double tolerance(const std::string& tensor, const std::string& dtype) {
  // loom/tolerance.h: out in bf16 2u; dq, dk, dv 2u (kBf16GradRelTol); lse stays fp32.
  static_assert(kBf16OutRelTol == kBf16GradRelTol);
  LOOM_CHECK(dtype == "fp32" || dtype == "bf16", InvalidArgument,
             "unknown dtype '" << dtype << "' (choose fp32 or bf16)");
  // An unknown name had the tolerance of a gradient.
  LOOM_CHECK(
      tensor == "out" || tensor == "lse" || tensor == "dq" || tensor == "dk" || tensor == "dv",
      InvalidArgument, "unknown tensor '" << tensor << "' (choose out, lse, dq, dk or dv)");
  if (dtype == "fp32") return kFp32RelTol;
  return tensor == "lse" ? kFp32RelTol : kBf16GradRelTol;
}

Report verify(const Problem& p, const Candidate& cand, const Options& o) {
  LOOM_CHECK(p.q.dim() == 3 && p.k.dim() == 3 && p.v.dim() == 3, InvalidArgument,
             "q, k, v must be [S, H, D] and [S, Hkv, D]");
  Ctx c(p, o);
  c.S = p.q.size(0);
  c.H = p.q.size(1);
  c.D = p.q.size(2);
  c.Hkv = p.k.size(1);
  LOOM_CHECK(c.S >= 1 && c.H >= 1 && c.D >= 1 && c.Hkv >= 1, InvalidArgument,
             "q " << shape_str(p.q.shape()) << " and k " << shape_str(p.k.shape())
                  << " must be non-empty");
  LOOM_CHECK(p.k.shape() == p.v.shape(), InvalidArgument,
             "k " << shape_str(p.k.shape()) << " and v " << shape_str(p.v.shape())
                  << " must have the same shape");
  LOOM_CHECK(p.k.size(0) == c.S && p.k.size(2) == c.D, InvalidArgument,
             "k " << shape_str(p.k.shape()) << " does not match q " << shape_str(p.q.shape()));
  LOOM_CHECK(c.H % c.Hkv == 0, InvalidArgument,
             "heads " << c.H << " must be a multiple of kv heads " << c.Hkv);
  (void)tolerance("out", o.dtype);
  c.group = c.H / c.Hkv;
  // 0 is the default; a negative or NaN scale became the default silently, infinity gave a
  // non-finite reference.
  LOOM_CHECK(
      p.scale == 0 || (std::isfinite(p.scale) && p.scale > 0), InvalidArgument,
      "scale must be 0 (the default, 1/sqrt(D)) or a positive finite number, got " << p.scale);
  c.scale = p.scale > 0 ? p.scale : 1.0 / std::sqrt(static_cast<double>(c.D));
  c.sh = make_sharding(o.convention, c.S, o.ranks, p.doc_lengths);
  c.nc = static_cast<int>(c.sh.chunks.size());
  c.pos.resize(c.S);
  std::iota(c.pos.begin(), c.pos.end(), 0);
  if (!p.doc_lengths.empty()) {
    int32_t d = 0;
    for (int64_t len : p.doc_lengths) {
      for (int64_t t = 0; t < len; ++t) c.doc.push_back(d);
      ++d;
    }
  }
  c.chunk_of.assign(c.S, 0);
  for (int b = 0; b < c.nc; ++b)
    for (int64_t t : c.sh.chunks[b]) c.chunk_of[t] = b;
  // 0 or less made every sequence sampled: dk and dv went uncompared and a wrong dk passed
  // (loom verify and loom.torch.verify refused it; this is their check, for library callers).
  LOOM_CHECK(o.full_check_max >= 1, InvalidArgument,
             (o.option_spelling == OptionSpelling::keyword ? "full_check_max" : "--full-check-max")
                 << " must be >= 1 (the longest sequence whose every row is compared), got "
                 << o.full_check_max);
  c.sampled = checks_sampled_rows(c.S, o.full_check_max);
  if (c.sampled) {
    for (int64_t i = 0; i < kSampleRows; ++i) c.rows.push_back(i * (c.S - 1) / (kSampleRows - 1));
    c.rows.erase(std::unique(c.rows.begin(), c.rows.end()), c.rows.end());
  } else {
    c.rows.resize(c.S);
    std::iota(c.rows.begin(), c.rows.end(), 0);
  }
  {
    // At most kLocRows rows, and at most kLocBytes for the pair partials of every row (out and
    // dq shares per KV chunk, and the six mask-offset partials), so a large problem is
    // localised on fewer rows instead of exhausting memory.
    const double per_row = 8.0 * static_cast<double>(c.H * c.D) * (2.0 * c.nc + 6.0);
    const int64_t cap = std::max<int64_t>(
        16, std::min<int64_t>(kLocRows, static_cast<int64_t>(kLocBytes / per_row)));
    const size_t step = (c.rows.size() + cap - 1) / cap;
    for (size_t i = 0; i < c.rows.size(); i += step) c.lrows.push_back(c.rows[i]);
    for (int64_t r : c.lrows) c.lrow_chunk.push_back(c.chunk_of[r]);
  }

  // Shapes of the candidate's tensors.
  auto check_shape = [&](const std::optional<Tensor<double>>& t, const char* name,
                         std::vector<int64_t> want) {
    if (!t) return;
    LOOM_CHECK(t->shape() == want, InvalidArgument,
               "candidate " << name << " has shape " << shape_str(t->shape()) << ", expected "
                            << shape_str(want));
  };
  check_shape(cand.out, "out", {c.S, c.H, c.D});
  check_shape(cand.lse, "lse", {c.H, c.S});
  check_shape(cand.dq, "dq", {c.S, c.H, c.D});
  check_shape(cand.dk, "dk", {c.S, c.Hkv, c.D});
  check_shape(cand.dv, "dv", {c.S, c.Hkv, c.D});
  const bool any_grad = cand.dq || cand.dk || cand.dv;
  if (any_grad)
    LOOM_CHECK(p.dout.numel() > 0, InvalidArgument,
               "the candidate has gradients (dq, dk or dv) but the input has no dout.npy");
  if (p.dout.numel() > 0)
    LOOM_CHECK(
        p.dout.shape() == p.q.shape(), InvalidArgument,
        "dout " << shape_str(p.dout.shape()) << " must have q's shape " << shape_str(p.q.shape()));
  LOOM_CHECK(cand.out || cand.lse || any_grad, InvalidArgument,
             "the candidate holds none of out, lse, dq, dk, dv");

  Report rep;
  rep.convention = o.convention;
  rep.ranks = o.ranks;
  rep.seq = c.S;
  rep.heads = c.H;
  rep.kv_heads = c.Hkv;
  rep.head_dim = c.D;
  rep.chunk_rank = c.sh.chunk_rank;

  // Non-finite inputs cannot be verified: their NaN reached the reference and was reported as
  // scores that overflow float64.
  for (const auto& [name, t] : {std::pair<const char*, const Tensor<double>*>{"q", &p.q},
                                {"k", &p.k},
                                {"v", &p.v},
                                {"dout", &p.dout}})
    for (int64_t i = 0; i < t->numel(); ++i)
      LOOM_CHECK(std::isfinite((*t)[i]), InvalidArgument,
                 name << " holds a NaN or Inf (token " << i / (t->size(1) * t->size(2)) << ", head "
                      << i / t->size(2) % t->size(1) << ", dim " << i % t->size(2)
                      << "): inputs must be finite");
  const Reference ref = run_reference(c, c.scale, any_grad);
  {
    const RowTokens rt(c);
    // The score condition over every query row, the others over the rows compared.
    Tensor<double> q_copy, dout_copy;
    const View3<const double> q = check_rows(c, p.q, q_copy);
    const View3<const double> dv =
        any_grad ? check_rows(c, p.dout, dout_copy) : View3<const double>{};
    CheckLimits limits =
        check_limits(q, p.k.view3(), p.v.view3(), dv, rt.tokens(), c.all_tokens(), p.mask, c.scale,
                     CheckedResults{o.dtype == "bf16", true, false, !c.sampled},
                     fp32_score_bound(p.q.view3(), p.k.view3(), c.scale));
    if (!limits.why.empty()) {
      rep.per_problem_why = (o.dtype == "bf16" ? "bf16 with " : "") + limits.why;
      rep.per_problem_hint = check_limits_hint(limits.miss);
      c.bounds = std::move(limits);
    }
    rep.per_problem_bounds = c.bounds.has_value();
  }
  // Finite inputs whose scores overflow float64 (|scale q.k| > 1.8e308) leave NaN in the
  // reference: every candidate then "failed" with an infinite error and a diagnosis fitted to
  // NaN (a correct out was named a dropped step). Such inputs cannot be verified.
  for (const auto& [name, t] : {std::pair<const char*, const Tensor<double>*>{"out", &ref.out},
                                {"lse", &ref.lse},
                                {"dq", &ref.dq},
                                {"dk", &ref.dk},
                                {"dv", &ref.dv}})
    for (int64_t i = 0; i < t->numel(); ++i)
      LOOM_CHECK(std::isfinite((*t)[i]) || (t == &ref.lse && (*t)[i] == -INFINITY), InvalidArgument,
                 "the fp64 reference " << name << " is not finite (at flat index " << i
                                       << "): the scores scale x q.k overflow float64 (scale "
                                       << c.scale << "); inputs this large cannot be verified");
  std::vector<int64_t> all_rows(c.S);
  std::iota(all_rows.begin(), all_rows.end(), 0);
  auto absent = [&](const char* n) {
    TensorCheck t;
    t.name = n;
    rep.tensors.push_back(t);
    rep.absent.push_back(n);
  };
  if (cand.out) {
    rep.tensors.push_back(compare_rows(c, "out", *cand.out, ref.out, c.rows, false));
    add_unsampled(rep.tensors.back(), non_finite_unsampled(c, *cand.out, false, false));
  } else {
    absent("out");
  }
  if (cand.lse) {
    rep.tensors.push_back(compare_lse(c, *cand.lse, ref.lse));
    add_unsampled(rep.tensors.back(), non_finite_unsampled(c, *cand.lse, true, false));
  } else {
    absent("lse");
  }
  if (cand.dq) {
    rep.tensors.push_back(compare_rows(c, "dq", *cand.dq, ref.dq, c.rows, false));
    add_unsampled(rep.tensors.back(), non_finite_unsampled(c, *cand.dq, false, false));
  } else {
    absent("dq");
  }
  for (const char* n : {"dk", "dv"}) {
    const auto& t = std::string(n) == "dk" ? cand.dk : cand.dv;
    if (!t) {
      absent(n);
      continue;
    }
    if (c.sampled) {  // not compared (they need every query row), but scanned for NaN / Inf
      TensorCheck x;
      x.name = n;
      x.present = x.scanned_only = true;
      x.tolerance = c.tol(n);
      x.non_finite = non_finite_unsampled(c, *t, false, true);
      x.compared = x.non_finite > 0;  // then a failure, whatever the exact values
      if (x.compared) x.rel_err = std::numeric_limits<double>::infinity();
      rep.tensors.push_back(x);
      continue;
    }
    rep.tensors.push_back(
        compare_rows(c, n, *t, std::string(n) == "dk" ? ref.dk : ref.dv, all_rows, true));
  }
  // A bound of 1 or more passes a tensor of zeros: such a tensor cannot be verified (scores so
  // large that fp32 or bf16 cannot resolve it), which is said rather than passed. Two answers
  // are still verdicts, as in `loom attn --check`: a candidate equal to the exact values (scores
  // so large that each row's weight sits on one key: out is that key's value, bitwise), and a
  // tensor whose exact values are all zero (values all equal make dq and dk 0), which is then
  // held to the bound as an absolute one.
  // Sampled rows compare no dk, dv (scanned for NaN and Inf only: their bounds, like their exact
  // values, need every query row, and are not computed).
  for (auto& t : rep.tensors) {
    if (!t.present || t.tolerance < 1) continue;
    if (c.sampled && (t.name == "dk" || t.name == "dv")) continue;
    const Tensor<double>& r = reference_of(ref, t.name);
    bool zeros = true;
    for (int64_t i = 0; i < r.numel() && zeros; ++i) zeros = r[i] == 0;
    const bool exact = t.compared && t.rel_err == 0;
    const bool absolute = t.compared && zeros && std::isfinite(t.tolerance);
    LOOM_CHECK(exact || absolute, InvalidArgument,
               t.name << " cannot be verified: this problem's " << o.dtype
                      << " error bound for it is " << bound_text(t.tolerance) << " ("
                      << (t.name[0] == 'o' || t.name[0] == 'l' ? "an " : "a ")  // an out, a dq
                      << t.name << " of zeros would pass; " << rep.per_problem_why
                      << "): " << rep.per_problem_hint);
    if (exact) t.passed = true;  // whatever the bound (not computable: NaN or inf)
  }
  // A tensor that failed where its exact values lie below float32's normal range, so far that
  // rounding them to float32 alone errs over a quarter of the tolerance, cannot be verified
  // (Float32Floor, loom/tolerance.h). Where rounding the exact values does not explain the miss,
  // the roundings of the terms that sum to them may (v of 1e-39: dp and ds subnormal, dq not):
  // subnormal_reference models them, run only here and freed before the localisation.
  // subnormal_reference_shift bounds how far the model lies from the exact values: where that
  // cannot matter (any input of ordinary size), the model does not run.
  {
    std::optional<Reference> modelled;
    const SubnormalShift shift = subnormal_reference_shift(
        p.q.view3(), p.k.view3(), p.v.view3(),
        any_grad ? View3<const double>(p.dout.view3()) : View3<const double>{}, c.scale);
    for (const auto& t : rep.tensors) {
      if (!t.compared || t.passed || t.non_finite > 0 || t.inf_mismatch > 0) continue;
      const Tensor<double>& r = reference_of(ref, t.name);
      // A bf16 candidate's tensors are bf16 values (lse is float32 in every implementation).
      const bool bf16_stored = o.dtype == "bf16" && t.name != "lse";
      Float32Floor f32(bf16_stored);
      for (int64_t i = 0; i < r.numel(); ++i) f32.add(r[i]);
      double floor = f32.rel();
      const double moved = t.name == "out"  ? shift.out
                           : t.name == "dq" ? shift.dq
                           : t.name == "dk" ? shift.dk
                                            : shift.dv;
      if (!float32_floor_blocks(floor, t.tolerance) && t.name != "lse" &&
          subnormal_model_may_block(moved, f32, t.tolerance)) {
        if (!modelled) modelled = run_reference(c, c.scale, any_grad, /*subnormal=*/true);
        const Tensor<double>& m = reference_of(*modelled, t.name);
        Float32Floor f(bf16_stored);
        for (int64_t i = 0; i < r.numel(); ++i) f.add(r[i], m[i]);
        floor = std::max(floor, f.rel());
      }
      LOOM_CHECK(!float32_floor_blocks(floor, t.tolerance), InvalidArgument,
                 t.name << " cannot be verified: its exact values or the terms that sum to them "
                           "lie below float32's normal range ("
                        << (bf16_stored ? "bf16" : "float32") << " alone errs "
                        << std::setprecision(3) << floor << ", over a quarter of the tolerance "
                        << t.tolerance << "): scale the inputs up to verify it");
    }
  }
  // Nothing compared is no verdict: dk and dv alone above full_check_max passed, exit 0.
  bool any_compared = false;
  for (const auto& t : rep.tensors) any_compared = any_compared || t.compared;
  LOOM_CHECK(any_compared, InvalidArgument,
             "nothing could be compared: dk and dv need every query row, and S = "
                 << c.S << " is above the full-check limit of " << o.full_check_max << " tokens ("
                 << (o.option_spelling == OptionSpelling::keyword ? "full_check_max="
                                                                  : "--full-check-max ")
                 << o.full_check_max << "); give out, lse or dq too, or raise the limit");
  rep.passed = true;
  for (const auto& t : rep.tensors)
    if (t.compared && !t.passed) rep.passed = false;
  if (rep.passed || !o.localise) return rep;
  {
    const double P = c.sh.ranks, nc = c.nc, hd = static_cast<double>(c.H * c.D);
    auto work = [&](double rows) {
      return (2 * P * (P + 1) + 8) * rows * hd * nc + 4 * nc * nc * rows * hd;
    };
    const double L = static_cast<double>(c.lrows.size());
    if (work(L) > kLocWork) {
      const int64_t keep =
          std::max<int64_t>(kMinLocRows, static_cast<int64_t>(L * kLocWork / work(L)));
      if (keep < static_cast<int64_t>(L) && work(static_cast<double>(keep)) <= kLocWork) {
        std::vector<int64_t> rows;
        std::vector<int> chunks;
        for (int64_t i = 0; i < keep; ++i) {
          const size_t k = static_cast<size_t>(i * static_cast<int64_t>(L) / keep);
          rows.push_back(c.lrows[k]);
          chunks.push_back(c.lrow_chunk[k]);
        }
        c.lrows = std::move(rows);
        c.lrow_chunk = std::move(chunks);
      } else {
        Diagnosis d;
        d.kind = "not_localised";
        std::ostringstream os;
        os << "not localised: " << c.sh.ranks << " ranks and " << c.nc
           << " chunks are past the localisation's budget (its work grows as ranks^2 x chunks); "
              "the tensors' errors above stand";
        d.text = os.str();
        rep.diagnoses.push_back(d);
        return rep;
      }
    }
  }

  // Localisation: the forward first (out, else nothing), then dq.
  const TensorCheck* out_t = nullptr;
  const TensorCheck* dq_t = nullptr;
  for (const auto& t : rep.tensors) {
    if (t.name == "out" && t.compared && !t.passed) out_t = &t;
    if (t.name == "dq" && t.compared && !t.passed) dq_t = &t;
  }
  const bool alt =
      p.mask.causal && p.mask.window == 0 && p.doc_lengths.empty() && o.convention != "stripe";
  std::vector<Diagnosis> all;
  bool bf16_evident = false;  // a bf16_storage diagnosis that is named whatever its residual
  // Where the localised tensor (out, else dq) holds NaN or Inf, those are named (below) and
  // nothing else: the models and the heat map see them as 0, an error they make up (an out of
  // NaN was named "rows are in the wrong order").
  const TensorCheck* loc_t = out_t ? out_t : dq_t;
  const bool loc_non_finite = loc_t && (loc_t->non_finite > 0 || loc_t->inf_mismatch > 0);
  if (loc_non_finite) {
    // nothing to fit
  } else if (out_t) {
    const Pairs pr = compute_pairs(c, alt, false);
    const Observed ob = observe(c, *cand.out, pr.out);
    forward_models(c, pr, ob, all);
    if (o.dtype == "fp32" && out_t->rel_err <= tolerance("out", "bf16")) {
      // A bf16 implementation checked with fp32 tolerances: every value of out is a bf16
      // number (a chance of 2^-16 per value for fp32 results), within the bf16 tolerance. Where
      // out is the exact answer rounded once to bf16, that model explains the error; an
      // implementation that also rounds inside (bf16 dot products round the probabilities of
      // p v, as loom's avx512bf16 and amx paths do) leaves more, and is named all the same.
      bool all_bf16 = true;
      for (double x : cand.out->vec()) {
        const float f = static_cast<float>(x);
        if (std::isfinite(f) && to_float(to_bf16(f)) != f) {
          all_bf16 = false;
          break;
        }
      }
      if (all_bf16) {
        Diagnosis d;
        d.kind = "bf16_storage";
        std::vector<bool> every(c.nc, true);
        d.residual = residual(c, ob, every, [&](int64_t ri, int64_t h, double* y) {
          const double* x = pr.out.data() + (ri * c.H + h) * c.D;
          for (int64_t k = 0; k < c.D; ++k) y[k] = round_bf16(x[k]);
        });
        std::ostringstream os;
        os.precision(3);
        if (d.residual <= kNameResidual) {
          os << "out is stored in bf16 (every value is a bf16 number, the exact answer rounded "
                "once) and its error "
             << out_t->rel_err << " is within the bf16 tolerance " << tolerance("out", "bf16");
        } else {
          os << "out is stored in bf16 (every value is a bf16 number) and its error "
             << out_t->rel_err << " is within the bf16 tolerance " << tolerance("out", "bf16")
             << ", more than one rounding of the exact answer gives (as from bf16 products "
                "inside)";
        }
        os << ": a bf16 implementation checked with fp32 tolerances; check it with "
           << bf16_option(o);
        d.text = os.str();
        bf16_evident = std::isfinite(d.residual);
        consider(all, d);
      }
    }
    order_model(c, *cand.out, ref, all);
    scale_model(c, *cand.out, all);
    gqa_model(c, ob, all);
    rep.heat_tensor = "out";
    // Two directions per pair: w_ib (O_ib - out_i), the first-order effect of scaling the
    // pair's weight in the merge (dropped, doubled, masked pairs), and O_ib itself, which a
    // merge without log-sum-exp weights adds with the wrong weight.
    rep.heat = heat_map(
        c, ob, 2, [&](int k, int64_t ri, int64_t h, std::vector<double>& tmp) -> const double* {
          const int b = k % c.nc;
          const double L = pr.out_lse[ri * c.H + h];
          const double lb = pr.lse[pr.li(b, ri, h)];
          const double w = (L == kNegInf || lb == kNegInf) ? 0.0 : std::exp(lb - L);
          const double* o_ = pr.o.data() + pr.oi(b, ri, h);
          const double* out = pr.out.data() + (ri * c.H + h) * c.D;
          if (k >= c.nc) return o_;
          for (int64_t d = 0; d < c.D; ++d) tmp[d] = w * (o_[d] - out[d]);
          return tmp.data();
        });
  } else if (dq_t) {
    const Pairs pr = compute_pairs(c, false, true);
    const Observed ob = observe(c, *cand.dq, pr.dq_sum);
    backward_models(c, pr, ob, all);
    rep.heat_tensor = "dq";
    rep.heat = heat_map(c, ob, 1,
                        [&](int b, int64_t ri, int64_t h, std::vector<double>&) -> const double* {
                          return pr.dq.data() + pr.oi(b, ri, h);
                        });
  }
  // Gradients stored in bf16 checked with fp32 tolerances, where out passed or is absent (bf16
  // dq, dk, dv with an fp32 out or none got no hint, only "no known defect"): every value of
  // each failed gradient is a bf16 number and its error within the bf16 tolerance. The model is
  // the exact gradient rounded once to bf16, on the compared rows.
  if (!out_t && !loc_non_finite && o.dtype == "fp32") {
    std::vector<const TensorCheck*> grads;
    bool evident = true;
    double m2 = 0, e2 = 0;
    for (const auto& t : rep.tensors) {
      if (t.name == "out" || t.name == "lse" || !t.compared || t.passed) continue;
      const bool is_dq = t.name == "dq";
      const Tensor<double>& x = is_dq ? *cand.dq : t.name == "dk" ? *cand.dk : *cand.dv;
      const Tensor<double>& r = is_dq ? ref.dq : t.name == "dk" ? ref.dk : ref.dv;
      if (t.rel_err > tolerance(t.name, "bf16")) evident = false;
      for (size_t k = 0; k < x.vec().size() && evident; ++k) {
        const float f = static_cast<float>(x[static_cast<int64_t>(k)]);
        if (std::isfinite(f) && to_float(to_bf16(f)) != f) evident = false;
      }
      if (!evident) break;
      grads.push_back(&t);
      const std::vector<int64_t>& rows = is_dq ? c.rows : all_rows;
      const int64_t w = x.size(1) * x.size(2);
      for (size_t ri = 0; ri < rows.size(); ++ri)
        for (int64_t e = 0; e < w; ++e) {
          const double xv = x[rows[ri] * w + e];
          const double rv = r[(is_dq ? static_cast<int64_t>(ri) : rows[ri]) * w + e];
          m2 += (xv - round_bf16(rv)) * (xv - round_bf16(rv));
          e2 += (xv - rv) * (xv - rv);
        }
    }
    if (evident && !grads.empty()) {
      Diagnosis d;
      d.kind = "bf16_storage";
      d.residual = e2 > 0 ? std::sqrt(m2 / e2) : 0.0;
      std::ostringstream os;
      os.precision(3);
      for (size_t i = 0; i < grads.size(); ++i)
        os << (i == 0 ? "" : (i + 1 == grads.size() ? " and " : ", ")) << grads[i]->name;
      const bool one = grads.size() == 1;
      os << (one ? " is" : " are") << " stored in bf16 (every value is a bf16 number"
         << (d.residual <= kNameResidual ? ", the exact answer rounded once" : "") << ") and "
         << (one ? "its error" : "their errors");
      for (size_t i = 0; i < grads.size(); ++i) os << (i ? ", " : " ") << grads[i]->rel_err;
      os << (one ? " is" : " are") << " within the bf16 tolerance "
         << tolerance(grads[0]->name, "bf16")
         << (d.residual <= kNameResidual ? ""
                                         : ", more than one rounding of the exact answer gives")
         << ": a bf16 implementation checked with fp32 tolerances; check it with "
         << bf16_option(o);
      d.text = os.str();
      bf16_evident = std::isfinite(d.residual);
      consider(all, d);
    }
  }
  std::stable_sort(all.begin(), all.end(),
                   [](const Diagnosis& a, const Diagnosis& b) { return a.residual < b.residual; });
  // Non-finite values are named first, with where the first one is.
  {
    const std::optional<Tensor<double>>* ts[] = {&cand.out, &cand.lse, &cand.dq, &cand.dk,
                                                 &cand.dv};
    const char* names[] = {"out", "lse", "dq", "dk", "dv"};
    std::vector<int> rank_of(c.S, 0);
    for (int r = 0; r < c.sh.ranks; ++r)
      for (int64_t tok : c.sh.tokens[r]) rank_of[tok] = r;
    for (int i = 0; i < 5; ++i) {
      if (!*ts[i]) continue;
      const Tensor<double>& t = **ts[i];
      const bool lse = i == 1;
      int64_t count = 0, first = -1;
      for (int64_t e = 0; e < t.numel(); ++e)
        if (std::isnan(t[e]) || (std::isinf(t[e]) && !(lse && t[e] < 0))) {
          ++count;
          if (first < 0) first = e;
        }
      if (!count) continue;
      const int64_t A = lse ? t.size(0) : t.size(1), Bw = lse ? 1 : t.size(2);
      const int64_t tok = lse ? first % c.S : first / (A * Bw);
      const int64_t head = lse ? first / c.S : (first / Bw) % A;
      Diagnosis d;
      d.kind = "non_finite";
      d.residual = 1;
      d.ranks = {rank_of[tok]};
      d.q_chunks = {c.chunk_of[tok]};
      std::ostringstream os;
      os << names[i] << " has " << count << " non-finite value" << (count > 1 ? "s" : "")
         << " (NaN or Inf); the first at token " << tok << ", head " << head << " (rank "
         << rank_of[tok] << ", chunk " << c.chunk_of[tok] << ")";
      d.text = os.str();
      rep.diagnoses.push_back(d);
    }
  }
  if (loc_non_finite) return rep;
  // Keep the named diagnosis (the best, when it explains the error) and a few runners-up. Where
  // no model explains it, bf16 storage is named when out is all bf16 numbers within the bf16
  // tolerance, whatever its own model leaves (see above).
  if (bf16_evident && !all.empty() && all[0].residual > kNameResidual)
    std::stable_partition(all.begin(), all.end(),
                          [](const Diagnosis& d) { return d.kind == "bf16_storage"; });
  const TensorCheck* main_t = out_t ? out_t : dq_t;
  if (!all.empty() && (all[0].residual <= kNameResidual || bf16_evident)) {
    for (size_t i = 0; i < all.size() && rep.diagnoses.size() < 3; ++i)
      if (i == 0 || all[i].residual <= kNameResidual) rep.diagnoses.push_back(all[i]);
  } else if (main_t) {
    Diagnosis d;
    d.kind = "unexplained";
    d.residual = all.empty() ? 1.0 : all[0].residual;
    d.text = unexplained_text(c, rep.heat, *main_t);
    rep.diagnoses.push_back(d);
  } else {
    Diagnosis d;
    d.kind = "unexplained";
    std::ostringstream os;
    os << "only ";
    bool first = true;
    for (const auto& t : rep.tensors)
      if (t.compared && !t.passed) {
        os << (first ? "" : ", ") << t.name;
        first = false;
      }
    os << " failed; localisation works on out (forward) and dq (backward)";
    d.text = os.str();
    rep.diagnoses.push_back(d);
  }
  return rep;
}

}  // namespace loom::verify
