// The GPT on one mesh rank: parameters, forward and hand-written backward.
//
// Words (see gpt.h): n is this cp rank's token count, n_sp = ceil(n / tp) the rows of the
// residual stream this tp rank owns ("sp rows"), and a "full" buffer holds tp * n_sp rows of
// which the first n are the cp shard (the rest are zero padding). Forward of a layer:
//   h   = rmsnorm(x) on sp rows          -> all_gather over tp -> full rows
//   qkv = h Wq|Wk|Wv (column-parallel)   -> rotary on rope positions -> CpAttention -> o
//   y   = o Wo (row-parallel, partial)   -> reduce_scatter over tp -> sp rows; x += y
//   and the same shape for the SwiGLU MLP (W1, W3 column-parallel, W2 row-parallel).
// Backward mirrors it: the transpose of an all-gather is a reduce-scatter and vice versa.
// As in Megatron's sequence parallelism, a layer keeps its normed inputs as sp rows and gathers
// them again over tp for the weight gradients in backward.
// With activation checkpointing a layer keeps only its input x and recomputes the rest
// (including its CpAttention forward) right before its backward.
#include "loom/model/gpt.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "loom/error.h"
#include "loom/rng.h"
#include "loom/timer.h"
#include "ops.h"

namespace loom::model {

Precision parse_precision(const std::string& name) {
  if (name == "fp32") return Precision::fp32;
  if (name == "bf16") return Precision::bf16;
  LOOM_CHECK(false, InvalidArgument, "unknown dtype '" << name << "' (choose fp32 or bf16)");
  return Precision::fp32;
}

std::string to_string(Precision p) {
  return p == Precision::fp32 ? "fp32" : "bf16";
}

namespace {

// The mesh's cp axes must be the strategy's: CpAttention takes the cp group with its ulysses and
// ring axes, but only a strategy whose degree option is --ulysses (hybrid) reads them; ulysses
// runs one all-to-all over the whole group and every other strategy runs over the whole group
// too. A mismatch ran something else than the summary said: --ulysses 2 --ring 2 --strategy
// ulysses was a 4-way all-to-all reported as "ulysses=2 ring=2", --ranks 4 --strategy hybrid a
// ring (U = 1) reported as hybrid, and --ulysses 4 --strategy ring a ring.
void check_strategy_axes(const ParallelConfig& p) {
  const MeshShape& s = p.mesh;
  const std::string name = to_string(p.strategy);
  const int64_t cp = int64_t{s.ulysses} * s.ring;
  const std::string axes = "--ulysses " + std::to_string(s.ulysses) + " x --ring " +
                           std::to_string(s.ring) + " = " + std::to_string(cp) +
                           " context-parallel rank" + (cp == 1 ? "" : "s");
  if (strategy_info(p.strategy).option == "--ulysses") {
    // loom attn runs hybrid with any --ulysses U dividing the ranks, U = ranks included (the ring
    // then has one group); U = 1 is a plain ring, which is --strategy ring's to run and name.
    if (s.ulysses > 1) return;
    int64_t u = 2;
    while (u < cp && cp % u != 0) ++u;
    std::string hint = "--strategy ring";
    if (cp > 1)
      hint = "e.g. --ulysses " + std::to_string(u) +
             (cp / u > 1 ? " --ring " + std::to_string(cp / u) : std::string(" without --ring")) +
             ", or --strategy ring";
    LOOM_CHECK(false, InvalidArgument,
               "--strategy " << name
                             << " takes its ulysses degree from the mesh and needs --ulysses U > 1 "
                                "(ulysses inside groups of U ranks, a ring across the groups), but "
                                "the mesh has "
                             << axes << ": give " << hint);
  }
  if (p.strategy == Strategy::ulysses) {
    LOOM_CHECK(s.ring == 1, InvalidArgument,
               "--strategy ulysses runs one all-to-all over the whole context-parallel group and "
               "has no ring axis, but the mesh has "
                   << axes << ": give --ulysses " << cp << " without --ring"
                   << (s.ulysses > 1 ? ", or --strategy hybrid (ulysses inside groups of --ulysses "
                                       "U ranks, a ring across them)"
                                     : ""));
    return;
  }
  LOOM_CHECK(s.ulysses == 1, InvalidArgument,
             "--strategy " << name
                           << " runs over the whole context-parallel group and has no ulysses "
                              "axis, but the mesh has "
                           << axes << ": give --ring " << cp
                           << " without --ulysses, or --strategy hybrid (ulysses inside groups of "
                              "--ulysses U ranks, a ring across them)");
}

}  // namespace

void validate(const ModelConfig& m, const ParallelConfig& p, int world, int64_t seq) {
  const MeshShape& s = p.mesh;
  LOOM_CHECK(s.dp >= 1 && s.tp >= 1 && s.ulysses >= 1 && s.ring >= 1, InvalidArgument,
             "mesh sizes must be >= 1: dp=" << s.dp << " tp=" << s.tp << " ulysses=" << s.ulysses
                                            << " ring=" << s.ring);
  LOOM_CHECK(world <= 0 || s.ranks() == world, InvalidArgument,
             "mesh dp=" << s.dp << " x tp=" << s.tp << " x ulysses=" << s.ulysses << " x ring="
                        << s.ring << " = " << (s.ranks() == INT64_MAX ? "at least " : "")
                        << s.ranks() << " ranks, but the world has " << world
                        << " (--ranks must equal dp * tp * ulysses * ring)");
  check_strategy_axes(p);
  LOOM_CHECK(m.layers >= 1 && m.dim >= 1 && m.heads >= 1 && m.kv_heads >= 1, InvalidArgument,
             "--layers, --dim, --heads and --kv-heads must be >= 1 (got "
                 << m.layers << ", " << m.dim << ", " << m.heads << ", " << m.kv_heads << ")");
  // Byte-level: the embedding and the LM head have one row / column per byte value, and the
  // targets index the logits (vocab 100 wrote past them in cross_entropy).
  LOOM_CHECK(m.vocab == 256, InvalidArgument,
             "the model is byte-level, so its vocab must be 256 (got " << m.vocab << ")");
  // A zero row (sequence-parallel padding) needs norm_eps > 0; NaN or a negative one gave a NaN
  // loss, as did a NaN rope_theta.
  LOOM_CHECK(std::isfinite(m.norm_eps) && m.norm_eps > 0, InvalidArgument,
             "norm_eps must be finite and > 0, got " << m.norm_eps);
  LOOM_CHECK(std::isfinite(m.rope_theta) && m.rope_theta > 0, InvalidArgument,
             "rope_theta must be finite and > 0, got " << m.rope_theta);
  LOOM_CHECK(m.dim % m.heads == 0, InvalidArgument,
             "--dim " << m.dim << " must be a multiple of --heads " << m.heads);
  LOOM_CHECK(m.head_dim() % 2 == 0 && m.head_dim() <= kMaxHeadDim, InvalidArgument,
             "head dim (--dim / --heads = "
                 << m.head_dim() << ") must be even (rotary) and at most " << kMaxHeadDim);
  LOOM_CHECK(m.heads % m.kv_heads == 0, InvalidArgument,
             "--heads " << m.heads << " must be a multiple of --kv-heads " << m.kv_heads);
  LOOM_CHECK(m.heads % s.tp == 0 && m.kv_heads % s.tp == 0, InvalidArgument,
             "tensor parallelism splits heads: --heads "
                 << m.heads << " and --kv-heads " << m.kv_heads
                 << " must both be divisible by --tp " << s.tp);
  LOOM_CHECK(m.ffn_dim() % s.tp == 0, InvalidArgument,
             "the MLP hidden size " << m.ffn_dim() << " must be divisible by --tp " << s.tp);
  const int64_t cp = s.cp(), hl = m.heads / s.tp, hkvl = m.kv_heads / s.tp;
  // The strategy's head and group rules, on this rank's heads (the registry's one function).
  try {
    check_cp_config(cp_config(p, m.head_dim()), s.cp(), hl, hkvl);
  } catch (const InvalidArgument& e) {
    // The strategy's rules speak of the cp group's ranks and of one tp rank's heads: say which
    // (a ring2d --inner error said "the number of ranks 2" of a 4-rank run, and blamed heads).
    std::string what = e.what();
    if (what.find("head") != std::string::npos && s.tp > 1)
      what += " (heads of one tp rank: --heads " + std::to_string(m.heads) + " and --kv-heads " +
              std::to_string(m.kv_heads) + " over --tp " + std::to_string(s.tp) + ")";
    else if (what.find("head") == std::string::npos && s.cp() != s.world())
      what += " (the context-parallel group: ulysses " + std::to_string(s.ulysses) + " x ring " +
              std::to_string(s.ring) + " = " + std::to_string(s.cp()) + " of the " +
              std::to_string(s.world()) + " ranks)";
    if (what.size() == std::string(e.what()).size()) throw;
    throw InvalidArgument(what);
  }
  LOOM_CHECK(seq >= 2 * cp, InvalidArgument,
             "--seq " << seq << " is too short for " << cp
                      << " context-parallel ranks (need >= " << 2 * cp << ")");
}

Strategy default_strategy(const MeshShape& mesh) {
  if (mesh.ulysses > 1 && mesh.ring > 1) return Strategy::hybrid;
  if (mesh.ulysses > 1) return Strategy::ulysses;
  return Strategy::ring;
}

CpConfig cp_config(const ParallelConfig& p, int64_t head_dim) {
  CpConfig cfg;
  cfg.strategy = p.strategy;
  // A strategy whose degree option is --ulysses (hybrid) takes the mesh's ulysses degree.
  if (strategy_info(p.strategy).option == "--ulysses") set_degree(cfg, p.mesh.ulysses);
  cfg.inner = p.inner;
  cfg.degree = p.degree;
  cfg.kernel.mask.causal = true;
  cfg.kernel.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  cfg.kernel.threads = p.threads;
  return cfg;
}

// ---------------------------------------------------------------------------------------------

namespace {

struct LayerOffsets {
  int64_t ln1, wq, wk, wv, wo, ln2, w1, w3, w2;
};

// What a layer keeps for its backward. Sizes in comments; "full" = tp * n_sp rows. With bf16
// the big tensors (h1, h2, q, k, v, o, u, g, a) are kept as bf16 in `packed` between forward and
// backward (pack/unpack); the residual stream, the norms' inverse rms and lse stay fp32.
struct LayerActs {
  std::vector<float> x_in;        // [n_sp, C] layer input
  std::vector<float> r1, r2;      // [n_sp] inverse rms of the two norms
  std::vector<float> h1, h2;      // [n_sp, C] normed inputs (sp rows; re-gathered in backward)
  std::vector<float> q, k, v, o;  // [n, Hl, D], [n, Hkvl, D] x2, [n, Hl, D]; q, k rotated
  std::vector<float> lse;         // [Hl, n]
  std::vector<float> x_mid;       // [n_sp, C] after attention's residual
  std::vector<float> u, g, a;     // [n, Fl] MLP: up, gate, silu(u) * g
  std::vector<bf16> packed;       // bf16 copies of the tensors listed in pack()
  std::vector<size_t> packed_sizes;
  int64_t bytes() const {
    size_t f = 0;
    for (const auto* v : {&x_in, &r1, &r2, &h1, &h2, &q, &k, &v, &o, &lse, &x_mid, &u, &g, &a})
      f += v->size();
    return static_cast<int64_t>(f * sizeof(float) + packed.size() * sizeof(bf16));
  }
  std::vector<std::vector<float>*> packable() { return {&h1, &h2, &q, &k, &v, &o, &u, &g, &a}; }
  // fp32 -> bf16 storage (rounding) and back (exact).
  void pack() {
    packed_sizes.clear();
    for (std::vector<float>* t : packable()) {
      const size_t at = packed.size();
      packed.resize(at + t->size());
      to_bf16(t->data(), static_cast<int64_t>(t->size()), packed.data() + at);
      packed_sizes.push_back(t->size());
      t->clear();
      t->shrink_to_fit();
    }
  }
  void unpack() {
    size_t at = 0, i = 0;
    for (std::vector<float>* t : packable()) {
      t->resize(packed_sizes[i++]);
      for (float& x : *t) x = to_float(packed[at++]);
    }
    packed.clear();
    packed.shrink_to_fit();
  }
  void release_all_but_input() {
    for (auto* v : {&r1, &r2, &h1, &h2, &q, &k, &v, &o, &lse, &x_mid, &u, &g, &a}) {
      v->clear();
      v->shrink_to_fit();
    }
  }
};

}  // namespace

struct Gpt::Impl {
  Gpt& m;
  Mesh& mesh;
  ParallelConfig par;
  Precision prec;
  bool ckpt;
  int T, tp_rank, P, cp_rank;
  int64_t C, D, Hl, Hkvl, Fl, V;
  std::vector<LayerOffsets> lo;
  int64_t off_emb = 0, off_lnf = 0, off_head = 0;

