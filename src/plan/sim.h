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

#include <cstdint>
#include <string>
#include <vector>

#include "loom/plan.h"

namespace loom::plan {

// The rows of one ring member (a cp rank's shard, or the union of a ulysses group's shards).
struct Block {
  std::vector<Chunk> chunks;
  int64_t rows = 0;
};

struct SimContext {
  const AttnCase& c;
  const Profile& p;
  AttnSim& out;
  int P;
  std::vector<std::vector<Chunk>> chunks;  // [cp rank]
  std::vector<double> t;                   // clock per cp rank
  bool in_backward = false;

  SimContext(const AttnCase& cs, const Profile& pr, AttnSim& o);

  int64_t rows(int r) const;
  int64_t max_rows() const;
  Block block(int first, int count) const;  // union of cp ranks [first, first + count)
  // The work of q rows (block qb) against one KV block, per head: the exact block_q x block_k
  // tiles (what the kernels report), the kernel calls (chunk pairs the cp layer does not skip)
  // and the work tiles the kernel really computes (Profile::work_tile), in block-tile areas.
  struct Work {
    TileCount tiles;
    int calls = 0;
    double full = 0, partial = 0;  // work tiles, each weighted by its area in block tiles
  };
  Work pair_work(const Block& qb, const Block& kb) const;

  // Durations.
  double kernel_time(const Work& w, int64_t heads, bool backward, int64_t kv_rows,
                     int64_t kv_heads) const;
  double mem_time(double bytes) const;
  // Time multiplier of member i's kernels when only the `busy` members (cp ranks `members`) of
  // its node compute at once: 1 when all of them do, 1 / alone_speedup when it computes alone.
  double busy_scale(const std::vector<int>& members, const std::vector<bool>& busy, int i) const;
  const Link& link(int a, int b) const;  // cp ranks
  double message_time(int a, int b, double bytes) const;

  // Events.
  void compute(int r, double dur, int step);
  // Blocks rank r until `until`; exposed communication of `kind`.
  void wait(int r, double until, const char* kind, int step);
  void flight(int r, const char* kind, int step, double t0, double t1);  // a transfer's span
  // A blocking collective over `members` (cp ranks); cost[i] is member i's share.
  void collective(const std::vector<int>& members, const std::vector<double>& cost,
                  const char* kind);
  void count_tiles_on(int r, const TileCount& tc, int64_t heads, bool backward, int step);
  void sent(int r, int64_t bytes) { out.ranks[r].bytes_sent += bytes; }
  void received(int r, int64_t bytes) { out.ranks[r].bytes_recv += bytes; }
  // Rank r's memory seam slot `slot` asks for `bytes` (slots grow, never shrink: Memory in
  // src/cp/memory.h); their sum is RankSim::peak_buffer_bytes.
  void slot(int r, int slot, int64_t bytes);
  std::vector<std::vector<int64_t>> slots;  // [rank][slot]
  void gathered(int r, int64_t bytes);      // tensors outside the seam (RankSim::gathered_bytes)
  void add_event(int r, const char* kind, int step, double t0, double t1);
  // Exposed seconds by kind, [rank][kind index]; folded into RankSim::comm_by_kind at the end.
  std::vector<std::vector<std::pair<const char*, double>>> exposed;
  void expose(int r, const char* kind, double s);
  void fold_exposed();
};

}  // namespace loom::plan
