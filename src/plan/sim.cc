// The simulation engine (see sim.h for the time model) and simulate_attention().
#include "sim.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <numeric>

#include "loom/error.h"

namespace loom::plan {

namespace {

constexpr int kMaxSimRanks = 8192;
constexpr double kMaxSimPairs = double(int64_t{1} << 34);
constexpr int64_t kMaxSimQTiles = int64_t{1} << 30;
// Heads of one simulated group, and the products the counters hold: every rank's bytes are a few
// dozen times S x H x D (ring, Ulysses and all-gather alike), its tiles at most the whole
// problem's (S / block_q) x (S / block_k) x H, forward and backward. Past these the int64
// counters wrapped (--head-dim 2^63 - 1 reported -16777216 bytes sent).
constexpr int64_t kMaxSimHeads = int64_t{1} << 16;
constexpr double kMaxSimElements = double(int64_t{1} << 56);  // S x H x D
constexpr double kMaxSimTiles = double(int64_t{1} << 61);

std::map<std::string, ScheduleFn>& registry() {
  static std::map<std::string, ScheduleFn> r;
  return r;
}

}  // namespace

void register_schedule(const std::string& name, ScheduleFn fn) {
  registry()[name] = std::move(fn);
}

void register_builtin_schedules();  // schedules.cc

std::vector<std::string> schedule_names() {
  register_builtin_schedules();
  std::vector<std::string> names;
  for (const auto& [name, fn] : registry()) names.push_back(name);
  return names;
}

double AttnSim::balance() const {
  if (ranks.empty()) return 1.0;
  const auto slower = [](const RankSim& a, const RankSim& b) { return a.compute_s < b.compute_s; };
  const double mx = std::max_element(ranks.begin(), ranks.end(), slower)->compute_s;
  const double mean =
      std::accumulate(ranks.begin(), ranks.end(), 0.0,
                      [](double acc, const RankSim& r) { return acc + r.compute_s; }) /
      static_cast<double>(ranks.size());
  return mean > 0 ? mx / mean : 1.0;
}

SimContext::SimContext(const AttnCase& cs, const Profile& pr, AttnSim& o)
    : c(cs), p(pr), out(o), P(cs.ranks) {
  chunks = shard_chunks(c.layout, c.seq, c.ranks, c.doc_lengths);
  t.assign(P, 0.0);
  exposed.assign(P, {});
  slots.assign(P, {});
  out.ranks.assign(P, RankSim{});
}

int64_t SimContext::rows(int r) const {
  int64_t n = 0;
  for (const Chunk& ch : chunks[r]) n += ch.count;
  return n;
}

int64_t SimContext::max_rows() const {
  int64_t m = 0;
  for (int r = 0; r < P; ++r) m = std::max(m, rows(r));
  return m;
}

Block SimContext::block(int first, int count) const {
  Block b;
  for (int r = first; r < first + count; ++r) {
    b.chunks.insert(b.chunks.end(), chunks[r].begin(), chunks[r].end());
    b.rows += rows(r);
  }
  return b;
}

SimContext::Work SimContext::pair_work(const Block& qb, const Block& kb) const {
  Work w;
  const Mask& m = c.mask;
  for (const Chunk& q : qb.chunks)
    for (const Chunk& k : kb.chunks) {
      if (q.count == 0 || k.count == 0 || q.doc != k.doc) continue;
      if (m.causal && k.first > q.last()) continue;
      if (m.window > 0 && std::max(k.first - q.last(), q.first - k.last()) >= m.window) continue;
      ++w.calls;
      const TileCount tc = count_tiles(q, k, m, c.block_q, c.block_k);
      w.tiles += tc;
      // The kernels' own work tiles (loom::work_tile_side, src/kernels/blockwise.cc).
      const int64_t wq = work_tile_side(c.block_q, q.count, p.work_tile),
                    wk = work_tile_side(c.block_k, k.count, p.work_tile);
      if (wq == c.block_q && wk == c.block_k) {
        w.full += static_cast<double>(tc.full);
        w.partial += static_cast<double>(tc.partial);
      } else {
        const TileCount wt = count_tiles(q, k, m, wq, wk);
        const double area =
            static_cast<double>(wq * wk) / static_cast<double>(c.block_q * c.block_k);
        w.full += area * static_cast<double>(wt.full);
        w.partial += area * static_cast<double>(wt.partial);
      }
    }
  return w;
}

double SimContext::busy_scale(const std::vector<int>& members, const std::vector<bool>& busy,
                              int i) const {
  if (p.alone_speedup <= 1.0) return 1.0;
  const int dpn = std::max(1, p.devices_per_node);
  const int node = members[i] * c.cp_stride / dpn;
  int on_node = 0, busy_on_node = 0;
  for (size_t j = 0; j < members.size(); ++j)
    if (members[j] * c.cp_stride / dpn == node) {
      ++on_node;
      busy_on_node += busy[j] ? 1 : 0;
    }
  if (on_node <= 1 || busy_on_node < 1) return 1.0;
  const double f = static_cast<double>(busy_on_node - 1) / (on_node - 1);
  return 1.0 / p.alone_speedup + (1.0 - 1.0 / p.alone_speedup) * f;
}

double SimContext::mem_time(double bytes) const {
  return bytes / p.mem_bandwidth;  // > 0: check_profile
}

double SimContext::kernel_time(const Work& w, int64_t heads, bool backward, int64_t kv_rows,
                               int64_t kv_heads) const {
  const double d = static_cast<double>(c.head_dim);
  double full = 0, partial = 0;
  const double* cal = c.dtype_bytes == 2 ? p.tile_s_bf16 : p.tile_s_fp32;
  const int i = backward ? 2 : 0;
  if (p.kind == "cpu" && cal[i] > 0) {
    const double scale = d / static_cast<double>(std::max<int64_t>(1, p.calib_head_dim));
    full = cal[i] * scale;
    partial = (cal[i + 1] > 0 ? cal[i + 1] : cal[i]) * scale;
  } else {
    const double peak = c.dtype_bytes == 2 ? p.flops_bf16 : p.flops_fp32;
    const double eff = backward ? p.attn_bwd_eff : p.attn_fwd_eff;
    LOOM_CHECK(peak > 0 && eff > 0, InvalidArgument,
               "profile " << p.name << " has no attention rate (flops and efficiency)");
    const double flops = (backward ? 10.0 : 4.0) * static_cast<double>(c.block_q * c.block_k) * d;
    full = flops / (peak * eff);
    partial = full * p.partial_tile_cost;
  }
  const double tiles_s = static_cast<double>(heads) * (w.full * full + w.partial * partial);
  // Each call packs its KV block (k and v; backward also k^T) once.
  const double pack =
      mem_time(static_cast<double>((backward ? 3 : 2) * kv_rows * kv_heads) * d * c.dtype_bytes);
  return tiles_s + w.calls * (p.call_overhead + pack);
}

const Link& SimContext::link(int a, int b) const {
  const int dpn = std::max(1, p.devices_per_node);
  const int wa = a * c.cp_stride, wb = b * c.cp_stride;
  return wa / dpn == wb / dpn ? p.intra : p.inter;
}

double SimContext::message_time(int a, int b, double bytes) const {
  const Link& l = link(a, b);
  return l.latency + bytes / l.bandwidth;  // > 0: check_profile
}

void SimContext::expose(int r, const char* kind, double s) {
  for (auto& [k, v] : exposed[r])
    if (k == kind) {
      v += s;
      return;
    }
  exposed[r].emplace_back(kind, s);
}

void SimContext::fold_exposed() {
  for (int r = 0; r < P; ++r)
    for (const auto& [k, v] : exposed[r]) out.ranks[r].comm_by_kind[k] += v;
}

void SimContext::add_event(int r, const char* kind, int step, double t0, double t1) {
  if (!c.timeline || static_cast<int64_t>(out.events.size()) >= c.max_events) return;
  out.events.push_back(Event{r, kind, step, t0, t1});
}

void SimContext::compute(int r, double dur, int step) {
  add_event(r, "compute", step, t[r], t[r] + dur);
  t[r] += dur;
  out.ranks[r].compute_s += dur;
}

void SimContext::wait(int r, double until, const char* kind, int step) {
  if (until <= t[r]) return;
  add_event(r, "wait", step, t[r], until);
  out.ranks[r].comm_s += until - t[r];
  expose(r, kind, until - t[r]);
  t[r] = until;
}

void SimContext::flight(int r, const char* kind, int step, double t0, double t1) {
  add_event(r, kind, step, t0, t1);
}

void SimContext::collective(const std::vector<int>& members, const std::vector<double>& cost,
                            const char* kind) {
  double start = 0, dur = 0;
  for (size_t i = 0; i < members.size(); ++i) {
    start = std::max(start, t[members[i]]);
    dur = std::max(dur, cost[i]);
  }
  for (int r : members) {
    out.ranks[r].idle_s += start - t[r];
    add_event(r, kind, -1, start, start + dur);
    out.ranks[r].comm_s += dur;
    expose(r, kind, dur);
    t[r] = start + dur;
  }
}

void SimContext::count_tiles_on(int r, const TileCount& tc, int64_t heads, bool backward,
                                int step) {
  RankSim& rs = out.ranks[r];
  const int64_t n = tc.total() * heads;
  (backward ? rs.bwd_tiles : rs.fwd_tiles) += n;
  rs.full_tiles += tc.full * heads;
  rs.partial_tiles += tc.partial * heads;
  if (!backward) {
    if (static_cast<int>(rs.step_tiles.size()) <= step) rs.step_tiles.resize(step + 1, 0);
    rs.step_tiles[step] += n;
  }
}

void SimContext::slot(int r, int s, int64_t bytes) {
  if (static_cast<int>(slots[r].size()) <= s) slots[r].resize(s + 1, 0);
  slots[r][s] = std::max(slots[r][s], bytes);
}

void SimContext::gathered(int r, int64_t bytes) {
  out.ranks[r].gathered_bytes = std::max(out.ranks[r].gathered_bytes, bytes);
}

AttnSim simulate_attention(const AttnCase& c, const Profile& p) {
  register_builtin_schedules();
  check_profile(p);
  LOOM_CHECK(c.seq >= 1, InvalidArgument, "the sequence length must be >= 1, got " << c.seq);
  LOOM_CHECK(c.heads >= 1 && c.kv_heads >= 1 && c.head_dim >= 1, InvalidArgument,
             "heads, kv-heads and head-dim must be positive (got " << c.heads << ", " << c.kv_heads
                                                                   << ", " << c.head_dim << ")");
  LOOM_CHECK(c.head_dim <= kMaxHeadDim, InvalidArgument,
             "head-dim must be in [1, " << kMaxHeadDim << "] (the attention kernels' limit), got "
                                        << c.head_dim);
  LOOM_CHECK(c.heads <= kMaxSimHeads, InvalidArgument,
             "too large to simulate: " << c.heads << " heads, at most " << kMaxSimHeads);
  LOOM_CHECK(c.heads % c.kv_heads == 0, InvalidArgument,
             "heads (" << c.heads << ") must be a multiple of kv-heads (" << c.kv_heads << ")");
  LOOM_CHECK(c.ranks >= 1, InvalidArgument, "ranks must be >= 1, got " << c.ranks);
  LOOM_CHECK(c.block_q >= 1 && c.block_k >= 1, InvalidArgument, "tile sizes must be >= 1");
  LOOM_CHECK(c.dtype_bytes == 2 || c.dtype_bytes == 4, InvalidArgument,
             "dtype must be fp32 (4 bytes) or bf16 (2 bytes), got " << c.dtype_bytes);
  LOOM_CHECK(c.mask.window >= 0, InvalidArgument, "window must be >= 0, got " << c.mask.window);
  const double elements =
      static_cast<double>(c.seq) * static_cast<double>(c.heads) * static_cast<double>(c.head_dim);
  LOOM_CHECK(elements <= kMaxSimElements, InvalidArgument,
             "too large to simulate: S x H x D = " << c.seq << " x " << c.heads << " x "
                                                   << c.head_dim << " = " << elements
                                                   << " elements, at most 2^56 (the byte "
                                                      "counters would overflow)");
  const double q_tiles = std::ceil(static_cast<double>(c.seq) / static_cast<double>(c.block_q)),
               k_tiles = std::ceil(static_cast<double>(c.seq) / static_cast<double>(c.block_k));
  LOOM_CHECK(2.0 * q_tiles * k_tiles * static_cast<double>(c.heads) <= kMaxSimTiles,
             InvalidArgument,
             "too large to simulate: " << q_tiles << " x " << k_tiles << " tiles of " << c.block_q
                                       << " x " << c.block_k << " for each of " << c.heads
                                       << " heads, forward and backward, at most 2^61 (the tile "
                                          "counters would overflow)");
  // Bounded work, checked before anything is built. The simulation keeps per-rank, per-step
  // state (O(P^2) for a ring of P ranks), visits every pair of chunks ((P c)^2 for c chunks per
  // rank: two per document with zigzag) and every q-tile of the pairs on the mask's diagonal
  // (about S / block_q). Measured at the limits' scale: 8192 zigzag ranks 17 s and 0.5 GB, 10000
  // documents on 4 ranks (6.4e9 chunk pairs) 19 s, S = 1e11 on 2 ranks (1.6e9 q-tiles) 16 s.
  // Past them it ran for minutes (--seq 1e12), centuries (--seq 2^63 - 1) or until memory ran
  // out (--ranks 100000) instead of answering.
  LOOM_CHECK(c.ranks <= kMaxSimRanks, InvalidArgument,
             "too large to simulate: " << c.ranks << " ranks, at most " << kMaxSimRanks);
  const double chunks = (c.layout == Layout::zigzag ? 2.0 : 1.0) *
                        static_cast<double>(std::max<size_t>(1, c.doc_lengths.size()));
  const double pairs = std::pow(static_cast<double>(c.ranks) * chunks, 2.0);
  LOOM_CHECK(pairs <= kMaxSimPairs, InvalidArgument,
             "too large to simulate: " << c.ranks << " ranks x " << chunks << " chunks each ("
                                       << c.doc_lengths.size() << " documents) make " << pairs
                                       << " chunk pairs, at most 2^34");
  LOOM_CHECK(c.seq / c.block_q <= kMaxSimQTiles, InvalidArgument,
             "too large to simulate: a sequence of " << c.seq << " tokens is " << c.seq / c.block_q
                                                     << " q-tiles of " << c.block_q
                                                     << " rows, at most 2^30");
  auto it = registry().find(c.strategy);
  if (it == registry().end()) {
    std::string names;
    for (const auto& [n, f] : registry()) names += (names.empty() ? "" : ", ") + n;
    throw InvalidArgument("unknown strategy '" + c.strategy + "' (choose " + names + ")");
  }
  AttnSim out;
  SimContext ctx(c, p, out);
  it->second(ctx);
  ctx.fold_exposed();
  for (int r = 0; r < c.ranks; ++r)
    for (int64_t b : ctx.slots[r]) out.ranks[r].peak_buffer_bytes += b;
  for (RankSim& r : out.ranks) {
    out.forward_s = std::max(out.forward_s, r.end_fwd_s);
    r.end_s = std::max(r.end_s, r.end_fwd_s);
  }
  for (const RankSim& r : out.ranks) out.backward_s = std::max(out.backward_s, r.end_s);
  out.backward_s = c.backward ? out.backward_s - out.forward_s : 0.0;
  return out;
}

}  // namespace loom::plan
