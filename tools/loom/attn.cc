// `loom attn`: one context-parallel attention (forward, optionally backward) on generated or
// .npy inputs, checked against the fp64 reference, with time, useful GFLOP/s and per-rank
// counters.
//
// Every rank builds the same shard plan and generates (or reads and slices) its own rows; the
// Philox generator makes a rank's rows identical to a one-rank run's. Rank 0 gathers the results
// to check them and to write files.
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iomanip>
#include <limits>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "commands.h"
#include "loom/bf16.h"
#include "loom/comm.h"
#include "loom/cp.h"
#include "loom/io.h"
#include "loom/npy.h"
#include "loom/rng.h"
#include "loom/timer.h"
#include "loom/tolerance.h"
#include "report.h"

extern "C" int openblas_get_num_threads(void);

namespace loom::tools {

namespace {

int g_exit_code = 0;

// Tolerances of every check against the fp64 reference: loom/tolerance.h's check_limits (the
// fixed ones inside their regime, else the problem's own bounds), as loom verify and
// bench_kernels hold them; bf16's reference runs on the bf16-rounded inputs.
// The files `--output DIR` may hold (the set replaces DIR as a whole).
const std::vector<std::string> kOutputNames = {"out.npy", "lse.npy", "dq.npy", "dk.npy", "dv.npy"};
// Above this many tokens --check compares a sample of kCheckSampleRows query rows.
constexpr int64_t kCheckFullMax = 4096;
constexpr int64_t kCheckSampleRows = 256;

struct AttnOptions {
  int64_t seq = 4096, heads = 8, kv_heads = 0, head_dim = 64;
  bool causal = true;
  int64_t window = 0;
  std::string docs;
  bool backward = false, check = false;
  std::string input, output;
  uint64_t seed = 1;
  int threads = 0, iters = 3, warmup = 1;
  double scale = 0;
  int ranks = 1;
  std::string strategy = "ring", layout = "zigzag";
  DegreeOptions degrees;  // the registry's degree options (--ulysses, --inner, ...)
  bool quiet = false;
  std::string json, trace, timeline, fault;
  std::string dtype = "fp32";
  bool baseline = false;
  std::string memory_limit;     // --memory-limit (empty: the machine's available memory)
  double progress_after_s = 2;  // LOOM_PROGRESS_AFTER_S: progress lines from this many seconds
  // set by CLI11
  bool ranks_given = false, shape_given = false, kv_heads_given = false, scale_given = false,
       docs_given = false;
};

struct Problem {
  int64_t S, H, HKV, D;
  std::vector<int64_t> doc_lengths;
  KernelConfig kernel;
  CpConfig cp;
  Layout layout;
  bool bf16 = false;  // --dtype bf16: q, k, v, out, dout stored in bf16
  // Inputs read from --input (global), empty when generated.
  Tensor<float> q, k, v, dout;
};

// The largest L2 norm of a row [.., D] of x [n, heads, D] (0 for none), and the largest |x|.
std::pair<double, double> row_norm_and_max(const Tensor<float>& x) {
  double norm = 0, big = 0;
  const int64_t D = x.numel() ? x.size(2) : 1;
  for (int64_t r = 0; r < x.numel(); r += D) {
    double ss = 0;
    for (int64_t d = 0; d < D; ++d) {
      const double e = x[r + d];
      ss += e * e;
      big = std::max(big, std::abs(e));
    }
    norm = std::max(norm, std::sqrt(ss));
  }
  return {norm, big};
}

void require_finite(const Tensor<float>& t, const std::string& name) {
  for (int64_t i = 0; i < t.numel(); ++i)
    LOOM_CHECK(std::isfinite(t[i]), InvalidArgument,
               name << " contains a non-finite value (NaN or Inf) at flat index " << i
                    << "; loom refuses non-finite inputs");
}

// Reads --input's bodies into p (whose shapes make_problem took from the headers), after the
// memory estimate; refuses non-finite values and a file that changed shape since its header.
void load_inputs(const AttnOptions& o, Problem& p) {
  if (o.input.empty()) return;
  const std::vector<int64_t> q_shape = {p.S, p.H, p.D}, kv_shape = {p.S, p.HKV, p.D};
  auto load = [&](Tensor<float>& t, const char* name, const std::vector<int64_t>& shape) {
    const std::string path = o.input + "/" + name;
    if (p.bf16) {
      // Each value rounded to bf16 once, from the file's own precision (a float64 file went
      // through float32 first and was rounded twice), and one that overflows bf16 named here
      // (it was called an overflow of the products, after the run).
      const Tensor<double> d = read_npy_f64(path);
      t = Tensor<float>(d.shape());
      for (int64_t i = 0; i < d.numel(); ++i) {
        const float b = to_float(to_bf16(d[i]));
        LOOM_CHECK(
            !std::isfinite(d[i]) || std::isfinite(b), IoError,
            path << " holds " << d[i] << " at flat index " << i
                 << ", which rounds past bf16's largest value " << to_float(bf16{0x7f7f})
                 << " (--dtype bf16: values of smaller magnitude than 3.3961775e+38 round to "
                    "a finite bf16)");
        t[i] = b;
      }
    } else {
      t = read_npy_f32(path);
    }
    LOOM_CHECK(t.shape() == shape, IoError,
               path << " has shape " << shape_str(t.shape()) << ", its header said "
                    << shape_str(shape) << " (it changed while loom read it)");
    require_finite(t, name);
  };
  load(p.q, "q.npy", q_shape);
  load(p.k, "k.npy", kv_shape);
  // The kernels form q.k in float32 before the scale (loom/attention.h, a precondition they do
  // not check): a pair past FLT_MAX scored -inf and its key was dropped, a wrong answer with exit
  // 0, even where scale q.k was small. |q_i.k_j| <= ||q_i|| ||k_j||, so within that product
  // every pair is safe (a pair a mask hides is counted too).
  const double qn = row_norm_and_max(p.q).first, kn = row_norm_and_max(p.k).first;
  LOOM_CHECK(qn * kn <= std::numeric_limits<float>::max(), InvalidArgument,
             "q.npy and k.npy: the largest ||q_i|| x ||k_j|| is "
                 << qn * kn
                 << ", past float32's range (3.4e38): the kernels form q.k in float32 before the "
                    "scale, and such a pair's score would overflow (its key dropped, or NaN); "
                    "multiply q by the scale and pass --scale 1");
  load(p.v, "v.npy", kv_shape);
  if (o.backward) load(p.dout, "dout.npy", q_shape);
}

Problem make_problem(const AttnOptions& o) {
  Problem p;
  if (!o.input.empty()) {
    LOOM_CHECK(!o.shape_given, InvalidArgument,
               "--input takes S, H, HKV and D from the files; do not also give --seq, --heads, "
               "--kv-heads or --head-dim");
    require_directory(o.input, "--input");
    // The headers only: the bodies are read by load_inputs once the memory estimate has passed
    // (files near the available memory were read whole, 2 GB resident before the refusal).
    const auto qs = read_npy_role_shape(o.input + "/q.npy", "q", 3);
    const auto ks = read_npy_role_shape(o.input + "/k.npy", "k", 3);
    const auto vs = read_npy_role_shape(o.input + "/v.npy", "v", 3);
    p.S = qs[0];
    p.H = qs[1];
    p.D = qs[2];
    p.HKV = ks[1];
    LOOM_CHECK(ks == vs, IoError,
               "k.npy " << shape_str(ks) << " and v.npy " << shape_str(vs)
                        << " must have the same shape [S, HKV, D]");
    LOOM_CHECK(ks[0] == p.S && ks[2] == p.D, IoError,
               "k.npy " << shape_str(ks) << " does not match q.npy " << shape_str(qs)
                        << " (k must be [S, HKV, D])");
    for (const auto& [s, name] : {std::pair<const std::vector<int64_t>*, const char*>{&qs, "q.npy"},
                                  {&ks, "k.npy"},
                                  {&vs, "v.npy"}})
      for (int64_t d = 0; d < 3; ++d)
        LOOM_CHECK((*s)[d] >= 1, IoError,
                   o.input << "/" << name << " has shape " << shape_str(*s)
                           << ": an empty array (every dimension must be >= 1)");
    if (o.backward) {
      const auto ds = read_npy_role_shape(o.input + "/dout.npy", "dout", 3);
      LOOM_CHECK(ds == qs, IoError,
                 "dout.npy " << shape_str(ds) << " must have q's shape " << shape_str(qs));
    }
  } else {
    p.S = o.seq;
    p.H = o.heads;
    p.HKV = o.kv_heads ? o.kv_heads : o.heads;
    p.D = o.head_dim;
  }
  LOOM_CHECK(p.S >= 1, InvalidArgument, "--seq must be >= 1, got " << p.S);
  LOOM_CHECK(p.H >= 1, InvalidArgument, "--heads must be >= 1, got " << p.H);
  LOOM_CHECK(p.HKV >= 1 && (!o.kv_heads_given || o.kv_heads >= 1), InvalidArgument,
             "--kv-heads must be >= 1, got " << (o.kv_heads_given ? o.kv_heads : p.HKV));
  // With --input the sizes are the files' (the messages named options --input forbids).
  const bool files = !o.input.empty();
  LOOM_CHECK(p.D >= 1 && p.D <= kMaxHeadDim, InvalidArgument,
             (files ? "q.npy's head dim" : "--head-dim")
                 << " must be in [1, " << kMaxHeadDim << "], got " << p.D);
  LOOM_CHECK(p.H % p.HKV == 0, InvalidArgument,
             (files ? "q.npy's heads " : "--heads ")
                 << p.H << " must be a multiple of " << (files ? "k.npy's heads " : "--kv-heads ")
                 << p.HKV);
  LOOM_CHECK(o.window >= 0, InvalidArgument,
             "--window must be >= 0 (0 = no window), got " << o.window);
  LOOM_CHECK(o.iters >= 1, InvalidArgument, "--iters must be >= 1, got " << o.iters);
  LOOM_CHECK(o.warmup >= 0, InvalidArgument, "--warmup must be >= 0, got " << o.warmup);
  // The run's iteration count, warmup + iters, is an int: it must not wrap (2^31 - 1 + 1 ran no
  // iteration at all and reported a time of 0 as a success).
  LOOM_CHECK(o.iters <= std::numeric_limits<int>::max() - o.warmup, InvalidArgument,
             "--warmup " << o.warmup << " + --iters " << o.iters << " is more than "
                         << std::numeric_limits<int>::max() << " iterations");
  LOOM_CHECK(
      o.threads >= 0 && o.threads <= kMaxThreads, InvalidArgument,
      "--threads must be in [0, " << kMaxThreads << "] (0: cores / ranks), got " << o.threads);
  // A scale is a positive finite float; the default is 1/sqrt(D).
  LOOM_CHECK(std::isfinite(o.scale) && o.scale >= 0 && (!o.scale_given || o.scale > 0) &&
                 o.scale <= std::numeric_limits<float>::max(),
             InvalidArgument, "--scale must be a positive finite number, got " << o.scale);
  if (o.scale_given) check_scale_in_float32(o.scale);
  if (o.docs_given || !o.docs.empty()) {
    p.doc_lengths = parse_doc_lengths(o.docs);
    int64_t sum = 0;
    for (int64_t l : p.doc_lengths)
      LOOM_CHECK(!__builtin_add_overflow(sum, l, &sum), InvalidArgument,
                 "--docs lengths sum to more than 2^63 (the sequence has " << p.S << " tokens)");
    LOOM_CHECK(sum == p.S, InvalidArgument,
               "--docs lengths sum to " << sum << " but the sequence has " << p.S << " tokens");
  }
  p.layout = parse_layout(o.layout);
  LOOM_CHECK(o.dtype == "fp32" || o.dtype == "bf16", InvalidArgument,
             "unknown --dtype '" << o.dtype << "' (choose fp32 or bf16)");
  p.bf16 = o.dtype == "bf16";
  p.kernel.mask.causal = o.causal;
  p.kernel.mask.window = o.window;
  p.kernel.scale = o.scale > 0 ? static_cast<float>(o.scale)
                               : static_cast<float>(1.0 / std::sqrt(static_cast<double>(p.D)));
  p.cp.strategy = parse_strategy(o.strategy);
  o.degrees.apply(p.cp, o.strategy);  // each strategy's registry entry names the one it takes
  return p;
}

// A result's subnormal_reference counterpart for compare(): shift bounds how far it lies from the
// exact values (subnormal_reference_shift), and values() computes it (ref's shape) only where
// that bound says it can matter.
struct Modelled {
  double shift = 0;
  std::function<const Tensor<double>&()> values;
};

// Relative norm error of x against ref over the given rows of [S, H, D] tensors (all rows when
// rows is empty). lse may hold -inf in both: such entries must agree exactly. modelled, where
// given, is asked for its values only when x misses tol, rounding ref alone to float32 does not
// explain it, and the model could (subnormal_model_may_block).
void compare(const char* name, const Tensor<float>& x, const Tensor<double>& ref,
             const std::vector<int64_t>& rows, int64_t row_width, double tol, CheckReport& r,
             const Modelled* modelled = nullptr, bool bf16_stored = false) {
  double num = 0, den = 0, max_abs = 0;
  // What rounding the exact values as stored alone errs (subnormals; bf16's out in bf16).
  Float32Floor floor(bf16_stored);
  bool inf_mismatch = false, non_finite = false;
  // fn(i) for every compared element i of x and ref.
  const auto each_compared = [&](const auto& fn) {
    if (rows.empty()) {
      for (int64_t i = 0; i < x.numel(); ++i) fn(i);
    } else {
      for (int64_t row : rows)
        for (int64_t c = 0; c < row_width; ++c) fn(row * row_width + c);
    }
  };
  auto visit = [&](int64_t i) {
    const double a = x[i], b = ref[i];
    if (!std::isfinite(a) && a != b) non_finite = true;
    if (std::isnan(a) || std::isnan(b)) {
      inf_mismatch = true;
      return;
    }
    if (std::isinf(b) || std::isinf(a)) {
      if (a != b) inf_mismatch = true;
      return;
    }
    const double e = a - b;
    num += e * e;
    floor.add(b);
    den += b * b;
    max_abs = std::max(max_abs, std::fabs(e));
    if (!std::isfinite(a)) inf_mismatch = true;
  };
  each_compared(visit);
  // A bound of 1 or more passes zeros: nothing a check can tell, unless the result is the exact
  // answer itself (scores so large that every row's weight sits on one key: out is that key's
  // value, bitwise), or the exact answer is zeros (den 0: the bound is then absolute, and a
  // result within it is as close to the zeros as the kernels' roundings allow: values all equal
  // make dq and dk exactly 0, and a bound of 4.7 said "cannot tell" of a dq 1e-3 from them).
  const bool absolute = den == 0 && std::isfinite(tol);
  if (!(tol < 1) && !absolute && (inf_mismatch || num != 0)) {
    std::ostringstream os;
    os << name << " (bound " << bound_text(tol) << ")";
    r.unverifiable.push_back(os.str());
    r.done = true;
    return;
  }
  const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  double rel_f32 = floor.rel();
  if (!inf_mismatch && !(rel <= tol) && !float32_floor_blocks(rel_f32, tol) && modelled &&
      subnormal_model_may_block(modelled->shift, floor, tol)) {
    const Tensor<double>& m = modelled->values();  // the terms' roundings below normal too
    Float32Floor f(bf16_stored);
    each_compared([&](int64_t i) { f.add(ref[i], m[i]); });
    rel_f32 = std::max(rel_f32, f.rel());
  }
  if (!inf_mismatch && !(rel <= tol) && float32_floor_blocks(rel_f32, tol)) {
    std::ostringstream os;
    os << std::setprecision(2) << name << " (" << (bf16_stored ? "bf16" : "float32")
       << " alone errs " << rel_f32 << ")";
    r.below_normal.push_back(os.str());
    r.done = true;
    return;
  }
  const bool exact = !inf_mismatch && num == 0;  // whatever the bound (NaN where not computable)
  const bool fails = !exact && (inf_mismatch || !(rel <= tol));
  r.done = true;
  r.max_abs = std::max(r.max_abs, max_abs);
  // worst: the first tensor that failed, else the one with the largest relative error.
  if (r.passed && (fails || rel > r.max_rel || r.worst.empty())) {
    r.max_rel = rel;
    r.worst = name;
    r.tolerance = tol;
    r.non_finite = non_finite;
  }
  if (fails) r.passed = false;
}

Tensor<double> to_f64(const Tensor<float>& x) {
  return convert<double>(x);
}

CheckReport run_check(const Problem& p, bool backward, const Tensor<float>& q,
                      const Tensor<float>& k, const Tensor<float>& v, const Tensor<float>& dout,
                      const Tensor<float>& out, const Tensor<float>& lse, const Tensor<float>& dq,
                      const Tensor<float>& dk, const Tensor<float>& dv) {
  CheckReport r;
  std::vector<int64_t> pos(p.S);
  std::iota(pos.begin(), pos.end(), 0);
  std::vector<int32_t> doc;
  for (size_t d = 0; d < p.doc_lengths.size(); ++d) doc.insert(doc.end(), p.doc_lengths[d], d);
  const Tokens all{pos.data(), doc.empty() ? nullptr : doc.data(), p.S};
  std::vector<int64_t> rows;  // sampled query rows (empty: all)
  if (p.S > kCheckFullMax) {
    r.sampled = true;
    for (int64_t j = 0; j < kCheckSampleRows; ++j)
      rows.push_back(j * (p.S - 1) / (kCheckSampleRows - 1));
  }
  const Tensor<double> qd = to_f64(q), kd = to_f64(k), vd = to_f64(v);
  Tensor<double> qs = qd;
  std::vector<int64_t> qpos = pos;
  std::vector<int32_t> qdoc = doc;
  if (r.sampled) {
    const int64_t w = p.H * p.D;
    qs = Tensor<double>({static_cast<int64_t>(rows.size()), p.H, p.D});
    qpos.clear();
    qdoc.clear();
    for (size_t j = 0; j < rows.size(); ++j) {
      std::copy_n(qd.data() + rows[j] * w, w, qs.data() + j * w);
      qpos.push_back(rows[j]);
      if (!doc.empty()) qdoc.push_back(doc[rows[j]]);
    }
  }
  const int64_t n = qs.size(0);
  const Tokens qt{qpos.data(), qdoc.empty() ? nullptr : qdoc.data(), n};
  Tensor<double> ref_out({n, p.H, p.D}), ref_lse({p.H, n});
  reference_forward(qs.view3(), kd.view3(), vd.view3(), qt, all, p.kernel.mask, p.kernel.scale,
                    ref_out.view3(), ref_lse.data());
  // Scatter the sampled reference back into full-size tensors so one compare() serves both.
  Tensor<double> full_out({p.S, p.H, p.D}), full_lse_t({p.S, p.H, 1});
  Tensor<float> lse_t({p.S, p.H, 1});
  for (int64_t h = 0; h < p.H; ++h)
    for (int64_t i = 0; i < p.S; ++i) lse_t[i * p.H + h] = lse[h * p.S + i];
  const int64_t w = p.H * p.D;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t row = r.sampled ? rows[j] : j;
    std::copy_n(ref_out.data() + j * w, w, full_out.data() + row * w);
    for (int64_t h = 0; h < p.H; ++h) full_lse_t[row * p.H + h] = ref_lse[h * n + j];
  }
  Tensor<double> dos;
  if (backward) {
    Tensor<double> dod = to_f64(dout);
    if (r.sampled) {
      dos = Tensor<double>({n, p.H, p.D});
      for (int64_t j = 0; j < n; ++j) std::copy_n(dod.data() + rows[j] * w, w, dos.data() + j * w);
    } else {
      dos = std::move(dod);
    }
  }
  // Tolerances: loom/tolerance.h's check_limits, the fixed ones where they hold, else the
  // problem's own bounds. The score condition over every query row, sampled or not; the others
  // over the rows compared.
  const View3<const double> dos_v =
      backward ? View3<const double>(dos.view3()) : View3<const double>{};
  const CheckLimits bound = check_limits(
      qs.view3(), kd.view3(), vd.view3(), dos_v, qt, all, p.kernel.mask, p.kernel.scale,
      CheckedResults{p.bf16, p.bf16 && kernel_path_bf16_dots(), /*loom_kernels=*/true},
      fp32_score_bound(qd.view3(), kd.view3(), p.kernel.scale));
  r.per_problem_why = bound.why;
  r.per_problem_hint = check_limits_hint(bound.miss);
  r.per_problem_bounds = !r.per_problem_why.empty();
  // Unsampled full-size [S, H, D] tensor of the n compared rows of x [n, H, D].
  const auto scatter = [&](const Tensor<double>& x) {
    Tensor<double> full({p.S, p.H, p.D});
    for (int64_t j = 0; j < n; ++j)
      std::copy_n(x.data() + j * w, w, full.data() + (r.sampled ? rows[j] : j) * w);
    return full;
  };
  // subnormal_reference's out and gradients, computed once and only for a tensor that misses.
  struct ModelRun {
    Tensor<double> out, dq, dk, dv;
    bool done = false;
  } m;
  const auto modelled = [&]() -> ModelRun& {
    if (m.done) return m;
    Tensor<double> out_n({n, p.H, p.D}), dq_n;
    if (backward) {
      dq_n = Tensor<double>({n, p.H, p.D});
      m.dk = Tensor<double>(kd.shape());
      m.dv = Tensor<double>(vd.shape());
    }
    subnormal_reference(qs.view3(), kd.view3(), vd.view3(), dos_v, qt, all, p.kernel.mask,
                        p.kernel.scale, out_n.view3(), backward ? dq_n.view3() : View3<double>{},
                        backward ? m.dk.view3() : View3<double>{},
                        backward ? m.dv.view3() : View3<double>{});
    m.out = scatter(out_n);
    if (backward) m.dq = scatter(dq_n);
    m.done = true;
    return m;
  };
  const SubnormalShift shift =
      subnormal_reference_shift(qd.view3(), kd.view3(), vd.view3(), dos_v, p.kernel.scale);
  const Modelled m_out{shift.out, [&]() -> const Tensor<double>& { return modelled().out; }};
  compare("out", out, full_out, rows, w, bound.out, r, &m_out, p.bf16);  // out is bf16 there
  compare("lse", lse_t, full_lse_t, rows, p.H, bound.lse, r);
  if (backward) {
    Tensor<double> rdq({n, p.H, p.D}), rdk(kd.shape()), rdv(vd.shape());
    reference_backward(qs.view3(), kd.view3(), vd.view3(), dos.view3(), qt, all, p.kernel.mask,
                       p.kernel.scale, rdq.view3(), rdk.view3(), rdv.view3());
    const Modelled m_dq{shift.dq, [&]() -> const Tensor<double>& { return modelled().dq; }};
    compare("dq", dq, scatter(rdq), rows, w, bound.dq, r, &m_dq);
    if (!r.sampled) {  // dk, dv need every query row: checked in full only
      const Modelled m_dk{shift.dk, [&]() -> const Tensor<double>& { return modelled().dk; }};
      const Modelled m_dv{shift.dv, [&]() -> const Tensor<double>& { return modelled().dv; }};
      compare("dk", dk, rdk, {}, 0, bound.dk, r, &m_dk);
      compare("dv", dv, rdv, {}, 0, bound.dv, r, &m_dv);
    }
  }
  return r;
}

int default_threads(int ranks_here) {
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, hw / std::max(1, ranks_here));
}

