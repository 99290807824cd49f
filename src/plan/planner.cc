// The planner: every valid mesh (dp x tp x ulysses x ring) x registered strategy x layout x
// activation checkpointing, each priced as one training (or prefill) step.
//
// Step model (per device, the slowest rank; every figure from the profile):
//   attention   the simulator's forward (+ backward, + the forward again when checkpointing) of
//               one layer's attention over the cp group (heads / tp, kv heads / tp), x layers;
//               exposed cp communication and idle time come from the same simulation.
//   GEMMs       2 x tokens_local x (layer weights / tp) FLOPs forward, 2x that backward, one
//               more forward when checkpointing; at peak x gemm_eff. The LM head likewise.
//   TP + SP     per layer and pass, 2 all-gathers and 2 reduce-scatters of the layer's
//               activations inside the tp group (intra-node), not overlapped (Megatron SP).
//   DP          one all-reduce of the bf16 gradients (params / tp) over the dp x cp ranks that
//               hold the same tp piece (each cp rank's gradients come from its own tokens, so
//               they are summed over cp too, as loom train sums them over its dp_cp group), ring
//               cost 2 (n - 1) / n for n = dp x cp; overlapped with the backward except the last
//               layer's share.
// Memory per device: bf16 weights and gradients (4 B/param) + fp32 master weights and Adam
//   moments (12 B/param) sharded over those dp x cp ranks (Megatron's distributed optimizer
//   shards over its data-parallel group with the context-parallel ranks, the group its gradients
//   are reduced over; loom train keeps the whole AdamW state on every rank), all / tp; activations
//   per layer and token 2 B x (2 dim + dim + 2 kv_dim + dim + 4 ffn) / tp + fp32 lse (Korthikanti
//   et al.'s accounting with FlashAttention, SP shards everything), or with full checkpointing
//   the layer inputs plus one layer; the strategy's peak buffers (simulated); fp32 logits of
//   tokens_local x vocab / tp. Estimates: say so in docs/planning.md.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <iomanip>
#include <map>
#include <optional>
#include <sstream>
#include <tuple>

#include "loom/error.h"
#include "loom/plan.h"
#include "sim.h"

