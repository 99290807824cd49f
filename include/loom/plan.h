// loom/plan.h: the step simulator and the planner behind `loom plan`.
//
// The simulator replays the real schedule of a context-parallel strategy (ring steps with a
// double buffer, Ulysses all-to-alls, hybrid, all-gather plus reduce-scatter; forward and
// backward) at chunk and tile granularity: the work of every rank at every step is the exact
// tile count of loom's kernels for loom's shard plans (the same (q-tile, k-tile) classification
// as src/kernels/blockwise.cc, computed in closed form per segment pair, never per token), and
// every message has the exact byte size the strategy code sends. Only time comes from a model:
// each compute or communication event takes its duration from a hardware Profile, and overlap is
// exactly what the schedule's dependencies allow (a transfer starts when both ends have posted,
// a rank waits where the code waits).
//
// Strategies are schedules found by name in a registry (schedule_names(); one function per
// strategy in src/plan/schedules.cc). A new strategy (for example ring2d after the structure
// refactor) is one function and one register_schedule() call.
//
// Thread safety: every function here is reentrant; the built-in schedules are registered once, on
// the registry's first use (std::call_once), and only read afterwards (register_schedule() is not
// thread-safe).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "loom/attention.h"
#include "loom/cp.h"

namespace loom::plan {

// ---------------------------------------------------------------------------------------------
// Hardware profiles (plan/profiles/*.json; field meanings in docs/planning.md).

struct Link {
  double bandwidth = 0;  // bytes/s per device, one direction
  double latency = 0;    // seconds per message
};

struct Profile {
  std::string name;
  std::string kind = "gpu";  // "gpu" (rates from peak x efficiency) or "cpu" (calibrated tiles)
  // Device.
  double flops_bf16 = 0, flops_fp32 = 0;          // dense peak FLOP/s of one device
  double attn_fwd_eff = 0.5, attn_bwd_eff = 0.4;  // attention kernel, fraction of peak, full tiles
  double partial_tile_cost = 1.0;                 // time of a partial (masked) tile over a full one
  double gemm_eff = 0.7;                          // dense GEMM, fraction of peak
  double memory_bytes = 0;                        // device memory
  double mem_bandwidth = 0;                       // bytes/s (element-wise work: pack, add, finish)
  int64_t block_q = 128, block_k = 128;           // the attention kernel's tile
  // The kernel computes on work tiles of whole block_q x block_k tiles, each side the block
  // times the smallest factor reaching work_tile rows (never more than the call has; loom's CPU
  // kernels: 128, src/kernels/blockwise.cc work_config). Time is charged per work tile (its
  // area in block tiles, at the full or partial rate of the work tile's own classification);
  // the counts reported stay those of block_q x block_k. 0: the work tiles are the block tiles.
  int64_t work_tile = 0;
  double call_overhead = 0;  // seconds per kernel call (launch)
  // Calibrated per-tile seconds of this machine's kernel ("cpu" profiles, from --calibrate):
  // [fwd full, fwd partial, bwd full, bwd partial] for fp32 and for bf16 storage, measured at
  // head_dim calib_head_dim (scaled linearly in D). Zero: use peak x efficiency.
  double tile_s_fp32[4] = {0, 0, 0, 0}, tile_s_bf16[4] = {0, 0, 0, 0};
  int64_t calib_head_dim = 64;
  int threads_per_device = 1;  // cpu: OpenMP threads of one rank the tile times were taken with
  // How much faster a rank's kernels run while the other ranks of its node idle (shared cores,
  // caches and memory bandwidth; 1: independent devices). The tile times above are for every
  // rank of the node computing at once.
  double alone_speedup = 1.0;
  // Links and collectives.
  int devices_per_node = 8;
  Link intra, inter;
  double a2a_eff = 1.0, allgather_eff = 1.0, allreduce_eff = 1.0;  // fraction of link bandwidth
  // true: a transfer proceeds while its rank computes (DMA engines, NICs); false: the posting
  // thread copies it (loom's local backend), so a send costs its sender's time.
  bool overlap = true;
  std::map<std::string, std::string> sources;  // field -> citation (kept when re-written)
};

// Parses a profile from JSON text; `where` names the file in errors (IoError naming the field).
// Every figure must lie in its range (docs/planning.md, "Hardware profiles"): rates, memory,
// bandwidths positive, efficiencies and partial_tile_cost at least 1e-3 (efficiencies at most 1),
// latencies and times >= 0, tile sides and counts integers; device.flops_bf16, flops_fp32,
// memory_bytes, mem_bandwidth and both links' bandwidth and latency_s must be given.
Profile parse_profile(const std::string& json_text, const std::string& where);
// Reads a profile from a regular file (IoError otherwise: a FIFO, a device, a directory, and "-",
// which is not standard input here), at most 16 MiB, and parses it.
Profile load_profile(const std::string& path);
std::string profile_json(const Profile& p);  // the JSON text (round-trips through parse)
// The same ranges on a Profile built in code: InvalidArgument "profile 'NAME': field 'x' must be
// ..., got v". plan(), simulate_attention() and predict_train_step() check their profile first.
void check_profile(const Profile& p);

// ---------------------------------------------------------------------------------------------
// Exact work at tile granularity.

// A run of a shard's rows: positions first, first + stride, ... (count of them), one document.
// The same runs as ShardPlan's segments (tests/plan holds the two together), computed without
// materialising tokens.
struct Chunk {
  int64_t first = 0, stride = 1, count = 0;
  int32_t doc = 0;
  int64_t last() const { return first + stride * (count - 1); }
};
// [rank] -> the rank's chunks in local row order (== ShardPlan::make(...).segments).
std::vector<std::vector<Chunk>> shard_chunks(Layout layout, int64_t seq, int ranks,
                                             const std::vector<int64_t>& doc_lengths);

struct TileCount {
  int64_t full = 0, partial = 0;  // per query head
  int64_t total() const { return full + partial; }
  TileCount& operator+=(const TileCount& o) {
    full += o.full;
    partial += o.partial;
    return *this;
  }
};
// Tiles one kernel call over rows q x keys k computes for one head (blockwise.cc's plan:
// block_q x block_k tiles, empty ones skipped), including the cp layer's skip of segment pairs
// the mask leaves empty. Requires block_q, block_k >= 1, mask.window >= 0, each chunk's
// stride >= 1, count >= 0 and positions in [0, 2^56), and q.stride == k.stride when both counts
// exceed 1: InvalidArgument naming the values otherwise.
TileCount count_tiles(const Chunk& q, const Chunk& k, const Mask& mask, int64_t block_q,
                      int64_t block_k);

// ---------------------------------------------------------------------------------------------
// The attention simulator.

struct AttnCase {
  std::string strategy = "ring";  // a registered schedule
  Layout layout = Layout::zigzag;
  int64_t seq = 0;
  std::vector<int64_t> doc_lengths;  // empty: one document
  int ranks = 1;                     // P, the cp group
  int ulysses = 1;                   // hybrid: U (P % U == 0)
  int inner = 1;                     // ring2d: I, the inner ring (P % I == 0)
  int64_t heads = 1, kv_heads = 1, head_dim = 64;
  Mask mask;
  int64_t block_q = 64, block_k = 64;  // kernel tiles (loom attn's defaults)
  int dtype_bytes = 4;                 // storage: 4 (fp32) or 2 (bf16)
  bool backward = true;
  // Placement: world rank of cp rank c is c * cp_stride (tp ranks sit inside); node of a world
  // rank = world / devices_per_node.
  int cp_stride = 1;      // 1 <= cp_stride <= INT_MAX / ranks (else InvalidArgument)
  bool timeline = false;  // record events (bounded: at most max_events)
  int64_t max_events = 20000;
};

struct Event {
  int rank;
  std::string kind;  // compute, send, recv, wait, a2a, allgather, reduce_scatter
  int step;
  double t0, t1;
};

struct RankSim {
  int64_t fwd_tiles = 0, bwd_tiles = 0;       // tiles over all query heads
  int64_t full_tiles = 0, partial_tiles = 0;  // forward + backward
  std::vector<int64_t> step_tiles;         // forward tiles per step (ring step / allgather block)
  int64_t bytes_sent = 0, bytes_recv = 0;  // forward + backward
  // Peak bytes of the strategy's reused buffers (the memory seam's slots; equal to
  // CpMetrics::peak_buffer_bytes): the KV double buffer and dK/dV accumulators (ring, ring2d),
  // the gathered K, V and dK, dV (allgather), delta.
  int64_t peak_buffer_bytes = 0;
  // Peak bytes of the head-sliced tensors ulysses and hybrid gather (q, k, v, out, dout, dq,
  // dk, dv of the group's rows), outside the seam.
  int64_t gathered_bytes = 0;
  double compute_s = 0, comm_s = 0, idle_s = 0;  // comm_s: exposed (blocked in communication)
  std::map<std::string, double> comm_by_kind;    // exposed seconds by p2p / a2a / allgather ...
  double end_fwd_s = 0, end_s = 0;
};

struct AttnSim {
  std::vector<RankSim> ranks;
  double forward_s = 0, backward_s = 0;  // slowest rank
  std::vector<Event> events;             // when AttnCase::timeline
  double balance() const;                // max over mean of compute
};

// Checks the case (InvalidArgument naming the values, as CpAttention does) and simulates it.
AttnSim simulate_attention(const AttnCase& c, const Profile& p);

// The registry. A schedule checks its constraints (throwing InvalidArgument) and fills the
// simulation through the Sim context of src/plan/sim.h.
struct SimContext;
using ScheduleFn = std::function<void(SimContext&)>;
void register_schedule(const std::string& name, ScheduleFn fn);
std::vector<std::string> schedule_names();

// ---------------------------------------------------------------------------------------------
// The planner: whole training (or prefill) steps of a transformer on a cluster.

struct ModelShape {
  int64_t layers = 32, dim = 4096, heads = 32, kv_heads = 8, ffn = 14336, vocab = 128256;
  int64_t head_dim() const { return dim / heads; }
  double params() const;  // parameter count
};

struct PlanRequest {
  ModelShape model;
  int64_t seq = 131072;
  std::vector<int64_t> doc_lengths;
  int64_t window = 0;
  int devices = 8;
  bool train = true;                    // false: prefill (forward only)
  double memory_limit = 0;              // bytes per device; 0: the profile's memory
  std::vector<std::string> strategies;  // empty: every registered one
  bool all_layouts = true;              // zigzag, contiguous, stripe (false: zigzag only)
  int dtype_bytes = 2;
  // Called on the searching thread with the fraction of the search done (0 first, 1 last; the
  // units are simulation work, a cp group's ranks squared), or empty. loom plan prints a line on
  // stderr from it every LOOM_PLAN_PROGRESS_S seconds (default 10) of a long search.
  std::function<void(double fraction)> progress;
};

struct Candidate {
  int dp = 1, tp = 1, ulysses = 1, ring = 1;
  int inner = 1;  // ring2d: the inner ring's size (ring = the whole cp group)
  std::string strategy;
  Layout layout = Layout::zigzag;
  bool checkpoint = false;
  bool fits = true;
  std::string why_not;       // when !fits or invalid
  bool over_memory = false;  // rejected for memory alone (why_not "needs ... GB per device")
  // Step breakdown (seconds, slowest rank).
  double step_s = 0, attn_s = 0, gemm_s = 0, recompute_s = 0;
  double exposed_cp_s = 0, tp_comm_s = 0, dp_comm_s = 0, cp_idle_s = 0;
  std::map<std::string, double> exposed_by_kind;
  double memory_bytes = 0;
  double mfu = 0, tokens_per_s = 0, balance = 1;
  std::string name() const;
};

struct PlanResult {
  std::vector<Candidate> ranked;    // fitting candidates, highest tokens/s first
  std::vector<Candidate> rejected;  // with why_not
  AttnSim best_attn;                // one layer's attention of the winner, with its timeline
  std::string explain;              // in words: why the winner wins
  double seconds = 0;               // planning time
};

PlanResult plan(const PlanRequest& req, const Profile& p);

// ---------------------------------------------------------------------------------------------
// One step of loom's own trainer (`loom train`, src/model) on a mesh of this machine.
//
// The trainer's work outside attention (GEMMs through OpenBLAS, norms, rotary, SwiGLU, the loss,
// AdamW) depends on its implementation, not only on FLOPs, so it is measured once on ONE rank
// (dp = tp = cp = 1, the same model, sequence, batch, dtype and checkpointing) and composed for
// the mesh: every rank's per-token work shrinks by tp and by the tokens it holds, the mesh's
// collectives come from the profile's links, and attention comes from the simulator, scaled by
// the one-rank run's measured attention over the simulator's one-rank figure (the trainer's head
// dim and call sizes against the profile's calibration shape). Ranks sharing a node's cores run
// alone_speedup slower than one rank alone.

// Figures of one measured one-rank step (medians over steps), from `loom plan --train-step`.
struct TrainMeasure {
  double attention_s = 0;  // CpAttention forward + backward
  double other_s = 0;      // the rest of forward + backward (GEMMs, element-wise, loss)
  double update_s = 0;     // gradient sums, clipping, AdamW
  double rest_s = 0;       // the step's wall time outside forward + backward and the update
};

struct TrainCase {
  ModelShape model;              // vocab 256 for loom train
  int64_t seq = 256, batch = 8;  // tokens per sequence; sequences per step (global, % dp == 0)
  MeshShape mesh;                // dp x tp x ulysses x ring
  int inner = 1;                 // ring2d: the inner ring
  std::string strategy = "ring";
  Layout layout = Layout::zigzag;
  int dtype_bytes = 4;      // 4: fp32, 2: bf16
  bool checkpoint = false;  // activation checkpointing (the measure must use the same)
};

struct TrainStepPrediction {
  double step_s = 0;  // wall time of one step on the slowest rank
  double attention_s = 0, other_s = 0, tp_comm_s = 0, grad_comm_s = 0, update_s = 0, rest_s = 0;
  double attention_scale = 1;  // measured / simulated one-rank attention
  AttnSim attention;           // one layer, one sequence, on the mesh's cp group
};

// Bytes as the plan's reports print GB (1e9 bytes): one decimal, or three significant digits
// below 0.1 GB (a profile's memory of 1 byte read "limit 0.0 GB").
std::string gb_text(double bytes);

// Checks the case (InvalidArgument: mesh sizes, divisibility, a strategy the simulator knows)
// and predicts its step from `one_rank` (measured with the same model, seq, batch, dtype and
// checkpointing on one rank) and the profile (kernels, alone_speedup, links).
TrainStepPrediction predict_train_step(const TrainCase& c, const TrainMeasure& one_rank,
                                       const Profile& p);

}  // namespace loom::plan