// Progress on stderr for runs longer than `after` seconds (rank 0 only; 2 s unless
// LOOM_PROGRESS_AFTER_S says otherwise), at most one line a second.
class Progress {
 public:
  Progress(bool enabled, int total, double after)
      : enabled_(enabled), total_(total), start_(now_s()), after_(after) {}
  void update(int done) {
    if (!enabled_) return;
    const double t = now_s(), el = t - start_;
    if (el < after_ || t - last_ < 1.0) return;
    last_ = t;
    const double eta = done > 0 ? el / done * (total_ - done) : 0;
    std::fprintf(stderr, "loom attn: iteration %d/%d, %.1f s elapsed, about %.1f s left\n", done,
                 total_, el, eta);
    shown_ = true;
  }

 private:
  bool enabled_;
  int total_;
  double start_, after_, last_ = -1e300;
  bool shown_ = false;
};

// Rank 0 receives every rank's `bytes` into recv (P * bytes); the other ranks only send, so no
// rank but 0 holds P copies of anything (an all_gather here made each rank's report memory grow
// with P, and the whole run's with P^2 or P^3).
void gather_to_root(Communicator& world, const void* send, size_t bytes, void* recv) {
  const int P = world.size(), me = world.rank();
  constexpr int kTag = 7100;
  if (me != 0) {
    world.isend(send, bytes, 0, kTag)->wait();
    return;
  }
  if (bytes == 0) return;
  std::copy_n(static_cast<const char*>(send), bytes, static_cast<char*>(recv));
  for (int r = 1; r < P; ++r)
    world.irecv(static_cast<char*>(recv) + static_cast<size_t>(r) * bytes, bytes, r, kTag)->wait();
}

