// The simulation engine (see sim.h for the time model) and simulate_attention().
#include "sim.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <unordered_map>

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

// The work of the q chunks [q, q + nq) against the k chunks [k, k + nk), chunk pair by chunk pair
// in that order; the q-tile loops of count_tiles run once per distinct loop (memo).
PairWork chunk_work(const Chunk* q0, size_t nq, const Chunk* k0, size_t nk, const PairKey& key,
                    TileMemo& memo) {
  PairWork w;
  Mask m;
  m.causal = key.causal;
  m.window = key.window;
  const auto tiles = [&](const Chunk& q, const Chunk& k, int64_t bq, int64_t bk) {
    TileCount tc;
    TileLoop loop;
    if (!count_tiles_or_loop(q, k, m, bq, bk, tc, loop)) return tc;
    auto [it, added] = memo.try_emplace(loop);
    if (added) it->second = tile_loop(loop);
    return it->second;
  };
  // Only chunks of one document meet: each q chunk's partners are the k chunks of its document,
  // found by binary search in the k chunks ordered by document (stably, so a q chunk meets them
  // in their given order, as when every pair was tried: the same sums, to the bit). Trying every
  // pair took 82 s for a 16-device search over 4000 documents. A rank's chunks are in row order,
  // their documents already ascending; a block of several ranks' chunks is sorted here.
  const auto doc_less = [](const Chunk* a, const Chunk* b) { return a->doc < b->doc; };
  std::vector<const Chunk*> ks(nk);
  for (size_t i = 0; i < nk; ++i) ks[i] = k0 + i;
  if (!std::is_sorted(ks.begin(), ks.end(), doc_less))
    std::stable_sort(ks.begin(), ks.end(), doc_less);
  for (const Chunk* q = q0; q != q0 + nq; ++q) {
    if (q->count == 0) continue;
    const auto [k_begin, k_end] = std::equal_range(ks.begin(), ks.end(), q, doc_less);
    for (auto it = k_begin; it != k_end; ++it) {
      const Chunk* k = *it;
      if (k->count == 0) continue;
      if (m.causal && k->first > q->last()) continue;
      if (m.window > 0 && std::max(k->first - q->last(), q->first - k->last()) >= m.window)
        continue;
      ++w.calls;
      w.kv_rows += static_cast<double>(k->count);
      const TileCount tc = tiles(*q, *k, key.block_q, key.block_k);
      w.tiles += tc;
      // The kernels' own work tiles (loom::work_tile_side, src/kernels/blockwise.cc).
      const int64_t wq = work_tile_side(key.block_q, q->count, key.work_tile),
                    wk = work_tile_side(key.block_k, k->count, key.work_tile);
      if (wq == key.block_q && wk == key.block_k) {
        w.full += static_cast<double>(tc.full);
        w.partial += static_cast<double>(tc.partial);
      } else {
        const TileCount wt = tiles(*q, *k, wq, wk);
        const double area =
            static_cast<double>(wq * wk) / static_cast<double>(key.block_q * key.block_k);
        w.full += area * static_cast<double>(wt.full);
        w.partial += area * static_cast<double>(wt.partial);
      }
    }
  }
  return w;
}

PairWork chunk_work(const std::vector<Chunk>& q, const std::vector<Chunk>& k, const PairKey& key,
                    TileMemo& memo) {
  return chunk_work(q.data(), q.size(), k.data(), k.size(), key, memo);
}

bool same(const PairWork& a, const PairWork& b) {
  return a.tiles.full == b.tiles.full && a.tiles.partial == b.tiles.partial && a.calls == b.calls &&
         std::bit_cast<uint64_t>(a.full) == std::bit_cast<uint64_t>(b.full) &&
         std::bit_cast<uint64_t>(a.partial) == std::bit_cast<uint64_t>(b.partial) &&
         std::bit_cast<uint64_t>(a.kv_rows) == std::bit_cast<uint64_t>(b.kv_rows);
}

struct PairWorkHash {
  size_t operator()(const PairWork& w) const {
    uint64_t h = 0;
    for (uint64_t v : {static_cast<uint64_t>(w.tiles.full), static_cast<uint64_t>(w.tiles.partial),
                       static_cast<uint64_t>(w.calls), std::bit_cast<uint64_t>(w.full),
                       std::bit_cast<uint64_t>(w.partial), std::bit_cast<uint64_t>(w.kv_rows)})
      h = (h ^ v) * 0x100000001b3ull + (h >> 29);
    return static_cast<size_t>(h);
  }
};

