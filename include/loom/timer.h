// loom/timer.h: monotonic time, stopwatches and peak memory.
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

namespace loom {

// Seconds on a monotonic clock since an arbitrary origin shared by all threads of the process.
double now_s();

class Stopwatch {
 public:
  Stopwatch() : start_(now_s()) {}
  void reset() { start_ = now_s(); }
  double elapsed_s() const { return now_s() - start_; }

 private:
  double start_;
};

// Adds the seconds a scope takes to an accumulator: { ScopedTimer t(stats.compute_s); ... }
class ScopedTimer {
 public:
  explicit ScopedTimer(double& sink) : sink_(sink), start_(now_s()) {}
  ~ScopedTimer() { sink_ += now_s() - start_; }
  ScopedTimer(const ScopedTimer&) = delete;
  ScopedTimer& operator=(const ScopedTimer&) = delete;

 private:
  double& sink_;
  double start_;
};

// The median of v (the mean of the two middle values for an even count), 0 for an empty v.
double median(std::vector<double> v);

// Peak resident set size of the process in bytes (VmHWM), 0 where unknown.
int64_t peak_rss_bytes();
// Current resident set size in bytes (VmRSS), 0 where unknown.
int64_t current_rss_bytes();

}  // namespace loom