// Why finite inputs gave a non-finite result, from the ranks' inputs (collective): the scores
// scale q.k are at most |scale| max|q| max|k| (Cauchy-Schwarz). Past 2^24 float32 holds a score
// only to within 1 or more, and exp(score - lse) can overflow with scores far below FLT_MAX
// (`--backward --scale 1e8` was reported as scores that overflowed float32).
std::string why_non_finite(Communicator& world, double scale, const Tensor<float>& q,
                           const Tensor<float>& k, const Tensor<float>& v,
                           const Tensor<float>* dout) {
  double m[4] = {row_norm_and_max(q).first, row_norm_and_max(k).first, row_norm_and_max(v).second,
                 dout ? row_norm_and_max(*dout).second : 0.0};
  world.all_reduce(m, 4, DType::f64, ReduceOp::max);
  const double bound = std::abs(scale) * m[0] * m[1];
  std::ostringstream os;
  os << std::setprecision(3) << "the inputs are finite";
  // The kernels' softmax runs in base 2 on scores times log2(e).
  if (bound > std::numeric_limits<float>::max() / 1.4426950408889634)
    os << ", but the scores scale q.k can pass float32's range (|scale| max|q| max|k| = " << bound
       << "): lower --scale or the inputs' magnitude";
  else if (bound >= 0x1p24)
    os << ", but the scores scale q.k can reach " << bound << " (|scale| max|q| max|k|), where "
       << "float32 holds a score only to about " << bound * 0x1p-24 << ": too coarse for the "
       << "softmax's exp(score - lse), which can then overflow; lower --scale or the inputs' "
          "magnitude";
  else {
    os << " and the scores small (|scale q.k| <= " << bound << "), so products or sums of the "
       << "values overflowed float32 (largest |v| " << m[2];
    if (dout) os << ", |dout| " << m[3];
    os << "): scale the inputs down";
  }
  return os.str();
}

