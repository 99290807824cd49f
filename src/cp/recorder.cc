// The recorder (recorder.h) and the CpMetrics helpers.
#include "recorder.h"

#include <algorithm>

namespace loom {

const char* to_string(SpanKind k) {
  static const char* const names[kSpanKinds] = {"compute", "send",      "recv",          "wait",
                                                "a2a",     "allgather", "reduce_scatter"};
  const int i = static_cast<int>(k);
  return i >= 0 && i < kSpanKinds ? names[i] : "?";
}

void CpMetrics::clear_counters() {
  compute_s = comm_s = wait_s = window_s = 0;
  bytes_sent = bytes_recv = tiles = visible_pairs = spans_dropped = 0;
  step_tiles.clear();
  spans.clear();
}

}  // namespace loom

namespace loom::cp_detail {

void Recorder::watch(const Communicator* c) {
  if (c && std::find(comms_.begin(), comms_.end(), c) == comms_.end()) comms_.push_back(c);
}

int64_t Recorder::bytes(bool sent) const {
  int64_t b = 0;
  for (const Communicator* c : comms_) b += sent ? c->stats().bytes_sent : c->stats().bytes_recv;
  return b;
}

void Recorder::begin() {
  sent0_ = bytes(true);
  recv0_ = bytes(false);
  window_.clear();
}

void Recorder::end() {
  m_.bytes_sent += bytes(true) - sent0_;
  m_.bytes_recv += bytes(false) - recv0_;
  m_.peak_buffer_bytes = std::max(m_.peak_buffer_bytes, static_cast<int64_t>(mem_.held_bytes()));
  // Length of the union of this call's communication intervals.
  std::sort(window_.begin(), window_.end());
  double total = 0, a = 0, b = -1e300;
  for (const auto& [x, y] : window_) {
    if (x > b) {
      if (b > a) total += b - a;
      a = x;
      b = y;
    } else {
      b = std::max(b, y);
    }
  }
  if (b > a) total += b - a;
  m_.window_s += total;
  window_.clear();  // keeps its capacity: no allocation in the next call of the same size
}

void Recorder::wait(Work& w, SpanKind kind, int step, Memory::Event posted) {
  const Memory::Event t0 = mem_.record();
  w.wait();
  const Memory::Event t1 = mem_.record();
  m_.wait_s += Memory::elapsed(t0, t1);
  m_.comm_s += Memory::elapsed(t0, t1);
  span(SpanKind::wait, step, t0, t1);
  span(kind, step, posted, t1);
}

void Recorder::span(SpanKind kind, int step, Memory::Event t0, Memory::Event t1) {
  if (is_comm(kind)) window_.emplace_back(t0, t1);
  if (!m_.record_spans) return;
  if (m_.spans.size() >= m_.span_limit) {
    ++m_.spans_dropped;
    return;
  }
  m_.spans.push_back(CpMetrics::Span{kind, step, t0, t1});
}

}  // namespace loom::cp_detail
