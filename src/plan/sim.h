// Internal to src/plan: the simulation context a schedule works on.
//
// Time model. Every cp rank has a clock. compute() advances it by a kernel's or an element-wise
// pass's modelled duration. A point-to-point message starts when both its sender and its
// receiver have posted it and takes latency + bytes / bandwidth of the link between their
// devices (intra-node or inter-node, from the placement); on a profile without overlap the
// sender's clock pays that time at posting. A rank that waits for a message that has not arrived
// is blocked: that time is exposed communication of the message's kind. A blocking collective
// starts when its last member arrives (the earlier ones idle) and ends for all members after the
// slowest member's share of the traffic.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/plan.h"

namespace loom::plan {

// The rows of one ring member (a cp rank's shard, or the union of a ulysses group's shards).
struct Block {
  std::vector<Chunk> chunks;
  int64_t rows = 0;
  int first = 0, count = 0;  // the cp ranks [first, first + count) whose chunks these are
};

// count_tiles (tiles.cc) in two halves: the closed form, and the loop over the q-tiles of a pair
// the mask's edge crosses, which costs q.count / block_q steps and depends on these figures
// alone. count_tiles_or_loop returns false with the count in tc, or true with the loop to run
// (tile_loop) in `loop`. Every pair of stripe shards loops (their positions interleave), P^2
// pairs of S / P rows: S = 2^28 on 8192 ranks ran for hours. Their loops are few distinct ones
// (the offset q.first - k.first is below the stride: two m_lo, two m_hi, two row counts per
// document), so a simulation runs each once (TileMemo).
struct TileLoop {
  int64_t qn = 0, kn = 0, m_lo = 0, m_hi = 0, block_q = 0, block_k = 0;
  auto operator<=>(const TileLoop&) const = default;
};
bool count_tiles_or_loop(const Chunk& q, const Chunk& k, const Mask& mask, int64_t block_q,
                         int64_t block_k, TileCount& tc, TileLoop& loop);
TileCount tile_loop(const TileLoop& loop);
using TileMemo = std::map<TileLoop, TileCount>;

// The work of q rows against one KV block, per head: the exact block_q x block_k tiles (what the
// kernels report), the kernel calls (chunk pairs the cp layer does not skip), the work tiles
// the kernel really computes (Profile::work_tile), in block-tile areas, and the key rows the
// calls pack: each call (attend_blocks in src/cp/ring_pass.cc: one per pair of segments) packs
// its own key chunk, not the whole block.
struct PairWork {
  TileCount tiles;
  int calls = 0;
  double full = 0, partial = 0;  // work tiles, each weighted by its area in block tiles
  double kv_rows = 0;            // the key chunk's rows, summed over the calls
};

// Everything the work of a pair of shards depends on: their chunks (layout, sequence, ranks,
// documents), the mask, the block tiles and the profile's work tile. Simulations with equal keys
// have equal pair work, whatever their strategy, heads, dtype or links.
struct PairKey {
  Layout layout = Layout::zigzag;
  int64_t seq = 0;
  int ranks = 0;
  std::vector<int64_t> doc_lengths;
  bool causal = true;
  int64_t window = 0, block_q = 0, block_k = 0, work_tile = 0;
  auto operator<=>(const PairKey&) const = default;
};

// The work of every pair (q rank, k rank) of single cp ranks' shards, computed once (P^2 pairs,
// chunk pair by chunk pair) and stored as one index per pair into the distinct values: a pair's
// work depends on its chunks' sizes and relative offsets, which repeat (causal, S = 128K on 1024
// ranks in 128 x 128 tiles: 3 distinct values contiguous, 2 zigzag, 7 zigzag with a window of
// 8K, 1 stripe), so the index is one byte per pair, two or four only past 256 or 65536 distinct
// values. The indices are stored by diagonal (q - k mod P), then q: a ring step reads one
// diagonal, q after q.
class PairTable {
 public:
  PairTable(PairKey key, const std::vector<std::vector<Chunk>>& chunks);
  const PairKey& key() const { return key_; }
  const PairWork& at(int q, int k) const {
    const int d = q >= k ? q - k : q - k + key_.ranks;
    const size_t i = static_cast<size_t>(d) * static_cast<size_t>(key_.ranks) + q;
    return values_[width_ == 1 ? idx_[i] : wide(i)];
  }
  size_t bytes() const { return idx_.size() + values_.size() * sizeof(PairWork); }
  // Whether the work of a union of shards may be summed from the pairs' in any order with the
  // same result, to the bit, as pair_work's chunk-by-chunk sum: every figure of a pair is an
  // integer (tiles, calls, key rows, and work tiles times their areas, integer products of the
  // block factors), so the sums are exact while every total stays below 2^53 (and calls below
  // 2^31).
  bool exact_sums() const { return exact_sums_; }
  // How many distinct q-tile loops (count_tiles_or_loop's TileLoop) the table ran: pairs with the
  // same loop shape share one run, so this stays small where the pairs are many (stripe: every
  // pair on the causal diagonal, P^2 loops of S / (P block_q) steps before).
  size_t loops_run() const { return loops_run_; }