// Every rank scans its results for NaN and Inf (lse may be -inf: a row that sees no key). The
// ranks exchange what they found, and all of them throw the same error naming the first rank's
// first non-finite value and why (why_non_finite), so none is left waiting for another.
void require_finite_results(Communicator& world, const ShardPlan& plan, int64_t iteration,
                            double scale, const Tensor<float>& q, const Tensor<float>& k,
                            const Tensor<float>& v, const Tensor<float>* dout,
                            const Tensor<float>& out, const Tensor<float>& lse,
                            const Tensor<float>* dq, const Tensor<float>* dk,
                            const Tensor<float>* dv) {
  const int me = world.rank(), P = world.size();
  static const char* const kNames[] = {"out", "lse", "dq", "dk", "dv"};
  const Tensor<float>* ts[] = {&out, &lse, dq, dk, dv};
  int64_t bad[4] = {-1, -1, -1, 0};  // tensor, global token, head, 1 for NaN
  const int64_t n = plan.rows(me);
  for (int t = 0; t < 5 && bad[0] < 0; ++t) {
    if (!ts[t]) continue;
    const Tensor<float>& x = *ts[t];
    for (int64_t i = 0; i < x.numel(); ++i) {
      const float v = x[i];
      if (std::isfinite(v) || (t == 1 && v == -INFINITY)) continue;
      int64_t row = 0, head = 0;
      if (t == 1) {  // lse [H, n]
        head = i / std::max<int64_t>(1, n);
        row = i % std::max<int64_t>(1, n);
      } else {  // [n, heads, D]
        row = i / (x.size(1) * x.size(2));
        head = (i / x.size(2)) % x.size(1);
      }
      bad[0] = t;
      bad[1] = plan.tokens[me][static_cast<size_t>(row)];
      bad[2] = head;
      bad[3] = std::isnan(v) ? 1 : 0;
      break;
    }
  }
  // The first rank with a bad value (P: none), then its details; O(1) memory per rank.
  int64_t key = bad[0] >= 0 ? P - me : 0;  // max over ranks: P - (first bad rank)
  world.all_reduce(&key, 1, DType::i64, ReduceOp::max);
  if (key == 0) return;
  const int64_t first = P - key;
  int64_t b[4] = {-1, -1, -1, -1};
  if (me == first) std::copy_n(bad, 4, b);
  world.all_reduce(b, 4, DType::i64, ReduceOp::max);
  {
    const int r = static_cast<int>(first);
    const std::string why = why_non_finite(world, scale, q, k, v, dout);
    std::ostringstream os;
    os << "non-finite result: " << kNames[b[0]] << " on rank " << r << " holds "
       << (b[3] ? "NaN" : "Inf") << " at token " << b[1] << ", head " << b[2] << " after iteration "
       << iteration << " (" << why << ")";
    throw Error(os.str(), __FILE__, __LINE__);
  }
}

// Whether a check (if one was run) lets the run succeed: it passed and could tell.
bool check_ok(const CheckReport& c) {
  return !c.done || (c.passed && c.conclusive());
}