  // The current sequence's plan and attention (rebuilt when the document lengths change).
  ShardPlan plan;
  std::unique_ptr<CpAttention> att;
  int64_t plan_seq = -1;
  std::vector<int64_t> plan_docs;

  // Per call.
  int64_t n = 0, nsp = 0, r0 = 0, valid = 0;
  std::vector<int64_t> rope_pos;  // [n]
  std::vector<bf16> scratch_a, scratch_b;

  Impl(Gpt& model, Mesh& me, const ParallelConfig& p, Precision pr, bool ck)
      : m(model), mesh(me), par(p), prec(pr), ckpt(ck) {
    T = mesh.shape.tp;
    tp_rank = mesh.tp_rank;
    P = mesh.shape.cp();
    cp_rank = mesh.cp_rank();
    const ModelConfig& c = m.cfg_;
    C = c.dim;
    D = c.head_dim();
    Hl = c.heads / T;
    Hkvl = c.kv_heads / T;
    Fl = c.ffn_dim() / T;
    V = c.vocab;
  }

  float* W(int64_t off) { return m.w_.data() + off; }
  float* G(int64_t off) { return m.g_.data() + off; }
  const bf16* WB(int64_t off) { return prec == Precision::bf16 ? m.wb_.data() + off : nullptr; }