 private:
  uint32_t wide(size_t i) const;
  void set(size_t i, uint32_t v);
  PairKey key_;
  std::vector<PairWork> values_;
  std::vector<uint8_t> idx_;  // width_ bytes per pair
  int width_ = 1;
  bool exact_sums_ = false;
  size_t loops_run_ = 0;
};

// The tables of one search (plan()): the candidates of one layout and cp degree share one. At
// most kBudget bytes are kept, the least recently used dropped first.
class PairCache {
 public:
  std::shared_ptr<const PairTable> get(const PairKey& key,
                                       const std::vector<std::vector<Chunk>>& chunks);

 private:
  static constexpr size_t kBudget = size_t{64} << 20;
  struct Entry {
    std::shared_ptr<const PairTable> table;
    uint64_t used = 0;
  };
  std::map<PairKey, Entry> tables_;
  uint64_t clock_ = 0;
  size_t bytes_ = 0;
};

// How simulate_attention() runs: with the pair tables of `cache` (nullptr: the simulation's
// own), and with or without RankSim::step_tiles (the search reads only the totals; the per-step
// tiles were P^2 counters per simulation, written rank after rank at every step).
struct SimOptions {
  PairCache* cache = nullptr;
  bool step_tiles = true;
};
AttnSim simulate_attention(const AttnCase& c, const Profile& p, const SimOptions& options);

struct SimContext {
  const AttnCase& c;
  const Profile& p;
  AttnSim& out;
  int P;
  std::vector<std::vector<Chunk>> chunks;  // [cp rank]
  std::vector<double> t;                   // clock per cp rank
  bool in_backward = false;

  SimContext(const AttnCase& cs, const Profile& pr, AttnSim& o, const SimOptions& options = {});

  int64_t rows(int r) const;
  int64_t max_rows() const;
  Block block(int first, int count) const;  // union of cp ranks [first, first + count)
  // The work of q rows (block qb) against one KV block, per head (PairWork). One-rank blocks
  // read the pair table; unions of g ranks aligned on g (hybrid's and Ulysses' groups) sum it
  // once per pair of groups when that is exact (PairTable::exact_sums); other blocks count their
  // chunk pairs.
  using Work = PairWork;
  Work pair_work(const Block& qb, const Block& kb) const {
    if (qb.count == 1 && kb.count == 1 && table_) return table_->at(qb.first, kb.first);
    return group_work(qb, kb);
  }

  // Durations. The small ones are defined below, inline: the schedules call them for every
  // rank at every step (O(P^2) calls per ring pass).
  double kernel_time(const Work& w, int64_t heads, bool backward, int64_t kv_heads) const {
    if (!rate_ok_[backward]) no_rate();
    const double d = static_cast<double>(c.head_dim);
    const double tiles_s = static_cast<double>(heads) *
                           (w.full * tile_full_[backward] + w.partial * tile_partial_[backward]);
    // Each call packs its key chunk (k and v; backward also k^T) once: the rows of every call's
    // chunk, not the whole KV block per call (128 documents of 256 tokens on one rank were
    // charged 384 packs of all 32K rows, 1147 ms predicted against 120 ms measured).
    const double pack = mem_time(w.kv_rows * static_cast<double>((backward ? 3 : 2) * kv_heads) *
                                 d * c.dtype_bytes);
    return tiles_s + w.calls * p.call_overhead + pack;
  }
  double mem_time(double bytes) const {
    return bytes / p.mem_bandwidth;  // > 0: check_profile
  }
  // Time multiplier of each member's kernels (scale[i], one per member) when only the `busy`
  // members (cp ranks `members`) of its node compute at once: 1 when all of them do,
  // 1 / alone_speedup when it computes alone. Counted per node once, for all members.
  void busy_scales(const std::vector<int>& members, const std::vector<bool>& busy,
                   std::vector<double>& scale) const;
  const Link& link(int a, int b) const {  // cp ranks
    return node_[a] == node_[b] ? p.intra : p.inter;
  }
  double message_time(int a, int b, double bytes) const {
    const Link& l = link(a, b);
    return l.latency + bytes / l.bandwidth;  // > 0: check_profile
  }

