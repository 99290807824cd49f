// Internal to src/cp: the recorder, the one place where the strategies' time and counters are
// kept. A strategy wraps each thing it does at a step boundary in one recorder call (a kernel
// call, posting transfers, a wait, a blocking collective) and the recorder does the timing
// (through the memory seam's events), the CpMetrics counters and the spans.
//
// Spans are kept only while CpMetrics::record_spans is set, and at most span_limit of them. The
// communication window (CpMetrics::window_s) is computed whether or not spans are kept, from the
// current call's communication intervals, which end() folds in and forgets: nothing grows with
// the number of calls.
#pragma once

#include <utility>
#include <vector>

#include "loom/comm.h"
#include "loom/cp.h"
#include "memory.h"

namespace loom::cp_detail {

class Recorder {
 public:
  Recorder(CpMetrics& m, Memory& mem) : m_(m), mem_(mem) {}

  // The communicators whose byte counters this strategy's calls move (duplicates ignored).
  void watch(const Communicator* c);

  // Call boundaries: begin() at the start of a forward or backward, end() when it returns
  // (adds the bytes sent and received, folds the call's communication window into window_s).
  void begin();
  void end();

  // A forward of `steps` steps starts: step_tiles gets one zero per step.
  void steps(int steps) { m_.step_tiles.assign(static_cast<size_t>(steps), 0); }

  // A forward kernel call at `step` (kernel() returns KernelStats): compute time, tiles, visible
  // pairs, step_tiles[step], a compute span.
  template <class F>
  KernelStats forward_step(int step, F&& kernel) {
    return kernel_call(step, true, kernel);
  }
  // A backward kernel call at `step`: compute time, tiles, a compute span.
  template <class F>
  KernelStats backward_step(int step, F&& kernel) {
    return kernel_call(step, false, kernel);
  }
  // Arithmetic on this rank that is no kernel call (adding accumulators): compute time only.
  template <class F>
  void local(F&& f) {
    const Memory::Event t0 = mem_.record();
    f();
    m_.compute_s += Memory::elapsed(t0, mem_.record());
  }
  // Posts asynchronous transfers (f() returns what it posted): the posting time goes to comm_s.
  // `posted` is set to the event of posting, for wait().
  template <class F>
  auto post(Memory::Event& posted, F&& f) {
    posted = mem_.record();
    auto works = f();
    m_.comm_s += Memory::elapsed(posted, mem_.record());
    return works;
  }
  // Waits for a transfer posted at `posted`: the blocked time goes to wait_s and comm_s, with a
  // wait span, and the transfer gets a `kind` span from posting to the wait's return.
  void wait(Work& w, SpanKind kind, int step, Memory::Event posted);
  // A blocking collective: all of it is exposed (comm_s and wait_s), a `kind` span at step -1.
  template <class F>
  void collective(SpanKind kind, F&& f) {
    const Memory::Event t0 = mem_.record();
    f();
    const Memory::Event t1 = mem_.record();
    m_.comm_s += Memory::elapsed(t0, t1);
    m_.wait_s += Memory::elapsed(t0, t1);
    span(kind, -1, t0, t1);
  }

 private:
  template <class F>
  KernelStats kernel_call(int step, bool forward, F& kernel) {
    const Memory::Event t0 = mem_.record();
    const KernelStats s = kernel();
    const Memory::Event t1 = mem_.record();
    m_.compute_s += Memory::elapsed(t0, t1);
    m_.tiles += s.tiles;
    if (forward) {
      m_.visible_pairs += s.visible_pairs;
      if (step >= 0 && static_cast<size_t>(step) < m_.step_tiles.size())
        m_.step_tiles[step] += s.tiles;
    }
    span(SpanKind::compute, step, t0, t1);
    return s;
  }
  void span(SpanKind kind, int step, Memory::Event t0, Memory::Event t1);
  int64_t bytes(bool sent) const;

  CpMetrics& m_;
  Memory& mem_;
  std::vector<const Communicator*> comms_;
  int64_t sent0_ = 0, recv0_ = 0;
  std::vector<std::pair<double, double>> window_;  // this call's communication intervals
};

}  // namespace loom::cp_detail