struct PairWorkEq {
  bool operator()(const PairWork& a, const PairWork& b) const { return same(a, b); }
};

}  // namespace

PairTable::PairTable(PairKey key, const std::vector<std::vector<Chunk>>& chunks)
    : key_(std::move(key)) {
  const int P = key_.ranks;
  LOOM_CHECK(static_cast<int>(chunks.size()) == P, InvalidArgument,
             "PairTable: " << chunks.size() << " shards for " << P << " ranks");
  // Exactness of sums in any order (exact_sums()): a bound on every work figure of any union,
  // the whole sequence's (q tiles) x (k tiles), each counted in work tiles times their block
  // factors, which is at least the block tile count; the key rows packed, at most S per q chunk
  // (a q chunk meets the chunks of its own document).
  double q_tiles = 0, k_tiles = 0, n_chunks = 0;
  for (const std::vector<Chunk>& shard : chunks)
    for (const Chunk& ch : shard) {
      const int64_t wq = work_tile_side(key_.block_q, ch.count, key_.work_tile),
                    wk = work_tile_side(key_.block_k, ch.count, key_.work_tile);
      q_tiles += static_cast<double>((ch.count + wq - 1) / wq * (wq / key_.block_q));
      k_tiles += static_cast<double>((ch.count + wk - 1) / wk * (wk / key_.block_k));
      n_chunks += 1;
    }
  exact_sums_ = q_tiles * k_tiles < 0x1p52 && n_chunks * n_chunks < 0x1p30 &&
                n_chunks * static_cast<double>(key_.seq) < 0x1p52;
  idx_.resize(static_cast<size_t>(P) * static_cast<size_t>(P));
  std::unordered_map<PairWork, uint32_t, PairWorkHash, PairWorkEq> seen;
  TileMemo memo;
  uint32_t last = 0;
  for (int d = 0; d < P; ++d)  // the layout of at(): by diagonal d = a - b mod P, then a
    for (int a = 0; a < P; ++a) {
      const int b = a >= d ? a - d : a - d + P;
      const PairWork w = chunk_work(chunks[a], chunks[b], key_, memo);
      uint32_t v = last;
      if (values_.empty() || !same(w, values_[last])) {
        auto [it, added] = seen.emplace(w, static_cast<uint32_t>(values_.size()));
        if (added) values_.push_back(w);
        v = it->second;
      }
      set(static_cast<size_t>(d) * static_cast<size_t>(P) + a, v);
      last = v;
    }
  loops_run_ = memo.size();
}

uint32_t PairTable::wide(size_t i) const {
  if (width_ == 2) {
    uint16_t v;
    std::memcpy(&v, &idx_[2 * i], 2);
    return v;
  }
  uint32_t v;
  std::memcpy(&v, &idx_[4 * i], 4);
  return v;
}

void PairTable::set(size_t i, uint32_t v) {
  const int need = v <= 0xff ? 1 : v <= 0xffff ? 2 : 4;
  if (need > width_) {  // widen every index stored so far
    const size_t n = idx_.size() / width_;
    std::vector<uint8_t> wider(n * need);
    for (size_t j = 0; j < n; ++j) {
      const uint32_t x = width_ == 1 ? idx_[j] : wide(j);
      if (need == 2) {
        const uint16_t y = static_cast<uint16_t>(x);
        std::memcpy(&wider[2 * j], &y, 2);
      } else {
        std::memcpy(&wider[4 * j], &x, 4);
      }
    }
    idx_.swap(wider);
    width_ = need;
  }
  if (width_ == 1) {
    idx_[i] = static_cast<uint8_t>(v);
  } else if (width_ == 2) {
    const uint16_t y = static_cast<uint16_t>(v);
    std::memcpy(&idx_[2 * i], &y, 2);
  } else {
    std::memcpy(&idx_[4 * i], &v, 4);
  }
}

