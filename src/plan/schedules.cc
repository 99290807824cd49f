// The schedules: one function per strategy, replaying what src/cp does, message by message.
//
//   ring       R = P ring members; forward posts the next KV block (send to r + 1, receive from
//              r - 1) before computing on the block in hand and waits for both after; backward
//              does the same with K, V and lets the fp32 dK, dV accumulator follow its block
//              (wait for the accumulator sent two steps ago, wait for the one arriving, add,
//              send on), arriving home after a full turn.
//   ulysses    all-to-alls q, k, v ("my tokens, all heads" -> "all tokens, my heads"), one
//              local attend, all-to-alls out and lse back; backward also moves out, dout and lse
//              in and dq, dk, dv back (fp32). KV heads scattered (Hkv % U == 0) or replicated.
//   hybrid     ulysses inside groups of U consecutive cp ranks, a ring of R = P / U groups.
//   allgather  all-gather K, V padded to the longest shard, P kernel calls, reduce-scatter the
//              padded fp32 dK, dV.
// The byte counts are those of the strategy code and the communicator's counters (messages to
// other ranks only), so tests/plan can demand equality with `loom attn --json`.
//
//   ring2d     O = P / I inner rings of I consecutive ranks; an outer ring across them moves one
//              KV block per outer step while the inner ring pass computes; backward moves the
//              group's dK, dV over the outer ring too.
// Besides the traffic, each schedule charges the element-wise copies the CPU code makes (packs,
// zero-fills, unpacks, the memmove of a collective's own part) at the profile's memory
// bandwidth, and the kernels' work tiles at the calibrated tile rates.
//
// Adding a strategy: write one function taking the SimContext and add it to
// register_builtin_schedules() below.
#include <algorithm>
#include <mutex>

#include "loom/error.h"
#include "sim.h"