// The job on one rank. Rank 0 fills `rep` and, with --output, stages the set in `*staged` for
// run_attn to commit when the whole run succeeds.
void attn_rank(Communicator& world, const AttnOptions& o, const Problem& p, int threads,
               AttnReport& rep, bool report, std::unique_ptr<OutputSet>* staged = nullptr) {
  const int P = world.size(), me = world.rank();
  const ShardPlan plan = ShardPlan::make(p.layout, p.S, P, p.doc_lengths);
  const int64_t n = plan.rows(me);
  CpConfig cfg = p.cp;
  cfg.kernel = p.kernel;
  cfg.kernel.threads = threads;
  CpAttention att(world, plan, cfg, p.H, p.HKV, p.D);

  // Inputs: this rank's rows only.
  Tensor<float> q, k, v, dout;
  if (!o.input.empty()) {
    q = plan.shard(p.q, me);
    k = plan.shard(p.k, me);
    v = plan.shard(p.v, me);
    if (o.backward) dout = plan.shard(p.dout, me);
  } else {
    q = Tensor<float>({n, p.H, p.D});
    k = Tensor<float>({n, p.HKV, p.D});
    v = Tensor<float>({n, p.HKV, p.D});
    fill_normal(q.view3(), plan.tokens[me].data(), o.seed, "q");
    fill_normal(k.view3(), plan.tokens[me].data(), o.seed, "k");
    fill_normal(v.view3(), plan.tokens[me].data(), o.seed, "v");
    if (o.backward) {
      dout = Tensor<float>({n, p.H, p.D});
      fill_normal(dout.view3(), plan.tokens[me].data(), o.seed, "dout");
    }
  }
  // bf16 storage: the values the kernels see are the bf16-rounded inputs.
  Tensor<bf16> bq, bk, bv, bdout, bout;
  if (p.bf16) {
    bq = convert<bf16>(q);
    bk = convert<bf16>(k);
    bv = convert<bf16>(v);
    bout = Tensor<bf16>({n, p.H, p.D});
    if (o.backward) bdout = convert<bf16>(dout);
  }
  Tensor<float> out({n, p.H, p.D}), lse({p.H, n}), dq, dk, dv;
  if (o.backward) {
    dq = Tensor<float>({n, p.H, p.D});
    dk = Tensor<float>({n, p.HKV, p.D});
    dv = Tensor<float>({n, p.HKV, p.D});
  }

  std::vector<double> fwd, bwd;
  const bool want_spans = report && (!o.trace.empty() || !o.timeline.empty());
  const int total = o.warmup + o.iters;
  Progress progress(report && me == 0 && !o.quiet, total, o.progress_after_s);
  for (int it = 0; it < total; ++it) {
    const bool timed = it >= o.warmup;
    if (it == o.warmup) att.metrics().clear_counters();
    // Spans only for a trace or timeline, of the timed iterations (bounded by span_limit).
    att.metrics().record_spans = timed && want_spans;
    world.barrier();
    double t0 = now_s();
    if (p.bf16) {
      att.forward(bq.view3(), bk.view3(), bv.view3(), bout.view3(), lse.data());
    } else {
      att.forward(q.view3(), k.view3(), v.view3(), out.view3(), lse.data());
    }
    double tf = now_s() - t0;
    world.all_reduce(&tf, 1, DType::f64, ReduceOp::max);  // the slowest rank
    if (timed) fwd.push_back(tf);
    if (o.backward) {
      world.barrier();
      t0 = now_s();
      if (p.bf16) {
        att.backward(bq.view3(), bk.view3(), bv.view3(), bout.view3(), bdout.view3(), lse.data(),
                     dq.view3(), dk.view3(), dv.view3());
      } else {
        att.backward(q.view3(), k.view3(), v.view3(), out.view3(), dout.view3(), lse.data(),
                     dq.view3(), dk.view3(), dv.view3());
      }
      double tb = now_s() - t0;
      world.all_reduce(&tb, 1, DType::f64, ReduceOp::max);
      if (timed) bwd.push_back(tb);
    }
    progress.update(it + 1);
  }
  if (p.bf16) out = convert<float>(bout);
  require_finite_results(world, plan, total, p.kernel.scale, q, k, v, o.backward ? &dout : nullptr,
                         out, lse, o.backward ? &dq : nullptr, o.backward ? &dk : nullptr,
                         o.backward ? &dv : nullptr);

  // Per-rank counters, per timed iteration, gathered everywhere (all ranks take part).
  const CpMetrics& m = att.metrics();
  const RankCounters mine = RankCounters::of(m, o.iters, peak_rss_bytes());
  std::vector<RankCounters> counters(me == 0 ? static_cast<size_t>(P) : 0);
  gather_to_root(world, &mine, sizeof mine, counters.data());
  std::vector<int64_t> steps(P, -1);
  std::copy_n(m.step_tiles.begin(), std::min<size_t>(P, m.step_tiles.size()), steps.begin());
  std::vector<int64_t> all_steps(me == 0 ? static_cast<size_t>(P) * P : 0);
  gather_to_root(world, steps.data(), sizeof(int64_t) * P, all_steps.data());
  std::vector<std::vector<CpMetrics::Span>> spans;
  if (want_spans) spans = gather_spans(world, m.spans);

  // Gather results where rank 0 needs them.
  const bool need = report && (o.check || !o.output.empty());
  Tensor<float> g_out, g_lse, g_dq, g_dk, g_dv;
  if (need) {
    g_out = gather_rows(world, plan, out);
    Tensor<float> lse_rows({n, p.H, 1});
    for (int64_t h = 0; h < p.H; ++h)
      for (int64_t i = 0; i < n; ++i) lse_rows[i * p.H + h] = lse[h * n + i];
    const Tensor<float> g_lse_rows = gather_rows(world, plan, lse_rows);
    g_lse = Tensor<float>({p.H, p.S});
    for (int64_t h = 0; h < p.H; ++h)
      for (int64_t i = 0; i < p.S; ++i) g_lse[h * p.S + i] = g_lse_rows[i * p.H + h];
    if (o.backward) {
      g_dq = gather_rows(world, plan, dq);
      g_dk = gather_rows(world, plan, dk);
      g_dv = gather_rows(world, plan, dv);
    }
  }
  if (me != 0) return;
  // Rank 0 goes on alone (its fp64 --check took 85 to 107 s at --seq 4096, far longer with more
  // heads; then the --output files): under mpirun it tells the others, which wait for it at exit,
  // that it is still working, so their LOOM_FINALIZE_TIMEOUT_S counts from its latest word (a
  // check longer than that ended the healthy job with no report).
  const std::shared_ptr<void> alone = mpi_rank0_alone();

  rep.fwd_times = fwd;
  rep.bwd_times = bwd;
  rep.world = P;
  rep.config["ranks"] = P;  // under mpirun, -np (--ranks is the local backend's; it read 1 there)
  rep.backend = world.backend();
  rep.threads = threads;
  rep.ranks.assign(P, {});
  for (int r = 0; r < P; ++r) {
    RankReport& k = rep.ranks[r];
    k.rank = r;
    static_cast<RankCounters&>(k) = counters[r];
    for (int s = 0; s < P; ++s)
      if (all_steps[r * P + s] >= 0) k.step_tiles.push_back(all_steps[r * P + s]);
    if (want_spans) k.spans = std::move(spans[r]);
  }
  if (!report) return;
  if (o.check) {
    // Global inputs: from the files, or regenerated (identical values, no communication).
    Tensor<float> gq = p.q, gk = p.k, gv = p.v, gdout = p.dout;
    if (o.input.empty()) {
      std::vector<int64_t> all(p.S);
      std::iota(all.begin(), all.end(), 0);
      gq = Tensor<float>({p.S, p.H, p.D});
      gk = Tensor<float>({p.S, p.HKV, p.D});
      gv = Tensor<float>({p.S, p.HKV, p.D});
      fill_normal(gq.view3(), all.data(), o.seed, "q");
      fill_normal(gk.view3(), all.data(), o.seed, "k");
      fill_normal(gv.view3(), all.data(), o.seed, "v");
      if (o.backward) {
        gdout = Tensor<float>({p.S, p.H, p.D});
        fill_normal(gdout.view3(), all.data(), o.seed, "dout");
      }
    }
    if (p.bf16) {  // the reference runs on the values the kernels saw
      for (Tensor<float>* t : {&gq, &gk, &gv, &gdout})
        if (t->numel() > 0) *t = convert<float>(convert<bf16>(*t));
    }
    rep.check = run_check(p, o.backward, gq, gk, gv, gdout, g_out, g_lse, g_dq, g_dk, g_dv);
  }
  if (!o.output.empty() && check_ok(rep.check) && staged) {
    // One set: staged in a fresh directory here, swapped in whole by run_attn once the run has
    // succeeded (loom/io.h OutputSet); committed before the check, a failed run replaced DIR.
    *staged = std::make_unique<OutputSet>(o.output, kOutputNames);
    OutputSet& set = **staged;
    write_npy(set.path("out.npy"), g_out);
    write_npy(set.path("lse.npy"), g_lse);
    if (o.backward) {
      write_npy(set.path("dq.npy"), g_dq);
      write_npy(set.path("dk.npy"), g_dk);
      write_npy(set.path("dv.npy"), g_dv);
    }
  }
}

// --baseline's run: the same problem on one rank, for its time only (no check, no files).
AttnOptions baseline_options(const AttnOptions& o) {
  AttnOptions one = o;
  one.check = false;
  one.output.clear();
  one.json.clear();
  one.trace.clear();
  one.timeline.clear();
  one.baseline = false;
  return one;
}

// --baseline's strategy configuration: p's, at degree 1. A degree option (hybrid's --ulysses,
// ring2d's --inner) divides the ranks, and one rank has only degree 1: the P-rank degree failed
// the strategy's rule for one rank after the whole P-rank run ("hybrid: --ulysses 2 must divide
// the number of ranks 1"). Checked here, before any run: InvalidArgument naming --baseline.
CpConfig baseline_config(const Problem& p) {
  CpConfig one = p.cp;
  if (!strategy_info(one.strategy).option.empty()) set_degree(one, 1);
  try {
    check_cp_config(one, 1, p.H, p.HKV);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(
        std::string("--baseline runs the problem on one rank, which --strategy ") +
            to_string(one.strategy) + " cannot: " + e.what(),
        __FILE__, __LINE__);
  }
  return one;
}

// What --baseline ran, for the report: {"ranks": 1, "strategy": ..., its degree option: 1,
// "threads_per_rank": T}.
nlohmann::json baseline_json(const CpConfig& one, int threads) {
  nlohmann::json j = {{"ranks", 1}, {"strategy", to_string(one.strategy)}};
  const std::string& option = strategy_info(one.strategy).option;  // "--ulysses"
  if (!option.empty()) j[option.substr(2)] = 1;
  j["threads_per_rank"] = threads;
  return j;
}

nlohmann::json config_json(const AttnOptions& o, const Problem& p) {
  nlohmann::json j = {{"seq", p.S},
                      {"heads", p.H},
                      {"kv_heads", p.HKV},
                      {"head_dim", p.D},
                      {"causal", o.causal},
                      {"window", o.window},
                      {"docs", p.doc_lengths},
                      {"backward", o.backward},
                      {"check", o.check},
                      {"input", o.input},
                      {"output", o.output},
                      {"seed", o.seed},
                      {"threads", o.threads},
                      {"iters", o.iters},
                      {"warmup", o.warmup},
                      {"scale", p.kernel.scale},
                      {"ranks", o.ranks},
                      {"strategy", o.strategy},
                      {"layout", o.layout},
                      {"dtype", o.dtype},
                      {"fault", o.fault},
                      {"baseline", o.baseline},
                      {"json", o.json},
                      {"trace", o.trace},
                      {"timeline", o.timeline}};
  for (const auto& [name, value] : o.degrees.values()) j[name] = value;  // "ulysses", "inner"
  return j;
}

