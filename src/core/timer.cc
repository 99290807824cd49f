// Monotonic time and memory statistics read from /proc/self/status.
#include "loom/timer.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace loom {

double now_s() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

namespace {
int64_t status_kib(const char* key) {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  int64_t kib = 0;
  const size_t n = std::strlen(key);
  while (std::fgets(line, sizeof line, f)) {
    if (std::strncmp(line, key, n) == 0) {
      long long v = 0;
      if (std::sscanf(line + n, " %lld", &v) == 1) kib = v;
      break;
    }
  }
  std::fclose(f);
  return kib;
}
}  // namespace

int64_t peak_rss_bytes() {
  return status_kib("VmHWM:") * 1024;
}
int64_t current_rss_bytes() {
  return status_kib("VmRSS:") * 1024;
}

}  // namespace loom
