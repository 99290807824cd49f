// Reports of `loom attn`: text, JSON, Chrome trace events, SVG timeline.
#include "report.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "loom/timer.h"

namespace loom::tools {

namespace {

double origin(const AttnReport& r) {
  double t = 1e300;
  for (const RankReport& k : r.ranks)
    for (const auto& s : k.spans) t = std::min(t, s.t0);
  return t == 1e300 ? 0 : t;
}

}  // namespace

std::string human_bytes(double b) {
  char buf[32];
  if (b >= 1 << 30) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1 << 30));
  } else if (b >= 1 << 20) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", b / (1 << 20));
  } else if (b >= 1 << 10) {
    std::snprintf(buf, sizeof buf, "%.1f KiB", b / (1 << 10));
  } else {
    std::snprintf(buf, sizeof buf, "%.0f B", b);
  }
  return buf;
}

RankCounters RankCounters::of(const CpMetrics& m, int iters, int64_t peak_rss_bytes) {
  const double it = iters;
  RankCounters c;
  c.compute_s = m.compute_s / it;
  c.comm_s = m.comm_s / it;
  c.wait_s = m.wait_s / it;
  c.window_s = m.comm_window_s() / it;
  c.bytes_sent = static_cast<double>(m.bytes_sent) / it;
  c.bytes_recv = static_cast<double>(m.bytes_recv) / it;
  c.tiles = static_cast<double>(m.tiles) / it;
  c.visible_pairs = static_cast<double>(m.visible_pairs) / it;
  for (int64_t t : m.step_tiles) c.fwd_tiles += static_cast<double>(t);
  c.peak_rss = static_cast<double>(peak_rss_bytes);
  c.peak_buffer = static_cast<double>(m.peak_buffer_bytes);
  c.spans_dropped = static_cast<double>(m.spans_dropped);
  return c;
}