  // C = op(A) op(B) (+ beta C): fp32 GEMM, or bf16 operands with fp32 accumulation. ab / bb
  // are ready bf16 copies of A / B (weights) or null (the operand is rounded here).
  void mm(bool ta, bool tb, int64_t rows, int64_t cols, int64_t k, const float* a, int64_t lda,
          const bf16* ab, const float* b, int64_t ldb, const bf16* bb, float beta, float* c,
          int64_t ldc) {
    if (prec == Precision::fp32) {
      gemm(ta, tb, rows, cols, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
      return;
    }
    if (!ab) {
      const int64_t count = (ta ? k : rows) * lda;
      scratch_a.resize(static_cast<size_t>(count));
      to_bf16(a, count, scratch_a.data());
      ab = scratch_a.data();
    }
    if (!bb) {
      const int64_t count = (tb ? cols : k) * ldb;
      scratch_b.resize(static_cast<size_t>(count));
      to_bf16(b, count, scratch_b.data());
      bb = scratch_b.data();
    }
    gemm(ta, tb, rows, cols, k, 1.0f, ab, lda, bb, ldb, beta, c, ldc);
  }

  // out [rows, cols] = in [rows, k] W [k, cols] (weight at offset off); rows = n unless given.
  void linear(const float* in, int64_t k, int64_t off, int64_t cols, float* out,
              int64_t rows = -1) {
    mm(false, false, rows < 0 ? n : rows, cols, k, in, k, nullptr, W(off), cols, WB(off), 0.0f, out,
       cols);
  }
  // din [n, k] (beta: 0 overwrite, 1 add) = dout [n, cols] W^T;  dW += in^T dout.
  void linear_backward(const float* in, int64_t k, int64_t off, int64_t cols, const float* dout,
                       float* din, float beta, int64_t rows = -1) {
    if (rows < 0) rows = n;
    mm(false, true, rows, k, cols, dout, cols, nullptr, W(off), cols, WB(off), beta, din, k);
    mm(true, false, k, cols, rows, in, k, nullptr, dout, cols, nullptr, 1.0f, G(off), cols);
  }

  // sp rows [n_sp, C] -> full [tp * n_sp, C] (rows >= n are padding).
  void sp_gather(const float* local, float* full) {
    if (T == 1) {
      std::memcpy(full, local, sizeof(float) * static_cast<size_t>(nsp * C));
      return;
    }
    mesh.tp->all_gather(local, sizeof(float) * static_cast<size_t>(nsp * C), full);
  }
  // full partial sums [tp * n_sp, C] -> this rank's summed sp rows [n_sp, C].
  void sp_scatter(const float* full, float* local) {
    if (T == 1) {
      std::memcpy(local, full, sizeof(float) * static_cast<size_t>(nsp * C));
      return;
    }
    mesh.tp->reduce_scatter(full, local, static_cast<size_t>(nsp * C), DType::f32, ReduceOp::sum);
  }
  size_t full_rows() const { return static_cast<size_t>(T * nsp); }

  View3<float> v3(std::vector<float>& x, int64_t heads) {
    return contiguous_view(x.data(), n, heads, D);
  }

  void prepare(const Sequence& seq) {
    const int64_t S = static_cast<int64_t>(seq.input.size());
    if (!att || plan_seq != S || plan_docs != seq.doc_lengths) {
      att.reset();
      plan = ShardPlan::make(par.layout, S, P, seq.doc_lengths);
      // The groups come from the mesh: cp, and its ulysses and ring axes.
      att = std::make_unique<CpAttention>(
          CpGroups{mesh.cp.get(), mesh.ulysses.get(), mesh.ring.get()}, plan, cp_config(par, D), Hl,
          Hkvl, D);
      plan_seq = S;
      plan_docs = seq.doc_lengths;
    }
    n = plan.rows(cp_rank);
    nsp = (n + T - 1) / T;
    r0 = std::min<int64_t>(n, tp_rank * nsp);
    valid = std::min<int64_t>(n, r0 + nsp) - r0;
    rope_pos.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) rope_pos[i] = seq.rope_pos[plan.tokens[cp_rank][i]];
  }