std::shared_ptr<const PairTable> PairCache::get(const PairKey& key,
                                                const std::vector<std::vector<Chunk>>& chunks) {
  ++clock_;
  auto it = tables_.find(key);
  if (it != tables_.end()) {
    it->second.used = clock_;
    return it->second.table;
  }
  auto table = std::make_shared<const PairTable>(key, chunks);
  while (!tables_.empty() && bytes_ + table->bytes() > kBudget) {
    auto lru = tables_.begin();
    for (auto e = tables_.begin(); e != tables_.end(); ++e)
      if (e->second.used < lru->second.used) lru = e;
    bytes_ -= lru->second.table->bytes();
    tables_.erase(lru);
  }
  tables_.emplace(key, Entry{table, clock_});
  bytes_ += table->bytes();
  return table;
}

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

SimContext::SimContext(const AttnCase& cs, const Profile& pr, AttnSim& o, const SimOptions& options)
    : c(cs), p(pr), out(o), P(cs.ranks), cache_(options.cache), step_tiles_(options.step_tiles) {
  key_.layout = c.layout;
  key_.seq = c.seq;
  key_.ranks = c.ranks;
  key_.doc_lengths = c.doc_lengths;
  key_.causal = c.mask.causal;
  key_.window = c.mask.window;
  key_.block_q = c.block_q;
  key_.block_k = c.block_k;
  key_.work_tile = p.work_tile;
  chunks = shard_chunks(c.layout, c.seq, c.ranks, c.doc_lengths);
  // Nodes numbered densely in rank order (world rank r x cp_stride, in int64: the node of the
  // last rank sized these arrays, and a stride of 2^30 asked for gigabytes): the cost model only
  // compares them and counts the ranks on each.
  const int64_t dpn = std::max(1, p.devices_per_node);
  node_.resize(P);
  int nodes = 0;
  for (int r = 0; r < P; ++r) {
    const int64_t node = static_cast<int64_t>(r) * c.cp_stride / dpn;
    const int64_t before = r > 0 ? static_cast<int64_t>(r - 1) * c.cp_stride / dpn : -1;
    if (node != before) ++nodes;
    node_[r] = nodes - 1;
  }
  on_node_.assign(nodes, 0);
  busy_on_node_ = on_node_;
  // The kernels' seconds per tile: calibrated ("cpu" profiles, scaled linearly in the head dim)
  // or the peak rate times the efficiency.
  const double d = static_cast<double>(c.head_dim);
  const double* cal = c.dtype_bytes == 2 ? p.tile_s_bf16 : p.tile_s_fp32;
  for (int backward = 0; backward < 2; ++backward) {
    const int i = backward ? 2 : 0;
    if (p.kind == "cpu" && cal[i] > 0) {
      const double scale = d / static_cast<double>(std::max<int64_t>(1, p.calib_head_dim));
      tile_full_[backward] = cal[i] * scale;
      tile_partial_[backward] = (cal[i + 1] > 0 ? cal[i + 1] : cal[i]) * scale;
    } else {
      const double peak = c.dtype_bytes == 2 ? p.flops_bf16 : p.flops_fp32;
      const double eff = backward ? p.attn_bwd_eff : p.attn_fwd_eff;
      rate_ok_[backward] = peak > 0 && eff > 0;
      const double flops = (backward ? 10.0 : 4.0) * static_cast<double>(c.block_q * c.block_k) * d;
      tile_full_[backward] = flops / (peak * eff);
      tile_partial_[backward] = tile_full_[backward] * p.partial_tile_cost;
    }
  }
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
  b.first = first;
  b.count = count;
  for (int r = first; r < first + count; ++r) {
    b.chunks.insert(b.chunks.end(), chunks[r].begin(), chunks[r].end());
    b.rows += rows(r);
  }
  return b;
}

const PairTable& SimContext::pair_table() const {
  if (!table_)
    table_ = cache_ ? cache_->get(key_, chunks) : std::make_shared<const PairTable>(key_, chunks);
  return *table_;
}

