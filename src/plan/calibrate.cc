// `loom plan --calibrate`: the machine's profile, measured.
//
// Kernel rates: one kernel call over n = 512 query rows and 512 key rows of H = kCalibHeads = 2
// heads, D = 64, 64 x 64 tiles: full attention gives 8 x 8 x 2 = 128 full tiles; alternating
// document ids on the rows make every tile partial (both documents in every tile, the mask
// applied per element). Seconds per tile = a call's typical time (window_time) over the tile
// count. The call overhead is a one-tile call's time less one tile.
// A tile's time grows with the heads of the [S, H, D] rows (their row stride): measured in one
// process on the Zen 3 VM at n = 1024, D = 64, fp32, per tile forward / backward relative to
// H = 2: H = 1 0.97 / 0.92, H = 4 1.06 / 1.08, H = 8 1.17 / 1.22. The profile has one figure, so
// it is taken at 2 heads, the heads per rank of bench/plan_validate.py's configurations and of
// loom train's default model over tp = 2 (docs/planning.md). Communication: ping-pong on the local
// backend between two ranks (half a round trip), 0 bytes for the latency and 8 MiB for the
// bandwidth; the all-to-all and all-gather of 2 ranks are timed against that model.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "../kernels/tile_ops.h"
#include "loom/comm.h"
#include "loom/error.h"
#include "loom/io.h"
#include "loom/plan.h"
#include "loom/rng.h"
#include "loom/timer.h"

namespace loom::plan {

namespace {

constexpr int64_t kCalibHeads = 2;  // heads of the calibration calls (see the top of the file)

// Seconds per call of each of `reps` timed runs of f after a warm-up run; f returns how many
// calls it made.
template <class F>
std::vector<double> per_call_times(F&& f, int reps) {
  f();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const double t0 = now_s();
    const int calls = f();
    t.push_back((now_s() - t0) / calls);
  }
  std::sort(t.begin(), t.end());
  return t;
}

// The fastest of `reps` timed calls (communication: latency and bandwidth are what an
// undisturbed message achieves).
template <class F>
double best_time(F&& f, int reps) {
  return per_call_times(
      [&] {
        f();
        return 1;
      },
      reps)[0];
}

// A kernel call's typical seconds: the median over `reps` windows of back-to-back calls (each
// window at least 30 ms) of the window's time per call. A window is as long as a timed
// iteration of `loom attn` at the validation sizes, so on a shared machine it sees the same
// share of the cores that such an iteration sees (the fastest short call would see an
// uncontended core, a figure no long run reaches); on a quiet machine the two agree.
// bench/plan_validate.py takes medians likewise.
template <class F>
double window_time(F&& f, int reps) {
  return per_call_times(
      [&] {
        const double t0 = now_s();
        int calls = 0;
        do {
          f();
          ++calls;
        } while (now_s() - t0 < 0.03);
        return calls;
      },
      reps)[reps / 2];
}

struct KernelBench {
  int64_t n, H = kCalibHeads, D = 64;
  std::vector<int64_t> pos;
  std::vector<int32_t> doc_same, doc_alt;
  Tensor<float> q, k, v, dout, out, dq, dk, dv;
  Tensor<bf16> bq, bk, bv, bdout, bout;
  std::vector<float> lse, delta;
  explicit KernelBench(int64_t rows) : n(rows) {
    pos.resize(n);
    std::iota(pos.begin(), pos.end(), 0);
    doc_same.assign(n, 0);
    doc_alt.resize(n);
    for (int64_t i = 0; i < n; ++i) doc_alt[i] = static_cast<int32_t>(i % 2);
    q = Tensor<float>({n, H, D});
    k = Tensor<float>({n, H, D});
    v = Tensor<float>({n, H, D});
    dout = Tensor<float>({n, H, D});
    fill_normal(q.view3(), pos.data(), 1, "q");
    fill_normal(k.view3(), pos.data(), 1, "k");
    fill_normal(v.view3(), pos.data(), 1, "v");
    fill_normal(dout.view3(), pos.data(), 1, "dout");
    out = Tensor<float>({n, H, D});
    dq = Tensor<float>({n, H, D});
    dk = Tensor<float>({n, H, D});
    dv = Tensor<float>({n, H, D});
    bq = convert<bf16>(q);
    bk = convert<bf16>(k);
    bv = convert<bf16>(v);
    bdout = convert<bf16>(dout);
    bout = Tensor<bf16>({n, H, D});
    lse.resize(static_cast<size_t>(H * n));
    delta.resize(static_cast<size_t>(H * n));
  }
  // Seconds of one call: forward or backward, fp32 or bf16, full or partial tiles.
  double time(bool backward, bool bf, bool partial, const KernelConfig& base, int reps) {
    KernelConfig cfg = base;
    cfg.mask.causal = false;
    const int32_t* docs = partial ? doc_alt.data() : doc_same.data();
    const Tokens t{pos.data(), docs, n};
    SoftmaxState st(n, H, D);
    // lse and delta of this problem (for the backward).
    st.reset();
    attend(st.view(), q.view3(), k.view3(), v.view3(), t, t, cfg);
    finish(st.view(), out.view3(), lse.data(), n);
    compute_delta(out.view3(), dout.view3(), delta.data(), n);
    if (!backward) {
      return window_time(
          [&] {
            st.reset();
            if (bf)
              attend(st.view(), bq.view3(), bk.view3(), bv.view3(), t, t, cfg);
            else
              attend(st.view(), q.view3(), k.view3(), v.view3(), t, t, cfg);
          },
          reps);
    }
    return window_time(
        [&] {
          if (bf)
            attend_backward(bq.view3(), bk.view3(), bv.view3(), bdout.view3(), lse.data(),
                            delta.data(), n, t, t, cfg, dq.view3(), dk.view3(), dv.view3());
          else
            attend_backward(q.view3(), k.view3(), v.view3(), dout.view3(), lse.data(), delta.data(),
                            n, t, t, cfg, dq.view3(), dk.view3(), dv.view3());
        },
        reps);
  }
};

}  // namespace

