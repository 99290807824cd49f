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
// Adding a strategy: write one function taking the SimContext and add it to
// register_builtin_schedules() below (ring2d: two ring_pass calls, inner and outer).
#include <algorithm>
#include <mutex>

#include "loom/error.h"
#include "sim.h"

namespace loom::plan {

namespace {

// Synchronises every clock to the latest one (loom attn's barrier between phases).
void barrier(SimContext& x) {
  const double m = *std::max_element(x.t.begin(), x.t.end());
  for (int r = 0; r < x.P; ++r) {
    x.out.ranks[r].idle_s += m - x.t[r];
    x.t[r] = m;
  }
}

// Rings of cp ranks: ring u holds cp ranks u, u + U, u + 2U, ... (the hybrid split; U = 1 is
// the plain ring). blocks[j]: the rows of ring member j (the same for every ring).
struct Rings {
  int U = 1, R = 1;
  std::vector<Block> blocks;
  int rank(int u, int j) const { return j * U + u; }
};

Rings make_rings(const SimContext& x, int U) {
  Rings g;
  g.U = U;
  g.R = x.P / U;
  for (int j = 0; j < g.R; ++j) g.blocks.push_back(x.block(j * U, U));
  return g;
}

int64_t max_block_rows(const Rings& g) {
  int64_t m = 0;
  for (const Block& b : g.blocks) m = std::max(m, b.rows);
  return m;
}

// One forward (or backward) pass of every ring: hl query heads, hkv KV heads travel.
void ring_pass(SimContext& x, const Rings& g, int64_t hl, int64_t hkv, bool backward) {
  const int R = g.R;
  const int64_t D = x.c.head_dim, T = x.c.dtype_bytes, row = hkv * D;
  const int64_t cap = 2 * max_block_rows(g) * row;
  for (int u = 0; u < g.U; ++u) {
    std::vector<int> m(R);
    for (int j = 0; j < R; ++j) m[j] = g.rank(u, j);
    // One step's kernels on every member; a member computing while others of its node idle
    // runs at the profile's alone rate (x.busy_scale).
    std::vector<TileCount> tcs(R);
    std::vector<int> calls(R);
    auto step_compute_all = [&](int s) {
      for (int i = 0; i < R; ++i)
        tcs[i] = x.pair_tiles(g.blocks[i], g.blocks[(i - s + R) % R], &calls[i]);
      std::vector<bool> busy(R);
      for (int i = 0; i < R; ++i) busy[i] = tcs[i].total() > 0;
      for (int i = 0; i < R; ++i) {
        const Block& kb = g.blocks[(i - s + R) % R];
        x.count_tiles_on(m[i], tcs[i], hl, backward, s);
        double dur = x.kernel_time(tcs[i], hl, backward, calls[i], kb.rows, hkv);
        dur *= x.busy_scale(m, busy, i);
        if (backward) dur += x.mem_time(2.0 * kb.rows * row * 4);  // zero the partial
        x.compute(m[i], dur, s);
      }
    };
    if (R == 1) {
      step_compute_all(0);
      continue;
    }
    for (int j = 0; j < R; ++j) x.buffer(m[j], 2 * cap * T + (backward ? 5 * cap * 4 : 0));
    // Backward accumulators: when each member's send of step s ended, and posting times.
    std::vector<std::vector<double>> dkv_end(R, std::vector<double>(2, 0.0));
    std::vector<double> dkv_last(R, 0.0);
    for (int s = 0; s < R; ++s) {
      std::vector<double> post(R), kv_end(R, 0.0);
      for (int i = 0; i < R; ++i) post[i] = x.t[m[i]];
      if (s < R - 1) {
        for (int i = 0; i < R; ++i) {
          const int next = (i + 1) % R, src = (i - s + R) % R;
          const int64_t bytes = 2 * g.blocks[src].rows * row * T;
          const double cost = x.message_time(m[i], m[next], static_cast<double>(bytes));
          kv_end[i] = std::max(post[i], post[next]) + cost;
          x.sent(m[i], bytes);
          x.received(m[next], bytes);
          x.flight(m[i], "send", s, post[i], kv_end[i]);
          if (!x.p.overlap) x.compute(m[i], cost, s);
        }
      }
      step_compute_all(s);
      if (backward) {
        const int par = s & 1;
        std::vector<double> post_acc(R);
        for (int i = 0; i < R; ++i) {
          const int prev = (i - 1 + R) % R, src = (i - s + R) % R;
          if (s >= 2) x.wait(m[i], dkv_end[i][par], "p2p", s);  // acc_send[par] free again
          if (s > 0) x.wait(m[i], dkv_last[prev], "p2p", s);    // the accumulator arriving
          x.compute(m[i], x.mem_time(3.0 * 2 * g.blocks[src].rows * row * 4),
                    s);  // acc = in + part
          post_acc[i] = x.t[m[i]];
        }
        std::vector<double> ends(R);
        for (int i = 0; i < R; ++i) {
          const int next = (i + 1) % R, src = (i - s + R) % R;
          const int64_t bytes = 2 * g.blocks[src].rows * row * 4;
          const double cost = x.message_time(m[i], m[next], static_cast<double>(bytes));
          ends[i] = std::max(post_acc[i], post_acc[next]) + cost;
          x.sent(m[i], bytes);
          x.received(m[next], bytes);
          x.flight(m[i], "send", s, post_acc[i], ends[i]);
          if (!x.p.overlap) x.compute(m[i], cost, s);
        }
        for (int i = 0; i < R; ++i) {
          dkv_end[i][par] = ends[i];
          dkv_last[i] = ends[i];
        }
      }
      if (s < R - 1) {
        for (int i = 0; i < R; ++i) {
          const int prev = (i - 1 + R) % R;
          x.wait(m[i], std::max(kv_end[i], kv_end[prev]), "p2p", s);
        }
      }
    }
    if (backward) {
      for (int i = 0; i < R; ++i) {
        const int prev = (i - 1 + R) % R;
        x.wait(m[i], dkv_last[prev], "p2p", R);  // my own block's accumulator, home
        x.wait(m[i], std::max(dkv_end[i][0], dkv_end[i][1]), "p2p", R);
      }
    }
  }
}

// One all-to-all inside each ulysses group: member i sends bytes(i, p) to member p.
template <class F>
void group_a2a(SimContext& x, int U, F bytes) {
  const int groups = x.P / U;
  for (int g = 0; g < groups; ++g) {
    std::vector<int> members(U);
    std::vector<double> cost(U, 0.0);
    for (int i = 0; i < U; ++i) members[i] = g * U + i;
    for (int i = 0; i < U; ++i) {
      double total = 0;
      for (int p = 0; p < U; ++p) {
        if (p == i) continue;
        const int64_t b = bytes(members[i], members[p]);
        x.sent(members[i], b);
        x.received(members[p], b);
        const Link& l = x.link(members[i], members[p]);
        cost[i] += l.latency + (l.bandwidth > 0 ? b / (l.bandwidth * x.p.a2a_eff) : 0.0);
        total += static_cast<double>(b);
      }
      x.compute(members[i], x.mem_time(2 * total), -1);  // pack and unpack
    }
    x.collective(members, cost, "a2a");
  }
}

void ulysses_like(SimContext& x, int U) {
  const AttnCase& c = x.c;
  const int64_t D = c.head_dim, T = c.dtype_bytes, hl = c.heads / U;
  const bool replicate = c.kv_heads % U != 0;
  const int64_t hkv = replicate ? 1 : c.kv_heads / U;
  const Rings g = make_rings(x, U);
  auto rows = [&](int r) { return x.rows(r); };
  auto gtotal = [&](int r) { return g.blocks[r / U].rows; };
  for (int r = 0; r < x.P; ++r) {
    const int64_t N = gtotal(r);
    x.buffer(r, N * (2 * hl + 2 * hkv) * D * T +
                    (c.backward ? N * (hl * T + hl * 4 + 2 * hkv * 4) * D : 0));
  }
  // seq_to_head of a [n, h, D] tensor of `bytes` per element: member i sends its rows.
  auto to_head = [&](int64_t heads, int64_t elem) {
    group_a2a(x, U, [&](int i, int) { return rows(i) * heads * D * elem; });
  };
  auto to_seq = [&](int64_t heads, int64_t elem) {
    group_a2a(x, U, [&](int, int p) { return rows(p) * heads * D * elem; });
  };
  // Forward.
  if (U > 1) {
    to_head(hl, T);
    to_head(hkv, T);
    to_head(hkv, T);
  }
  for (int r = 0; r < x.P; ++r) x.compute(r, x.mem_time(gtotal(r) * hl * D * 4.0), 0);  // state
  ring_pass(x, g, hl, hkv, false);
  for (int r = 0; r < x.P; ++r)
    x.compute(r, x.mem_time(gtotal(r) * hl * D * (4.0 + T)), -1);  // finish
  if (U > 1) {
    to_seq(hl, T);
    group_a2a(x, U, [&](int, int p) { return hl * rows(p) * 4; });  // lse
  }
  for (int r = 0; r < x.P; ++r) x.out.ranks[r].end_fwd_s = x.t[r];
  if (!c.backward) return;
  barrier(x);
  if (U > 1) {
    to_head(hl, T);                                                 // q
    to_head(hkv, T);                                                // k
    to_head(hkv, T);                                                // v
    to_head(hl, T);                                                 // out
    to_head(hl, T);                                                 // dout
    group_a2a(x, U, [&](int i, int) { return hl * rows(i) * 4; });  // lse
  }
  for (int r = 0; r < x.P; ++r)
    x.compute(r, x.mem_time(gtotal(r) * hl * D * (2.0 * T + 4.0)), -1);  // delta, zero dq
  ring_pass(x, g, hl, hkv, true);
  if (U > 1) {
    to_seq(hl, 4);   // dq
    to_seq(hkv, 4);  // dk
    to_seq(hkv, 4);  // dv
  }
  for (int r = 0; r < x.P; ++r) x.out.ranks[r].end_s = x.t[r];
}

void check_ulysses(const AttnCase& c, int U, const char* name) {
  if (U <= 1) return;
  LOOM_CHECK(
      c.heads % U == 0, InvalidArgument,
      name << ": heads (" << c.heads << ") must be divisible by the ulysses degree (" << U << ")");
  LOOM_CHECK(c.kv_heads % U == 0 || U % c.kv_heads == 0, InvalidArgument,
             name << ": kv-heads (" << c.kv_heads << ") and the ulysses degree (" << U
                  << ") must divide one another; heads = " << c.heads);
}

void ring_schedule(SimContext& x) {
  ulysses_like(x, 1);
}

void ulysses_schedule(SimContext& x) {
  check_ulysses(x.c, x.P, "ulysses");
  ulysses_like(x, x.P);
}

void hybrid_schedule(SimContext& x) {
  const int U = x.c.ulysses;
  LOOM_CHECK(U >= 1 && x.P % U == 0, InvalidArgument,
             "hybrid: --ulysses " << U << " must divide the number of ranks " << x.P);
  check_ulysses(x.c, U, "hybrid");
  ulysses_like(x, U);
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
  auto gather = [&](int64_t elem, const char* kind) {
    std::vector<double> cost(P, 0.0);
    for (int r = 0; r < P; ++r) {
      for (int q = 0; q < P; ++q) {
        if (q == r) continue;
        const Link& l = x.link(r, q);
        cost[r] +=
            l.latency + (l.bandwidth > 0 ? per * elem / (l.bandwidth * x.p.allgather_eff) : 0.0);
      }
      x.sent(r, (P - 1) * per * elem);
      x.received(r, (P - 1) * per * elem);
    }
    if (P > 1) x.collective(all, cost, kind);
  };
  for (int r = 0; r < P; ++r) x.buffer(r, P * per * T + (c.backward ? (P + 1) * per * 4 : 0));
  // Forward.
  for (int r = 0; r < P; ++r) x.compute(r, x.mem_time(per * T + x.rows(r) * c.heads * D * 4.0), -1);
  gather(T, "allgather");
  auto blocks_pass = [&](bool backward) {
    for (int j = 0; j < P; ++j) {
      std::vector<TileCount> tcs(P);
      std::vector<int> calls(P);
      std::vector<bool> busy(P);
      for (int r = 0; r < P; ++r) {
        tcs[r] = x.pair_tiles(blocks[r], blocks[j], &calls[r]);
        busy[r] = tcs[r].total() > 0;
      }
      for (int r = 0; r < P; ++r) {
        x.count_tiles_on(r, tcs[r], c.heads, backward, j);
        x.compute(r,
                  x.kernel_time(tcs[r], c.heads, backward, calls[r], blocks[j].rows, c.kv_heads) *
                      x.busy_scale(all, busy, r),
                  j);
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
  gather(T, "allgather");
  blocks_pass(true);
  gather(4, "reduce_scatter");
  for (int r = 0; r < P; ++r) {
    x.compute(r, x.mem_time(P * per * 4.0), -1);  // the reduction
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
    register_schedule("allgather", allgather_schedule);
  });
}

}  // namespace loom::plan