SimContext::Work SimContext::group_work(const Block& qb, const Block& kb) const {
  const int g = qb.count;
  if (g >= 1 && kb.count == g && qb.first % g == 0 && kb.first % g == 0 && qb.first + g <= P &&
      kb.first + g <= P) {
    const PairTable& t = pair_table();
    if (g == 1) return t.at(qb.first, kb.first);
    if (t.exact_sums()) {
      const size_t n = static_cast<size_t>(P / g);
      if (group_ != g) {
        group_ = g;
        groups_.assign(n * n, Work{});
        done_.assign(n * n, 0);
      }
      const size_t i = static_cast<size_t>(qb.first / g) * n + static_cast<size_t>(kb.first / g);
      if (!done_[i]) {
        Work& w = groups_[i];
        for (int a = qb.first; a < qb.first + g; ++a)
          for (int b = kb.first; b < kb.first + g; ++b) {
            const Work& x = t.at(a, b);
            w.tiles += x.tiles;
            w.calls += x.calls;
            w.full += x.full;
            w.partial += x.partial;
            w.kv_rows += x.kv_rows;
          }
        done_[i] = 1;
      }
      return groups_[i];
    }
  }
  return chunk_work(qb.chunks, kb.chunks, key_, memo_);
}

void SimContext::busy_scales(const std::vector<int>& members, const std::vector<bool>& busy,
                             std::vector<double>& scale) const {
  const size_t n = members.size();
  scale.assign(n, 1.0);
  if (p.alone_speedup <= 1.0) return;
  for (size_t j = 0; j < n; ++j) {
    ++on_node_[node_[members[j]]];
    busy_on_node_[node_[members[j]]] += busy[j] ? 1 : 0;
  }
  for (size_t i = 0; i < n; ++i) {
    const int on_node = on_node_[node_[members[i]]],
              busy_on_node = busy_on_node_[node_[members[i]]];
    if (on_node <= 1 || busy_on_node < 1) continue;
    const double f = static_cast<double>(busy_on_node - 1) / (on_node - 1);
    scale[i] = 1.0 / p.alone_speedup + (1.0 - 1.0 / p.alone_speedup) * f;
  }
  for (size_t j = 0; j < n; ++j) on_node_[node_[members[j]]] = busy_on_node_[node_[members[j]]] = 0;
}

void SimContext::no_rate() const {
  throw InvalidArgument("profile " + p.name + " has no attention rate (flops and efficiency)",
                        __FILE__, __LINE__);
}

void SimContext::fold_exposed() {
  for (int r = 0; r < P; ++r)
    for (const auto& [k, v] : exposed[r]) out.ranks[r].comm_by_kind[k] += v;
}

void SimContext::add_event(int r, const char* kind, int step, double t0, double t1) {
  if (!c.timeline || static_cast<int64_t>(out.events.size()) >= c.max_events) return;
  out.events.push_back(Event{r, kind, step, t0, t1});
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

void SimContext::gathered(int r, int64_t bytes) {
  out.ranks[r].gathered_bytes = std::max(out.ranks[r].gathered_bytes, bytes);
}

AttnSim simulate_attention(const AttnCase& c, const Profile& p) {
  return simulate_attention(c, p, SimOptions{});
}

AttnSim simulate_attention(const AttnCase& c, const Profile& p, const SimOptions& options) {
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
  // Before the work bounds below, which count a layout's chunks (an unknown one simulated no
  // work at all).
  LOOM_CHECK(
      c.layout == Layout::contiguous || c.layout == Layout::zigzag || c.layout == Layout::stripe,
      InvalidArgument,
      "layout must be contiguous, zigzag or stripe, got the value " << static_cast<int>(c.layout));
  // World rank of cp rank r: r x cp_stride, an int (a negative stride indexed the node counters
  // out of bounds).
  LOOM_CHECK(c.cp_stride >= 1 && c.cp_stride <= std::numeric_limits<int>::max() / c.ranks,
             InvalidArgument,
             "cp_stride must be in [1, "
                 << std::numeric_limits<int>::max() / c.ranks << "] for " << c.ranks
                 << " ranks (world rank = cp rank x cp_stride), got " << c.cp_stride);
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
  SimContext ctx(c, p, out, options);
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
  // A checked profile and case give finite times (profile.cc's ranges); never return others
  // (a rate of 1e-300 printed "forward inf ms, backward -nan ms", exit 0). Finite as printed,
  // in ms: a forward of 1.5e307 s passed isfinite and printed "inf ms".
  LOOM_CHECK(std::isfinite(out.forward_s * 1e3) && std::isfinite(out.backward_s * 1e3) &&
                 std::isfinite(out.balance()),
             InvalidArgument,
             "profile '" << p.name << "' gives " << c.strategy << " on " << c.ranks
                         << " ranks a forward of " << out.forward_s << " s and a backward of "
                         << out.backward_s << " s; check its figures");
  return out;
}

}  // namespace loom::plan