namespace loom::plan {

double ModelShape::params() const {
  const double d = static_cast<double>(dim), kv = static_cast<double>(kv_heads * head_dim());
  const double layer = 2 * d * d + 2 * d * kv + 3 * d * static_cast<double>(ffn);
  return static_cast<double>(layers) * layer + 2 * static_cast<double>(vocab) * d;
}

std::string Candidate::name() const {
  std::ostringstream o;
  o << "dp" << dp << " tp" << tp << " u" << ulysses << " r" << ring;
  if (inner > 1) o << " i" << inner;
  o << " " << strategy << "/" << to_string(layout) << (checkpoint ? " ckpt" : "");
  return o.str();
}

namespace {

// Context-parallel degrees that leave each rank fewer tokens than this (one 128 x 128 work tile of
// loom's kernels, the tile side of FlashAttention's) are rejected unsimulated: every ring step is
// then a sliver of a tile whose transfer latency costs more than its compute, and a smaller cp with
// a larger dp on the same devices fits as well (fewer tokens per rank already fit) and runs
// faster. Their simulations, O(cp^2) steps, were most of a large search: --devices 4096 took 118 s
// at S = 128K, most of it on cp = 2048 and 4096 (64 and 32 tokens per rank).
constexpr int64_t kMinTokensPerCpRank = 128;

// Model sizes past any real model (Llama 3 405B: 126 layers, dim 16384, ffn 53248, vocab 128256)
// but small enough that every size product stays an exact double.
constexpr int64_t kMaxLayers = int64_t{1} << 16;
constexpr int64_t kMaxDim = int64_t{1} << 20;
constexpr int64_t kMaxFfn = int64_t{1} << 24;
constexpr int64_t kMaxVocab = int64_t{1} << 24;

// The divisors of n >= 1, ascending. Pairs (i, n / i) up to sqrt(n): the loop `i <= n` over int
// wrapped past INT_MAX for --devices 2147483647 and divided by zero (SIGFPE).
std::vector<int> divisors(int n) {
  std::vector<int> small, large;
  for (int64_t i = 1; i * i <= n; ++i) {
    if (n % i != 0) continue;
    small.push_back(static_cast<int>(i));
    if (i * i != n) large.push_back(static_cast<int>(n / i));
  }
  small.insert(small.end(), large.rbegin(), large.rend());
  return small;
}

// One layer's attention over a cp group of `cp` ranks inside tp; u: the degree of the
// strategy's inner axis (hybrid, ulysses: U; ring2d: the inner ring).
AttnCase attn_case(const PlanRequest& req, const Profile& prof, const Mask& mask,
                   const std::string& strategy, Layout layout, int cp, int u, int tp) {
  AttnCase a;
  a.strategy = strategy;
  a.layout = layout;
  a.seq = req.seq;
  a.doc_lengths = req.doc_lengths;
  a.ranks = cp;
  a.ulysses = strategy == "ring2d" ? 1 : u;
  a.inner = strategy == "ring2d" ? u : 1;
  a.heads = req.model.heads / tp;
  a.kv_heads = req.model.kv_heads / tp;  // tp divides the kv heads (loom train's rule)
  a.head_dim = req.model.head_dim();
  a.mask = mask;
  a.block_q = prof.block_q;
  a.block_k = prof.block_k;
  a.dtype_bytes = req.dtype_bytes;
  a.backward = req.train;
  a.cp_stride = tp;
  return a;
}

// (query, key) pairs the mask allows, per head, over the whole sequence (useful FLOPs).
double visible_pairs(int64_t seq, const std::vector<int64_t>& docs0, const Mask& m) {
  std::vector<int64_t> docs = docs0;
  if (docs.empty()) docs.push_back(seq);
  double total = 0;
  for (int64_t L0 : docs) {
    const double L = static_cast<double>(L0);
    const double W = m.window > 0 ? std::min<double>(static_cast<double>(m.window), L) : L;
    // causal: row i sees min(i + 1, W) keys.
    const double causal = W * (W + 1) / 2 + (L - W) * W;
    total += m.causal ? causal : 2 * causal - L;
  }
  return total;
}

double ring_allreduce_s(double bytes, int n, const Link& l, double eff) {
  if (n <= 1 || bytes <= 0) return 0;
  return 2.0 * (n - 1) * l.latency + 2.0 * (n - 1) / n * bytes / (l.bandwidth * eff);
}

double gather_s(double bytes_per_rank, int n, const Link& l, double eff) {
  if (n <= 1) return 0;
  return (n - 1) * (l.latency + bytes_per_rank / (l.bandwidth * eff));
}

std::string fmt(double x, int prec = 2) {
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(prec);
  o << x;
  return o.str();
}

// A duration with a unit that shows it: "5.525 s", "406 ms", "33.0 ms", "41.3 us" (a 40 us
// step read "0.000 s"); 0 is "0 s".
std::string duration(double s) {
  if (s == 0) return "0 s";
  const double a = std::fabs(s);
  if (a >= 1) return fmt(s, 3) + " s";
  const bool ms = a >= 1e-3;
  const double v = ms ? a * 1e3 : a * 1e6;
  return fmt(s * (ms ? 1e3 : 1e6), v >= 100 ? 0 : v >= 10 ? 1 : 2) + (ms ? " ms" : " us");
}

}  // namespace

std::string gb_text(double bytes) {
  if (bytes >= 0.1e9) return fmt(bytes / 1e9, 1);
  std::ostringstream o;
  o << std::setprecision(3) << bytes / 1e9;
  return o.str();
}

PlanResult plan(const PlanRequest& req, const Profile& prof) {
  const auto t_start = std::chrono::steady_clock::now();
  const ModelShape& M = req.model;
  // Everything that would make every candidate invalid is refused here, in one line naming it
  // (a negative window or documents not summing to S rejected every candidate, unexplained).
  check_profile(prof);
  LOOM_CHECK(
      M.layers >= 1 && M.dim >= 1 && M.heads >= 1 && M.kv_heads >= 1 && M.ffn >= 1 && M.vocab >= 1,
      InvalidArgument, "--model values must be positive");
  LOOM_CHECK(M.layers <= kMaxLayers && M.dim <= kMaxDim && M.ffn <= kMaxFfn && M.vocab <= kMaxVocab,
             InvalidArgument,
             "--model is too large: at most "
                 << kMaxLayers << " layers, dim " << kMaxDim << ", ffn " << kMaxFfn << " and vocab "
                 << kMaxVocab << " (got " << M.layers << " layers, dim " << M.dim << ", ffn "
                 << M.ffn << ", vocab " << M.vocab << ")");
  LOOM_CHECK(M.dim % M.heads == 0, InvalidArgument,
             "model dim (" << M.dim << ") must be a multiple of heads (" << M.heads << ")");
  LOOM_CHECK(M.heads % M.kv_heads == 0, InvalidArgument,
             "heads (" << M.heads << ") must be a multiple of kv-heads (" << M.kv_heads << ")");
  LOOM_CHECK(M.head_dim() <= kMaxHeadDim, InvalidArgument,
             "the model's head dim (dim " << M.dim << " / " << M.heads
                                          << " heads = " << M.head_dim() << ") must be at most "
                                          << kMaxHeadDim << " (the attention kernels' limit)");
  // loom train's rotary embeddings rotate pairs of channels (model::validate): a training plan of
  // head dim 15 was ranked, which loom train refuses. Prefill plans any head dim.
  LOOM_CHECK(!req.train || M.head_dim() % 2 == 0, InvalidArgument,
             "the model's head dim (dim " << M.dim << " / " << M.heads
                                          << " heads = " << M.head_dim()
                                          << ") must be even to plan training (loom train's "
                                             "rotary embeddings); --mode prefill plans it");
  LOOM_CHECK(req.devices >= 1, InvalidArgument, "--devices must be >= 1, got " << req.devices);
  LOOM_CHECK(req.seq >= 1, InvalidArgument, "--seq must be >= 1, got " << req.seq);
  // loom train's shortest sequence (model::validate: seq >= 2 x cp; the search's cp > 1 has at
  // least 128 tokens per rank): a training plan of one token ranked dp and tp meshes that loom
  // train refuses. Prefill plans one token.
  LOOM_CHECK(!req.train || req.seq >= 2, InvalidArgument,
             "--seq must be >= 2 to plan training (loom train's shortest sequence), got "
                 << req.seq << "; --mode prefill plans a single token");
  LOOM_CHECK(req.window >= 0, InvalidArgument,
             "--window must be >= 0 (0 = no window), got " << req.window);
  if (!req.doc_lengths.empty()) checked_doc_lengths(req.seq, req.doc_lengths);
  LOOM_CHECK(req.dtype_bytes == 2 || req.dtype_bytes == 4, InvalidArgument,
             "dtype must be fp32 (4 bytes) or bf16 (2 bytes), got " << req.dtype_bytes);
  LOOM_CHECK(std::isfinite(req.memory_limit) && req.memory_limit >= 0, InvalidArgument,
             "the memory limit must be a positive number of bytes (0: the profile's), got "
                 << req.memory_limit);
  const double mem_limit = req.memory_limit > 0 ? req.memory_limit : prof.memory_bytes;
  const double peak = req.dtype_bytes == 2 ? prof.flops_bf16 : prof.flops_fp32;
  const std::vector<std::string> known = schedule_names();
  std::vector<std::string> strategies;  // each once (--strategies ring,ring listed every row twice)
  for (const std::string& s : req.strategies.empty() ? known : req.strategies) {
    if (std::find(strategies.begin(), strategies.end(), s) != strategies.end()) continue;
    std::string names;
    for (const std::string& n : known) names += (names.empty() ? "" : ", ") + n;
    LOOM_CHECK(std::find(known.begin(), known.end(), s) != known.end(), InvalidArgument,
               "unknown strategy '" << s << "' (choose " << names << ")");
    strategies.push_back(s);
  }
  std::vector<Layout> layouts = {Layout::zigzag};
  if (req.all_layouts) layouts = {Layout::zigzag, Layout::contiguous, Layout::stripe};

  Mask mask;
  mask.causal = true;
  mask.window = req.window;
  const double D = static_cast<double>(M.head_dim());
  const double pairs = visible_pairs(req.seq, req.doc_lengths, mask) * static_cast<double>(M.heads);
  const double attn_flops_fwd = 4.0 * D * pairs;  // all heads, one layer, whole sequence
  const double dense_params = M.params() - 2.0 * static_cast<double>(M.vocab) * M.dim;
  const double head_params = static_cast<double>(M.vocab) * M.dim;
  const double passes = req.train ? 3.0 : 1.0;  // fwd + bwd (2x)
  const double model_flops =
      passes * (2.0 * (dense_params + head_params) * static_cast<double>(req.seq) +
                static_cast<double>(M.layers) * attn_flops_fwd);

  PlanResult res;
  // One simulation per (strategy, layout, cp, u, tp): the loops below visit each once, its
  // candidates with and without checkpointing in a row, so only the last one is kept (keeping all
  // held every rank's per-step tiles of every simulation: 1.3 GB at --devices 4096). A candidate
  // reads only the simulation's totals, so the per-step tiles are not recorded; the pair tables
  // are shared by every simulation of one layout and cp degree.
  std::tuple<std::string, int, int, int, int> last_key;
  AttnSim last_sim;
  bool have_last = false;
  PairCache tables;
  const SimOptions search{&tables, false};
  const int N = req.devices;
  // The meshes and strategy shapes to simulate, listed first so that the search can say how far
  // it is (a device count with many divisors, 720720, searched for minutes without a word).
  struct Shape {
    int tp, cp, u;
    std::string strategy;
    std::optional<Candidate> rejected;  // a mesh refused before simulating, in the search's order
  };
  std::vector<Shape> shapes;
  for (int tp : divisors(N)) {
    // Tensor parallelism stays inside a node (its all-reduces run every layer on the node's
    // links), so a tp above the node's devices is rejected, and said so: it was skipped without
    // a word, and a profile of one device per node ranked nothing and blamed the memory.
    if (tp > prof.devices_per_node) {
      Candidate c;
      c.tp = tp;
      c.strategy = "-";
      c.fits = false;
      c.why_not = "tp " + std::to_string(tp) + " spans more than a node's " +
                  std::to_string(prof.devices_per_node) +
                  " devices (tp stays inside a node: the profile's devices_per_node)";
      shapes.push_back({tp, 1, 1, "", c});
      continue;
    }
    // loom train's rule (model::validate): tp divides the heads and the kv heads, so that every
    // ranked plan is one loom's own trainer runs. A tp above the kv heads (each tp rank holding
    // a replicated kv head, as some frameworks do) was ranked: `--model 2,256,8,2,0,256
    // --devices 8` ranked dp2 tp4, which loom train and --train-step refuse.
    // Its FFN is split over tp too (model::validate: the MLP hidden size divisible by tp):
    // `--model 8,4096,32,8,16386,256 --devices 4` ranked dp1 tp4, which loom train refuses.
    if (M.heads % tp != 0 || M.kv_heads % tp != 0 || M.ffn % tp != 0) {
      Candidate c;
      c.tp = tp;
      c.strategy = "-";
      c.fits = false;
      c.why_not = M.heads % tp != 0 || M.kv_heads % tp != 0
                      ? "tp " + std::to_string(tp) + " does not divide both the " +
                            std::to_string(M.heads) + " heads and the " +
                            std::to_string(M.kv_heads) + " kv heads (loom train's rule)"
                      : "tp " + std::to_string(tp) + " does not divide the FFN size " +
                            std::to_string(M.ffn) + " (loom train's rule)";
      shapes.push_back({tp, 1, 1, "", c});
      continue;
    }
    for (int cp : divisors(N / tp)) {
      const int dp = N / tp / cp;
      if (cp > 1 && req.seq / cp < kMinTokensPerCpRank) {
        Candidate c;
        c.dp = dp;
        c.tp = tp;
        c.ring = cp;
        c.strategy = "-";
        c.fits = false;
        c.why_not = "cp " + std::to_string(cp) + " leaves " + std::to_string(req.seq / cp) +
                    " tokens per rank, under one " + std::to_string(kMinTokensPerCpRank) +
                    "-token work tile";
        shapes.push_back({tp, cp, 1, "", c});
        continue;
      }
      for (const std::string& strategy : strategies) {
        // One rank: no cp at all ("none", simulated as a ring of one), whatever --strategies
        // names: --strategies ulysses dropped the meshes without a cp group (8 devices: their
        // best, dp8, 1.6x faster than the winner shown; 1 device: "nothing to rank").
        if (cp == 1 && strategy != strategies.front()) continue;
        if (cp == 1 || strategy == "ring" || strategy == "allgather")
          shapes.push_back({tp, cp, 1, strategy, {}});
        else if (strategy == "ulysses")
          shapes.push_back({tp, cp, cp, strategy, {}});
        else
          for (int u : divisors(cp))
            if (u > 1 && u < cp) shapes.push_back({tp, cp, u, strategy, {}});
      }
    }
  }
  // A simulation's cost grows as the square of its ranks (a ring of R ranks: R steps of R
  // kernels); progress is reported in those units.
  double total_work = 0, done_work = 0;
  for (const Shape& sh : shapes)
    if (!sh.rejected)
      total_work += (1.0 + static_cast<double>(sh.cp) * sh.cp) * (sh.cp == 1 ? 1 : layouts.size());
  if (req.progress) req.progress(0.0);
  for (const Shape& sh : shapes) {
    if (sh.rejected) {
      res.rejected.push_back(*sh.rejected);
      continue;
    }
    const int tp = sh.tp, cp = sh.cp, u = sh.u, dp = N / tp / cp;
    const std::string& strategy = sh.strategy;
    const int64_t hl = M.heads / tp;
    // One rank holds the whole sequence: contiguous, every document in one piece, whatever
    // --zigzag-only (zigzag cut each in two, three kernel calls per document instead of one).
    const std::vector<Layout> one_rank = {Layout::contiguous};
    for (Layout layout : cp == 1 ? one_rank : layouts) {
      for (bool ckpt : {false, true}) {
        if (!req.train && ckpt) continue;
        Candidate c;
        c.dp = dp;
        c.tp = tp;
        const bool two_rings = strategy == "ring2d";
        c.ulysses = two_rings ? 1 : u;
        c.inner = two_rings ? u : 1;
        c.ring = two_rings ? cp : cp / u;
        c.strategy = cp == 1 ? "none" : strategy;
        c.layout = layout;
        c.checkpoint = ckpt;
        const std::string simulated = cp == 1 ? "ring" : strategy;
        const AttnCase a = attn_case(req, prof, mask, simulated, layout, cp, u, tp);
        // Memory.
        const double L = static_cast<double>(M.layers);
        const double tokens = static_cast<double>(req.seq) / cp;
        const double params = M.params() / tp;
        // Optimizer state sharded over the dp x cp ranks that reduce the same gradients.
        double mem =
            req.train ? params * (4.0 + 12.0 / (static_cast<double>(dp) * cp)) : params * 2.0;
        const double kvdim = static_cast<double>(M.kv_heads * M.head_dim());
        const double per_token_layer =
            2.0 * (5.0 * M.dim + 2.0 * kvdim + 4.0 * M.ffn) / tp + 4.0 * hl;
        if (!req.train) {
          mem += tokens * per_token_layer + L * tokens * 2.0 * kvdim * 2.0 / tp;
        } else if (ckpt) {
          mem += L * tokens * 2.0 * M.dim / tp + tokens * per_token_layer;
        } else {
          mem += L * tokens * per_token_layer;
        }
        // Cheap rejection before simulating: the memory without the strategy's buffers.
        const double mem_base = mem + tokens * static_cast<double>(M.vocab) / tp * 4.0;
        if (mem_base > mem_limit) {
          c.fits = false;
          c.over_memory = true;
          c.memory_bytes = mem_base;  // at least this (JSON memory_bytes read 0)
          c.why_not = "needs more than " + gb_text(mem_base) + " GB per device, limit " +
                      gb_text(mem_limit) + " GB";
          res.rejected.push_back(c);
          continue;
        }
        const auto key = std::make_tuple(simulated, static_cast<int>(layout), cp, u, tp);
        if (!have_last || key != last_key) {
          have_last = false;
          try {
            last_sim = simulate_attention(a, prof, search);
          } catch (const InvalidArgument& e) {
            c.fits = false;
            c.why_not = e.what();
            res.rejected.push_back(c);
            continue;
          }
          last_key = key;
          have_last = true;
        }
        const AttnSim& sim = last_sim;
        double comm = 0, idle = 0, compute = 0;
        const RankSim* most_comm = nullptr;  // the rank whose exposed communication is `comm`
        for (const RankSim& r : sim.ranks) {
          if (most_comm == nullptr || r.comm_s > comm) most_comm = &r;
          comm = std::max(comm, r.comm_s);
          idle = std::max(idle, r.idle_s);
          compute = std::max(compute, r.compute_s);
        }
        const double fwd = sim.forward_s, bwd = sim.backward_s;
        c.attn_s = L * (fwd + bwd);
        c.recompute_s = ckpt ? L * fwd : 0.0;
        const double gemm_fwd =
            2.0 * tokens * (dense_params + head_params) / tp / (peak * prof.gemm_eff);
        c.gemm_s = passes * gemm_fwd;
        if (ckpt) c.recompute_s += gemm_fwd * dense_params / (dense_params + head_params);
        // TP + SP: 2 all-gathers + 2 reduce-scatters per layer and pass.
        const double act_bytes = tokens * static_cast<double>(M.dim) * req.dtype_bytes / tp;
        const double tp_pass = 4.0 * gather_s(act_bytes, tp, prof.intra, prof.allgather_eff);
        c.tp_comm_s = L * tp_pass * (passes + (ckpt ? 1.0 : 0.0));
        // DP: the gradient all-reduce over the dp x cp ranks holding the same tp piece (a cp
        // rank's gradients are those of its own tokens: with dp 1 and cp 16 they still travel,
        // and a dp1 x cp16 mesh ranked first with no all-reduce at all), overlapped with the
        // backward except the last layer. The group spans nodes once the job does.
        if (req.train && dp * cp > 1) {
          const bool inter = N > prof.devices_per_node;
          const double ar = ring_allreduce_s(2.0 * M.params() / tp, dp * cp,
                                             inter ? prof.inter : prof.intra, prof.allreduce_eff);
          const double bwd_time = L * bwd + 2.0 * gemm_fwd;
          c.dp_comm_s = std::max(ar / L, ar - bwd_time);
        }
        // With checkpointing the forward runs twice: its exposed communication too, in the
        // total and in each kind (the kinds summed to less than the total). The kinds are those
        // of the rank the total is of, so that they sum to it (each kind's maximum over the
        // ranks, from different ranks, summed to more: hybrid with a ring of 3 or 6).
        const double again = ckpt ? (fwd + bwd + fwd) / std::max(1e-30, fwd + bwd) : 1.0;
        if (most_comm != nullptr)
          for (const auto& [k, v] : most_comm->comm_by_kind) c.exposed_by_kind[k] = L * v * again;
        c.exposed_cp_s = L * comm * again;
        c.cp_idle_s = L * idle;
        c.step_s = c.attn_s + c.recompute_s + c.gemm_s + c.tp_comm_s + c.dp_comm_s;
        c.balance = sim.balance();
        int64_t buf = 0;
        for (const RankSim& r : sim.ranks)
          buf = std::max(buf, r.peak_buffer_bytes + r.gathered_bytes);
        mem += static_cast<double>(buf);
        mem += tokens * static_cast<double>(M.vocab) / tp * 4.0;  // fp32 logits
        c.memory_bytes = mem;
        c.tokens_per_s = dp * static_cast<double>(req.seq) / c.step_s;
        c.mfu = model_flops * dp / (N * peak * c.step_s);
        // A checked profile and problem give positive, finite figures; never rank others. The
        // figures as printed too: the table shows the step in ms (a step of 1.5e307 s passed
        // isfinite and printed "inf"), and the ranking is by tokens/s (a 7e297 s step ranked a
        // winner at 0 tokens/s).
        LOOM_CHECK(std::isfinite(c.step_s * 1e6) && c.step_s > 0 && std::isfinite(c.mfu) &&
                       std::isfinite(c.tokens_per_s) && c.tokens_per_s > 0 &&
                       std::isfinite(c.memory_bytes),
                   InvalidArgument,
                   "profile '" << prof.name << "' gives " << c.name() << " a step of " << c.step_s
                               << " s and " << c.memory_bytes
                               << " bytes per device; check its figures");
        if (mem > mem_limit) {
          c.fits = false;
          c.over_memory = true;
          c.why_not =
              "needs " + gb_text(mem) + " GB per device, limit " + gb_text(mem_limit) + " GB";
          res.rejected.push_back(c);
        } else {
          res.ranked.push_back(c);
        }
      }
      done_work += 1.0 + static_cast<double>(cp) * cp;
      if (req.progress) req.progress(done_work / total_work);
    }
  }
  std::stable_sort(res.ranked.begin(), res.ranked.end(),
                   [](const Candidate& a, const Candidate& b) {
                     return a.tokens_per_s > b.tokens_per_s;  // dp changes tokens per step
                   });
  if (!res.ranked.empty()) {
    const Candidate& w = res.ranked.front();
    AttnCase a = attn_case(req, prof, mask, w.strategy == "none" ? "ring" : w.strategy, w.layout,
                           w.ulysses * w.ring, w.strategy == "ring2d" ? w.inner : w.ulysses, w.tp);
    a.timeline = true;
    a.max_events = 4000;
    res.best_attn = simulate_attention(a, prof, SimOptions{&tables, true});
    // Why the winner wins, in words.
    std::ostringstream e;
    e << "The winner is " << w.name() << ": " << fmt(w.tokens_per_s, 0) << " tokens/s (" << w.dp
      << " sequence" << (w.dp > 1 ? "s" : "") << " of " << req.seq << " tokens per step), "
      << duration(w.step_s) << " per step, MFU " << fmt(100 * w.mfu, 1) << " %, "
      << gb_text(w.memory_bytes) << " GB per device.\n";
    e << "  Its step: attention " << duration(w.attn_s) << ", GEMMs " << duration(w.gemm_s)
      << ", recompute " << duration(w.recompute_s) << ", TP/SP collectives "
      << duration(w.tp_comm_s) << ", exposed DP all-reduce " << duration(w.dp_comm_s)
      << "; exposed context-parallel communication " << duration(w.exposed_cp_s) << ", balance "
      << fmt(w.balance, 3) << ".\n";
    // Ulysses caps: query heads bound the degree, KV heads bound it without replication.
    const int64_t hq_tp = M.heads / w.tp, hkv_tp = M.kv_heads / w.tp;
    e << "  Ulysses is capped at " << hq_tp << " ranks by the " << hq_tp
      << " query heads per tp rank, and at " << hkv_tp << " by the KV heads (above that K and V "
      << "are replicated: "
      << "more all-to-all bytes per rank)";
    const int cp = w.ulysses * w.ring;
    if (cp > hq_tp)
      e << "; Ulysses alone cannot cover this cp group of " << cp
        << ", so a ring factor of at least " << (cp + hq_tp - 1) / hq_tp << " is needed";
    e << ".\n";
    // When does a ring step hide its transfer? A full block pair of n tokens per rank computes
    // 4 n^2 D hl FLOPs while 2 n hkv D bytes-per-element travel.
    {
      const double rate = peak * prof.attn_fwd_eff;
      const double n_star = 2.0 * static_cast<double>(hkv_tp) * req.dtype_bytes * rate /
                            (4.0 * static_cast<double>(hq_tp) * prof.inter.bandwidth);
      const double n_star_in = n_star * prof.inter.bandwidth / prof.intra.bandwidth;
      const double tokens = static_cast<double>(req.seq) / cp;
      e << "  A ring hides its KV traffic once S/P >= " << fmt(n_star_in, 0)
        << " tokens inside a node and >= " << fmt(n_star, 0)
        << " tokens across nodes (a block pair's compute outlasts its transfer); here S/P = "
        << fmt(tokens, 0) << ".\n";
      if (w.ring > 1 && w.strategy != "allgather") {
        const bool inter = cp * w.tp > prof.devices_per_node;
        e << "  The winner's ring has " << w.ring << " members"
          << (inter ? " spanning nodes" : " inside a node")
          << ", and its exposed cp communication is " << duration(w.exposed_cp_s) << " of "
          << duration(w.attn_s) << " attention.\n";
      }
    }
    if (w.checkpoint) {
      bool without_fits = false;
      for (const Candidate& c : res.ranked)
        if (!c.checkpoint && c.dp == w.dp && c.tp == w.tp && c.ulysses == w.ulysses &&
            c.inner == w.inner && c.ring == w.ring && c.strategy == w.strategy &&
            c.layout == w.layout)
          without_fits = true;
      e << "  Activation checkpointing: "
        << (without_fits ? "chosen although the run without it fits, because it frees memory for "
                           "a faster mesh"
                         : "needed: without it this mesh does not fit in memory")
        << " (recompute " << duration(w.recompute_s) << ").\n";
    }
    // The best of every other strategy, and where it loses time.
    std::map<std::string, const Candidate*> best_of;
    for (const Candidate& c : res.ranked)
      if (!best_of.count(c.strategy)) best_of[c.strategy] = &c;
    auto parts = [](const Candidate& c) {
      const double k = 1.0 / c.dp;  // seconds per sequence: a step holds dp sequences
      return std::vector<double>{k * std::max(0.0, c.attn_s - c.exposed_cp_s),
                                 k * c.exposed_cp_s,
                                 k * c.gemm_s,
                                 k * c.recompute_s,
                                 k * c.tp_comm_s,
                                 k * c.dp_comm_s};
    };
    const char* part_names[] = {"attention compute", "exposed cp communication", "GEMMs",
                                "recompute",         "TP/SP collectives",        "DP all-reduce"};
    for (const auto& [s, c] : best_of) {
      if (c == &w) continue;
      const auto pc = parts(*c), pw = parts(w);
      int worst = 0;
      for (int k = 1; k < 6; ++k)
        if (pc[k] - pw[k] > pc[worst] - pw[worst]) worst = k;
      e << "  Best " << s << ": " << c->name() << ", " << fmt(c->tokens_per_s, 0) << " tokens/s ("
        << fmt(w.tokens_per_s / c->tokens_per_s, 2) << "x slower), step " << duration(c->step_s)
        << ", loses mostly in " << part_names[worst] << " (" << duration(pc[worst])
        << " per sequence against " << duration(pw[worst]);
      if (worst <= 1 && c->balance > w.balance + 0.01) e << "; balance " << fmt(c->balance, 3);
      e << ").\n";
    }
    int no_fit = 0;
    for (const Candidate& c : res.rejected) no_fit += c.over_memory;
    if (no_fit)
      e << "  " << no_fit << " candidates do not fit in memory (see the rejected list).\n";
    res.explain = e.str();
  }
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  return res;
}

}  // namespace loom::plan