CommFigures measure_comm(Communicator& c) {
  LOOM_CHECK(c.size() >= 2, InvalidArgument, "measuring communication needs >= 2 ranks");
  const size_t big = 8 << 20;
  std::vector<char> buf(big, 1), rbuf(big, 0);
  // Ping-pong between ranks 0 and 1 (half a round trip); the others wait at the barrier.
  auto pingpong = [&](size_t bytes) {
    double t = 0;
    if (c.rank() <= 1)
      t = best_time(
              [&] {
                if (c.rank() == 0) {
                  c.isend(buf.data(), bytes, 1, 7)->wait();
                  c.irecv(rbuf.data(), bytes, 1, 8)->wait();
                } else {
                  c.irecv(rbuf.data(), bytes, 0, 7)->wait();
                  c.isend(buf.data(), bytes, 0, 8)->wait();
                }
              },
              15) /
          2;
    c.barrier();
    return t;
  };
  CommFigures f;
  const double t0 = pingpong(0), t1 = pingpong(big);
  const int P = c.size();
  const size_t part = big / static_cast<size_t>(P);
  std::vector<char> send(part * P, 1), recv(part * P, 0);
  std::vector<size_t> sb(P, part), so(P);
  for (int p = 0; p < P; ++p) so[p] = p * part;
  c.barrier();
  const double ta = best_time(
      [&] { c.all_to_all(send.data(), sb.data(), so.data(), recv.data(), sb.data(), so.data()); },
      7);
  const double tg = best_time([&] { c.all_gather(send.data(), part, recv.data()); }, 7);
  f.latency = t0;
  f.bandwidth = static_cast<double>(big) / std::max(1e-12, t1 - t0);
  // Each collective moves (P - 1) parts per rank; against the point-to-point model.
  const double model = (P - 1) * (f.latency + static_cast<double>(part) / f.bandwidth);
  f.a2a_eff = std::clamp(model / ta, 0.05, 1.0);
  f.allgather_eff = std::clamp(model / tg, 0.05, 1.0);
  double v[4] = {f.latency, f.bandwidth, f.a2a_eff, f.allgather_eff};
  c.all_reduce(v, 4, DType::f64, ReduceOp::max);  // rank 0's figures everywhere (others: 0)
  f.latency = v[0];
  f.bandwidth = v[1];
  f.a2a_eff = v[2];
  f.allgather_eff = v[3];
  return f;
}