// Peak bytes of the run's allocations in this process, from the problem alone (before anything
// is allocated). `ranks_here` ranks live in this process (all of them on the local backend, one
// under mpirun), each calling the kernels with `threads` threads. The phases follow each other,
// so the peak is the largest of them, plus what outlives its phase (the local backend's pool of
// message copies) and the --input files:
//   run     each rank's shard (fp32 and bf16 inputs and outputs), the strategy's working set
//           (strategy_working_bytes: its buffers, the kernels' workspace and, on the local
//           backend, its message copies), its threads, communicator and plan, and rank 0's
//           report counters;
//   gather  with --check or --output every rank also receives the global results (gather_rows
//           is an all-gather: its own padded rows, the P ranks' rows and the global tensor, the
//           earlier results kept), and the local backend copies at most one message of each pair
//           of ranks per all-gather (each rank posts its receives first);
//   check   with --check, rank 0 alone (the others have returned) also holds the regenerated
//           global inputs and run_check's fp64 copies, reference and scattered results (all
//           query rows up to kCheckFullMax, else kCheckSampleRows of them).
double attn_run_bytes(const AttnOptions& o, const Problem& p, int world, int ranks_here,
                      int threads) {
  const double S = double(p.S), H = double(p.H), HKV = double(p.HKV), D = double(p.D);
  // A rank's rows, in integers: as a double it rounded S = 2^63 - 1 up to 2^63, whose
  // conversion back to int64 overflowed (the estimate went negative and the run went on).
  const int64_t rows = rank_rows_bound(p.S, world);
  const double P = double(world), n = double(rows), here = double(ranks_here);
  const bool bw = o.backward, local = !launched_by_mpirun();
  const double q_rows = n * H * D * 4, kv_rows = n * HKV * D * 4;
  // q,out(,dout,dq) k,v(,dk,dv), lse, and their bf16 copies, with the fp32 out converted back
  // from bf16 after the run beside the one it replaces
  double shard = q_rows * (bw ? 4 : 2) + kv_rows * (bw ? 4 : 2) + n * H * 4;
  if (p.bf16) shard += (q_rows * (bw ? 3 : 2) + kv_rows * 2) / 2 + q_rows;
  CpProblem cp;
  cp.seq = p.S;
  cp.rows = rows;
  cp.heads = p.H;
  cp.kv_heads = p.HKV;
  cp.head_dim = p.D;
  cp.ranks = world;
  cp.backward = bw;
  cp.dtype_bytes = p.bf16 ? 2 : 4;
  cp.threads = threads;
  cp.local_backend = local;
  const double working = strategy_working_bytes(p.cp, cp);
  cp.local_backend = false;
  const double pool = working - strategy_working_bytes(p.cp, cp);  // message copies, scratch
  // Its thread, communicator and engine (256 KiB and 1 KiB per rank of the world: the local
  // backend's receives of a collective in flight, one per peer; fitted to the peaks of 16 to 1024
  // ranks of 256 to 4096 tokens, 0.4 MiB a rank at 256 ranks, 1.0 MiB at 1024; the 1 MiB counted
  // before, from when each pair of ranks kept its channels for ever, was up to 2.9x high), each
  // further kernel thread's stack and OpenMP state (about 200 KiB, measured), and the token lists
  // of the whole plan (int64 positions, int32 documents), which attn_rank, CpAttention, its
  // engine and hybrid's groups each hold.
  // --trace and --timeline: each rank keeps the spans of its timed iterations, at most
  // CpMetrics::span_limit; an iteration makes at most 5P + 2 of them forward and 16P + 8 with
  // the backward (measured for every strategy, layout and degree at 1 to 16 ranks: ring's and
  // ring2d's forward 5P - 4, ulysses' 6; ring2d's backward 16P - 8, ulysses' 16). A rank holds them
  // (a vector that may have doubled past them) and its row of gather_spans (32 bytes a span); rank
  // 0 every rank's, for the report, and then the text of the trace and the timeline, reserved at
  // their bounds (report.h). They were counted nowhere: 16 ranks of 65,536 spans peaked at 2 GB
  // against an estimate of 17.3 MiB.
  double spans = 0, render = 0;
  if (!o.trace.empty() || !o.timeline.empty()) {
    const double per_iter = bw ? 16.0 * P + 8 : 5.0 * P + 2;
    spans = std::min(double(CpMetrics{}.span_limit), double(std::max(0, o.iters)) * per_iter);
    if (!o.trace.empty())
      render += kReportFixedBytes + P * (kTraceBytesPerRank + spans * kTraceBytesPerSpan);
    if (!o.timeline.empty())
      render += kReportFixedBytes + P * (kTimelineBytesPerRank + spans * kTimelineBytesPerSpan);
  }
  const double span_bytes = double(sizeof(CpMetrics::Span));
  const double rank = shard + working + 256.0 * 1024 + 1024.0 * P + 256.0 * 1024 * (threads - 1) +
                      4 * S * 12 + spans * (2 * span_bytes + 32);
  const double report = P * P * 8 + P * 128 + P * spans * span_bytes + spans * 32;
  double peak = rank * here + report;
  const bool need = o.check || !o.output.empty();
  double gathered = 0;  // on every rank after the gathers: out, lse (and dq, dk, dv)
  if (need) {
    gathered = S * (H * D + H + (bw ? (H + 2 * HKV) * D : 0)) * 4;
    // The largest gather in flight (dq's or out's): its own padded rows and the P ranks' (the
    // global tensor is counted in `gathered`); lse's passes through a [S, H] transpose.
    const double in_flight = std::max((P + 1) * n * H * D * 4, (P + 2) * n * H * 4 + S * H * 4);
    double copies = 0;  // one message of each pair, for each size
    if (local) {
      copies = n * H * D * 4 + (bw && HKV != H ? n * HKV * D * 4 : 0) + n * H * 4;
      copies *= P * (P - 1) / 2;
    }
    peak = std::max(peak, (rank + gathered + in_flight) * here + report + copies);
    if (o.check) {
      // Rank 0: its shard and strategy, the others' pool, the gathered results; the regenerated
      // fp32 inputs; run_check's fp64 q, k, v (and q again when every row is compared), the
      // reference out, the scattered out, lse (fp32 and fp64), and in backward dout (and its
      // sampled rows), the reference dq, dk, dv and the scattered dq.
      const double rows_compared = p.S > kCheckFullMax ? double(kCheckSampleRows) : S;
      const double inputs = S * (2 * H + 2 * HKV) * D * 4;
      double ref =
          S * (H + 2 * HKV) * D * 8 + rows_compared * H * D * 8 * 2 + S * H * D * 8 + S * H * 20;
      if (bw)
        ref += S * H * D * 8 + rows_compared * H * D * 8 * 2 + S * 2 * HKV * D * 8 + S * H * D * 8;
      if (HKV > 1) ref += 2 * S * D * 8;  // the reference's copy of one kv head's k and v rows
      peak = std::max(peak, rank + pool * (here - 1) + copies + gathered + inputs + ref + report);
    }
  }
  const double files = o.input.empty() ? 0 : S * (2 * H + 2 * HKV) * D * (4 + 8);  // f32 + f64
  peak += files;
  // The reports are made once the ranks have ended: the inputs, rank 0's report and their text.
  peak = std::max(peak, files + report + render);
  if (o.baseline) {
    // Then, on rank 0, after the P ranks have ended and freed theirs (their local backend's pool
    // with them): what their run leaves (the global results for --output or --check, the files
    // read) and the whole problem on one rank.
    // The peak is the larger of the two: their sum refused runs that fit (593 MiB estimated at
    // --ranks 4 --seq 8192 --heads 64 --head-dim 16, against a 369 MB peak).
    AttnOptions one = baseline_options(o);
    one.input.clear();
    Problem base = p;  // shapes only: the --input bodies are read after the estimate
    base.cp = baseline_config(p);
    peak = std::max(peak, (need ? gathered * 2 : 0) + files + report +
                              attn_run_bytes(one, base, 1, 1, threads));
  }
  return peak;
}

// The estimate --memory-limit and an address-space limit compare: the run's allocations
// (attn_run_bytes) and the process as it stands, its resident set (the binary, its libraries and
// OpenBLAS: 9 to 10 MiB measured on the local backend; about 19 MiB under mpirun, once MPI is
// initialised), in whole MiB and at least 12 MiB: the resident set moves by a few pages from one
// run to the next (OpenBLAS's threads start as the library loads), and one problem's estimate
// must not (--baseline's is compared with the run's alone).
double estimate_attn_bytes(const AttnOptions& o, const Problem& p, int world, int ranks_here,
                           int threads) {
  const double mib = 1024.0 * 1024.0;
  const double process = std::max(12 * mib, std::ceil(double(current_rss_bytes()) / mib) * mib);
  return process + attn_run_bytes(o, p, world, ranks_here, threads);
}

// The address space the run's threads map beyond what attn_run_bytes counts, for check_memory's
// mapped_bytes (threads_mapped_bytes, commands.h): a stack for each of the `rank_threads` threads
// the local backend starts (one a rank; none under mpirun, where the rank is the main thread) and
// for each kernel thread past the first of each of the `ranks_here` ranks (OpenMP's workers),
// with their malloc arenas: the rank threads allocate, the workers only with bf16 storage
// (`workers_allocate`; measured: a bf16 run of 16 threads maps 15 arenas more than one of 1
// thread, an fp32 run none). Counted nowhere, loom attn under `ulimit -v` passed its check and
// ended in libgomp's abort ("libgomp: Thread creation failed", --threads 256) or in "could not
// start the thread of rank 48" (--ranks 64).
double attn_mapped_bytes(int rank_threads, int ranks_here, int threads, bool workers_allocate,
                         std::string* what) {
  bool blas_missing = false;
  const double bytes =
      threads_mapped_bytes(rank_threads, ranks_here, threads, workers_allocate, &blas_missing);
  if (what) {
    const long long n = static_cast<long long>(rank_threads) +
                        ranks_here * static_cast<long long>(std::max(0, threads - 1));
    *what = "for the stacks and malloc arenas of its " + std::to_string(n) + " thread" +
            (n == 1 ? "" : "s") +
            (blas_missing ? " and OpenBLAS's buffers still to be mapped" : "") +
            "; fewer --ranks or --threads map less";
  }
  return bytes;
}