  // Layer forward: a.x_in must be set; writes the layer output to x_out [n_sp, C].
  void layer_forward(int l, LayerActs& a, float* x_out) {
    const LayerOffsets& o = lo[l];
    const size_t sp = static_cast<size_t>(nsp * C), full = full_rows() * C;
    std::vector<float> h_full(full), y_full(full, 0.0f), y(sp);
    a.r1.resize(nsp);
    a.h1.resize(sp);
    rmsnorm_forward(a.x_in.data(), W(o.ln1), nsp, C, m.cfg_.norm_eps, a.h1.data(), a.r1.data());
    sp_gather(a.h1.data(), h_full.data());
    a.q.resize(n * Hl * D);
    a.k.resize(n * Hkvl * D);
    a.v.resize(n * Hkvl * D);
    linear(h_full.data(), C, o.wq, Hl * D, a.q.data());
    linear(h_full.data(), C, o.wk, Hkvl * D, a.k.data());
    linear(h_full.data(), C, o.wv, Hkvl * D, a.v.data());
    rope(a.q.data(), n, Hl, D, rope_pos.data(), m.cfg_.rope_theta, false);
    rope(a.k.data(), n, Hkvl, D, rope_pos.data(), m.cfg_.rope_theta, false);
    if (prec == Precision::bf16) {  // attention runs on bf16 values (fp32 arithmetic)
      for (std::vector<float>* t : {&a.q, &a.k, &a.v})
        for (float& x : *t) x = to_float(loom::to_bf16(x));
    }
    a.o.resize(n * Hl * D);
    a.lse.resize(Hl * n);
    {
      ScopedTimer t(m.stats_.attention_s);
      att->forward(v3(a.q, Hl), v3(a.k, Hkvl), v3(a.v, Hkvl), v3(a.o, Hl), a.lse.data());
    }
    linear(a.o.data(), Hl * D, o.wo, C, y_full.data());
    sp_scatter(y_full.data(), y.data());
    a.x_mid.resize(sp);
    for (size_t i = 0; i < sp; ++i) a.x_mid[i] = a.x_in[i] + y[i];
    // MLP
    a.r2.resize(nsp);
    a.h2.resize(sp);
    rmsnorm_forward(a.x_mid.data(), W(o.ln2), nsp, C, m.cfg_.norm_eps, a.h2.data(), a.r2.data());
    sp_gather(a.h2.data(), h_full.data());
    a.u.resize(n * Fl);
    a.g.resize(n * Fl);
    a.a.resize(n * Fl);
    linear(h_full.data(), C, o.w1, Fl, a.u.data());
    linear(h_full.data(), C, o.w3, Fl, a.g.data());
    swiglu_forward(a.u.data(), a.g.data(), n * Fl, a.a.data());
    std::fill(y_full.begin(), y_full.end(), 0.0f);
    linear(a.a.data(), Fl, o.w2, C, y_full.data());
    sp_scatter(y_full.data(), y.data());
    for (size_t i = 0; i < sp; ++i) x_out[i] = a.x_mid[i] + y[i];
  }