Profile calibrate(int threads, int ranks_per_node, void (*log)(const char*)) {
  LOOM_CHECK(threads >= 1 && threads <= kMaxCalibrateThreads, InvalidArgument,
             "--threads must be in [1, " << kMaxCalibrateThreads << "], got " << threads);
  LOOM_CHECK(
      ranks_per_node >= 1 && ranks_per_node <= kMaxCalibrateRanks, InvalidArgument,
      "--ranks-per-node must be in [1, " << kMaxCalibrateRanks << "], got " << ranks_per_node);
  Profile p;
  p.name = "this machine (loom plan --calibrate)";
  p.kind = "cpu";
  p.block_q = p.block_k = 64;
  p.work_tile = kernels::select_ops().work_tile;  // the kernels' work tiles (blockwise.cc)
  p.calib_head_dim = 64;
  p.threads_per_device = threads;
  p.devices_per_node = ranks_per_node;
  p.overlap = false;
  KernelConfig cfg;
  cfg.scale = 0.125f;
  cfg.threads = threads;
  const int64_t n = 512, tiles = (n / 64) * (n / 64) * kCalibHeads;
  // Every rank of the node runs the same kernel at the same time (as `loom attn --ranks N`
  // does), so shared caches, memory bandwidth and cores are contended as in a real run; the
  // median over ranks of each rank's typical call is kept.
  std::vector<std::vector<double>> per_rank(ranks_per_node, std::vector<double>(8, 0.0));
  run_local(ranks_per_node, [&](Communicator& c) {
    KernelBench kb(n);
    for (int i = 0; i < 8; ++i) {
      const bool bf = i / 4, bwd = (i / 2) % 2, partial = i % 2;
      c.barrier();
      per_rank[c.rank()][i] = kb.time(bwd, bf, partial, cfg, 5) / tiles;
    }
  });
  for (int i = 0; i < 8; ++i) {
    std::vector<double> v;
    for (const auto& r : per_rank) v.push_back(r[i]);
    std::sort(v.begin(), v.end());
    const double x = v[v.size() / 2];
    const bool bf = i / 4, bwd = (i / 2) % 2, partial = i % 2;
    (bf ? p.tile_s_bf16 : p.tile_s_fp32)[2 * bwd + partial] = x;
    if (log) {
      char line[160];
      std::snprintf(line, sizeof line, "  kernel %s %s %s tile: %.3f us", bf ? "bf16" : "fp32",
                    bwd ? "backward" : "forward", partial ? "partial" : "full", x * 1e6);
      log(line);
    }
  }
  // One rank alone (the others idle) against all ranks at once, interleaved in rounds so that
  // both see the same load (on a shared machine it drifts within seconds): the median over
  // rounds of rank 0's together / alone time of the fp32 forward call.
  if (ranks_per_node > 1) {
    constexpr int kRounds = 5;
    std::vector<double> ratio(kRounds, 1.0);
    run_local(ranks_per_node, [&](Communicator& c) {
      KernelBench kb(n);
      for (int round = 0; round < kRounds; ++round) {
        c.barrier();
        const double together = kb.time(false, false, false, cfg, 3);
        c.barrier();
        if (c.rank() == 0) ratio[round] = together / kb.time(false, false, false, cfg, 3);
        c.barrier();
      }
    });
    std::sort(ratio.begin(), ratio.end());
    p.alone_speedup = std::max(1.0, ratio[kRounds / 2]);
    if (log) {
      char line[160];
      std::snprintf(line, sizeof line, "  one rank alone: %.2fx faster (median of %d rounds)",
                    p.alone_speedup, kRounds);
      log(line);
    }
  }
  // Call overhead: a 64 x 64 call (one tile per head) less its tiles.
  {
    KernelBench small(64);
    const double one = small.time(false, false, false, cfg, 5);
    p.call_overhead = std::max(0.0, one - kCalibHeads * p.tile_s_fp32[0]);
  }
  // Memory bandwidth: memcpy of 64 MiB (read + write counted).
  {
    std::vector<char> a(64 << 20, 1), b(64 << 20, 0);
    const double t = window_time([&] { std::memcpy(b.data(), a.data(), a.size()); }, 5);
    p.mem_bandwidth = 2.0 * static_cast<double>(a.size()) / t;
  }
  // Memory per rank: this machine's available memory shared by the node's ranks (a profile needs
  // a positive device.memory_bytes; 0 meant "no limit" to the planner).
  {
    int64_t avail = available_memory_bytes();
    if (avail <= 0) avail = int64_t{sysconf(_SC_PHYS_PAGES)} * int64_t{sysconf(_SC_PAGE_SIZE)};
    p.memory_bytes = std::max(1.0, static_cast<double>(avail) / ranks_per_node);
  }
  // Local backend: ping-pong, all-to-all, all-gather between 2 ranks.
  double lat = 0, bw = 0, a2a = 0, ag = 0;
  run_local(2, [&](Communicator& c) {
    const CommFigures f = measure_comm(c);
    if (c.rank() == 0) {
      lat = f.latency;
      bw = f.bandwidth;
      a2a = f.a2a_eff;
      ag = f.allgather_eff;
    }
  });
  p.intra = Link{bw, lat};
  p.inter = Link{bw, lat};  // one machine: no inter-node link to measure (the same figures)
  p.a2a_eff = a2a;
  p.allgather_eff = ag;
  p.allreduce_eff = ag;
  if (log) {
    char line[200];
    std::snprintf(line, sizeof line,
                  "  call overhead %.1f us, memcpy %.2f GB/s, p2p latency %.1f us, bandwidth %.2f "
                  "GB/s, a2a eff %.2f, all_gather eff %.2f",
                  p.call_overhead * 1e6, p.mem_bandwidth * 1e-9, lat * 1e6, bw * 1e-9, a2a, ag);
    log(line);
  }
  // Dense rates for the planner's GEMMs and the "gpu"-style fallbacks: the measured full-tile
  // forward rate (4 * 64 * 64 * 64 FLOPs per tile).
  const double tile_flops = 4.0 * 64 * 64 * 64;
  p.flops_fp32 = tile_flops / p.tile_s_fp32[0];
  p.flops_bf16 = tile_flops / p.tile_s_bf16[0];
  p.attn_fwd_eff = 1.0;
  p.attn_bwd_eff = std::min(1.0, 2.5 * p.tile_s_fp32[0] / p.tile_s_fp32[2]);
  p.partial_tile_cost = p.tile_s_fp32[1] / p.tile_s_fp32[0];
  p.gemm_eff = 1.0;
  const std::string how = "measured by loom plan --calibrate on this machine (threads per rank " +
                          std::to_string(threads) + ")";
  p.sources["device.memory_bytes"] =
      "this machine's available memory when calibrated (MemAvailable, or the cgroup's headroom) "
      "over the ranks per node (" +
      std::to_string(ranks_per_node) + ")";
  for (const char* f : {"device.tile_s.fp32", "device.work_tile", "device.tile_s.bf16",
                        "device.call_overhead_s", "device.alone_speedup", "device.mem_bandwidth",
                        "links.intra.bandwidth", "links.intra.latency_s", "collectives.a2a_eff",
                        "collectives.allgather_eff", "collectives.allreduce_eff"})
    p.sources[f] = how;
  p.sources["links.inter.bandwidth"] = p.sources["links.inter.latency_s"] =
      "one machine: no inter-node link; set to the intra-node figures";
  p.sources["device.flops_fp32"] = p.sources["device.flops_bf16"] =
      "the measured forward full-tile rate of the attention kernel (" + how + ")";
  p.sources["overlap"] = "the local backend copies a message on the posting thread";
  return p;
}

}  // namespace loom::plan