int run_attn(const AttnOptions& o) {
  // Outputs: distinct paths, and no temporaries left by an earlier killed run.
  std::vector<std::pair<std::string, std::string>> paths;
  if (!o.input.empty())  // an output must not replace an input (--json in/q.npy did)
    for (const char* name : {"q.npy", "k.npy", "v.npy", "dout.npy"})
      paths.emplace_back("--input's " + std::string(name), o.input + "/" + name);
  for (const auto& [option, path] : {std::pair<const char*, const std::string*>{"--json", &o.json},
                                     {"--trace", &o.trace},
                                     {"--timeline", &o.timeline},
                                     {"--output", &o.output}})
    paths.emplace_back(option, *path);
  check_distinct_outputs(paths, o.input.empty() ? 0 : 4);
  // --output DIR is replaced as a whole after the run: a report written inside it was either
  // swapped away with the old set or, written after the swap, replaced one of its files (--json
  // DIR/out.npy left the JSON as out.npy) or became a foreign file the next run refuses.
  for (const auto& [option, path] : {std::pair<const char*, const std::string*>{"--json", &o.json},
                                     {"--trace", &o.trace},
                                     {"--timeline", &o.timeline}})
    check_output_outside(option, *path, "--output", o.output, "which loom replaces as a whole");
  // Only the writer (rank 0) removes stale temporaries: a pid is judged on this node, in this
  // PID namespace, so another rank took a running job's for a dead one's (io.h).
  if (launcher_rank() <= 0) {
    for (const std::string* out : {&o.json, &o.trace, &o.timeline})
      if (!out->empty()) clean_stale_temps(*out);
    if (!o.output.empty()) clean_stale_temps(o.output, kOutputNames);
  }
  // Unwritable outputs fail here, not after the run (--json nodir/r.json ran the whole job,
  // printed its table and only then failed).
  check_output_writable(o.json, "--json");
  check_output_writable(o.trace, "--trace");
  check_output_writable(o.timeline, "--timeline");
  check_output_writable(o.output, "--output", true);
  check_output_set(o.output, kOutputNames);  // a foreign file in DIR: refused now, not after
  const int64_t memory_limit =
      o.memory_limit.empty() ? -1 : parse_size(o.memory_limit, "--memory-limit");
  Problem p = make_problem(o);  // shapes and options; the --input bodies come after the estimate
  AttnReport rep;
  rep.config = config_json(o, p);
  rep.strategy = o.strategy;
  rep.layout = o.layout;
  rep.dtype = o.dtype;
  rep.iters = o.iters;
  rep.S = p.S;
  rep.H = p.H;
  rep.HKV = p.HKV;
  rep.D = p.D;
  rep.causal = p.kernel.mask.causal;
  rep.backward = o.backward;
  rep.window = p.kernel.mask.window;
  rep.docs = std::max<size_t>(1, p.doc_lengths.size());
  rep.scale = p.kernel.scale;
  rep.degrees = o.degrees.values();
  int threads = 1;
  bool root = true;
  std::unique_ptr<OutputSet> staged;  // --output, committed last: a failed run leaves DIR as it was
  std::unique_ptr<Communicator> mpi;
  CpConfig baseline_cp;  // --baseline's one-rank configuration (baseline_config)
  if (launched_by_mpirun()) {
    LOOM_CHECK(!o.ranks_given, InvalidArgument,
               "--ranks is for the local backend; under mpirun the number of ranks is mpirun's "
               "-np (drop --ranks)");
    LOOM_CHECK(o.fault.empty(), InvalidArgument,
               "--fault works on the local backend only (not under mpirun)");
    mpi = mpi_world();
    const int here = std::max(1, mpi_ranks_on_this_node());
    threads = o.threads ? o.threads : default_threads(here);
    // --memory-limit bounds one process, as in loom train: under mpirun one rank. Without it,
    // the node's `here` ranks together must fit in its available memory (each rank was checked
    // alone against all of it, so 4 ranks that each fitted could together not).
    const double one = estimate_attn_bytes(o, p, mpi->size(), 1, threads);
    const std::string node = "loom attn with " + std::to_string(here) + " rank" +
                             (here > 1 ? "s" : "") + " on this node";
    // The address-space limit is this process's: its one rank's threads (the rank is the main
    // thread).
    std::string mapped_what;
    const double mapped = attn_mapped_bytes(0, 1, threads, p.bf16, &mapped_what);
    if (memory_limit >= 0)
      check_memory(one, memory_limit, "this rank", "--memory-limit", mapped, mapped_what);
    else
      check_memory(here * one, memory_limit, node, "--memory-limit", mapped, mapped_what);
    load_inputs(o, p);
    {  // every rank the same command line and the same --input bytes (commands.h)
      uint64_t h = 0;
      if (!o.input.empty()) {
        h = fnv1a64(nullptr, 0);
        for (const Tensor<float>* t : {&p.q, &p.k, &p.v, &p.dout})
          h = fnv1a64(t->data(), static_cast<size_t>(t->numel()) * sizeof(float), h);
      }
      agree_across_ranks(*mpi, h, "--input files");
    }
    check_cp_config(p.cp, mpi->size(), p.H, p.HKV);  // the strategy's rules, before any work
    if (o.baseline) baseline_cp = baseline_config(p);
    attn_rank(*mpi, o, p, threads, rep, true, &staged);
    root = mpi->rank() == 0;
  } else {
    LOOM_CHECK(o.ranks >= 1, InvalidArgument, "--ranks must be >= 1, got " << o.ranks);
    const FaultPlan faults = o.fault.empty() ? FaultPlan{} : parse_fault(o.fault);
    LOOM_CHECK(
        faults.kill_rank < o.ranks && faults.drop_rank < o.ranks && faults.delay_rank < o.ranks,
        InvalidArgument, "--fault " << o.fault << " names a rank outside 0.." << o.ranks - 1);
    check_cp_config(p.cp, o.ranks, p.H, p.HKV);  // the strategy's rules, before any rank starts
    if (o.baseline) baseline_cp = baseline_config(p);
    threads = o.threads ? o.threads : default_threads(o.ranks);
    // The threads' address space last, just before check_memory reads what is mapped: an
    // OpenBLAS buffer mapped in between is counted twice (a refusal near the limit), never not.
    const double estimate = estimate_attn_bytes(o, p, o.ranks, o.ranks, threads);
    std::string mapped_what;
    const double mapped = attn_mapped_bytes(o.ranks, o.ranks, threads, p.bf16, &mapped_what);
    check_memory(estimate, memory_limit,
                 "loom attn with " + std::to_string(o.ranks) + " rank" + (o.ranks > 1 ? "s" : ""),
                 "--memory-limit", mapped, mapped_what);
    load_inputs(o, p);
    run_local(
        o.ranks, [&](Communicator& world) { attn_rank(world, o, p, threads, rep, true, &staged); },
        faults);
    // A kill or a drop that fires always ends the run with an error; reaching here means the
    // run finished before the fault's op.
    LOOM_CHECK(faults.kill_rank < 0 && faults.drop_rank < 0, InvalidArgument,
               "--fault " << o.fault << " never fired: rank "
                          << std::max(faults.kill_rank, faults.drop_rank)
                          << " finished before that operation (choose a smaller at=)");
  }
  if (!root) return 0;
  if (o.baseline) {
    // The same problem on one rank with the same threads per rank: T1 for the efficiency. The
    // strategy at degree 1 (baseline_config); the report says what ran.
    const AttnOptions one = baseline_options(o);
    p.cp = baseline_cp;
    AttnReport base;
    run_local(1, [&](Communicator& world) { attn_rank(world, one, p, threads, base, false); });
    rep.baseline_s = base.forward_s() + (o.backward ? base.backward_s() : 0.0);
    rep.baseline_run = baseline_json(baseline_cp, threads);
  }
  // With an output on standard output ("-"), the table stays off it.
  if (o.json != "-" && o.trace != "-" && o.timeline != "-") print_text(rep);
  for (const RankReport& k : rep.ranks)
    if (k.spans_dropped > 0 && (!o.trace.empty() || !o.timeline.empty()))
      std::fprintf(stderr, "loom attn: note: rank %d kept its first %zu spans and dropped %.0f\n",
                   k.rank, k.spans.size(), k.spans_dropped);
  // Every report's bytes first, then all written as a unit (write_outputs): one after another,
  // --json a.json --trace /dev/full wrote a.json and then failed. --output's set is swapped in
  // after them and after the check, below. Paths in the report's config are bytes, not always
  // UTF-8 (a directory named "bad\xff" failed the whole run at this point with the JSON library's
  // error): invalid bytes become U+FFFD.
  std::vector<std::pair<std::string, std::string>> outputs;
  if (!o.json.empty())
    outputs.emplace_back(
        o.json, to_json(rep).dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
  if (!o.trace.empty()) outputs.emplace_back(o.trace, chrome_trace(rep));
  if (!o.timeline.empty()) outputs.emplace_back(o.timeline, timeline_svg(rep));
  write_outputs(outputs);
  if (!check_ok(rep.check)) {
    if (rep.check.passed && rep.check.unverifiable.empty()) {
      std::string names;
      for (const std::string& u : rep.check.below_normal) names += (names.empty() ? "" : ", ") + u;
      std::fprintf(stderr,
                   "loom: error: check cannot tell %s: its exact values or the terms that sum to "
                   "them lie below float32's normal range, where no result as stored meets the "
                   "tolerance; scale the inputs up to check it\n",
                   names.c_str());
    } else if (rep.check.passed) {
      std::string names;
      for (const std::string& u : rep.check.unverifiable) names += (names.empty() ? "" : ", ") + u;
      std::fprintf(stderr,
                   "loom: error: check cannot tell: this problem's %s error bound for %s is 1 or "
                   "more (a result of zeros would pass; %s): %s\n",
                   rep.dtype.c_str(), names.c_str(), rep.check.per_problem_why.c_str(),
                   rep.check.per_problem_hint.c_str());
    } else if (rep.check.non_finite) {
      std::fprintf(stderr,
                   "loom: error: check failed: %s holds NaN or Inf values where the fp64 "
                   "reference is finite\n",
                   rep.check.worst.c_str());
    } else {
      std::fprintf(stderr,
                   "loom: error: check failed: %s differs from the fp64 reference (relative "
                   "error %.3g > %.3g)\n",
                   rep.check.worst.c_str(), rep.check.max_rel, rep.check.tolerance);
    }
    return 1;
  }
  // The new set is in place; an old one that could not be removed (another user's files) is
  // named, not left silently as DIR.tmp.PID-N.
  if (staged)
    if (const std::string left = staged->commit(); !left.empty())
      std::fprintf(stderr, "loom attn: warning: %s\n", left.c_str());
  return 0;
}

}  // namespace