  // Layer backward: dx [n_sp, C] holds d(loss)/d(layer output) and becomes d/d(layer input).
  void layer_backward(int l, LayerActs& a, float* dx) {
    const LayerOffsets& o = lo[l];
    const size_t sp = static_cast<size_t>(nsp * C), full = full_rows() * C;
    std::vector<float> d_full(full), dh_full(full, 0.0f), dh(sp), h_full(full);
    // MLP: x_out = x_mid + W2(swiglu(h2 W1, h2 W3)).
    sp_gather(dx, d_full.data());
    std::vector<float> da(n * Fl), du(n * Fl), dg(n * Fl);
    linear_backward(a.a.data(), Fl, o.w2, C, d_full.data(), da.data(), 0.0f);
    swiglu_backward(a.u.data(), a.g.data(), da.data(), n * Fl, du.data(), dg.data());
    sp_gather(a.h2.data(), h_full.data());
    linear_backward(h_full.data(), C, o.w1, Fl, du.data(), dh_full.data(), 0.0f);
    linear_backward(h_full.data(), C, o.w3, Fl, dg.data(), dh_full.data(), 1.0f);
    sp_scatter(dh_full.data(), dh.data());
    rmsnorm_backward(a.x_mid.data(), W(o.ln2), a.r2.data(), dh.data(), nsp, C, dx, G(o.ln2), true);
    // Attention: x_mid = x_in + Wo(attn(rope(h1 Wq), rope(h1 Wk), h1 Wv)).
    sp_gather(dx, d_full.data());
    std::vector<float> d_o(n * Hl * D), dq(n * Hl * D), dk(n * Hkvl * D), dv(n * Hkvl * D);
    linear_backward(a.o.data(), Hl * D, o.wo, C, d_full.data(), d_o.data(), 0.0f);
    {
      ScopedTimer t(m.stats_.attention_s);
      att->backward(v3(a.q, Hl), v3(a.k, Hkvl), v3(a.v, Hkvl), v3(a.o, Hl), v3(d_o, Hl),
                    a.lse.data(), v3(dq, Hl), v3(dk, Hkvl), v3(dv, Hkvl));
    }
    rope(dq.data(), n, Hl, D, rope_pos.data(), m.cfg_.rope_theta, true);
    rope(dk.data(), n, Hkvl, D, rope_pos.data(), m.cfg_.rope_theta, true);
    std::fill(dh_full.begin(), dh_full.end(), 0.0f);
    sp_gather(a.h1.data(), h_full.data());
    linear_backward(h_full.data(), C, o.wq, Hl * D, dq.data(), dh_full.data(), 0.0f);
    linear_backward(h_full.data(), C, o.wk, Hkvl * D, dk.data(), dh_full.data(), 1.0f);
    linear_backward(h_full.data(), C, o.wv, Hkvl * D, dv.data(), dh_full.data(), 1.0f);
    sp_scatter(dh_full.data(), dh.data());
    rmsnorm_backward(a.x_in.data(), W(o.ln1), a.r1.data(), dh.data(), nsp, C, dx, G(o.ln1), true);
  }