  // Events.
  void compute(int r, double dur, int step) {
    if (c.timeline) add_event(r, "compute", step, t[r], t[r] + dur);
    t[r] += dur;
    out.ranks[r].compute_s += dur;
  }
  // Blocks rank r until `until`; exposed communication of `kind`.
  void wait(int r, double until, const char* kind, int step) {
    if (until <= t[r]) return;
    if (c.timeline) add_event(r, "wait", step, t[r], until);
    out.ranks[r].comm_s += until - t[r];
    expose(r, kind, until - t[r]);
    t[r] = until;
  }
  void flight(int r, const char* kind, int step, double t0, double t1) {  // a transfer's span
    if (c.timeline) add_event(r, kind, step, t0, t1);
  }
  // A blocking collective over `members` (cp ranks); cost[i] is member i's share.
  void collective(const std::vector<int>& members, const std::vector<double>& cost,
                  const char* kind);
  void count_tiles_on(int r, const TileCount& tc, int64_t heads, bool backward, int step) {
    RankSim& rs = out.ranks[r];
    const int64_t n = tc.total() * heads;
    (backward ? rs.bwd_tiles : rs.fwd_tiles) += n;
    rs.full_tiles += tc.full * heads;
    rs.partial_tiles += tc.partial * heads;
    if (!backward && step_tiles_) {
      if (static_cast<int>(rs.step_tiles.size()) <= step) rs.step_tiles.resize(step + 1, 0);
      rs.step_tiles[step] += n;
    }
  }
  void sent(int r, int64_t bytes) { out.ranks[r].bytes_sent += bytes; }
  void received(int r, int64_t bytes) { out.ranks[r].bytes_recv += bytes; }
  // Rank r's memory seam slot `slot` asks for `bytes` (slots grow, never shrink: Memory in
  // src/cp/memory.h); their sum is RankSim::peak_buffer_bytes.
  void slot(int r, int slot, int64_t bytes) {
    std::vector<int64_t>& s = slots[r];
    if (static_cast<int>(s.size()) <= slot) s.resize(slot + 1, 0);
    s[slot] = std::max(s[slot], bytes);
  }
  std::vector<std::vector<int64_t>> slots;  // [rank][slot]
  void gathered(int r, int64_t bytes);      // tensors outside the seam (RankSim::gathered_bytes)
  void add_event(int r, const char* kind, int step, double t0, double t1);
  // Exposed seconds by kind, [rank][kind index]; folded into RankSim::comm_by_kind at the end.
  std::vector<std::vector<std::pair<const char*, double>>> exposed;
  void expose(int r, const char* kind, double s) {
    for (auto& [k, v] : exposed[r])
      if (k == kind) {
        v += s;
        return;
      }
    exposed[r].emplace_back(kind, s);
  }
  void fold_exposed();

 private:
  Work group_work(const Block& qb, const Block& kb) const;
  [[noreturn]] void no_rate() const;
  std::vector<int> node_;  // node of each cp rank (placement: world rank = cp rank x cp_stride)
  mutable std::vector<int> on_node_, busy_on_node_;  // busy_scales(), zero between calls
  // Seconds per full and per partial tile of one head, forward [0] and backward [1]; rate_ok_
  // false: the profile has no attention rate (kernel_time refuses).
  double tile_full_[2] = {0, 0}, tile_partial_[2] = {0, 0};
  bool rate_ok_[2] = {true, true};
  const PairTable& pair_table() const;
  PairCache* cache_;
  bool step_tiles_;
  PairKey key_;
  mutable std::shared_ptr<const PairTable> table_;  // at the first pair_work
  mutable int group_ = 0;                           // the ranks per group of groups_
  mutable std::vector<Work> groups_;                // [q group][k group], when done_
  mutable std::vector<char> done_;
  mutable TileMemo memo_;  // group_work's chunk-by-chunk sums
};

}  // namespace loom::plan