namespace loom::plan {

namespace {

// The memory seam slots the strategies use (src/cp/strategies/strategy.h; the ring pass: 0-6).
constexpr int kSlotDelta = 7;
constexpr int kSlotOwn = 8;

// i mod n for i in (-n, 2n): a member's neighbour or source in a ring, without a division (the
// schedules ask for it for every member at every step).
int wrap(int i, int n) {
  return i < 0 ? i + n : i >= n ? i - n : i;
}

// Synchronises every clock to the latest one (loom attn's barrier between phases).
void barrier(SimContext& x) {
  const double m = *std::max_element(x.t.begin(), x.t.end());
  for (int r = 0; r < x.P; ++r) {
    x.out.ranks[r].idle_s += m - x.t[r];
    x.t[r] = m;
  }
}

// A message of `bytes` from cp rank a (posted at time ta) to cp rank b (posted at tb): counted
// on both, in flight from the later posting; returns its arrival. Without overlap the sender's
// thread copies it (its clock pays the transfer).
inline double p2p(SimContext& x, int a, int b, int64_t bytes, double ta, double tb, int step) {
  const double cost = x.message_time(a, b, static_cast<double>(bytes));
  const double end = std::max(ta, tb) + cost;
  x.sent(a, bytes);
  x.received(b, bytes);
  x.flight(a, "send", step, ta, end);
  if (!x.p.overlap) x.compute(a, cost, step);
  return end;
}

// A ring of cp ranks: member j is cp rank members[j], computes for query rows *q[j] and holds
// the KV block *blocks[j] at step 0 (ring, hybrid: its own rows; ring2d's inner rings: another
// group's). The blocks belong to the schedule.
struct Ring {
  std::vector<int> members;
  std::vector<const Block*> q, blocks;
  int size() const { return static_cast<int>(members.size()); }
  int64_t max_rows() const {
    int64_t m = 0;
    for (const Block* b : blocks) m = std::max(m, b->rows);
    return m;
  }
};

// The rings of the hybrid split over the blocks of the ulysses groups (group j: cp ranks
// jU .. jU + U - 1): ring u holds cp ranks u, u + U, u + 2U, ... and member j's block is group
// j's (U = 1: the plain ring).
std::vector<Ring> hybrid_rings(const std::vector<Block>& groups, int U) {
  const int R = static_cast<int>(groups.size());
  std::vector<Ring> rings(U);
  for (int u = 0; u < U; ++u)
    for (int j = 0; j < R; ++j) {
      rings[u].members.push_back(j * U + u);
      rings[u].q.push_back(&groups[j]);
      rings[u].blocks.push_back(&groups[j]);
    }
  return rings;
}

// TravellingSum (src/cp/ring_pass.cc) over one ring: at step s each member waits for its send
// of step s - 2 (the double buffer), waits for the accumulator its predecessor sent at step
// s - 1, adds its part (step 0: copies it) and sends the sum on to its successor.
struct SumSim {
  const Ring* g = nullptr;
  std::vector<double> end[2], last;  // [parity][member]: when its send ended; the latest send
  std::vector<double> post;          // scratch
  SumSim() = default;
  explicit SumSim(const Ring& r) { reset(r); }
  void reset(const Ring& r) {  // a new travelling sum over r (storage kept)
    g = &r;
    end[0].assign(r.size(), 0.0);
    end[1].assign(r.size(), 0.0);
    last.assign(r.size(), 0.0);
    post.resize(r.size());
  }
  // Member i sends count(i) fp32 elements at step s.
  template <class F>
  void pass(SimContext& x, int s, F count, int step) {
    const int R = g->size(), par = s & 1;
    for (int i = 0; i < R; ++i) {
      const int r = g->members[i];
      if (s >= 2) x.wait(r, end[par][i], "p2p", step);
      if (s > 0) x.wait(r, last[wrap(i - 1, R)], "p2p", step);
      x.compute(r, x.mem_time((s == 0 ? 2.0 : 3.0) * 4.0 * static_cast<double>(count(i))), step);
      post[i] = x.t[r];
    }
    // The new sends' ends go to end[par] (the sends of step s - 2, waited for above) and, after
    // every member has read its predecessor's from `last`, to `last`.
    std::vector<double>& ends = end[par];
    for (int i = 0; i < R; ++i) {
      const int next = wrap(i + 1, R);
      ends[i] = p2p(x, g->members[i], g->members[next], 4 * count(i), post[i], post[next], step);
    }
    last = ends;
  }
  // The accumulator of each member's own block, home after a full turn; every send done.
  void home(SimContext& x, int step) {
    const int R = g->size();
    for (int i = 0; i < R; ++i) {
      x.wait(g->members[i], last[wrap(i - 1, R)], "p2p", step);
      x.wait(g->members[i], std::max(end[0][i], end[1][i]), "p2p", step);
    }
  }
};

// One ring pass (ring_forward / ring_backward of src/cp/ring_pass.cc) on every ring: hl query
// heads compute, hkv KV heads travel; steps are numbered from step0. Forward: post the next KV
// block (send to i + 1, receive from i - 1), compute on the block in hand, wait for both.
// Backward: the same with K, V, and the fp32 dK, dV accumulator of each block following it
// (SumSim), home after a full turn and unpacked into dk, dv.
// pack_own: the member's own K, V are separate tensors, packed into one buffer first (ring,
// hybrid); ring2d's inner rings start from the outer buffer, which is one already.
void ring_pass(SimContext& x, const std::vector<Ring>& rings, int64_t hl, int64_t hkv,
               bool backward, int step0, bool pack_own = true) {
  const int64_t T = x.c.dtype_bytes, row = hkv * x.c.head_dim;
  // Per-step state, sized once for the largest ring (a pass of ring2d visits many small rings).
  size_t most = 0;
  for (const Ring& g : rings) most = std::max(most, g.members.size());
  std::vector<SimContext::Work> w(most);
  std::vector<bool> busy(most);
  std::vector<double> scale;
  std::vector<double> post(most), kv_end(most);
  SumSim sum;
  for (const Ring& g : rings) {
    const int R = g.size();
    const std::vector<int>& m = g.members;
    // One step's kernels on every member; a member computing while others of its node idle
    // runs at the profile's alone rate (x.busy_scales).
    auto step_compute_all = [&](int s) {
      for (int i = 0; i < R; ++i) {
        w[i] = x.pair_work(*g.q[i], *g.blocks[wrap(i - s, R)]);
        busy[i] = w[i].tiles.total() > 0;
      }
      x.busy_scales(m, busy, scale);
      for (int i = 0; i < R; ++i) {
        const Block& kb = *g.blocks[wrap(i - s, R)];
        x.count_tiles_on(m[i], w[i].tiles, hl, backward, step0 + s);
        double dur = x.kernel_time(w[i], hl, backward, hkv) * scale[i];
        if (backward) dur += x.mem_time(2.0 * kb.rows * row * 4);  // zero the partial dK, dV
        x.compute(m[i], dur, step0 + s);
      }
    };
    if (R == 1) {
      step_compute_all(0);
      continue;
    }
    const int64_t cap = 2 * g.max_rows() * row;
    for (int j = 0; j < R; ++j)  // the KV double buffer; backward: partial, 4 accumulators
      for (int s = 0; s < (backward ? 7 : 2); ++s) x.slot(m[j], s, cap * (s < 2 ? T : 4));
    if (pack_own)
      for (int i = 0; i < R; ++i)
        x.compute(m[i], x.mem_time(2.0 * 2 * g.blocks[i]->rows * row * T), step0);
    if (backward) sum.reset(g);
    for (int s = 0; s < R; ++s) {
      for (int i = 0; i < R; ++i) post[i] = x.t[m[i]];
      if (s < R - 1) {  // kv_end is read only then
        for (int i = 0; i < R; ++i) {
          const int next = wrap(i + 1, R), src = wrap(i - s, R);
          kv_end[i] = p2p(x, m[i], m[next], 2 * g.blocks[src]->rows * row * T, post[i], post[next],
                          step0 + s);
        }
      }
      step_compute_all(s);
      if (backward)
        sum.pass(
            x, s, [&](int i) { return 2 * g.blocks[wrap(i - s, R)]->rows * row; }, step0 + s);
      if (s < R - 1) {
        for (int i = 0; i < R; ++i)
          x.wait(m[i], std::max(kv_end[i], kv_end[wrap(i - 1, R)]), "p2p", step0 + s);
      }
    }
    if (backward) {
      sum.home(x, step0 + R);
      for (int i = 0; i < R; ++i)  // unpack into dk, dv
        x.compute(m[i], x.mem_time(2.0 * 2 * g.blocks[i]->rows * row * 4), step0 + R);
    }
  }
}

// One all-to-all inside each ulysses group (src/cp/ulysses.cc on the local backend): member i
// sends bytes(i, p) to member p; its own part bytes(i, i) is a memmove. Besides the transfers
// each member copies, in memory traffic (reads + writes):
//   to_head (seq_to_head): a zero-filled send vector packed with its heads (3 x in), the
//     zero-filled receive vector (1 x out) and the Tensor it moves into (1 x out, after);
//   to_seq (head_to_seq and the lse/grad returns): the tensor is sent as it is, the receive
//     vector is zero-filled (1 x out) and unpacked (2 x out, after).
template <class F>
void group_a2a(SimContext& x, int U, bool to_head, F bytes) {
  const int groups = x.P / U;
  for (int g = 0; g < groups; ++g) {
    std::vector<int> members(U);
    std::vector<double> cost(U, 0.0), after(U, 0.0);
    for (int i = 0; i < U; ++i) members[i] = g * U + i;
    for (int i = 0; i < U; ++i) {
      double in = 0, out = 0;
      for (int p = 0; p < U; ++p) {
        in += static_cast<double>(bytes(members[i], members[p]));
        out += static_cast<double>(bytes(members[p], members[i]));
        if (p == i) continue;
        const int64_t b = bytes(members[i], members[p]);
        x.sent(members[i], b);
        x.received(members[p], b);
        const Link& l = x.link(members[i], members[p]);
        cost[i] += l.latency + b / (l.bandwidth * x.p.a2a_eff);  // > 0: check_profile
      }
      const double self = 2.0 * static_cast<double>(bytes(members[i], members[i]));
      x.compute(members[i], x.mem_time((to_head ? 3 * in + out : out) + self), -1);
      after[i] = x.mem_time(to_head ? out : 2 * out);
    }
    x.collective(members, cost, "a2a");
    for (int i = 0; i < U; ++i) x.compute(members[i], after[i], -1);
  }
}

// gathers: the strategy moves the group's head-sliced tensors into its own (Ulysses, hybrid,
// even on a group of one); the ring computes on the caller's and gathers none.
void ulysses_like(SimContext& x, int U, bool gathers) {
  const AttnCase& c = x.c;
  const int64_t D = c.head_dim, T = c.dtype_bytes, hl = c.heads / U;
  const bool replicate = c.kv_heads % U != 0;
  const int64_t hkv = replicate ? 1 : c.kv_heads / U;
  std::vector<Block> groups;
  for (int j = 0; j < x.P / U; ++j) groups.push_back(x.block(j * U, U));
  const std::vector<Ring> rings = hybrid_rings(groups, U);
  auto rows = [&](int r) { return x.rows(r); };
  auto gtotal = [&](int r) { return groups[r / U].rows; };
  for (int r = 0; r < x.P; ++r) {
    const int64_t N = gtotal(r);
    if (gathers)
      x.gathered(r, N * (2 * hl + 2 * hkv) * D * T +
                        (c.backward ? N * (hl * T + hl * 4 + 2 * hkv * 4) * D : 0));
    if (c.backward) x.slot(r, kSlotDelta, hl * N * 4);
  }
  // seq_to_head of a [n, h, D] tensor of `elem` bytes per element: member i sends its rows.
  auto to_head = [&](int64_t heads, int64_t elem) {
    group_a2a(x, U, true, [&](int i, int) { return rows(i) * heads * D * elem; });
  };
  auto to_seq = [&](int64_t heads, int64_t elem) {
    group_a2a(x, U, false, [&](int, int p) { return rows(p) * heads * D * elem; });
  };
  // Forward.
  if (U > 1) {
    to_head(hl, T);
    to_head(hkv, T);
    to_head(hkv, T);
  }
  for (int r = 0; r < x.P; ++r) x.compute(r, x.mem_time(gtotal(r) * hl * D * 4.0), 0);  // state
  ring_pass(x, rings, hl, hkv, false, 0);
  for (int r = 0; r < x.P; ++r)
    x.compute(r, x.mem_time(gtotal(r) * hl * D * (4.0 + T)), -1);  // finish
  if (U > 1) {
    to_seq(hl, T);
    group_a2a(x, U, false, [&](int, int p) { return hl * rows(p) * 4; });  // lse
  }
  for (int r = 0; r < x.P; ++r) x.out.ranks[r].end_fwd_s = x.t[r];
  if (!c.backward) return;
  barrier(x);
  if (U > 1) {
    to_head(hl, T);                                                       // q
    to_head(hkv, T);                                                      // k
    to_head(hkv, T);                                                      // v
    to_head(hl, T);                                                       // out
    to_head(hl, T);                                                       // dout
    group_a2a(x, U, true, [&](int i, int) { return hl * rows(i) * 4; });  // lse
  }
  for (int r = 0; r < x.P; ++r)
    x.compute(r, x.mem_time(gtotal(r) * hl * D * (2.0 * T + 4.0)), -1);  // delta, zero dq
  ring_pass(x, rings, hl, hkv, true, 0);
  if (U > 1) {
    to_seq(hl, 4);   // dq
    to_seq(hkv, 4);  // dk
    to_seq(hkv, 4);  // dv
  }
  for (int r = 0; r < x.P; ++r) x.out.ranks[r].end_s = x.t[r];
}

// The cp registry's rules for x.c run as `strategy` (check_cp_config): the simulator refuses
// what CpAttention would, in the same words, and takes its inner degree.
int checked_inner(const SimContext& x, Strategy strategy) {
  CpConfig cfg;
  cfg.strategy = strategy;
  cfg.ulysses = x.c.ulysses;
  cfg.inner = x.c.inner;
  return check_cp_config(cfg, x.P, x.c.heads, x.c.kv_heads).inner;
}

void ring_schedule(SimContext& x) {
  ulysses_like(x, 1, false);
}

void ulysses_schedule(SimContext& x) {
  ulysses_like(x, checked_inner(x, Strategy::ulysses), true);
}

void hybrid_schedule(SimContext& x) {
  ulysses_like(x, checked_inner(x, Strategy::hybrid), true);
}

// ring2d (src/cp/strategies/ring2d.cc): O = P / I inner rings of I consecutive cp ranks; rank
// (o, i) = cp rank o I + i. At outer step t it holds the outer block, the KV of rank (g, i),
// g = o - t, posts the next one over the outer ring (to (o + 1, i), from (o - 1, i)), runs one
// inner ring pass over group g's shards (steps t I .. t I + I - 1), and waits for the transfer.
// Backward: the same with K, V; the inner pass leaves group o's dK, dV of the outer block (
// unpacked into a group sum), which follows its block around the outer ring (SumSim) and is
// home after O outer steps.
void ring2d_schedule(SimContext& x) {
  const AttnCase& c = x.c;
  const int I = checked_inner(x, Strategy::ring2d), P = x.P;
  const int O = P / I;
  const int64_t D = c.head_dim, T = c.dtype_bytes, row = c.kv_heads * D;
  std::vector<Block> shard(P);
  for (int r = 0; r < P; ++r) shard[r] = x.block(r, 1);
  // The outer rings: ring i holds ranks (o, i), o = 0 .. O - 1; its blocks are their shards.
  std::vector<Ring> outer(I);
  for (int i = 0; i < I; ++i)
    for (int o = 0; o < O; ++o) {
      outer[i].members.push_back(o * I + i);
      outer[i].q.push_back(&shard[o * I + i]);
      outer[i].blocks.push_back(&shard[o * I + i]);
    }
  // The inner rings of outer step t: ring o holds ranks (o, j) with the shards of group o - t.
  std::vector<Ring> inner(O);
  for (int o = 0; o < O; ++o)
    for (int j = 0; j < I; ++j) {
      inner[o].members.push_back(o * I + j);
      inner[o].q.push_back(&shard[o * I + j]);
      inner[o].blocks.push_back(nullptr);
    }
  auto inner_rings = [&](int t) -> const std::vector<Ring>& {
    for (int o = 0; o < O; ++o) {
      const int g = (o - t + O) % O;
      for (int j = 0; j < I; ++j) inner[o].blocks[j] = &shard[g * I + j];
    }
    return inner;
  };
  const int64_t cap = 2 * x.max_rows() * row;
  for (int r = 0; r < P; ++r) {    // the outer KV double buffer; backward: the group sum and the
    x.slot(r, kSlotOwn, cap * T);  // outer accumulators (the inner ring's: in ring_pass)
    x.slot(r, kSlotOwn + 1, cap * T);
    if (!c.backward) continue;
    x.slot(r, kSlotDelta, c.heads * x.rows(r) * 4);
    for (int s = 2; s < (O > 1 ? 7 : 3); ++s) x.slot(r, kSlotOwn + s, cap * 4);
  }
  auto pass = [&](bool backward) {
    for (int r = 0; r < P; ++r)  // the own KV packed into the outer buffer
      x.compute(r, x.mem_time(2.0 * 2 * shard[r].rows * row * T), 0);
    std::vector<SumSim> sums;
    if (backward)
      for (const Ring& g : outer) sums.emplace_back(g);
    std::vector<double> kv_end(P, 0.0), post(P);  // kv_end is read only when t < O - 1
    for (int t = 0; t < O; ++t) {
      const int step = (t + 1) * I - 1;
      if (t < O - 1) {
        post = x.t;
        for (int r = 0; r < P; ++r) {
          const int o = r / I, i = r % I, next = ((o + 1) % O) * I + i;
          const int g = (o - t + O) % O;
          kv_end[r] =
              p2p(x, r, next, 2 * shard[g * I + i].rows * row * T, post[r], post[next], t * I);
        }
      }
      ring_pass(x, inner_rings(t), c.heads, c.kv_heads, backward, t * I, false);
      if (backward) {
        if (O > 1)
          for (int i = 0; i < I; ++i)
            sums[i].pass(
                x, t, [&](int o) { return 2 * shard[((o - t + O) % O) * I + i].rows * row; }, step);
      }
      if (t < O - 1)
        for (int r = 0; r < P; ++r) {
          const int o = r / I, i = r % I, prev = ((o - 1 + O) % O) * I + i;
          x.wait(r, std::max(kv_end[r], kv_end[prev]), "p2p", step);
        }
    }
    if (backward) {
      if (O > 1)
        for (int i = 0; i < I; ++i) sums[i].home(x, P);
      for (int r = 0; r < P; ++r)  // unpack into dk, dv
        x.compute(r, x.mem_time(2.0 * 2 * shard[r].rows * row * 4), P);
    }
  };
  for (int r = 0; r < P; ++r) x.compute(r, x.mem_time(x.rows(r) * c.heads * D * 4.0), 0);
  pass(false);
  for (int r = 0; r < P; ++r) {
    x.compute(r, x.mem_time(x.rows(r) * c.heads * D * (4.0 + T)), -1);  // finish
    x.out.ranks[r].end_fwd_s = x.t[r];
  }
  if (!c.backward) return;
  barrier(x);
  for (int r = 0; r < P; ++r)
    x.compute(r, x.mem_time(x.rows(r) * c.heads * D * (2.0 * T + 4.0)), -1);  // delta, zero dq
  pass(true);
  for (int r = 0; r < P; ++r) x.out.ranks[r].end_s = x.t[r];
}

void allgather_schedule(SimContext& x) {
  const AttnCase& c = x.c;
  const int P = x.P;
  const int64_t D = c.head_dim, T = c.dtype_bytes, row = c.kv_heads * D, max_n = x.max_rows();
  const int64_t per = 2 * max_n * row;  // elements of one rank's padded K, V
  std::vector<Block> blocks;
  for (int j = 0; j < P; ++j) blocks.push_back(x.block(j, 1));
  std::vector<int> all(P);
  for (int r = 0; r < P; ++r) all[r] = r;
  // gather_kv: pack the own K, V, all-gather them (the own part is a memmove) or, for the
  // reduce-scatter, send block p of the fp32 partials to rank p.
  auto gather = [&](int64_t elem, const char* kind) {
    std::vector<double> cost(P, 0.0);
    for (int r = 0; r < P; ++r) {
      for (int q = 0; q < P; ++q) {
        if (q == r) continue;
        const Link& l = x.link(r, q);
        cost[r] += l.latency + per * elem / (l.bandwidth * x.p.allgather_eff);  // check_profile
      }
      x.sent(r, (P - 1) * per * elem);
      x.received(r, (P - 1) * per * elem);
    }
    if (P > 1) x.collective(all, cost, kind);
  };
  auto pack_and_gather = [&] {
    for (int r = 0; r < P; ++r) x.compute(r, x.mem_time(2.0 * 2 * x.rows(r) * row * T), -1);
    gather(T, "allgather");
    for (int r = 0; r < P; ++r) x.compute(r, x.mem_time(2.0 * per * T), -1);  // own part
  };
  for (int r = 0; r < P; ++r) {  // own and gathered K, V; backward: all dK, dV partials, mine
    x.slot(r, kSlotOwn, per * T);
    x.slot(r, kSlotOwn + 1, P * per * T);
    if (!c.backward) continue;
    x.slot(r, kSlotDelta, c.heads * x.rows(r) * 4);
    x.slot(r, kSlotOwn + 2, P * per * 4);
    x.slot(r, kSlotOwn + 3, per * 4);
  }
  // Forward.
  for (int r = 0; r < P; ++r) x.compute(r, x.mem_time(x.rows(r) * c.heads * D * 4.0), -1);
  pack_and_gather();
  std::vector<SimContext::Work> w(P);
  std::vector<bool> busy(P);
  std::vector<double> scale;
  auto blocks_pass = [&](bool backward) {
    for (int j = 0; j < P; ++j) {
      for (int r = 0; r < P; ++r) {
        w[r] = x.pair_work(blocks[r], blocks[j]);
        busy[r] = w[r].tiles.total() > 0;
      }
      x.busy_scales(all, busy, scale);
      for (int r = 0; r < P; ++r) {
        x.count_tiles_on(r, w[r].tiles, c.heads, backward, j);
        x.compute(r, x.kernel_time(w[r], c.heads, backward, c.kv_heads) * scale[r], j);
      }
    }
  };
  blocks_pass(false);
  for (int r = 0; r < P; ++r) {
    x.compute(r, x.mem_time(x.rows(r) * c.heads * D * (4.0 + T)), -1);
    x.out.ranks[r].end_fwd_s = x.t[r];
  }
  if (!c.backward) return;
  barrier(x);
  for (int r = 0; r < P; ++r)
    x.compute(r, x.mem_time(x.rows(r) * c.heads * D * (2.0 * T + 4.0) + P * per * 4.0), -1);
  pack_and_gather();
  blocks_pass(true);
  gather(4, "reduce_scatter");
  for (int r = 0; r < P; ++r) {  // the reduction, then unpack dk, dv
    x.compute(r, x.mem_time(P * per * 4.0 + 2.0 * 2 * x.rows(r) * row * 4), -1);
    x.out.ranks[r].end_s = x.t[r];
  }
}

}  // namespace

void register_builtin_schedules() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_schedule("ring", ring_schedule);
    register_schedule("ulysses", ulysses_schedule);
    register_schedule("hybrid", hybrid_schedule);
    register_schedule("ring2d", ring2d_schedule);
    register_schedule("allgather", allgather_schedule);
  });
}

}  // namespace loom::plan