  void track(int64_t delta) {
    m.stats_.act_bytes_live += delta;
    m.stats_.act_bytes_peak = std::max(m.stats_.act_bytes_peak, m.stats_.act_bytes_live);
  }

  double run(const Sequence& seq, double loss_scale, bool backward) {
    prepare(seq);
    const int64_t L = m.cfg_.layers;
    const std::vector<int64_t>& tok = plan.tokens[cp_rank];
    const size_t sp = static_cast<size_t>(nsp * C);
    if (prec == Precision::bf16 && !m.bf16_fresh_) {
      m.wb_.resize(m.w_.size());
      to_bf16(m.w_.data(), static_cast<int64_t>(m.w_.size()), m.wb_.data());
      m.bf16_fresh_ = true;
    }
    // Embedding of this rank's sp rows.
    std::vector<float> x(sp, 0.0f);
    for (int64_t i = 0; i < valid; ++i) {
      const int32_t b = seq.input[tok[r0 + i]];
      std::memcpy(&x[i * C], W(off_emb) + b * C, sizeof(float) * static_cast<size_t>(C));
    }
    std::vector<LayerActs> acts(static_cast<size_t>(L));
    for (int64_t l = 0; l < L; ++l) {
      LayerActs& a = acts[l];
      a.x_in = x;
      layer_forward(static_cast<int>(l), a, x.data());
      if (!backward || ckpt) a.release_all_but_input();
      if (backward && !ckpt && prec == Precision::bf16) a.pack();
      if (backward) track(a.bytes());
    }
    // Final norm, LM head, loss on the sp rows (padding rows predict nothing).
    std::vector<float> xf(sp), rf(nsp), logits(nsp * V), dlogits(nsp * V);
    std::vector<int32_t> target(nsp, -1);
    for (int64_t i = 0; i < valid; ++i) target[i] = seq.target[tok[r0 + i]];
    rmsnorm_forward(x.data(), W(off_lnf), nsp, C, m.cfg_.norm_eps, xf.data(), rf.data());
    linear(xf.data(), C, off_head, V, logits.data(), nsp);  // the head works on sp rows
    const double loss = cross_entropy(logits.data(), target.data(), nsp, V,
                                      static_cast<float>(loss_scale), dlogits.data());
    if (!backward) return loss;
    std::vector<float> dxf(sp), dx(sp, 0.0f);
    linear_backward(xf.data(), C, off_head, V, dlogits.data(), dxf.data(), 0.0f, nsp);
    rmsnorm_backward(x.data(), W(off_lnf), rf.data(), dxf.data(), nsp, C, dx.data(), G(off_lnf),
                     false);
    for (int64_t l = L - 1; l >= 0; --l) {
      LayerActs& a = acts[l];
      if (ckpt) {  // recompute this layer's forward from its saved input
        std::vector<float> out(sp);
        const int64_t before = a.bytes();
        layer_forward(static_cast<int>(l), a, out.data());
        if (prec == Precision::bf16) a.pack();  // the same rounding as without checkpointing
        track(a.bytes() - before);
      }
      const int64_t kept = a.bytes();
      if (prec == Precision::bf16) a.unpack();
      layer_backward(static_cast<int>(l), a, dx.data());
      track(-kept);
      a = LayerActs{};
    }
    for (int64_t i = 0; i < valid; ++i) {
      const int32_t b = seq.input[tok[r0 + i]];
      float* ge = G(off_emb) + b * C;
      for (int64_t c = 0; c < C; ++c) ge[c] += dx[i * C + c];
    }
    return loss;
  }
};

// ---------------------------------------------------------------------------------------------

Gpt::Gpt(const ModelConfig& cfg, const ParallelConfig& par, Mesh& mesh, Precision precision,
         bool checkpoint_activations, uint64_t seed)
    : cfg_(cfg) {
  validate(cfg, par, 0, 2 * mesh.shape.cp());
  impl_ = std::make_unique<Impl>(*this, mesh, par, precision, checkpoint_activations);
  Impl& s = *impl_;
  const int64_t C = cfg.dim, H = cfg.heads, Hkv = cfg.kv_heads, D = cfg.head_dim(),
                F = cfg.ffn_dim(), T = mesh.shape.tp;
  int64_t offset = 0;
  auto add = [&](const std::string& name, int64_t rows, int64_t cols, ParamSpec::Split split,
                 bool decay) {
    ParamSpec p;
    p.name = name;
    p.rows = rows;
    p.cols = cols;
    p.split = split;
    p.local_rows = split == ParamSpec::by_rows ? rows / T : rows;
    p.local_cols = split == ParamSpec::by_cols ? cols / T : cols;
    p.offset = offset;
    p.decay = decay;
    offset += p.local_size();
    specs_.push_back(p);
    return p.offset;
  };
  // Replicated over tp first, then the tp-split matrices (two reduction groups).
  s.off_emb = add("embedding", cfg.vocab, C, ParamSpec::none, true);
  std::vector<int64_t> ln1(cfg.layers), ln2(cfg.layers);
  for (int64_t l = 0; l < cfg.layers; ++l) {
    ln1[l] = add("layer" + std::to_string(l) + ".norm1", 1, C, ParamSpec::none, false);
    ln2[l] = add("layer" + std::to_string(l) + ".norm2", 1, C, ParamSpec::none, false);
  }
  s.off_lnf = add("final_norm", 1, C, ParamSpec::none, false);
  s.off_head = add("lm_head", C, cfg.vocab, ParamSpec::none, true);
  replicated_size_ = offset;
  for (int64_t l = 0; l < cfg.layers; ++l) {
    const std::string p = "layer" + std::to_string(l) + ".";
    LayerOffsets o;
    o.ln1 = ln1[l];
    o.ln2 = ln2[l];
    o.wq = add(p + "wq", C, H * D, ParamSpec::by_cols, true);
    o.wk = add(p + "wk", C, Hkv * D, ParamSpec::by_cols, true);
    o.wv = add(p + "wv", C, Hkv * D, ParamSpec::by_cols, true);
    o.wo = add(p + "wo", H * D, C, ParamSpec::by_rows, true);
    o.w1 = add(p + "w1", C, F, ParamSpec::by_cols, true);
    o.w3 = add(p + "w3", C, F, ParamSpec::by_cols, true);
    o.w2 = add(p + "w2", F, C, ParamSpec::by_rows, true);
    s.lo.push_back(o);
  }
  w_.assign(static_cast<size_t>(offset), 0.0f);
  g_.assign(static_cast<size_t>(offset), 0.0f);
  // Initialisation by global (row, col): identical on every mesh.
  const double out_scale = 1.0 / std::sqrt(2.0 * static_cast<double>(cfg.layers));
  for (const ParamSpec& p : specs_) {
    float* dst = w_.data() + p.offset;
    if (p.rows == 1) {  // norm gains
      std::fill_n(dst, p.local_size(), 1.0f);
      continue;
    }
    double std_dev = 1.0 / std::sqrt(static_cast<double>(p.rows));
    if (p.name == "embedding") std_dev = 1.0;
    if (p.name.ends_with(".wo") || p.name.ends_with(".w2")) std_dev *= out_scale;
    const uint64_t key = rng_key(seed, p.name);
    const int t = mesh.tp_rank;
    for (int64_t i = 0; i < p.local_rows; ++i)
      for (int64_t j = 0; j < p.local_cols; ++j) {
        const int64_t gi = p.split == ParamSpec::by_rows ? t * p.local_rows + i : i;
        const int64_t gj = p.split == ParamSpec::by_cols ? t * p.local_cols + j : j;
        dst[i * p.local_cols + j] = static_cast<float>(normal_at(key, gi, gj, 0) * std_dev);
      }
  }
}

Gpt::~Gpt() = default;

const ParamSpec& Gpt::spec(const std::string& name) const {
  for (const ParamSpec& p : specs_)
    if (p.name == name) return p;
  LOOM_CHECK(false, InvalidArgument, "no parameter named " << name);
  return specs_.front();
}

void Gpt::zero_grads() {
  std::fill(g_.begin(), g_.end(), 0.0f);
}

double Gpt::forward_backward(const Sequence& seq, double loss_scale, bool backward) {
  ScopedTimer t(stats_.total_s);
  return impl_->run(seq, loss_scale, backward);
}

}  // namespace loom::model
