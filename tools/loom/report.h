// What `loom attn` reports: the text table, the JSON document, the Chrome trace and the SVG
// timeline, all made from one AttnReport gathered on rank 0.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "loom/comm.h"
#include "loom/cp.h"

namespace loom::tools {

// One rank's counters per timed iteration, as they travel in the gather to rank 0 (a plain
// struct of doubles: every rank sends the same bytes).
struct RankCounters {
  double compute_s = 0, comm_s = 0, wait_s = 0, window_s = 0;
  double bytes_sent = 0, bytes_recv = 0, tiles = 0, visible_pairs = 0;
  double fwd_tiles = 0;      // tiles of the last forward
  double peak_rss = 0;       // bytes (the whole process on the local backend)
  double peak_buffer = 0;    // bytes of the strategy's buffers (CpMetrics::peak_buffer_bytes)
  double spans_dropped = 0;  // spans past CpMetrics::span_limit (not per iteration)
  // From a rank's metrics accumulated over `iters` timed iterations.
  static RankCounters of(const CpMetrics& m, int iters, int64_t peak_rss_bytes);
};

struct RankReport : RankCounters {
  int rank = 0;
  std::vector<int64_t> step_tiles;
  std::vector<CpMetrics::Span> spans;  // timed iterations only, with a trace or timeline
};

// Every rank's spans, on rank 0 (collective over world; the other ranks get an empty vector).
// Each rank holds a row of 32 bytes a span (the longest rank's count) while it sends; rank 0 one
// such row and all the spans (sizeof(CpMetrics::Span) each).
std::vector<std::vector<CpMetrics::Span>> gather_spans(Communicator& world,
                                                       const std::vector<CpMetrics::Span>& mine);

// What chrome_trace and timeline_svg reserve for their text, at most, for each span, each rank and
// once: the bounds of what they write (a span's trace event is at most 162 bytes, its SVG rect
// 142 below a million ranks and spans of 10^7 ms; about 110 each in practice), which loom attn's
// memory estimate counts (attn_run_bytes). Text past them is still written (the string grows).
constexpr double kTraceBytesPerSpan = 168, kTraceBytesPerRank = 512;
constexpr double kTimelineBytesPerSpan = 160, kTimelineBytesPerRank = 320;
constexpr double kReportFixedBytes = 4096;

// The registry, as the command line shows it: the --strategy help (names and what each is for).
std::string strategy_help();

// "1.50 MiB".
std::string human_bytes(double bytes);

struct CheckReport {
  bool done = false, passed = true, sampled = false;
  // Outside the fixed tolerances' regime (loom/tolerance.h, check_limits: scores past
  // kFp32FixedTolMaxScore, fewer effective keys than kFp32FixedTolMinEffectiveKeys, for bf16
  // kBf16FixedTolMinEffectiveKeys, keys or values sharing a large component, or a head dim under
  // kBf16FixedTolMinHeadDim): each tensor is held to the problem's own bound (fp32_error_bounds,
  // bf16_error_bounds), not to the fixed tolerance. why: the reason, as the report prints it
  // (fixed_tolerance_exclusion's text); hint: what would let a check whose bound is 1 or more
  // tell (check_limits_hint).
  bool per_problem_bounds = false;
  std::string per_problem_why, per_problem_hint;
  // worst: the first tensor that failed, else the one with the largest relative error; max_rel
  // and tolerance are that tensor's; non_finite: it holds NaN/Inf where the reference is finite.
  std::string worst;
  double max_rel = 0, tolerance = 0;
  bool non_finite = false;
  double max_abs = 0;  // over every compared tensor
  // Tensors whose per-problem bound is 1 or more ("dq (bound 14)"): an all-zero tensor would
  // pass, so the check cannot tell and says so (not compared). The check passed only if
  // `passed` and none is unverifiable.
  std::vector<std::string> unverifiable;
  // Tensors that missed the tolerance where their exact values lie so far below float32's normal
  // range (2^-126) that rounding them to float32 alone errs more than a quarter of it ("dk
  // (float32 alone errs 0.0061)"): no float32 result could meet it, so the miss is no failure,
  // and the check cannot tell (it said FAILED on inputs of 1e-42).
  std::vector<std::string> below_normal;
  bool conclusive() const { return unverifiable.empty() && below_normal.empty(); }
};

struct AttnReport {
  nlohmann::json config;
  std::string strategy, layout, backend, dtype = "fp32";
  int world = 1, threads = 1, iters = 1;
  int64_t S = 0, H = 0, HKV = 0, D = 0;
  bool causal = true, backward = false;
  int64_t window = 0;
  size_t docs = 1;
  double scale = 0;
  std::vector<std::pair<std::string, int>> degrees;  // degree options ({"inner", 2}; 0: none)
  std::vector<double> fwd_times, bwd_times;          // slowest rank, per timed iteration
  std::vector<RankReport> ranks;
  CheckReport check;
  double baseline_s = -1;  // one-rank forward (+ backward) median, when --baseline
  // What --baseline ran ({"ranks": 1, "strategy": "hybrid", "ulysses": 1, "threads_per_rank": T}:
  // the strategy at degree 1); null without --baseline.
  nlohmann::json baseline_run;

  double forward_s() const;
  double backward_s() const;  // 0 without backward
  double useful_forward_flops() const;
  double balance() const;     // max over mean of per-rank compute_s
  double overlap() const;     // 1 - sum(comm_s) / sum(window_s); see docs/cli.md
  double efficiency() const;  // T1 / (P * TP), < 0 without baseline
};

void print_text(const AttnReport& r);
nlohmann::json to_json(const AttnReport& r);
std::string chrome_trace(const AttnReport& r);
std::string timeline_svg(const AttnReport& r);

}  // namespace loom::tools
