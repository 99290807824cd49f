// Command-line code the subcommands share: the registry's degree options, the options several
// subcommands declare alike.
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>
#include <vector>

#include <sched.h>
#include <stdio_ext.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "commands.h"
#include "loom/error.h"
#include "loom/io.h"
#include "loom/model/trainer.h"
#include "loom/rng.h"

extern "C" int openblas_get_num_threads(void);

namespace loom::tools {

namespace {

// "hybrid" or "hybrid or foo": the strategies whose degree option is `flag`.
std::string strategies_taking(const std::string& flag) {
  std::string names;
  for (const StrategyInfo& s : strategies())
    if (s.option == flag) names += (names.empty() ? "" : " or ") + s.name;
  return names;
}

uint64_t g_command_line_hash = 0;  // set_command_line

}  // namespace

void set_command_line(int argc, char** argv) {
  uint64_t h = fnv1a64(nullptr, 0);
  for (int i = 1; i < argc; ++i) h = fnv1a64(argv[i], std::strlen(argv[i]) + 1, h);  // with its NUL
  g_command_line_hash = h;
}

void check_scale_in_float32(double scale) {
  // A positive double that rounds to 0 in float32 was refused as "softmax scale must be
  // positive" (or "got 0"), after the value given had been checked as positive; a subnormal one
  // (1e-44) gave dq and dk 40 % off.
  // Both numbers in the fewest digits that read back as themselves: with 6 digits the limit read
  // 1.17549e-38, below float32's smallest normal, and "--scale 1.17549e-38 is subnormal ... at
  // least 1.17549e-38" named one number twice.
  const float f = static_cast<float>(scale);
  LOOM_CHECK(f >= std::numeric_limits<float>::min(), InvalidArgument,
             "--scale " << exact_text(scale) << (f > 0 ? " is subnormal" : " rounds to 0")
                        << " in float32 (the kernels need at least "
                        << exact_text(std::numeric_limits<float>::min())
                        << ", float32's smallest normal number)");
}

void agree_across_ranks(Communicator& world, uint64_t inputs_hash, const std::string& inputs_what) {
  const uint64_t mine[2] = {g_command_line_hash, inputs_hash};
  std::vector<uint64_t> all(2 * static_cast<size_t>(world.size()));
  world.all_gather(mine, sizeof mine, all.data());
  for (int r = 1; r < world.size(); ++r) {
    LOOM_CHECK(all[2 * r] == all[0], InvalidArgument,
               "rank " << r
                       << " was started with other arguments than rank 0: under mpirun every "
                          "rank must run the same loom command line");
    LOOM_CHECK(all[2 * r + 1] == all[1], InvalidArgument,
               "rank " << r << " read other " << inputs_what
                       << " than rank 0 (their bytes differ): every rank must read the same");
  }
}

std::string stdout_write_error() {
  errno = 0;
  if (std::fflush(stdout) == 0 && !std::ferror(stdout)) return "";
  return std::string("standard output: write failed (") +
         (errno ? std::strerror(errno) : "an earlier write failed") + ")";
}

// Written one after another, a run's outputs were not a unit: loom plan --json a.json --svg
// /dev/full wrote the JSON, then failed on the SVG (exit 1), and loom verify and loom attn did
// the same with --heatmap and --trace / --timeline, so a failed run left a new output or replaced
// an old one. Outputs written in place cannot be staged or undone, so they go first: a failure
// there leaves every file untouched. The regular files are staged (stage_output: temporaries
// named as write_output's, which the next run's clean_stale_temps removes when this one is
// killed) and renamed only once all are written.
void write_outputs(const std::vector<std::pair<std::string, std::string>>& outputs) {
  // The text report on standard output first: a run that could not write it fails (main.cc), and
  // a failed run leaves its files as they were (loom plan --json a.json > /dev/full replaced
  // a.json, then exited 1). Reported here once: the unwritten text is dropped, so main's own
  // check of standard output finds nothing more to flush.
  const std::string why = stdout_write_error();
  if (!why.empty()) {
    __fpurge(stdout);
    std::clearerr(stdout);
    throw IoError(why, __FILE__, __LINE__);
  }
  std::vector<const std::pair<std::string, std::string>*> regular;
  for (const auto& out : outputs) {
    if (out.first.empty()) continue;
    struct stat st;
    const bool in_place =
        out.first == "-" || own_stream_fd(out.first) >= 0 ||
        (::stat(resolve_output_path(out.first).c_str(), &st) == 0 && !S_ISREG(st.st_mode));
    if (in_place) {
      write_output(out.first, out.second);
    } else {
      clean_stale_temps(out.first);  // as write_output does: a killed run's staged files too
      regular.push_back(&out);
    }
  }
  // One file alone is already atomic (write_output). Every name is staged, however long: a name
  // of 201 to 255 bytes was written directly, after the others were staged, so a full disk
  // replaced --json and then failed on --trace (stage_output's temporary name fits NAME_MAX).
  if (regular.size() == 1) {
    write_output(regular[0]->first, regular[0]->second);
    return;
  }
  std::vector<std::pair<std::string, std::string>> staged;  // {temporary, path}; "" once renamed
  try {
    for (const auto* out : regular)
      staged.emplace_back(stage_output(out->first, out->second), out->first);
    for (auto& [tmp, path] : staged) {
      const std::string t = tmp;
      tmp.clear();  // commit_staged removes it if the rename fails
      commit_staged(t, path);
    }
  } catch (...) {
    for (const auto& s : staged)
      if (!s.first.empty()) ::unlink(s.first.c_str());
    throw;
  }
}

double blas_mapped_bytes(int callers, int threads) {
  // A thread's stack is RLIMIT_STACK's soft limit (8 MiB by default; glibc takes less where it is
  // unlimited, and 8 MiB then bounds it), and a thread that allocates gets a malloc arena that
  // reserves 64 MiB (glibc's HEAP_MAX_SIZE): mapped before the thread's OpenBLAS buffer, they
  // took the room the estimate left for it.
  struct rlimit stack;
  const double stack_bytes =
      ::getrlimit(RLIMIT_STACK, &stack) == 0 && stack.rlim_cur != RLIM_INFINITY
          ? double(stack.rlim_cur)
          : double(8 << 20);
  const double arena_bytes = double(64 << 20);
  const int more = std::max(0, threads - openblas_get_num_threads());
  return std::max(0, callers) * (double(kOpenBlasBufferBytes) + stack_bytes + arena_bytes) +
         more * (double(kOpenBlasBufferBytes) + stack_bytes);
}

double threads_mapped_bytes(int rank_threads, int ranks_here, int threads, bool workers_allocate,
                            bool* blas_missing_out) {
  const double page = double(::sysconf(_SC_PAGESIZE) > 0 ? ::sysconf(_SC_PAGESIZE) : 4096);
  struct rlimit stack;
  const double stack_bytes =
      (::getrlimit(RLIMIT_STACK, &stack) == 0 && stack.rlim_cur != RLIM_INFINITY
           ? double(stack.rlim_cur)
           : double(8 << 20)) +
      page;
  // OMP_STACKSIZE (GOMP_STACKSIZE first, as libgomp reads them): a number with an optional B, K,
  // M or G (K when none).
  double worker_stack = stack_bytes;
  for (const char* name : {"GOMP_STACKSIZE", "OMP_STACKSIZE"}) {
    const char* text = std::getenv(name);
    if (!text || !*text) continue;
    char* end = nullptr;
    const double v = std::strtod(text, &end);
    if (end == text || !(v > 0)) continue;
    while (*end == ' ') ++end;
    const char unit = static_cast<char>(std::toupper(static_cast<unsigned char>(*end)));
    const double scale = unit == 'B' ? 1 : unit == 'M' ? 1 << 20 : unit == 'G' ? 1 << 30 : 1024;
    worker_stack = v * scale + page;
    break;
  }
  // glibc's arenas: MALLOC_ARENA_MAX, else 8 a core (of those this process may run on, or of
  // those online, the larger), and at least 9 (it makes 8 before it counts the cores).
  double arenas = 0;
  if (const char* text = std::getenv("MALLOC_ARENA_MAX"); text && *text) {
    char* end = nullptr;
    const long v = std::strtol(text, &end, 10);
    if (end != text && *end == '\0' && v > 0) arenas = double(v);
  }
  if (arenas == 0) {
    cpu_set_t set;
    const int affine = ::sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
    const long online = ::sysconf(_SC_NPROCESSORS_ONLN);
    arenas = std::max(9.0, 8.0 * double(std::max<long>(affine, online)));
  }
  const double workers = double(ranks_here) * double(std::max(0, threads - 1));
  const double allocating =
      std::min(double(rank_threads) + (workers_allocate ? workers : 0.0), arenas - 1);
  // OpenBLAS's own threads (loom attn and verify call no GEMM, but the library starts them as it
  // loads) map their buffers as they start, some after main has begun: a check that ran before
  // one of them had mapped its 128 MiB let the run through, and the run's threads then found no
  // room.
  const int64_t blas_threads = std::max(0, openblas_get_num_threads() - 1);
  const int64_t blas_missing =
      std::max<int64_t>(0, blas_threads - std::max<int64_t>(0, openblas_buffers_mapped()));
  const double bytes = rank_threads * stack_bytes + workers * worker_stack +
                       allocating * double(64 << 20) +
                       double(blas_missing) * double(kOpenBlasBufferBytes);
  if (blas_missing_out) *blas_missing_out = blas_missing > 0;
  return bytes;
}

void DegreeOptions::add_to(CLI::App* command, const std::set<std::string>& skip) {
  for (const StrategyInfo& s : strategies()) {
    if (s.option.empty() || skip.count(s.option) || values_.count(s.option)) continue;
    std::string help;
    for (const StrategyInfo& t : strategies())
      if (t.option == s.option) help += (help.empty() ? "" : "; ") + t.name + ": " + t.option_help;
    // A given 0 reads as "not given" in values_, so it is refused here: --strategy hybrid
    // --ulysses 0 said "needs --ulysses N". What is not an integer is strict_integers' to name.
    command->add_option(s.option, values_[s.option], help)
        ->check(CLI::Validator(
            [](std::string& text) -> std::string {
              char* end = nullptr;
              errno = 0;
              const long long x = std::strtoll(text.c_str(), &end, 10);
              if (text.empty() || *end != '\0' || errno != 0 || x >= 1) return "";
              return "must be an integer >= 1, got " + text;
            },
            "", "positive degree"));
  }
}

void DegreeOptions::apply(CpConfig& cfg, const std::string& strategy) const {
  const StrategyInfo& mine = strategy_info(cfg.strategy);
  for (const auto& [flag, value] : values_) {
    if (flag == mine.option) {
      LOOM_CHECK(value >= 1, InvalidArgument,
                 "--strategy " << strategy << " needs " << flag << " N (" << mine.option_help
                               << "; docs/strategies.md)");
      set_degree(cfg, value);
    } else {
      LOOM_CHECK(value == 0, InvalidArgument,
                 flag << " is only for --strategy " << strategies_taking(flag)
                      << " (got --strategy " << strategy << ")");
    }
  }
}

std::vector<std::pair<std::string, int>> DegreeOptions::values() const {
  std::vector<std::pair<std::string, int>> v;
  for (const auto& [flag, value] : values_) v.emplace_back(flag.substr(2), value);
  return v;
}

CLI::Option* add_mask_options(CLI::App* command, bool& causal, int64_t& window, std::string& docs) {
  // CLI11 shows after a flag's name the value that name sets: "--causal,--no-causal{false}" read
  // as "default false" (causal is on by default). Both names carry theirs, and the help says the
  // default in words ("causal mask (default) or full attention" read as off).
  command->add_flag("--causal{true},--no-causal{false}", causal,
                    "causal mask, on by default (--no-causal turns it off: full attention)");
  command->add_option("--window", window, "sliding window W: keys with |i - j| < W (0: none)")
      ->capture_default_str();
  return command->add_option("--docs", docs, "packed documents: lengths L1,L2,... summing to S");
}

void add_memory_limit_option(CLI::App* command, std::string& limit) {
  command->add_option("--memory-limit", limit,
                      "refuse runs whose estimated peak memory is above this (e.g. 8G; default: "
                      "the machine's available memory)");
}

}  // namespace loom::tools