namespace loom::plan {

TrainStepPrediction predict_train_step(const TrainCase& c, const TrainMeasure& one,
                                       const Profile& p) {
  check_profile(p);
  const ModelShape& M = c.model;
  const MeshShape& m = c.mesh;
  LOOM_CHECK(m.dp >= 1 && m.tp >= 1 && m.ulysses >= 1 && m.ring >= 1, InvalidArgument,
             "mesh sizes must be >= 1 (dp " << m.dp << ", tp " << m.tp << ", ulysses " << m.ulysses
                                            << ", ring " << m.ring << ")");
  LOOM_CHECK(c.batch >= 1 && c.batch % m.dp == 0, InvalidArgument,
             "--batch " << c.batch << " must be a positive multiple of --dp " << m.dp);
  LOOM_CHECK(M.heads % m.tp == 0 && M.kv_heads % m.tp == 0, InvalidArgument,
             "tp " << m.tp << " must divide the " << M.heads << " heads and " << M.kv_heads
                   << " kv heads");
  LOOM_CHECK(one.attention_s >= 0 && one.other_s > 0 && one.update_s >= 0, InvalidArgument,
             "the one-rank measure needs positive forward + backward time");
  const int cp = m.cp(), world = m.world();
  // Attention of one layer and one sequence on the cp group, and on one rank.
  AttnCase a;
  a.strategy = cp == 1 ? "ring" : c.strategy;
  a.layout = c.layout;
  a.seq = c.seq;
  a.ranks = cp;
  a.ulysses = c.strategy == "hybrid" ? m.ulysses : 1;
  a.inner = c.strategy == "ring2d" ? c.inner : 1;
  a.heads = M.heads / m.tp;
  a.kv_heads = M.kv_heads / m.tp;
  a.head_dim = M.head_dim();
  a.mask.causal = true;
  a.block_q = a.block_k = 64;  // the trainer's CpConfig: KernelConfig's default tiles
  a.dtype_bytes = c.dtype_bytes;
  a.cp_stride = m.tp;
  AttnCase a1 = a;
  a1.strategy = "ring";
  a1.layout = Layout::zigzag;
  a1.ranks = 1;
  a1.ulysses = a1.inner = 1;
  a1.heads = M.heads;
  a1.kv_heads = M.kv_heads;
  a1.cp_stride = 1;
  const AttnSim s = simulate_attention(a, p), s1 = simulate_attention(a1, p);
  const double L = static_cast<double>(M.layers);
  const double seqs = static_cast<double>(c.batch / m.dp);  // sequences per rank per step
  // One layer and sequence: forward (twice with checkpointing: the recompute) and backward.
  const double recompute = c.checkpoint ? 1.0 : 0.0;
  const auto layer_s = [&](const AttnSim& x) {
    return x.forward_s * (1 + recompute) + x.backward_s;
  };
  // The simulator's figures are for every rank of the node computing at once (the profile's
  // tile times); a lone rank is alone_speedup faster, ranks sharing the node's cores are not.
  const double alone = std::max(1.0, p.alone_speedup);
  const double shared = world > 1 ? alone : 1.0;
  TrainStepPrediction r;
  const double sim1_alone = L * static_cast<double>(c.batch) * layer_s(s1) / alone;
  r.attention_scale = sim1_alone > 0 && one.attention_s > 0 ? one.attention_s / sim1_alone : 1.0;
  r.attention_s = r.attention_scale * L * seqs * layer_s(s) * shared / alone;
  // Per-token work: this rank holds seq / cp tokens of each of its sequences and 1 / tp of each
  // token's work (Megatron tp + sp).
  const double token_share =
      seqs / static_cast<double>(c.batch) / static_cast<double>(cp) / static_cast<double>(m.tp);
  r.other_s = one.other_s * token_share * shared;
  r.rest_s = one.rest_s * token_share * shared;
  // TP + SP (inside a node): per layer and sequence, forward 2 all-gathers + 2 reduce-scatters
  // of the rank's fp32 rows (n / tp of dim), the backward as many, the recompute as many again.
  if (m.tp > 1) {
    const double nsp = std::ceil(static_cast<double>(c.seq) / cp / m.tp);
    const double part = nsp * static_cast<double>(M.dim) * 4.0;
    const double one_coll = gather_s(part, m.tp, p.intra, p.allgather_eff);
    r.tp_comm_s = L * seqs * (8.0 + 4.0 * recompute) * one_coll;
  }
  // Gradients: the replicated ones (embedding, norms, LM head) summed over the world, the
  // tp-split ones over dp x cp; fp32, over the inter-node link once the job spans nodes.
  const double d = static_cast<double>(M.dim), kv = static_cast<double>(M.kv_heads * M.head_dim());
  const double split = L * (2 * d * d + 2 * d * kv + 3 * d * static_cast<double>(M.ffn));
  const double replicated = M.params() - split;
  const Link& link = world > std::max(1, p.devices_per_node) ? p.inter : p.intra;
  r.grad_comm_s = ring_allreduce_s(4.0 * replicated, world, link, p.allreduce_eff) +
                  ring_allreduce_s(4.0 * split / m.tp, m.dp * cp, link, p.allreduce_eff);
  r.update_s = one.update_s * (replicated + split / m.tp) / M.params() * shared;
  r.attention = s;
  r.step_s = r.attention_s + r.other_s + r.rest_s + r.tp_comm_s + r.grad_comm_s + r.update_s;
  LOOM_CHECK(std::isfinite(r.step_s * 1e3), InvalidArgument,  // printed in ms
             "profile '" << p.name << "' gives mesh dp " << m.dp << " tp " << m.tp << " ulysses "
                         << m.ulysses << " ring " << m.ring << " a step of " << r.step_s
                         << " s; check its figures");
  return r;
}

}  // namespace loom::plan