void strict_integers(CLI::App* command) {
  for (CLI::Option* opt : command->get_options()) {
    const std::string type = opt->get_type_name();
    // An empty value read as "not given" (--input "" ran on generated inputs, --json "" wrote
    // nothing, exit 0: an unset shell variable) or as 0 (--scale ''): refused for every option
    // that takes a value.
    if (opt->get_type_size() != 0 && type != "INT" && type != "UINT")
      opt->check(CLI::Validator(
          [](std::string& text) -> std::string {
            return text.empty() ? "an empty value (give one, or leave the option out)" : "";
          },
          "", "non-empty"));
    // A number past double's range was read as inf and refused as "got inf" (--scale 1e309).
    if (type == "FLOAT")
      opt->check(CLI::Validator(
          [](std::string& text) -> std::string {
            char* end = nullptr;
            errno = 0;
            const double x = std::strtod(text.c_str(), &end);
            return errno == ERANGE && std::isinf(x)
                       ? "is out of range (beyond double's 1.8e308): " + text
                       : "";
          },
          "", "in double range"));
    if (type != "INT" && type != "UINT") continue;
    const bool is_unsigned = type == "UINT";
    // A transform, not a check: the text is rewritten as the decimal number it was read as, since
    // CLI11 then converts it with base 0, where a leading zero means octal (--seq 064 ran with
    // S = 52, --steps 010 ran 8 steps).
    opt->transform(CLI::Validator(
        [is_unsigned](std::string& text) -> std::string {
          const char* b = text.c_str();
          char* end = nullptr;
          errno = 0;
          std::string decimal;
          if (is_unsigned) {
            while (*b == ' ') ++b;
            if (*b == '-') return "must not be negative, got " + text;
            decimal = std::to_string(std::strtoull(b, &end, 10));
          } else {
            decimal = std::to_string(std::strtoll(b, &end, 10));
          }
          if (end == b || *end != '\0') return "is not an integer: '" + text + "'";
          if (errno == ERANGE) return "is out of range (does not fit 64 bits): " + text;
          text = decimal;
          return {};
        },
        "", "strict integer"));
  }
}

int exit_code() {
  return g_exit_code;
}
void set_exit_code(int code) {
  g_exit_code = code;
}

namespace {

void declare_attn(CLI::App* c, AttnOptions& opts) {
  AttnOptions* o = &opts;
  c->add_option("--seq", o->seq, "global sequence length S")->capture_default_str();
  c->add_option("--heads", o->heads, "query heads H")->capture_default_str();
  c->add_option("--kv-heads", o->kv_heads, "key/value heads HKV (default: H)");
  c->add_option("--head-dim", o->head_dim,
                "head dimension D (<= " + std::to_string(kMaxHeadDim) + ")")
      ->capture_default_str();
  add_mask_options(c, o->causal, o->window, o->docs);
  c->add_flag("--backward", o->backward, "also run the backward pass");
  c->add_flag("--check", o->check,
              "compare with the fp64 reference (above 4096 tokens: 256 sampled query rows)");
  c->add_option("--input", o->input,
                "directory with q.npy [S,H,D], k.npy and v.npy [S,HKV,D] (and dout.npy "
                "[S,H,D] with --backward)");
  c->add_option("--output", o->output,
                "directory to write out.npy [S,H,D], lse.npy [H,S] (and dq, dk, dv .npy)");
  c->add_option("--seed", o->seed, "seed of the generated inputs")->capture_default_str();
  c->add_option("--threads", o->threads, "OpenMP threads per rank (0: cores / ranks)")
      ->capture_default_str();
  c->add_option("--iters", o->iters, "timed iterations")->capture_default_str();
  c->add_option("--warmup", o->warmup, "untimed iterations first")->capture_default_str();
  c->add_option("--scale", o->scale, "softmax scale > 0 (default 1/sqrt(D))");
  c->add_option("--ranks", o->ranks, "ranks on the local backend (threads)")->capture_default_str();
  c->add_option("--strategy", o->strategy, strategy_help())->capture_default_str();
  c->add_option("--layout", o->layout, "contiguous, zigzag or stripe")->capture_default_str();
  o->degrees.add_to(c);
  c->add_option("--dtype", o->dtype,
                "storage of q, k, v, out, dout: fp32 or bf16 (accumulation is always fp32)")
      ->capture_default_str();
  c->add_flag("--quiet", o->quiet, "no progress output on stderr");
  c->add_option("--json", o->json, "write the report as JSON to FILE (keys: docs/cli.md)");
  c->add_option("--trace", o->trace, "write a Chrome trace (chrome://tracing, Perfetto) to FILE");
  c->add_option("--timeline", o->timeline, "write an SVG timeline of the ranks to FILE");
  c->add_option("--fault", o->fault,
                "local backend fault injection: kill:R[,at=K] (rank R fails at its K-th "
                "communication, 0-based; default 1), drop:R[,at=K] (its K-th message is lost) or "
                "delay:R:MS (see docs/cli.md)");
  c->add_flag("--baseline", o->baseline,
              "also time the same problem on one rank (the strategy's degree option at 1) and "
              "report the scaling efficiency");
  add_memory_limit_option(c, o->memory_limit);
}

}  // namespace

void add_attn_command(CLI::App& app) {
  add_command<AttnOptions>(app, "attn", "run one context-parallel attention and check it",
                           declare_attn, [](const CLI::App* c, AttnOptions& o) {
                             o.ranks_given = c->count("--ranks") > 0;
                             o.kv_heads_given = c->count("--kv-heads") > 0;
                             o.scale_given = c->count("--scale") > 0;
                             o.docs_given = c->count("--docs") > 0;
                             // Strictly, as LOOM_TIMEOUT_S: garbage (atof's 0) showed progress
                             // from the first iteration instead of being refused.
                             o.progress_after_s = env_seconds("LOOM_PROGRESS_AFTER_S", 2, 0, 1e9);
                             o.shape_given = c->count("--seq") + c->count("--heads") +
                                                 c->count("--kv-heads") + c->count("--head-dim") >
                                             0;
                             return run_attn(o);
                           });
}

}  // namespace loom::tools