namespace loom::plan {

// Measures this machine and returns a "cpu" profile for one rank of `threads` OpenMP threads
// and `ranks_per_node` ranks per node:
//   tile seconds of the blockwise kernels (the median over windows of >= 30 ms of repeated
//   calls, every rank computing at once), forward and backward, fp32 and bf16 storage, full
//   tiles (full attention) and partial tiles (every tile masked per element), at the config's
//   64 x 64 tiles, head_dim 64 and 2 heads (src/plan/calibrate.cc); the kernels' work tile; how
//   much faster one rank runs alone (interleaved rounds); a kernel call's overhead; memory
//   bandwidth (memcpy); the local backend's point-to-point latency and bandwidth (ping-pong of 0 B
//   and 8 MiB), and all-to-all and all-gather efficiency against that point-to-point model.
// Takes about 3-5 seconds on a quiet machine. Progress lines go to `log` when non-null.
// threads in [1, kMaxCalibrateThreads], ranks_per_node in [1, kMaxCalibrateRanks], else
// InvalidArgument: the node's ranks run at once as threads of this process, about 3 MiB each
// (--ranks-per-node 100000 grew past 1400 threads and 4 GB before any answer).
inline constexpr int kMaxCalibrateThreads = kMaxKernelThreads;  // as the kernels' (attention.h)
inline constexpr int kMaxCalibrateRanks = 1024;  // ranks per node: 1024 take about 3 GiB
Profile calibrate(int threads, int ranks_per_node, void (*log)(const char*) = nullptr);

// Point-to-point latency and bandwidth (ping-pong of 0 B and 8 MiB between ranks 0 and 1) and
// all-to-all / all-gather efficiency against that model, over any communicator of >= 2 ranks
// (`loom plan --calibrate` under mpirun passes the MPI world: the inter-node link). Collective
// over c; every rank returns the same figures.
struct CommFigures {
  double latency = 0, bandwidth = 0, a2a_eff = 1, allgather_eff = 1;
};
CommFigures measure_comm(Communicator& c);

}  // namespace loom::plan