std::vector<std::vector<CpMetrics::Span>> gather_spans(Communicator& world,
                                                       const std::vector<CpMetrics::Span>& mine) {
  // Rank 0 alone receives them: the longest count first, then each rank's spans in turn as
  // (kind, step, t0, t1) doubles padded to it (kind -1 pads), into one row that rank 0 posts
  // before it tells that rank to send (a one-byte message), so the local backend never copies a
  // message that has no receive yet. An all-gather gave every rank every rank's spans: on the
  // local backend's one process P^2 copies (16 ranks of 65,536 spans: 0.5 GiB), none of them in
  // the memory estimate.
  const int P = world.size(), me = world.rank();
  int64_t most = static_cast<int64_t>(mine.size());
  world.all_reduce(&most, 1, DType::i64, ReduceOp::max);
  std::vector<std::vector<CpMetrics::Span>> out(me == 0 ? static_cast<size_t>(P) : 0);
  if (most == 0) return out;
  constexpr int kGoTag = 7110, kRowTag = 7111;
  std::vector<double> row(static_cast<size_t>(4 * most), -1.0);
  const size_t bytes = row.size() * sizeof(double);
  if (me != 0) {
    for (size_t i = 0; i < mine.size(); ++i) {
      row[4 * i] = static_cast<double>(mine[i].kind);
      row[4 * i + 1] = mine[i].step;
      row[4 * i + 2] = mine[i].t0;
      row[4 * i + 3] = mine[i].t1;
    }
    char go = 0;
    world.irecv(&go, 1, 0, kGoTag)->wait();
    world.isend(row.data(), bytes, 0, kRowTag)->wait();
    return out;
  }
  out[0] = mine;
  for (int r = 1; r < P; ++r) {
    WorkPtr recv = world.irecv(row.data(), bytes, r, kRowTag);
    const char go = 1;
    world.isend(&go, 1, r, kGoTag)->wait();
    recv->wait();
    int64_t n = 0;
    while (n < most && row[4 * n] >= 0) ++n;
    out[r].reserve(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
      out[r].push_back(CpMetrics::Span{static_cast<SpanKind>(static_cast<int>(row[4 * i])),
                                       static_cast<int>(row[4 * i + 1]), row[4 * i + 2],
                                       row[4 * i + 3]});
  }
  return out;
}

std::string strategy_help() {
  std::string h = "context-parallel strategy:";
  for (const StrategyInfo& s : strategies()) {
    h += "\n  " + s.name + (s.option.empty() ? "" : " (" + s.option + " N)") + ": " + s.summary;
  }
  return h;
}

double AttnReport::forward_s() const {
  return median(fwd_times);
}
double AttnReport::backward_s() const {
  return median(bwd_times);
}

double AttnReport::useful_forward_flops() const {
  double pairs = 0;
  for (const RankReport& k : ranks) pairs += k.visible_pairs;
  return 4.0 * static_cast<double>(D) * pairs;
}

double AttnReport::balance() const {
  double mx = 0, sum = 0;
  for (const RankReport& k : ranks) {
    mx = std::max(mx, k.compute_s);
    sum += k.compute_s;
  }
  return sum > 0 ? mx / (sum / static_cast<double>(ranks.size())) : 1.0;
}

double AttnReport::overlap() const {
  double exposed = 0, window = 0, bytes = 0;
  for (const RankReport& k : ranks) {
    exposed += k.comm_s;
    window += k.window_s;
    bytes += k.bytes_sent + k.bytes_recv;
  }
  // No communication at all: nothing to hide. One rank's ulysses or all-gather still calls its
  // collectives, which move nothing (overlap read 0 there, ring's 1).
  if (window <= 0 || bytes <= 0) return 1.0;
  return std::clamp(1.0 - exposed / window, 0.0, 1.0);
}

double AttnReport::efficiency() const {
  const double tp = forward_s() + backward_s();
  if (baseline_s <= 0 || tp <= 0) return -1;
  return baseline_s / (static_cast<double>(world) * tp);
}

void print_text(const AttnReport& r) {
  const double tf = r.forward_s(), tb = r.backward_s(), flops = r.useful_forward_flops();
  std::printf("loom attn: %s / %s, %d rank%s x %d thread%s (%s backend)\n", r.strategy.c_str(),
              r.layout.c_str(), r.world, r.world == 1 ? "" : "s", r.threads,
              r.threads == 1 ? "" : "s", r.backend.c_str());
  std::printf("  problem   S=%lld H=%lld HKV=%lld D=%lld %s window=%lld docs=%zu scale=%.6g",
              static_cast<long long>(r.S), static_cast<long long>(r.H),
              static_cast<long long>(r.HKV), static_cast<long long>(r.D),
              r.causal ? "causal" : "full", static_cast<long long>(r.window), r.docs, r.scale);
  for (const auto& [name, value] : r.degrees)
    if (value > 0) std::printf(" %s=%d", name.c_str(), value);
  std::printf(" %s", r.dtype.c_str());
  std::printf("\n");
  std::printf("  forward   %10.3f ms  %8.2f GFLOP/s useful  (median of %d, slowest rank)\n",
              tf * 1e3, tf > 0 ? flops / tf * 1e-9 : 0.0, r.iters);
  if (r.backward)
    std::printf("  backward  %10.3f ms  %8.2f GFLOP/s useful\n", tb * 1e3,
                tb > 0 ? 2.5 * flops / tb * 1e-9 : 0.0);
  std::printf("  balance   %.3f (max / mean compute)   overlap %.3f", r.balance(), r.overlap());
  if (r.efficiency() >= 0) {
    // The baseline's strategy and degree ("hybrid --ulysses 1"): not always the P-rank run's.
    std::string what = r.strategy;
    if (r.baseline_run.is_object()) {
      what = r.baseline_run.value("strategy", r.strategy);
      for (const auto& [key, value] : r.baseline_run.items())
        if (key != "ranks" && key != "strategy" && key != "threads_per_rank")
          what += " --" + key + " " + value.dump();
    }
    std::printf("   efficiency %.3f (one rank, %s: %.3f ms)", r.efficiency(), what.c_str(),
                r.baseline_s * 1e3);
  }
  std::printf("\n");
  std::printf("  %-4s %10s %10s %10s %11s %11s %9s  %s\n", "rank", "compute_s", "comm_s", "wait_s",
              "sent", "recv", "fwd_tiles", "forward tiles per step");
  for (const RankReport& k : r.ranks) {
    std::string steps;
    for (int64_t t : k.step_tiles) {
      if (!steps.empty()) steps += ' ';
      steps += std::to_string(t);
    }
    std::printf("  %-4d %10.4f %10.4f %10.4f %11s %11s %9.0f  %s\n", k.rank, k.compute_s, k.comm_s,
                k.wait_s, human_bytes(k.bytes_sent).c_str(), human_bytes(k.bytes_recv).c_str(),
                k.fwd_tiles, steps.c_str());
  }
  if (r.check.done) {
    std::string bounds;
    if (r.check.per_problem_bounds)
      bounds = std::string(": this problem's ") + r.dtype + " bound, " + r.check.per_problem_why;
    for (const std::string& u : r.check.unverifiable)
      std::printf("  check     cannot tell %s: a bound of 1 or more passes zeros\n", u.c_str());
    for (const std::string& u : r.check.below_normal)
      std::printf(
          "  check     cannot tell %s: its exact values or the terms that sum to them lie below "
          "float32's normal range\n",
          u.c_str());
    // Every tensor unverifiable: nothing was compared (it printed "max rel err 0 (; tolerance
    // 0.00e+00 ...").
    if (r.check.worst.empty() && !r.check.conclusive()) {
      std::printf("  check     UNVERIFIABLE  no tensor could be compared%s\n", bounds.c_str());
      return;
    }
    // The fixed tolerances to their own digits (2^-7 printed "8e-03", above what it is: 0.0078125).
    char tol[32];
    std::snprintf(tol, sizeof tol, r.check.per_problem_bounds ? "%.2e" : "%g", r.check.tolerance);
    if (!std::isfinite(r.check.tolerance))  // an exact result passes a bound not computable
      std::snprintf(tol, sizeof tol, "not computable");
    std::printf("  check     %s  max abs err %.3g, max rel err %.3g (%s; tolerance %s%s, %s)\n",
                !r.check.passed        ? "FAILED"
                : r.check.conclusive() ? "passed"
                                       : "UNVERIFIABLE",
                r.check.max_abs, r.check.max_rel, r.check.worst.c_str(), tol, bounds.c_str(),
                r.check.sampled ? "sampled: out, lse and dq of 256 evenly spaced query rows; dk, "
                                  "dv unchecked above 4096 tokens"
                                : "every row");
  }
}

nlohmann::json to_json(const AttnReport& r) {
  using nlohmann::json;
  json j;
  j["config"] = r.config;
  j["backend"] = r.backend;
  j["dtype"] = r.dtype;
  j["world"] = r.world;
  j["threads_per_rank"] = r.threads;
  j["forward_s"] = r.forward_s();
  j["backward_s"] = r.backward ? json(r.backward_s()) : json(nullptr);
  j["forward_times_s"] = r.fwd_times;
  j["backward_times_s"] = r.bwd_times;
  const double flops = r.useful_forward_flops() * (r.backward ? 3.5 : 1.0);
  const double t = r.forward_s() + (r.backward ? r.backward_s() : 0.0);
  j["useful_flops"] = flops;
  j["gflops"] = t > 0 ? flops / t * 1e-9 : 0.0;
  j["forward_gflops"] = r.forward_s() > 0 ? r.useful_forward_flops() / r.forward_s() * 1e-9 : 0.0;
  j["backward_gflops"] = r.backward && r.backward_s() > 0
                             ? json(2.5 * r.useful_forward_flops() / r.backward_s() * 1e-9)
                             : json(nullptr);
  j["efficiency"] = r.efficiency() >= 0 ? json(r.efficiency()) : json(nullptr);
  j["baseline_s"] = r.baseline_s > 0 ? json(r.baseline_s) : json(nullptr);
  j["baseline_run"] = r.baseline_s > 0 ? r.baseline_run : json(nullptr);
  j["balance"] = r.balance();
  j["overlap"] = r.overlap();
  json ranks = json::array();
  for (const RankReport& k : r.ranks) {
    ranks.push_back({{"rank", k.rank},
                     {"compute_s", k.compute_s},
                     {"comm_s", k.comm_s},
                     {"wait_s", k.wait_s},
                     {"comm_window_s", k.window_s},
                     {"bytes_sent", static_cast<int64_t>(k.bytes_sent)},
                     {"bytes_recv", static_cast<int64_t>(k.bytes_recv)},
                     {"tiles", static_cast<int64_t>(k.tiles)},
                     {"forward_tiles", static_cast<int64_t>(k.fwd_tiles)},
                     {"step_tiles", k.step_tiles},
                     {"peak_rss_bytes", static_cast<int64_t>(k.peak_rss)},
                     {"peak_buffer_bytes", static_cast<int64_t>(k.peak_buffer)},
                     {"spans_dropped", static_cast<int64_t>(k.spans_dropped)}});
  }
  j["ranks"] = ranks;
  if (r.check.done) {
    j["check"] = {{"passed", r.check.passed && r.check.conclusive()},
                  {"max_abs_err", r.check.max_abs},
                  {"max_rel_err", r.check.max_rel},
                  {"tolerance", r.check.tolerance},
                  {"sampled", r.check.sampled},
                  {"worst", r.check.worst},
                  {"bounds", r.check.per_problem_bounds ? "per-problem" : "fixed"},
                  {"unverifiable", r.check.unverifiable},
                  {"below_normal", r.check.below_normal}};
  } else {
    j["check"] = nullptr;
  }
  return j;
}

namespace {

size_t span_count(const AttnReport& r) {
  size_t n = 0;
  for (const RankReport& k : r.ranks) n += k.spans.size();
  return n;
}

// x as JSON: the shortest text that reads back as x (as the JSON library printed it).
void append_number(std::string& s, double x) {
  char buf[32];
  const auto res = std::to_chars(buf, buf + sizeof buf, x);
  s.append(buf, res.ptr);
}

}  // namespace

// Written as text into one string reserved at its bound (kTraceBytesPerSpan a span): built as a
// JSON document first, the trace took about 1.5 KB a span (16 ranks of 65,536 spans: 2 GB for a
// run estimated at 17 MiB). The keys are in the order the JSON library wrote them (sorted).
std::string chrome_trace(const AttnReport& r) {
  const double t0 = origin(r);
  std::string s;
  s.reserve(static_cast<size_t>(kReportFixedBytes + kTraceBytesPerRank * double(r.ranks.size()) +
                                kTraceBytesPerSpan * double(span_count(r))));
  s += "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  bool first = true;
  const auto next = [&]() {
    if (!first) s += ',';
    first = false;
  };
  static const char* const tracks[3] = {"compute", "communication", "waiting"};
  for (const RankReport& k : r.ranks) {
    const std::string pid = std::to_string(k.rank);
    next();
    s += "{\"args\":{\"name\":\"rank " + pid +
         "\"},\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" + pid + "}";
    for (int tid = 0; tid < 3; ++tid) {
      next();
      s += "{\"args\":{\"name\":\"" + std::string(tracks[tid]) +
           "\"},\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" + pid +
           ",\"tid\":" + std::to_string(tid) + "}";
    }
    for (const auto& sp : k.spans) {
      const int tid = sp.kind == SpanKind::compute ? 0 : sp.kind == SpanKind::wait ? 2 : 1;
      next();
      s += "{\"cat\":\"";
      s += to_string(sp.kind);
      s += "\",\"dur\":";
      append_number(s, std::max(0.0, sp.t1 - sp.t0) * 1e6);
      s += ",\"name\":\"";
      s += to_string(sp.kind);
      if (sp.step >= 0) s += " step " + std::to_string(sp.step);
      s += "\",\"ph\":\"X\",\"pid\":" + pid + ",\"tid\":" + std::to_string(tid) + ",\"ts\":";
      append_number(s, (sp.t0 - t0) * 1e6);
      s += '}';
    }
  }
  s += "]}";
  return s;
}

namespace {

// Appends printf-style text to s (numbers as the stream with fixed and precision 2 wrote them:
// "%.2f" for doubles).
template <class... A>
void appendf(std::string& s, const char* format, A... args) {
  char buf[512];
  const int n = std::snprintf(buf, sizeof buf, format, args...);
  if (n < 0) return;
  if (static_cast<size_t>(n) < sizeof buf) {
    s.append(buf, static_cast<size_t>(n));
    return;
  }
  std::string big(static_cast<size_t>(n) + 1, '\0');
  std::snprintf(big.data(), big.size(), format, args...);
  s.append(big.data(), static_cast<size_t>(n));
}

}  // namespace

// Written into one string reserved at its bound (kTimelineBytesPerSpan a span), as the trace is:
// through a string stream, it was copied whole at the end.
std::string timeline_svg(const AttnReport& r) {
  const double t0 = origin(r);
  double t1 = t0;
  for (const RankReport& k : r.ranks)
    for (const auto& s : k.spans) t1 = std::max(t1, s.t1);
  const double span = std::max(t1 - t0, 1e-9);
  const int left = 70, right = 20, top = 50, row_h = 36, width = 1000;
  const int plot_w = width - left - right;
  const int height = top + row_h * static_cast<int>(r.ranks.size()) + 70;
  auto x = [&](double t) { return left + (t - t0) / span * plot_w; };
  std::string o;
  o.reserve(static_cast<size_t>(kReportFixedBytes + kTimelineBytesPerRank * double(r.ranks.size()) +
                                kTimelineBytesPerSpan * double(span_count(r))));
  appendf(o,
          "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
          "font-family=\"sans-serif\" font-size=\"12\">\n"
          "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
          width, height);
  o += "<text x=\"" + std::to_string(left) +
       "\" y=\"20\" font-size=\"14\">loom attn: " + r.strategy + " / " + r.layout + ", " +
       std::to_string(r.world) + " ranks, S=" + std::to_string(r.S) +
       " (timed iterations)</text>\n";
  // Colours: compute blue, communication in flight orange (thin, upper half), waiting red.
  for (size_t i = 0; i < r.ranks.size(); ++i) {
    const RankReport& k = r.ranks[i];
    const int y = top + row_h * static_cast<int>(i);
    appendf(o, "<text x=\"8\" y=\"%d\">rank %d</text>\n", y + row_h / 2 + 4, k.rank);
    appendf(o, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"#f4f4f4\"/>\n", left,
            y + 2, plot_w, row_h - 4);
    for (const auto& s : k.spans) {
      const double a = x(s.t0), w = std::max(0.5, x(s.t1) - x(s.t0)), ms = (s.t1 - s.t0) * 1e3;
      if (s.kind == SpanKind::compute) {
        appendf(o,
                "<rect x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"18\" fill=\"#3b73b9\"><title>"
                "compute step %d: %.2f ms</title></rect>\n",
                a, y + 14, w, s.step, ms);
      } else if (s.kind == SpanKind::wait) {
        appendf(o,
                "<rect x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"18\" fill=\"#d62728\"><title>"
                "wait: %.2f ms</title></rect>\n",
                a, y + 14, w, ms);
      } else {
        appendf(o,
                "<rect x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"8\" fill=\"#ff9f1c\" "
                "fill-opacity=\"0.8\"><title>%s: %.2f ms</title></rect>\n",
                a, y + 4, w, to_string(s.kind), ms);
      }
    }
  }
  // Axis with ticks in milliseconds.
  const int ay = top + row_h * static_cast<int>(r.ranks.size()) + 6;
  appendf(o, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"black\"/>\n", left, ay,
          left + plot_w, ay);
  const double ms = span * 1e3;
  const double raw = ms / 8, mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double step = raw / mag < 2 ? 2 * mag : raw / mag < 5 ? 5 * mag : 10 * mag;
  for (double t = 0; t <= ms + 1e-9; t += step) {
    const double px = left + t / ms * plot_w;
    appendf(o,
            "<line x1=\"%.2f\" y1=\"%d\" x2=\"%.2f\" y2=\"%d\" stroke=\"black\"/><text x=\"%.2f\" "
            "y=\"%d\" text-anchor=\"middle\">%.2f</text>\n",
            px, ay, px, ay + 5, px, ay + 18, t);
  }
  appendf(o, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">ms</text>\n", left + plot_w, ay + 32);
  // Legend.
  const int ly = height - 18;
  appendf(o,
          "<rect x=\"%d\" y=\"%d\" width=\"14\" height=\"10\" fill=\"#3b73b9\"/><text x=\"%d\" "
          "y=\"%d\">compute</text>\n",
          left, ly - 10, left + 18, ly);
  appendf(o,
          "<rect x=\"%d\" y=\"%d\" width=\"14\" height=\"10\" fill=\"#ff9f1c\"/><text x=\"%d\" "
          "y=\"%d\">communication in flight</text>\n",
          left + 100, ly - 10, left + 118, ly);
  appendf(o,
          "<rect x=\"%d\" y=\"%d\" width=\"14\" height=\"10\" fill=\"#d62728\"/><text x=\"%d\" "
          "y=\"%d\">waiting (exposed communication)</text>\n",
          left + 300, ly - 10, left + 318, ly);
  o += "</svg>\n";
  return o;
}

}  // namespace loom::tools
