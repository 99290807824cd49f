// bench_kernels: forward and backward GFLOP/s of the blockwise kernels next to the same machine's
// measured sgemm rate.
//
// For each shape of the sweep (--seq x --dim x causal/full x {1 thread, all threads}; --heads
// query heads, --kv-heads kv heads) the forward is one attend over all keys plus finish, the
// backward one attend_backward (delta precomputed). Each is called once untimed, then at least 5
// times and more until the timed calls add up to --min-time seconds; the GFLOP/s column is the
// fastest call.
// Useful FLOPs count only visible (query, key, head) triples, as reported by the kernel: forward
// 4 * D * pairs, backward 2.5x that.
//
// The sgemm rate is measured in the same run, between the timed calls: window, call, window, ...,
// call, window (time_paired), C = A B with M = N = K = --gemm-n, with the thread count of the row,
// each window back-to-back calls as long as one kernel call. The sgemm is OpenBLAS's cblas_sgemm
// where CMake found it (threads set with openblas_set_num_threads, the run-time form of
// OPENBLAS_NUM_THREADS), else a naive blocked sgemm. Each kernel of a row (forward, backward) has
// its own sgemm column, the fastest window among its own calls, and its /gemm column is its
// fastest call's rate over that: on a shared machine whose speed moves 10-25 % from minute to
// minute, windows among the calls keep both from the same seconds.
//
// Before timing, every configuration the run times (each --dtype, --dim and mask, each thread
// count, --block-q x --block-k, the kernel path, the GQA group of --heads / --kv-heads) is checked
// on a small problem of its kind (S about 1.5 tiles, tiles that do not divide it) against the fp64
// reference, within loom/tolerance.h's tolerances (the fixed ones where they hold, else the
// problem's own bounds); a failed check is one line on standard error and exit 1, nothing timed.
// --no-check skips it.
//
// Where /usr/bin/python3 (or --torch-python) can import torch, PyTorch attention, eager
// (bench/torch_compare.py: its scaled dot product attention and the textbook formulation
// alternated, each kernel the faster) runs on each fp32 one-thread shape right after loom's row
// and is printed beneath it (its sgemm column: torch.mm), so the loom / PyTorch targets divide
// rates of the same minute; elsewhere one line says they were skipped.
// --torch makes them required (a Python without torch is an error), --no-torch leaves them out,
// --torch-json reads them from an earlier torch_compare.py run instead (read and checked before
// anything is timed). PyTorch runs every head's own k and v (no GQA: with --kv-heads below
// --heads its rows are skipped, --torch refuses), and its rows are matched to loom's by the whole
// shape. Where CMake found a ggml build (-DLOOM_GGML_DIR, bench/kernels.cmake),
// ggml's CPU flash attention (bench/ggml_compare.cc: forward only, fp32 k and v, --kv-heads
// broadcast as GQA, its own check against the fp64 reference) runs on each fp32 one-thread shape
// too, printed beneath as `ggml`
// with loom's row's sgemm; --no-ggml leaves it out. ggml is not in Debian, so by default these rows
// are not built.
//
// The targets follow the table, each line tagged with what its value divides (a legend says
// it); a line whose rows the run did not measure says what it needs.
//
//   bench_kernels                                  the default sweep, a table
//   bench_kernels --seq 1024 --dim 64 --json out.json
//   bench_kernels --seq 4096 --dim 128 64 --dtype fp32 bf16 --ring 512 --threads 1
//   bench_kernels --thread-scaling 8 --dtype fp32 bf16 --threads 2   the two-thread lines
#include <fcntl.h>
#include <omp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <initializer_list>
#include <iostream>
#include <map>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "../src/kernels/tile_ops.h"
#include "bench_cli.h"
#include "bench_common.h"
#include "loom/attention.h"
#include "loom/error.h"
#include "loom/io.h"
#include "loom/tensor.h"
#include "loom/timer.h"
#include "loom/tolerance.h"

#if LOOM_BENCH_OPENBLAS
#include <cblas.h>
#endif

namespace loom {
namespace {

struct Options {
  std::vector<int64_t> seqs = {4096};
  std::vector<std::string> dtypes = {"fp32", "bf16"};
  int64_t ring = 512;  // ring-step rows: ring x ring, full mask (0: none)
  std::vector<int64_t> dims = {64, 128};
  int64_t heads = 8, kv_heads = 8;
  int64_t block_q = 64, block_k = 64;
  int threads = 0;  // "all threads"; 0: omp_get_max_threads()
  int64_t gemm_n = 1024;
  double min_time = 0.5;
  bool no_check = false;
  bool tile_ops = false;
  int thread_scaling = 0;           // > 0: rounds of --thread-scaling instead of the sweep
  double sgemm_window = 0;          // > 0: print one-thread sgemm over windows this long, and exit
  bool keep_openblas_core = false;  // time the sgemm with the core OpenBLAS chose
  std::string json, torch_json;
  // PyTorch's rows (bench/torch_compare.py after each fp32 one-thread row): by default where
  // torch_python can import torch; --torch requires them, --no-torch (or --torch-json) leaves
  // them out.
  bool torch = false, no_torch = false;
  // ggml's rows (ggml_compare after each fp32 one-thread row) where it was built; --no-ggml leaves
  // them out.
  bool no_ggml = false;
  std::string torch_python = "/usr/bin/python3";
};

using bench::random_normal;
using bench::rel_error;

// With --cpu-time the kernel calls and the sgemm windows are timed by the process's CPU clock
// instead of the wall clock: on a machine shared with other work, the time this process was
// descheduled then does not count (cache and memory-bandwidth interference still does). Meaningful
// for one-thread rows only (the CPU time of several threads adds up), so the threads > 1 rows keep
// the wall clock.
bool g_cpu_time = false;

double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// ---------------------------------------------------------------------------------------------
// sgemm

// The kernel paths that issue 10's AVX-512 targets apply to: avx512, avx512bf16 and amx (the
// avx512 table with bf16 GEMMs on AMX tiles).
bool avx512_path(const std::string& path) {
  return path.rfind("avx512", 0) == 0 || path == "amx";
}

#if LOOM_BENCH_OPENBLAS
const char* kGemmName = "openblas";

// OpenBLAS chooses its kernels (its "core") when it loads: from the CPU, or from
// OPENBLAS_CORETYPE. The environment may name a core of an older instruction set than the CPU
// runs (on the Zen 5 machines of this project's sessions it holds OPENBLAS_CORETYPE=Haswell, whose
// AVX2 sgemm measured 115-121 GFLOP/s against 207-223 for the AVX-512 SkylakeX and Cooperlake
// kernels OpenBLAS picks itself there): a ratio to that sgemm would overstate an AVX-512 path by
// 2x. So the sgemm runs the core of the kernel path's instruction set: match_openblas_core
// re-executes the bench with OPENBLAS_CORETYPE naming an AVX-512 core for an avx512 path where
// OpenBLAS would run an older one, and Haswell for the avx2 path where it would run an AVX-512
// one (the AVX2 targets are the AVX2 path against an AVX2 sgemm, on any CPU); other paths keep
// OpenBLAS's choice. The header line says what was replaced; --keep-openblas-core keeps it.
// PyTorch's rows inherit the environment, so their torch.mm runs the same core.
bool avx512_core(const std::string& core) {
  return core == "SkylakeX" || core == "Cooperlake" || core == "SapphireRapids";
}

std::string g_core_replaced;  // what the re-execution replaced, for the header line

void match_openblas_core(char** argv) {
  const char* replaced = std::getenv("LOOM_BENCH_CORE_REPLACED");  // set before re-executing
  if (replaced != nullptr) {
    g_core_replaced = replaced;
    unsetenv("LOOM_BENCH_CORE_REPLACED");
    return;
  }
  std::string path;
  try {
    path = kernel_path();
  } catch (const Error&) {
    return;  // a LOOM_KERNEL the kernels refuse: the run reports it
  }
  const std::string core = openblas_get_corename();
  const char* want = nullptr;
  if (avx512_path(path) && !avx512_core(core))
    want = __builtin_cpu_supports("avx512bf16") ? "Cooperlake" : "SkylakeX";
  else if (path == "avx2" && avx512_core(core))
    want = "Haswell";
  if (want == nullptr) return;
  const char* env = std::getenv("OPENBLAS_CORETYPE");
  const std::string note = "replaced " + core +
                           (env != nullptr ? " (OPENBLAS_CORETYPE=" + std::string(env) + ")"
                                           : std::string(" (OpenBLAS's choice)")) +
                           " to match the " + path + " path";
  setenv("OPENBLAS_CORETYPE", want, 1);
  setenv("LOOM_BENCH_CORE_REPLACED", note.c_str(), 1);
  execv("/proc/self/exe", argv);
  std::fprintf(stderr, "bench_kernels: could not re-execute with OPENBLAS_CORETYPE=%s\n", want);
  if (env != nullptr) {
    setenv("OPENBLAS_CORETYPE", env, 1);
  } else {
    unsetenv("OPENBLAS_CORETYPE");
  }
  unsetenv("LOOM_BENCH_CORE_REPLACED");
}

// "openblas (core SkylakeX, ...)" for the header lines.
std::string gemm_description() {
  std::string s = std::string(kGemmName) + " (core " + openblas_get_corename();
  if (!g_core_replaced.empty()) s += "; " + g_core_replaced;
  return s + ")";
}

void sgemm(int64_t n, const float* a, const float* b, float* c, int threads) {
  openblas_set_num_threads(threads);
  const int ni = static_cast<int>(n);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, ni, ni, 1.0f, a, ni, b, ni, 0.0f, c,
              ni);
}
#else
const char* kGemmName = "naive-blocked";
void match_openblas_core(char**) {}
std::string gemm_description() {
  return kGemmName;
}
// C = A B, row-major n x n: 64 x 64 x 256 blocks, an axpy inner loop GCC vectorises.
void sgemm(int64_t n, const float* a, const float* b, float* c, int threads) {
  constexpr int64_t kBi = 64, kBj = 256, kBk = 256;
  std::fill(c, c + n * n, 0.0f);
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
  for (int64_t i0 = 0; i0 < n; i0 += kBi) {
    for (int64_t j0 = 0; j0 < n; j0 += kBj) {
      for (int64_t k0 = 0; k0 < n; k0 += kBk) {
        for (int64_t i = i0; i < std::min(i0 + kBi, n); ++i) {
          float* ci = c + i * n;
          for (int64_t k = k0; k < std::min(k0 + kBk, n); ++k) {
            const float aik = a[i * n + k];
            const float* bk = b + k * n;
            for (int64_t j = j0; j < std::min(j0 + kBj, n); ++j) ci[j] += aik * bk[j];
          }
        }
      }
    }
  }
}
#endif

// Windows of back-to-back sgemm calls of M = N = K = n, each about `seconds` long (at least one
// call; the count is set by one untimed call), timed as one, with the clock of the rows' kernel
// calls. A shared machine's noise comes in bursts: the best of many short calls finds a quiet
// 30 ms, a one-second kernel call never does, so the short-call rate would overstate what the
// machine gives a long call (here 1024^3 calls: best 78-79 GFLOP/s; 4096^3 calls of 1.4 s: best
// 69-71).
class SgemmWindow {
 public:
  SgemmWindow(int64_t n, int threads, double seconds)
      : n_(n),
        threads_(threads),
        a_(random_normal({n, n}, 1)),
        b_(random_normal({n, n}, 2)),
        c_({n, n}) {
    Stopwatch one;
    sgemm(n_, a_.data(), b_.data(), c_.data(), threads_);
    calls_ = std::max<int64_t>(1, std::llround(seconds / one.elapsed_s()));
  }
  // GFLOP/s of one window.
  double gflops() {
    const bool cpu = g_cpu_time && threads_ == 1;
    Stopwatch sw;
    const double c0 = cpu ? cpu_seconds() : 0.0;
    for (int64_t i = 0; i < calls_; ++i) sgemm(n_, a_.data(), b_.data(), c_.data(), threads_);
    const double t = cpu ? cpu_seconds() - c0 : sw.elapsed_s();
    return 2.0 * static_cast<double>(n_ * n_ * n_) * static_cast<double>(calls_) / t * 1e-9;
  }

 private:
  int64_t n_;
  int threads_;
  Tensor<float> a_, b_, c_;
  int64_t calls_ = 1;
};

// The faster of two windows (--sgemm-window).
double sgemm_window_gflops(int64_t n, int threads, double seconds) {
  SgemmWindow w(n, threads, seconds);
  return std::max(w.gflops(), w.gflops());
}

// The timed calls of one kernel of a row and the sgemm windows between them: one untimed warm-up
// call, then window, call, window, ..., call, window (at least kMinCalls calls, more until they
// add up to min_time), each window as long as the warm-up call. The windows span the same seconds
// as the calls, so the fastest call and the fastest window, the least disturbed of each, come
// from the same stretch of the machine's drifting speed.
struct Paired {
  std::vector<double> call_s;  // each timed call, seconds
  std::vector<double> sgemm;   // windows, GFLOP/s: sgemm[i] right before call i, sgemm[i + 1] after
  double best_s() const { return *std::min_element(call_s.begin(), call_s.end()); }
  double best_sgemm() const { return *std::max_element(sgemm.begin(), sgemm.end()); }
};

constexpr int kMinCalls = 5;

template <class F>
Paired time_paired(F&& f, double min_time, int threads, int64_t gemm_n) {
  const bool cpu = g_cpu_time && threads == 1;
  Stopwatch warm;
  f();
  SgemmWindow window(gemm_n, threads, warm.elapsed_s());
  // With several threads, OpenBLAS's workers spin for a while after a call and the kernels'
  // OpenMP threads after theirs: on a machine with few cores each would slow the other down. A
  // pause (untimed) lets them go idle.
  auto gemm = [&] {
    if (threads > 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const double g = window.gflops();
    if (threads > 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    return g;
  };
  Paired p;
  p.sgemm.push_back(gemm());
  double in_calls = 0;  // min_time counts the calls, not the windows
  while (static_cast<int>(p.call_s.size()) < kMinCalls || in_calls < min_time) {
    Stopwatch sw;
    const double c0 = cpu ? cpu_seconds() : 0.0;
    f();
    p.call_s.push_back(cpu ? cpu_seconds() - c0 : sw.elapsed_s());
    in_calls += sw.elapsed_s();
    p.sgemm.push_back(gemm());
  }
  return p;
}

// ---------------------------------------------------------------------------------------------
// Kernels

struct Row {
  std::string dtype;  // storage: fp32 or bf16
  int64_t sq, sk, heads, kv_heads, dim;
  bool causal;
  int threads;
  int64_t visible_pairs;
  Paired fwd, bwd;
  double fwd_flops() const { return 4.0 * static_cast<double>(dim * visible_pairs); }
  double bwd_flops() const { return 2.5 * fwd_flops(); }
  double fwd_gflops() const { return fwd_flops() / fwd.best_s() * 1e-9; }
  double bwd_gflops() const { return bwd_flops() / bwd.best_s() * 1e-9; }
  // Each kernel's sgemm column: the fastest of the windows among its own calls, its ratio's
  // denominator (the forward's and the backward's calls are seconds apart, and a row's forward
  // once read 0.61 of the backward's windows where its own read 49-57 GFLOP/s: round 10).
  double fwd_gemm() const { return fwd.best_sgemm(); }
  double bwd_gemm() const { return bwd.best_sgemm(); }
  // The fastest window of the whole row (the run's summary of the machine's speed).
  double gemm_gflops() const { return std::max(fwd_gemm(), bwd_gemm()); }
  double fwd_ratio() const { return fwd_gflops() / fwd_gemm(); }
  double bwd_ratio() const { return bwd_gflops() / bwd_gemm(); }
};

// One problem: sq query rows at positions [sk - sq, sk) against sk keys at [0, sk) (sq == sk: the
// whole sequence; sq < sk with !causal: one ring step's block pair), its inputs drawn once. The
// forward is one attend over all keys plus finish; the backward one attend_backward on the lse
// and delta of a forward run before prepare_backward(); `threads` is the kernels' thread count.
template <class T>
class Problem {
 public:
  Problem(const Options& o, int64_t sq, int64_t sk, int64_t d, bool causal)
      : sq_(sq), kpos_(static_cast<size_t>(sk)), st_(sq, o.heads, d) {
    const int64_t h = o.heads, hkv = o.kv_heads;
    const Tensor<float> q32 = random_normal({sq, h, d}, 11), k32 = random_normal({sk, hkv, d}, 12),
                        v32 = random_normal({sk, hkv, d}, 13), do32 = random_normal({sq, h, d}, 14);
    if constexpr (std::is_same_v<T, float>) {
      q_ = q32, k_ = k32, v_ = v32, dout_ = do32;
    } else {
      q_ = convert<T>(q32), k_ = convert<T>(k32), v_ = convert<T>(v32), dout_ = convert<T>(do32);
    }
    std::iota(kpos_.begin(), kpos_.end(), 0);
    kt_ = Tokens{kpos_.data(), nullptr, sk};
    qt_ = Tokens{kpos_.data() + (sk - sq), nullptr, sq};
    cfg_.mask = Mask{causal, 0};
    cfg_.scale = 1.0f / std::sqrt(static_cast<float>(d));
    cfg_.block_q = o.block_q;
    cfg_.block_k = o.block_k;
    out_ = Tensor<T>({sq, h, d});
    lse_.resize(static_cast<size_t>(h * sq));
    delta_.resize(static_cast<size_t>(h * sq));
    dq_ = Tensor<float>({sq, h, d});
    dk_ = Tensor<float>({sk, hkv, d});
    dv_ = Tensor<float>({sk, hkv, d});
  }
  KernelStats forward(int threads) {
    cfg_.threads = threads;
    st_.reset();
    const KernelStats stats =
        attend(st_.view(), q_.view3(), k_.view3(), v_.view3(), qt_, kt_, cfg_);
    finish(st_.view(), out_.view3(), lse_.data(), sq_);
    return stats;
  }
  // delta = rowsum(dout o out) of the last forward's out (call after a forward, before backward).
  void prepare_backward() {
    compute_delta(View3<const T>(out_.view3()), dout_.view3(), delta_.data(), sq_);
  }
  void backward(int threads) {
    cfg_.threads = threads;
    attend_backward(q_.view3(), k_.view3(), v_.view3(), dout_.view3(), lse_.data(), delta_.data(),
                    sq_, qt_, kt_, cfg_, dq_.view3(), dk_.view3(), dv_.view3());
  }
  // For the check (check_runs): one forward and one backward into zeroed gradients (backward
  // accumulates), the results as fp32 in the order out, lse, dq, dk, dv.
  std::array<std::vector<float>, 5> results(int threads) {
    forward(threads);
    prepare_backward();
    for (Tensor<float>* g : {&dq_, &dk_, &dv_}) std::fill(g->vec().begin(), g->vec().end(), 0.0f);
    backward(threads);
    std::vector<float> out;
    if constexpr (std::is_same_v<T, float>)
      out = out_.vec();
    else
      out = convert<float>(out_).vec();
    return {out, lse_, dq_.vec(), dk_.vec(), dv_.vec()};
  }
  // q, k, v, dout as the fp64 reference takes them: exactly the values the kernels read.
  std::array<Tensor<double>, 4> inputs_f64() const {
    auto f64 = [](const Tensor<T>& x) {
      if constexpr (std::is_same_v<T, float>)
        return convert<double>(x);
      else
        return convert<double>(convert<float>(x));
    };
    return {f64(q_), f64(k_), f64(v_), f64(dout_)};
  }
  Tokens qt() const { return qt_; }
  Tokens kt() const { return kt_; }
  const KernelConfig& config() const { return cfg_; }

 private:
  int64_t sq_;
  std::vector<int64_t> kpos_;
  Tokens qt_{}, kt_{};
  KernelConfig cfg_;
  Tensor<T> q_, k_, v_, dout_, out_;
  SoftmaxState st_;
  std::vector<float> lse_, delta_;
  Tensor<float> dq_, dk_, dv_;
};

// One row: the forward and the backward of one problem, each timed between sgemm windows
// (time_paired).
template <class T>
Row run_shape_t(const Options& o, int64_t sq, int64_t sk, int64_t d, bool causal, int threads,
                const char* dtype) {
  Problem<T> p(o, sq, sk, d, causal);
  KernelStats stats;
  Paired fwd = time_paired([&] { stats = p.forward(threads); }, o.min_time, threads, o.gemm_n);
  p.prepare_backward();
  Paired bwd = time_paired([&] { p.backward(threads); }, o.min_time, threads, o.gemm_n);
  Row r{dtype, sq, sk, o.heads, o.kv_heads, d, causal, threads, stats.visible_pairs, {}, {}};
  r.fwd = std::move(fwd);
  r.bwd = std::move(bwd);
  return r;
}

Row run_shape(const Options& o, const std::string& dtype, int64_t sq, int64_t sk, int64_t d,
              bool causal, int threads) {
  if (dtype == "bf16") return run_shape_t<bf16>(o, sq, sk, d, causal, threads, "bf16");
  return run_shape_t<float>(o, sq, sk, d, causal, threads, "fp32");
}

// ---------------------------------------------------------------------------------------------
// Correctness check

// Before timing, every configuration the run times is checked against the fp64 reference on a
// small problem of its own kind: its dtype, head dim, mask, GQA group (--heads over --kv-heads),
// thread count, tiles (--block-q x --block-k) and kernel path, run by the timed rows' own
// Problem class on S = check_seq() tokens. The tolerances are loom/tolerance.h's, applied as
// `loom attn --check` applies them (check_limits: the fixed ones where they hold for the problem,
// else the problem's own bounds, with the path's bf16 dots). The check once ran fp32 alone, on
// 48 x 40 tiles and the all-threads count: the bf16 rows (on an AMX CPU tile_ops_amx.cc, separate
// code) and --block-q / --block-k were timed and judged unchecked.

// S of the check problems: along queries and keys a full tile and a ragged one where the blocks
// allow (S a multiple of neither, below twice the larger), at most kCheckMaxSeq so that a large
// block keeps the check cheap (one ragged tile then).
constexpr int64_t kCheckMaxSeq = 320;

int64_t check_seq(const Options& o) {
  const int64_t big = std::max(o.block_q, o.block_k), small = std::min(o.block_q, o.block_k);
  int64_t s = big + small / 2 + 1;
  for (int64_t t = s; t < 2 * big; ++t) {
    if (t % o.block_q != 0 && t % o.block_k != 0) {
      s = t;
      break;
    }
  }
  return std::min(s, kCheckMaxSeq);
}

// The check problems' heads: the run's GQA group (--heads / --kv-heads query heads per kv head)
// over at most two kv heads.
Options check_heads(const Options& o) {
  Options c = o;
  c.kv_heads = std::min<int64_t>(o.kv_heads, 2);
  c.heads = o.heads / o.kv_heads * c.kv_heads;
  return c;
}

std::string sci(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2e", x);
  return buf;
}

struct CheckOutcome {
  nlohmann::json cases = nlohmann::json::array();
  std::string failed;      // the first failure, as its line says it ("": none)
  double worst = 0;        // the largest error / limit of the checks
  std::string worst_what;  // which check and tensor
};

// The check of one dtype, head dim and mask at each of thread_counts (one reference for all),
// appended to c; stops at the first failure.
template <class T>
void check_config(const Options& o, const std::string& dtype, int64_t d, bool causal,
                  const std::vector<int>& thread_counts, CheckOutcome& c) {
  static constexpr const char* kNames[5] = {"out", "lse", "dq", "dk", "dv"};
  constexpr bool kBf16 = std::is_same_v<T, bf16>;
  const Options co = check_heads(o);
  const int64_t s = check_seq(o), h = co.heads, hkv = co.kv_heads;
  Problem<T> p(co, s, s, d, causal);
  const std::array<Tensor<double>, 4> in = p.inputs_f64();
  const View3<const double> q = in[0].view3(), k = in[1].view3(), v = in[2].view3(),
                            dout = in[3].view3();
  const KernelConfig& cfg = p.config();
  Tensor<double> ref_out({s, h, d}), ref_dq({s, h, d}), ref_dk({s, hkv, d}), ref_dv({s, hkv, d});
  std::vector<double> ref_lse(static_cast<size_t>(h * s));
  reference_forward(q, k, v, p.qt(), p.kt(), cfg.mask, cfg.scale, ref_out.view3(), ref_lse.data());
  reference_backward(q, k, v, dout, p.qt(), p.kt(), cfg.mask, cfg.scale, ref_dq.view3(),
                     ref_dk.view3(), ref_dv.view3());
  const std::array<const std::vector<double>*, 5> ref = {&ref_out.vec(), &ref_lse, &ref_dq.vec(),
                                                         &ref_dk.vec(), &ref_dv.vec()};
  const CheckLimits l =
      check_limits(q, k, v, dout, p.qt(), p.kt(), cfg.mask, cfg.scale,
                   CheckedResults{kBf16, kBf16 && kernel_path_bf16_dots(), /*loom_kernels=*/true});
  const std::array<double, 5> limit = {l.out, l.lse, l.dq, l.dk, l.dv};
  const std::string& why = l.why;
  const std::string tolerance =
      why.empty() ? "the fixed tolerance" : "the problem's own bound (" + why + ")";
  // LOOM_TEST_BENCH_CHECK_FAIL=<dtype>: the tests' way to see a failed check end the run before
  // anything is timed (that dtype's dq negated, a sign error).
  const char* fail = std::getenv("LOOM_TEST_BENCH_CHECK_FAIL");
  for (const int threads : thread_counts) {
    std::array<std::vector<float>, 5> got = p.results(threads);
    if (fail != nullptr && dtype == fail)
      for (float& x : got[2]) x = -x;
    const std::string what = dtype + " D=" + std::to_string(d) + (causal ? " causal " : " full ") +
                             std::to_string(threads) + " thr";
    nlohmann::json errors, limits;
    for (int i = 0; i < 5; ++i) {
      const double e = rel_error(got[i], *ref[i]);
      errors[kNames[i]] = e;
      limits[kNames[i]] = limit[i];
      if (!(e <= limit[i]) && c.failed.empty())
        c.failed = what + ": " + kNames[i] + " relative error " + sci(e) + " > " + sci(limit[i]) +
                   ", " + tolerance;
      if (e / limit[i] > c.worst) {
        c.worst = e / limit[i];
        c.worst_what = what + " " + kNames[i];
      }
    }
    c.cases.push_back({{"dtype", dtype},
                       {"dim", d},
                       {"causal", causal},
                       {"threads", threads},
                       {"tolerance", why.empty() ? "fixed" : "per-problem bound"},
                       {"errors", errors},
                       {"limits", limits}});
    if (!c.failed.empty()) return;
  }
}

// The JSON's description of the sgemm the ratios divide by.
nlohmann::json gemm_doc(const Options& o) {
  nlohmann::json g = {{"impl", kGemmName}, {"n", o.gemm_n}, {"description", gemm_description()}};
#if LOOM_BENCH_OPENBLAS
  g["core"] = openblas_get_corename();
  if (!g_core_replaced.empty()) g["core_replaced"] = g_core_replaced;
#endif
  return g;
}

// "a, b and c" of the values.
template <class V>
std::string listed(const std::vector<V>& values) {
  std::ostringstream s;
  for (size_t i = 0; i < values.size(); ++i)
    s << (i == 0 ? "" : i + 1 == values.size() ? " and " : ", ") << values[i];
  return s.str();
}

// The check before timing (unless --no-check) of every dtype and --dim of the run, at each of
// `masks` (causal or not) and thread_counts: one line and doc["check"] when every check holds;
// else one line on standard error naming the first failure, nothing timed, and false.
bool run_check(const Options& o, const std::vector<bool>& masks,
               const std::vector<int>& thread_counts, nlohmann::json& doc) {
  if (o.no_check) return true;
  CheckOutcome c;
  for (const std::string& dtype : o.dtypes)
    for (const int64_t d : o.dims)
      for (const bool causal : masks) {
        if (!c.failed.empty()) break;
        if (dtype == "bf16")
          check_config<bf16>(o, dtype, d, causal, thread_counts, c);
        else
          check_config<float>(o, dtype, d, causal, thread_counts, c);
      }
  const Options co = check_heads(o);
  const int64_t s = check_seq(o);
  std::vector<std::string> mask_names;
  for (const bool causal : masks) mask_names.push_back(causal ? "causal" : "full");
  const std::string where = "blocks " + std::to_string(o.block_q) + " x " +
                            std::to_string(o.block_k) + ", " + kernel_path() +
                            " path, S=" + std::to_string(s) + " H=" + std::to_string(co.heads) +
                            " Hkv=" + std::to_string(co.kv_heads);
  if (!c.failed.empty()) {
    std::fprintf(stderr,
                 "bench_kernels: check FAILED against the fp64 reference, nothing timed: %s (%s) "
                 "(--no-check skips the check)\n",
                 c.failed.c_str(), where.c_str());
    return false;
  }
  std::printf(
      "check: ok, %zu configurations against the fp64 reference before timing (%s; D %s; %s; %s "
      "thr; %s), each within its tolerance (loom/tolerance.h); closest: %s at %.2f of its limit\n",
      c.cases.size(), listed(o.dtypes).c_str(), listed(o.dims).c_str(), listed(mask_names).c_str(),
      listed(thread_counts).c_str(), where.c_str(), c.worst_what.c_str(), c.worst);
  doc["check"] = {{"ok", true},
                  {"kernel_path", kernel_path()},
                  {"block", {o.block_q, o.block_k}},
                  {"seq", s},
                  {"heads", co.heads},
                  {"kv_heads", co.kv_heads},
                  {"worst_fraction_of_limit", c.worst},
                  {"cases", c.cases}};
  return true;
}

// What a target's value divides (its "basis" in the JSON, its tag in the printed line): a row's
// /gemm column; one row's /gemm column over another's, each row's rate over the sgemm windows
// among its own calls (rows a minute or more apart: the machine's drift between them cancels,
// docs/performance.md, round 14), which is not the quotient of their GFLOP/s columns; the
// quotient of two GFLOP/s columns (a second thread, or loom over PyTorch, is what those measure);
// the median over --thread-scaling's rounds of t1 / tN.
enum class Basis { kGemmRatio, kGemmRatioQuotient, kGflopsQuotient, kPairedMedian };

struct BasisInfo {
  const char* key;          // the JSON's "basis"
  const char* tag;          // ends the printed line
  const char* description;  // the legend's
};

const BasisInfo& basis_info(Basis b) {
  static const BasisInfo kInfo[] = {
      {"gemm_ratio", "[/gemm]",
       "the row's /gemm column: its rate over the fastest sgemm window among its own calls"},
      {"gemm_ratio_quotient", "[/gemm over /gemm]",
       "the first row's /gemm column over the second's (each over its own sgemm windows: the "
       "drift between rows a minute apart cancels, docs/performance.md round 14), not the "
       "quotient of their GFLOP/s columns"},
      {"gflops_quotient", "[GFLOP/s over GFLOP/s]",
       "the quotient of the two rows' GFLOP/s columns"},
      {"paired_median", "[median of t1 / tN]",
       "the median over the rounds of t1 / tN, the kernel's one-thread time over its N-thread "
       "time in the same round"},
  };
  return kInfo[static_cast<int>(b)];
}

// The legend of the bases above, printed under a targets header, and recorded in the JSON.
nlohmann::json print_bases(std::initializer_list<Basis> bases) {
  nlohmann::json legend = nlohmann::json::object();
  for (const Basis b : bases) {
    std::printf("  %-24s %s\n", basis_info(b).tag, basis_info(b).description);
    legend[basis_info(b).key] = basis_info(b).description;
  }
  return legend;
}

// The value of a target line, to three decimals: a met value rounded to nearest (never below its
// goal, which has at most two), a value that missed its goal rounded down, so that it never
// prints equal to the goal ("0.85 (target >= 0.85: NOT met)" was 0.8474).
std::string target_value_text(double value, bool met) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3f", met ? value : std::floor(value * 1e3) / 1e3);
  return buf;
}

// One target line: printed with met / NOT met and its basis, and appended to targets.
void print_target(nlohmann::json& targets, const std::string& what, double value, double goal,
                  Basis basis) {
  // A ratio that is not a finite positive number measured nothing (an sgemm of 0 GFLOP/s made
  // every line over it "inf: met"): never met.
  const bool measured = std::isfinite(value) && value > 0;
  const bool met = measured && value >= goal;
  if (measured)
    std::printf("  %-62s %7s  (target >= %.2f: %s)  %s\n", what.c_str(),
                target_value_text(value, met).c_str(), goal, met ? "met" : "NOT met",
                basis_info(basis).tag);
  else
    std::printf("  %-62s %7s  (target >= %.2f: NOT met, nothing measured)  %s\n", what.c_str(), "-",
                goal, basis_info(basis).tag);
  targets.push_back({{"what", what},
                     {"value", measured ? nlohmann::json(value) : nlohmann::json()},
                     {"target", goal},
                     {"basis", basis_info(basis).key},
                     {"measured", measured},
                     {"met", met}});
}

// A target this run cannot compute (its rows were not measured): printed and recorded as such,
// with what it needs, never silently dropped.
void print_unmeasured(nlohmann::json& targets, const std::string& what, double goal,
                      const std::string& needs) {
  std::printf("  %-62s %7s  (target >= %.2f: not measured, needs %s)\n", what.c_str(), "-", goal,
              needs.c_str());
  targets.push_back({{"what", what},
                     {"value", nullptr},
                     {"target", goal},
                     {"measured", false},
                     {"met", false},
                     {"needs", needs}});
}

// The header of a target list: issue 10 sets one list for the AVX-512 paths and one for AVX2+FMA;
// other paths (sse4, ssse3, scalar) have none of their own, and show the AVX2+FMA list for
// reference. Records which in doc.
void print_targets_header(const std::string& path, const char* source, nlohmann::json& doc) {
  const bool avx512 = avx512_path(path);
  const bool reference = !avx512 && path != "avx2";
  const char* list = avx512 ? "AVX-512" : "AVX2+FMA";
  if (reference)
    std::printf(
        "\ntargets: issue 10's %s list, shown for reference on the %s path (the issue sets "
        "targets for the AVX2+FMA and AVX-512 paths only), %s; each value is\n",
        list, path.c_str(), source);
  else
    std::printf("\ntargets (issue 10's %s list, %s path), %s; each value is\n", list, path.c_str(),
                source);
  doc["target_list"] = list;
  doc["target_list_for_reference"] = reference;
}

// ---------------------------------------------------------------------------------------------
// --tile-ops: the tile operations of every runnable target on one work tile (128 x 128, D), each
// the best of many short calls (a loaded machine leaves some calls undisturbed), next to the
// same-size sgemm. This isolates the GEMM micro-kernel and the softmax steps from packing and
// threading.

template <class F>
double best_short(F&& f, int reps) {
  f();
  double best = 1e300;
  for (int i = 0; i < reps; ++i) {
    Stopwatch sw;
    f();
    best = std::min(best, sw.elapsed_s());
  }
  return best;
}

// The best time of f over reps calls, each after an untimed setup().
template <class S, class F>
double best_short_after(S&& setup, F&& f, int reps) {
  double best = 1e300;
  for (int i = 0; i <= reps; ++i) {
    setup();
    Stopwatch sw;
    f();
    if (i > 0) best = std::min(best, sw.elapsed_s());
  }
  return best;
}

int run_tile_ops(const Options& o) {
  const int64_t bq = 128, bk = 128, dp = o.dims.back();
  const Tensor<float> a = random_normal({bq, std::max(bk, dp)}, 31),
                      b = random_normal({std::max(bk, dp), std::max(bk, dp)}, 32);
  Tensor<float> c({std::max(bq, bk), std::max(bk, dp)});
  const int reps = 400;
  const double gemm_flops = 2.0 * bq * bk * dp;
#if LOOM_BENCH_OPENBLAS
  openblas_set_num_threads(1);
#endif
  const double t_blas = best_short(
      [&] {
#if LOOM_BENCH_OPENBLAS
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(bq),
                    static_cast<int>(bk), static_cast<int>(dp), 1.0f, a.data(),
                    static_cast<int>(dp), b.data(), static_cast<int>(bk), 0.0f, c.data(),
                    static_cast<int>(bk));
#else
        sgemm(bq, a.data(), b.data(), c.data(), 1);
#endif
      },
      reps);
  std::printf("tile ops, one thread, best of %d calls; tile %lld x %lld, D = %lld\n", reps,
              static_cast<long long>(bq), static_cast<long long>(bk), static_cast<long long>(dp));
  std::printf("sgemm (%s) %lld x %lld x %lld: %.1f GFLOP/s\n", kGemmName,
              static_cast<long long>(bq), static_cast<long long>(bk), static_cast<long long>(dp),
              gemm_flops / t_blas * 1e-9);
  // One column for the backward's dv += p^T dout and dk += ds^T q: the same call on operands of
  // the same shapes and layout (A [bq, bk] read transposed, B [bq, D]), which it once timed twice
  // as two columns.
  std::printf("%-11s %9s %9s %9s | %10s %10s %10s %10s\n", "target", "q k^T", "p v", "p^T do",
              "softmax ns", "max grew", "probs ns", "ds ns");
  std::vector<float> m(bq), l(bq), lse(bq, 0.0f), delta(bq, 0.1f);
  Tensor<float> s({bq, bk}), acc({bq, dp});
  for (const kernels::KernelTarget& t : kernels::kernel_targets()) {
    if (!t.runnable) {
      std::printf("%-11s skipped: this CPU cannot run it\n", t.name);
      continue;
    }
    const kernels::TileOps& ops = *t.ops;
    auto rate = [&](auto&& f) { return gemm_flops / best_short(f, reps) * 1e-9; };
    // s = q k^T (q [bq, dp] rows, k^T [dp, bk]); acc += p v; dv += p^T dout (A read transposed),
    // which times dk += ds^T q too (the same call).
    const double g_qk = rate(
        [&] { ops.gemm(bq, bk, dp, a.data(), dp, 1, b.data(), bk, 0.1f, false, s.data(), bk); });
    const double g_pv = rate(
        [&] { ops.gemm(bq, dp, bk, a.data(), bk, 1, b.data(), dp, 1.0f, true, acc.data(), dp); });
    const double g_pt = rate(
        [&] { ops.gemm(bk, dp, bq, a.data(), 1, bk, b.data(), dp, 1.0f, true, c.data(), dp); });
    // q k^T with k^T read from a pool of 256 tiles (32 MiB, beyond L2 and most L3s) as the
    // forward reads a long KV block: the GEMM with its B operand streaming from memory.
    static const Tensor<float> pool = random_normal({256, dp, bk}, 33);
    int next = 0;
    const double g_cold =
        gemm_flops * 8 /
        best_short(
            [&] {
              for (int i = 0; i < 8; ++i, next = (next + 1) % 256)
                ops.gemm_panels(bq, bk, dp, a.data(), dp, 1, pool.data() + next * dp * bk, dp * 16,
                                0.1f, false, s.data(), bk);
            },
            reps / 4) *
        1e-9;
    std::printf("%-11s q k^T with k^T from memory: %.1f GFLOP/s\n", t.name, g_cold);
    const double per_elem = 1e9 / static_cast<double>(bq * bk);
    // The softmax step alone on a real score tile (scale 0.1, as 1 / sqrt(D) at D = 128), every
    // call from the same saved scores. Steady state: each row's running max m already at the
    // tile's (alpha = 1, acc untouched), as for most tiles after a row's first; "max grew": m
    // below it (m = -1), so every row also rescales acc [bq, D] by alpha = exp(m - m').
    ops.gemm(bq, bk, dp, a.data(), dp, 1, b.data(), bk, 0.1f, false, s.data(), bk);
    const std::vector<float> scores(s.vec());
    std::vector<float> row_max(bq);
    for (int64_t r = 0; r < bq; ++r)
      row_max[r] = *std::max_element(scores.begin() + r * bk, scores.begin() + (r + 1) * bk);
    auto softmax_from = [&](bool grew) {
      return best_short_after(
          [&] {
            std::copy(scores.begin(), scores.end(), s.vec().begin());
            if (grew)
              std::fill(m.begin(), m.end(), -1.0f);
            else
              std::copy(row_max.begin(), row_max.end(), m.begin());
            std::fill(l.begin(), l.end(), 1.0f);
          },
          [&] { ops.softmax_update(bq, bk, bq, bk, dp, s.data(), m.data(), l.data(), acc.data()); },
          reps);
    };
    const double t_soft = softmax_from(false), t_grew = softmax_from(true);
    const double t_probs =
        best_short([&] { ops.probs(bq, bk, bq, bk, lse.data(), s.data()); }, reps);
    const double t_ds =
        best_short([&] { ops.ds(s.data(), delta.data(), 0.1f, bq, bk, c.data()); }, reps);
    std::printf("%-11s %9.1f %9.1f %9.1f | %10.2f %10.2f %10.2f %10.2f\n", t.name, g_qk, g_pv, g_pt,
                t_soft * per_elem, t_grew * per_elem, t_probs * per_elem, t_ds * per_elem);
  }
  std::printf(
      "(GEMM columns: GFLOP/s; p^T do is also ds^T q, the same call on tiles of the same shapes "
      "(A read transposed, B row-major); ns columns: per score of the tile; softmax: the "
      "steady-state step, the running max already at the tile's; max grew: every row's max grew, "
      "acc [bq, D] rescaled)\n");
  return 0;
}

#ifndef LOOM_TORCH_COMPARE
#define LOOM_TORCH_COMPARE "bench/torch_compare.py"
#endif
constexpr int kTorchTimeoutS = 1800;  // one shape of PyTorch eager, forward and backward

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

#ifndef LOOM_GGML_COMPARE
#define LOOM_GGML_COMPARE ""  // not built: no ggml was found (bench/kernels.cmake)
#endif
constexpr int kGgmlTimeoutS = 900;  // one shape of ggml's forward

// Runs `cmd` (a benchmark child, its output to a pipe) under timeout(1), reading what it wrote to
// the JSON file `path`; the child's output is dropped. A child that fails, times out or writes no
// JSON with one row is one error naming `what`, the command and its last output line.
nlohmann::json child_row(const std::string& what, const std::string& cmd, const char* path,
                         int timeout_s) {
  std::fflush(stdout);
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) unlink(path);
  LOOM_CHECK(pipe != nullptr, IoError, what << ": cannot run `" << cmd << "`");
  std::string last;  // the child's last non-empty output line, for the error message
  char buf[4096];
  while (std::fgets(buf, sizeof buf, pipe) != nullptr) {
    std::string line(buf);
    while (!line.empty() && line.back() == '\n') line.pop_back();
    if (!line.empty()) last = line;
  }
  const int st = pclose(pipe);
  const int code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  if (code != 0) {
    unlink(path);
    LOOM_CHECK(false, IoError,
               what << ": `" << cmd << "` "
                    << (code == 124 ? "timed out after " + std::to_string(timeout_s) + " s"
                                    : "exited " + std::to_string(code))
                    << (last.empty() ? "" : ": " + last));
  }
  std::ifstream f(path);
  nlohmann::json tj;
  try {
    tj = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    unlink(path);
    LOOM_CHECK(false, IoError, what << ": `" << cmd << "` wrote no JSON (" << e.what() << ")");
  }
  unlink(path);
  LOOM_CHECK(tj.contains("results") && tj["results"].is_array() && tj["results"].size() == 1,
             IoError, what << ": `" << cmd << "` wrote no row for this shape");
  return tj;
}

// A temporary file for a child's JSON (the child writes it, child_row removes it).
std::string temp_json(const char* what) {
  char path[] = "/tmp/loom_bench_child_XXXXXX";
  const int fd = mkstemp(path);
  LOOM_CHECK(fd >= 0, IoError, what << ": cannot create a temporary file in /tmp");
  close(fd);
  return path;
}

// PyTorch's rows: bench/torch_compare.py's JSON ("results": rows; "torch", "attention": what ran),
// from --torch-json or from each --torch child. Each row is checked for the fields the
// comparison reads and their types before anything is timed: well-formed JSON of another shape
// (a bench_kernels output, {"results": [1, 2]}) aborted the run with nlohmann's type_error.
struct TorchRow {
  std::string dtype;
  int64_t seq_q = 0, seq_k = 0, heads = 0, kv_heads = 0, dim = 0, threads = 0;
  bool causal = false;
  double fwd_s = 0, bwd_s = 0, fwd_gflops = 0, bwd_gflops = 0, gemm_gflops = 0;
};

constexpr const char* kTorchJsonHint = " (write it with bench/torch_compare.py --json)";

// Field `key` of the object j, of type T (a string, a bool, an integer or any number); absent,
// or of another type, is one IoError naming `where` and the key. Optional fields give `fallback`
// where absent.
template <class T>
T torch_field(const nlohmann::json& j, const char* key, const std::string& where,
              const T* fallback = nullptr) {
  const auto it = j.find(key);
  if (it == j.end() && fallback != nullptr) return *fallback;
  const char* kind = "a number";
  bool ok = it != j.end();
  if constexpr (std::is_same_v<T, std::string>) {
    kind = "a string";
    ok = ok && it->is_string();
  } else if constexpr (std::is_same_v<T, bool>) {
    kind = "true or false";
    ok = ok && it->is_boolean();
  } else if constexpr (std::is_integral_v<T>) {
    kind = "an integer";
    ok = ok && it->is_number_integer();
  } else {
    ok = ok && it->is_number();
  }
  LOOM_CHECK(ok, IoError,
             where << ": \"" << key << "\" "
                   << (it == j.end() ? std::string("is missing") : std::string("is not ") + kind)
                   << kTorchJsonHint);
  return it->get<T>();
}

TorchRow torch_row_of(const nlohmann::json& t, const std::string& where) {
  LOOM_CHECK(t.is_object(), IoError, where << " is not an object" << kTorchJsonHint);
  TorchRow r;
  r.dtype = torch_field<std::string>(t, "dtype", where);
  r.seq_q = torch_field<int64_t>(t, "seq_q", where);
  r.seq_k = torch_field<int64_t>(t, "seq_k", where);
  r.heads = torch_field<int64_t>(t, "heads", where);
  // PyTorch runs every head's own k and v (no GQA): a row without kv_heads has as many as heads.
  r.kv_heads = torch_field<int64_t>(t, "kv_heads", where, &r.heads);
  r.dim = torch_field<int64_t>(t, "dim", where);
  r.causal = torch_field<bool>(t, "causal", where);
  r.threads = torch_field<int64_t>(t, "threads", where);
  r.fwd_gflops = torch_field<double>(t, "fwd_gflops", where);
  r.bwd_gflops = torch_field<double>(t, "bwd_gflops", where);
  const double zero = 0;
  r.fwd_s = torch_field<double>(t, "fwd_s", where, &zero);
  r.bwd_s = torch_field<double>(t, "bwd_s", where, &zero);
  r.gemm_gflops = torch_field<double>(t, "gemm_gflops", where, &zero);
  return r;
}

// The rows of a torch_compare.py document (checked as above); `what` names it in messages.
std::vector<TorchRow> torch_rows_of(const nlohmann::json& doc, const std::string& what) {
  LOOM_CHECK(doc.is_object() && doc.contains("results") && doc["results"].is_array(), IoError,
             what << ": no \"results\" array" << kTorchJsonHint);
  // Every torch_compare.py output names the torch version; a bench_kernels output (whose rows
  // have the same fields) has no such string.
  LOOM_CHECK(
      doc.contains("torch") && doc["torch"].is_string(), IoError,
      what << ": no \"torch\" version string, not a torch_compare.py output" << kTorchJsonHint);
  LOOM_CHECK(!doc.contains("attention") || doc["attention"].is_string(), IoError,
             what << ": \"attention\" is not a string" << kTorchJsonHint);
  std::vector<TorchRow> rows;
  for (size_t i = 0; i < doc["results"].size(); ++i)
    rows.push_back(torch_row_of(doc["results"][i], what + ": results[" + std::to_string(i) + "]"));
  return rows;
}

// --torch-json, read and checked before anything is timed (read after the sweep, a missing file
// lost the whole run's results, and a FIFO blocked for ever): a regular file only.
nlohmann::json read_torch_json(const std::string& path) {
  LOOM_CHECK(path != "-", InvalidArgument,
             "--torch-json: give a file (standard input is not read)");
  InputFile f(path, "--torch-json");
  const std::string text = f.read_rest(size_t{256} << 20);
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    LOOM_CHECK(false, IoError, "--torch-json " << path << ": not JSON (" << e.what() << ")");
  }
  torch_rows_of(doc, "--torch-json " + path);
  return doc;
}

// --torch: PyTorch eager on one shape (bench/torch_compare.py in a child process, one thread, reps
// timed calls of each kernel: as many as loom's forward took), right after loom's row of the same
// shape. Returns its JSON row.
nlohmann::json torch_row(const Options& o, int64_t sq, int64_t d, bool causal, size_t reps) {
  const std::string path = temp_json("--torch");
  const std::string cmd =
      "timeout -k 10 " + std::to_string(kTorchTimeoutS) + " " + shell_quote(o.torch_python) + " " +
      shell_quote(LOOM_TORCH_COMPARE) + " --seq " + std::to_string(sq) + " --dim " +
      std::to_string(d) + " --heads " + std::to_string(o.heads) + " --dtype fp32 --threads 1" +
      " --ring 0 --mask " + (causal ? "causal" : "full") + " --reps " + std::to_string(reps) +
      " --gemm-n " + std::to_string(o.gemm_n) + " --json " + shell_quote(path) + " 2>&1";
  const nlohmann::json tj = child_row("--torch", cmd, path.c_str(), kTorchTimeoutS);
  torch_rows_of(tj, "--torch: `" + cmd + "`");  // the fields the comparison reads, checked
  nlohmann::json row = tj["results"][0];
  row["torch"] = tj.value("torch", std::string("?"));
  return row;
}

// ggml's forward on one shape (ggml_compare, where a ggml build was found), fp32 k and v, one
// thread, reps timed calls, right after loom's and PyTorch's rows of the shape. With --kv-heads:
// ggml broadcasts k and v over the query heads as loom does (it was given --heads alone, and its
// row beside a GQA row timed every head's own k and v).
nlohmann::json ggml_row(const Options& o, int64_t sq, int64_t d, bool causal, size_t reps) {
  const std::string path = temp_json("ggml");
  const std::string cmd =
      "timeout -k 10 " + std::to_string(kGgmlTimeoutS) + " " + shell_quote(LOOM_GGML_COMPARE) +
      " --seq " + std::to_string(sq) + " --dim " + std::to_string(d) + " --heads " +
      std::to_string(o.heads) + " --kv-heads " + std::to_string(o.kv_heads) + " --mask " +
      (causal ? "causal" : "full") + " --kv-type fp32" + " --threads 1 --reps " +
      std::to_string(reps) + " --json " + shell_quote(path) + " 2>&1";
  const nlohmann::json gj = child_row("ggml", cmd, path.c_str(), kGgmlTimeoutS);
  nlohmann::json row = gj["results"][0];
  row["ggml"] = gj.value("ggml", std::string("?"));
  row["ggml_commit"] = gj.value("ggml_commit", std::string("?"));
  return row;
}

// Whether o.torch_python can import torch (the default's test for PyTorch's rows; --torch's
// before anything is timed). Where it cannot, *why gets the command's last output line.
bool torch_importable(const Options& o, std::string* why = nullptr) {
  const std::string cmd =
      "timeout -k 5 120 " + shell_quote(o.torch_python) + " -c 'import torch' 2>&1";
  std::fflush(stdout);
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) {
    if (why != nullptr) *why = "cannot run `" + cmd + "`";
    return false;
  }
  std::string last;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, pipe) != nullptr) {
    std::string line(buf);
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
    if (!line.empty()) last = line;
  }
  const int st = pclose(pipe);
  const bool ok = st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0;
  if (!ok && why != nullptr)
    *why = "`" + o.torch_python + " -c 'import torch'` failed" + (last.empty() ? "" : ": " + last);
  return ok;
}

// One row of the table: a loom row, or PyTorch's beneath it (label "torch", its sgemm torch.mm).
// Each kernel's block: its fastest call, its rate, the sgemm beside it and the rate over that.
// bwd_s <= 0: no backward (ggml's rows), printed as dashes.
void print_row(const char* label, int64_t sq, int64_t sk, int64_t heads, int64_t kv_heads,
               int64_t d, bool causal, int threads, double fwd_s, double fwd_gflops,
               double fwd_gemm, double bwd_s, double bwd_gflops, double bwd_gemm) {
  std::printf("%5s %6lld %6lld %3lld %4lld %4lld %6s %3d | %9.1f %8.1f %6.1f %5.2f | ", label,
              static_cast<long long>(sq), static_cast<long long>(sk), static_cast<long long>(heads),
              static_cast<long long>(kv_heads), static_cast<long long>(d),
              causal ? "causal" : "full", threads, fwd_s * 1e3, fwd_gflops, fwd_gemm,
              fwd_gemm > 0 ? fwd_gflops / fwd_gemm : 0.0);
  if (bwd_s > 0)
    std::printf("%9.1f %8.1f %6.1f %5.2f\n", bwd_s * 1e3, bwd_gflops, bwd_gemm,
                bwd_gemm > 0 ? bwd_gflops / bwd_gemm : 0.0);
  else
    std::printf("%9s %8s %6s %5s\n", "-", "-", "-", "-");
  std::fflush(stdout);
}

// Where PyTorch's rows come from, settled before anything is timed: --torch with a Python that
// cannot import torch failed only after loom's first row, and --torch-json was read after the
// whole sweep.
struct TorchPlan {
  bool run = false;     // torch_compare.py right after each fp32 one-thread row
  std::string skipped;  // the default's reason for leaving them out ("": not skipped)
  nlohmann::json file;  // --torch-json's document, checked (null: none)
};

TorchPlan plan_torch(const Options& o) {
  TorchPlan p;
  if (!o.torch_json.empty()) {
    p.file = read_torch_json(o.torch_json);
    return p;
  }
  if (o.no_torch) return p;
  // PyTorch runs every head's own k and v: beside a GQA row it would time other work.
  if (o.kv_heads != o.heads) {
    LOOM_CHECK(!o.torch, InvalidArgument,
               "--torch: PyTorch's rows run every head's own k and v (no GQA), so they need "
               "--kv-heads equal to --heads (got --heads "
                   << o.heads << " --kv-heads " << o.kv_heads << ")");
    p.skipped = "PyTorch runs every head's own k and v (no GQA), and --kv-heads " +
                std::to_string(o.kv_heads) + " is not --heads " + std::to_string(o.heads);
    return p;
  }
  std::string why;
  p.run = torch_importable(o, &why);
  LOOM_CHECK(p.run || !o.torch, IoError, "--torch: " << why);
  if (!p.run)
    p.skipped = o.torch_python +
                " cannot import torch; --torch-python names a Python that can, --no-torch leaves "
                "them out";
  return p;
}

// The PyTorch row of loom's row r's shape: the same dtype, queries, keys, heads, kv heads, head
// dim, mask and threads (a row of one head was once judged against loom's eight as "the same
// shape"); nullptr where there is none.
const TorchRow* torch_match(const std::vector<TorchRow>& rows, const Row& r) {
  for (const TorchRow& t : rows)
    if (t.dtype == r.dtype && t.seq_q == r.sq && t.seq_k == r.sk && t.heads == r.heads &&
        t.kv_heads == r.kv_heads && t.dim == r.dim && t.causal == r.causal &&
        t.threads == r.threads)
      return &t;
  return nullptr;
}

// Whether two PyTorch rows are of one shape (the fields torch_match compares).
bool same_torch_shape(const TorchRow& a, const TorchRow& b) {
  return a.dtype == b.dtype && a.seq_q == b.seq_q && a.seq_k == b.seq_k && a.heads == b.heads &&
         a.kv_heads == b.kv_heads && a.dim == b.dim && a.causal == b.causal &&
         a.threads == b.threads;
}

std::string shape_tag(const std::string& dtype, int64_t sq, int64_t sk, int64_t heads,
                      int64_t kv_heads, int64_t dim, bool causal, int64_t threads) {
  return " " + dtype + " Sq=" + std::to_string(sq) + (sk != sq ? " Sk=" + std::to_string(sk) : "") +
         " H=" + std::to_string(heads) +
         (kv_heads != heads ? " Hkv=" + std::to_string(kv_heads) : "") +
         " D=" + std::to_string(dim) + (causal ? " causal" : " full") + " " +
         std::to_string(threads) + " thr";
}

int run(const Options& o, const TorchPlan& tp) {
  const int all = o.threads > 0 ? o.threads : omp_get_max_threads();
  std::vector<int> thread_counts = {1};
  if (all > 1) thread_counts.push_back(all);
  nlohmann::json doc;
  doc["gemm"] = gemm_doc(o);
  doc["block"] = {o.block_q, o.block_k};

  if (!run_check(o, {false, true}, thread_counts, doc)) return 1;

  {
    std::string all;
    for (const kernels::KernelTarget& t : kernels::kernel_targets())
      all +=
          std::string(all.empty() ? "" : ", ") + t.name + (t.runnable ? "" : " (not on this CPU)");
    std::printf("kernel path: %s (LOOM_KERNEL = auto | portable | %s)\n", kernel_path(),
                all.c_str());
  }
  std::printf(
      "sgemm: %s, M = N = K = %lld, with the row's threads, in windows as long as one kernel call "
      "between each kernel's timed calls; the kernel's fastest window, and /gemm its fastest call "
      "over that\n",
      gemm_description().c_str(), static_cast<long long>(o.gemm_n));
  const bool torch = tp.run;
  if (!tp.skipped.empty()) std::printf("PyTorch rows: skipped (%s)\n", tp.skipped.c_str());
  if (torch)
    std::printf("PyTorch rows: %s %s on each fp32 one-thread shape, right after loom's row\n",
                o.torch_python.c_str(), LOOM_TORCH_COMPARE);
  const bool ggml = LOOM_GGML_COMPARE[0] != '\0' && !o.no_ggml;
  if (ggml)
    std::printf(
        "ggml rows: %s (ggml_flash_attn_ext, fp32 k and v, forward only) on each fp32 one-thread "
        "shape after loom's row; its sgemm column is loom's forward's\n",
        LOOM_GGML_COMPARE);
  else
    std::printf("ggml rows: %s\n",
                LOOM_GGML_COMPARE[0] == '\0'
                    ? "not built (no ggml found: -DLOOM_GGML_DIR, bench/kernels.cmake)"
                    : "left out (--no-ggml)");
  std::printf("\n%5s %6s %6s %3s %4s %4s %6s %3s | %9s %8s %6s %5s | %9s %8s %6s %5s\n", "dtype",
              "Sq", "Sk", "H", "Hkv", "D", "mask", "thr", "fwd ms", "GFLOP/s", "sgemm", "/gemm",
              "bwd ms", "GFLOP/s", "sgemm", "/gemm");
  nlohmann::json rows = nlohmann::json::array();
  nlohmann::json torch_rows = nlohmann::json::array();  // --torch
  nlohmann::json ggml_rows = nlohmann::json::array();
  std::vector<Row> done;
  auto measure = [&](const std::string& dtype, int64_t sq, int64_t sk, int64_t d, bool causal,
                     int threads) {
    const Row r = run_shape(o, dtype, sq, sk, d, causal, threads);
    print_row(r.dtype.c_str(), r.sq, r.sk, r.heads, r.kv_heads, r.dim, r.causal, r.threads,
              r.fwd.best_s(), r.fwd_gflops(), r.fwd_gemm(), r.bwd.best_s(), r.bwd_gflops(),
              r.bwd_gemm());
    rows.push_back({{"dtype", r.dtype},
                    {"seq_q", r.sq},
                    {"seq_k", r.sk},
                    {"heads", r.heads},
                    {"kv_heads", r.kv_heads},
                    {"dim", r.dim},
                    {"causal", r.causal},
                    {"threads", r.threads},
                    {"visible_pairs", r.visible_pairs},
                    {"fwd_s", r.fwd.best_s()},
                    {"bwd_s", r.bwd.best_s()},
                    {"fwd_gflops", r.fwd_gflops()},
                    {"bwd_gflops", r.bwd_gflops()},
                    {"gemm_gflops", r.gemm_gflops()},
                    {"fwd_gemm_gflops", r.fwd_gemm()},
                    {"bwd_gemm_gflops", r.bwd_gemm()},
                    {"fwd_ratio", r.fwd_ratio()},
                    {"bwd_ratio", r.bwd_ratio()},
                    {"fwd_calls_s", r.fwd.call_s},
                    {"fwd_sgemm", r.fwd.sgemm},
                    {"bwd_calls_s", r.bwd.call_s},
                    {"bwd_sgemm", r.bwd.sgemm}});
    done.push_back(r);
    if (torch && threads == 1 && dtype == "fp32") {
      const nlohmann::json t = torch_row(o, sq, d, causal, r.fwd.call_s.size());
      const TorchRow tr = torch_row_of(t, "--torch");  // checked by torch_row
      print_row("torch", sq, sk, tr.heads, tr.kv_heads, d, causal, threads, tr.fwd_s, tr.fwd_gflops,
                tr.gemm_gflops, tr.bwd_s, tr.bwd_gflops, tr.gemm_gflops);
      torch_rows.push_back(t);
    }
    if (ggml && threads == 1 && dtype == "fp32") {
      nlohmann::json g = ggml_row(o, sq, d, causal, r.fwd.call_s.size());
      const double gf = g.value("fwd_gflops", 0.0);
      g["loom_over_ggml_fwd"] = gf > 0 ? r.fwd_gflops() / gf : 0.0;
      print_row("ggml", sq, sk, o.heads, o.kv_heads, d, causal, threads, g.value("fwd_s", 0.0), gf,
                r.fwd_gemm(), 0.0, 0.0, 0.0);
      ggml_rows.push_back(g);
    }
  };
  // The dtypes of a shape in consecutive rows: the bf16 / fp32 lines divide rows a minute apart,
  // not the length of the sweep.
  for (int64_t s : o.seqs)
    for (int64_t d : o.dims)
      for (bool causal : {false, true})
        for (const std::string& dtype : o.dtypes)
          for (int threads : thread_counts) measure(dtype, s, s, d, causal, threads);
  // Ring-step size: one shard's queries against one KV block (a later, unmasked ring step). A
  // --ring equal to a --seq is that sequence's full one-thread rows, timed above: timed again,
  // its rows printed twice and every loom / torch target line of the shape twice, with two
  // values under one name.
  const bool ring_timed = std::find(o.seqs.begin(), o.seqs.end(), o.ring) != o.seqs.end();
  if (o.ring > 0 && ring_timed)
    std::printf(
        "# --ring %lld: the full-mask one-thread rows of --seq %lld above (not timed "
        "twice)\n",
        static_cast<long long>(o.ring), static_cast<long long>(o.ring));
  else if (o.ring > 0)
    for (int64_t d : o.dims)
      for (const std::string& dtype : o.dtypes) measure(dtype, o.ring, o.ring, d, false, 1);

  // The targets as ratios of rows of this run: kernel rates over the sgemm windows among
  // their calls (the rows' ratios), and rows' ratios over each other. The run's best and worst
  // sgemm are printed beside them: on a shared machine the rate drifts by 20-30 % from minute to
  // minute, and a ratio of measurements minutes apart mostly measures that.
  std::map<int, double> best_gemm, worst_gemm;
  for (const Row& r : done) {
    best_gemm[r.threads] = std::max(best_gemm[r.threads], r.gemm_gflops());
    worst_gemm[r.threads] = worst_gemm.count(r.threads)
                                ? std::min(worst_gemm[r.threads], r.gemm_gflops())
                                : r.gemm_gflops();
  }
  std::printf("\nsgemm of the run's rows (each row's fastest window), worst - best:");
  for (const auto& [threads, g] : best_gemm)
    std::printf(" %.1f - %.1f GFLOP/s (%d thr)", worst_gemm[threads], g, threads);
  std::printf("\n");
  if (best_gemm.size() >= 2) {  // how much N threads could add on this machine right now
    // The sgemm scales nearly N-fold on N idle cores: below 0.95 N (1.9 at two threads) the run
    // did not have them (it named two threads whatever N was).
    const int n = best_gemm.rbegin()->first;
    std::printf(
        "sgemm scaling of the run: %.2f x (%d thr / 1 thr); below ~%.3g the run did not have %d "
        "idle cores (other work, or fewer cores) and the %d-thread rows do not measure loom's "
        "scaling (their lines divide rows a minute or more apart: --thread-scaling R times both "
        "thread counts side by side, beside the sgemm's)\n",
        best_gemm.rbegin()->second / best_gemm.begin()->second, n, 0.95 * n, n, n);
  }
  doc["best_sgemm"] = nlohmann::json::object();
  for (const auto& [threads, g] : best_gemm) doc["best_sgemm"][std::to_string(threads)] = g;
  doc["worst_sgemm"] = nlohmann::json::object();
  for (const auto& [threads, g] : worst_gemm) doc["worst_sgemm"][std::to_string(threads)] = g;
  auto find = [&](const std::string& dtype, int64_t sq, int64_t d, bool causal,
                  int threads) -> const Row* {
    for (const Row& r : done)
      if (r.dtype == dtype && r.sq == sq && r.dim == d && r.causal == causal &&
          r.threads == threads)
        return &r;
    return nullptr;
  };
  nlohmann::json targets = nlohmann::json::array();
  auto target = [&](const std::string& what, double value, double goal, Basis basis) {
    print_target(targets, what, value, goal, basis);
  };
  auto unmeasured = [&](const std::string& what, double goal, const std::string& needs) {
    print_unmeasured(targets, what, goal, needs);
  };
  // Issue 10's targets for the path this run took: the AVX-512 ones on avx512 / avx512bf16 / amx,
  // the AVX2+FMA ones otherwise (on sse4, ssse3 and scalar for reference: the issue sets none
  // there). A line whose rows this run did not measure is printed as such, with what it needs.
  const std::string path = kernel_path();
  const bool avx512 = avx512_path(path);
  print_targets_header(path, "from the rows above", doc);
  doc["target_bases"] =
      print_bases({Basis::kGemmRatio, Basis::kGemmRatioQuotient, Basis::kGflopsQuotient});
  // Two 1-thread rows over each other, each over its own sgemm windows (fwd_ratio / bwd_ratio):
  // the rows ran a minute or more apart, and the machine's speed drifts by more than the targets'
  // margins in that time; the 2-thread / 1-thread targets stay raw (a second thread is what they
  // measure).
  auto rel_fwd = [](const Row& a, const Row& b) { return a.fwd_ratio() / b.fwd_ratio(); };
  auto rel_bwd = [](const Row& a, const Row& b) { return a.bwd_ratio() / b.bwd_ratio(); };
  const bool has_fp32 = std::count(o.dtypes.begin(), o.dtypes.end(), "fp32") > 0;
  const bool has_bf16 = std::count(o.dtypes.begin(), o.dtypes.end(), "bf16") > 0;
  const bool has64 = std::count(o.dims.begin(), o.dims.end(), 64) > 0;
  const bool has128 = std::count(o.dims.begin(), o.dims.end(), 128) > 0;
  const int64_t big = o.seqs.back();
  const std::string tb = " S=" + std::to_string(big);
  if (!has128) {  // the issue sets the sgemm lines at D = 128
    const std::string tag = tb + " D=128";
    unmeasured("fp32 fwd / row's sgemm, full, 1 thr," + tag, avx512 ? 0.85 : 0.80,
               "--dim 128" + std::string(has_fp32 ? "" : " and --dtype fp32"));
    unmeasured("fp32 bwd / row's sgemm, full, 1 thr," + tag, avx512 ? 0.70 : 0.65,
               "--dim 128" + std::string(has_fp32 ? "" : " and --dtype fp32"));
  }
  for (int64_t d : o.dims) {
    const std::string tag = tb + " D=" + std::to_string(d);
    const Row* full = find("fp32", big, d, false, 1);
    const Row* causal = find("fp32", big, d, true, 1);
    if (d == 128) {  // the issue sets these at D = 128; D = 64 is judged against it below
      const std::string f = "fp32 fwd / row's sgemm, full, 1 thr," + tag;
      const std::string b = "fp32 bwd / row's sgemm, full, 1 thr," + tag;
      if (full) {
        target(f, full->fwd_ratio(), avx512 ? 0.85 : 0.80, Basis::kGemmRatio);
        target(b, full->bwd_ratio(), avx512 ? 0.70 : 0.65, Basis::kGemmRatio);
      } else {
        unmeasured(f, avx512 ? 0.85 : 0.80, "--dtype fp32");
        unmeasured(b, avx512 ? 0.70 : 0.65, "--dtype fp32");
      }
    }
    if (!avx512) {
      const std::string f = "fp32 causal fwd useful rate / full, 1 thr," + tag;
      const std::string b = "fp32 causal bwd useful rate / full, 1 thr," + tag;
      if (full && causal) {
        target(f, rel_fwd(*causal, *full), 0.85, Basis::kGemmRatioQuotient);
        target(b, rel_bwd(*causal, *full), 0.85, Basis::kGemmRatioQuotient);
      } else {
        unmeasured(f, 0.85, "--dtype fp32");
        unmeasured(b, 0.85, "--dtype fp32");
      }
    }
    for (const std::string& dtype : o.dtypes) {
      const Row* one = find(dtype, big, d, false, 1);
      if (!avx512) {  // issue 10's two-thread target is for 2 threads, not for every count
        const Row* two = find(dtype, big, d, false, 2);
        const std::string f = dtype + " fwd 2 thr / 1 thr, full," + tag;
        const std::string b = dtype + " bwd 2 thr / 1 thr, full," + tag;
        if (one && two) {
          target(f, two->fwd_gflops() / one->fwd_gflops(), 1.85, Basis::kGflopsQuotient);
          target(b, two->bwd_gflops() / one->bwd_gflops(), 1.85, Basis::kGflopsQuotient);
        } else {
          std::string needs = "--threads 2";
          if (all > 2)
            needs += " (this run's all-threads rows ran " + std::to_string(all) + " threads)";
          else if (o.threads == 0)
            needs += " (OpenMP's default here is 1 thread)";
          unmeasured(f, 1.85, needs);
          unmeasured(b, 1.85, needs);
        }
      }
      if (!avx512) {
        const Row* ring = o.ring > 0 ? find(dtype, o.ring, d, false, 1) : nullptr;
        const int64_t rs = o.ring > 0 ? o.ring : 512;  // --ring 0: named as the default's
        const std::string rt = " " + std::to_string(rs) + "x" + std::to_string(rs) +
                               " / S=" + std::to_string(big) + ", D=" + std::to_string(d);
        const std::string f = dtype + " ring-step fwd," + rt;
        const std::string b = dtype + " ring-step bwd," + rt;
        if (one && ring && o.ring != big) {
          target(f, rel_fwd(*ring, *one), 0.80, Basis::kGemmRatioQuotient);
          target(b, rel_bwd(*ring, *one), 0.80, Basis::kGemmRatioQuotient);
        } else {
          const std::string needs = o.ring > 0 ? "--ring other than the last --seq"
                                               : "--ring 512 (--ring 0 timed no ring-step rows)";
          unmeasured(f, 0.80, needs);
          unmeasured(b, 0.80, needs);
        }
      }
    }
    const Row* b16 = find("bf16", big, d, false, 1);
    {
      const std::string f = "bf16 fwd / fp32 fwd, full, 1 thr," + tag;
      const std::string b = "bf16 bwd / fp32 bwd, full, 1 thr," + tag;
      if (full && b16) {
        target(f, rel_fwd(*b16, *full), avx512 ? 1.6 : 0.95, Basis::kGemmRatioQuotient);
        target(b, rel_bwd(*b16, *full), avx512 ? 1.3 : 0.95, Basis::kGemmRatioQuotient);
      } else {
        const std::string needs = std::string("--dtype fp32 bf16") + (has_fp32   ? " (no bf16 rows)"
                                                                      : has_bf16 ? " (no fp32 rows)"
                                                                                 : "");
        unmeasured(f, avx512 ? 1.6 : 0.95, needs);
        unmeasured(b, avx512 ? 1.3 : 0.95, needs);
      }
    }
  }
  if (!avx512) {  // "D = 64: within 15 % of D = 128"
    const Row* small = find("fp32", big, 64, false, 1);
    const Row* large = find("fp32", big, 128, false, 1);
    const std::string tag = ", full, 1 thr, D=64 / D=128";
    if (small && large) {
      target("fp32 fwd" + tag, rel_fwd(*small, *large), 0.85, Basis::kGemmRatioQuotient);
      target("fp32 bwd" + tag, rel_bwd(*small, *large), 0.85, Basis::kGemmRatioQuotient);
    } else {
      const std::string needs = std::string("--dim 64 128") + (has_fp32 ? "" : " and --dtype fp32");
      unmeasured("fp32 fwd" + tag, 0.85, (has64 && has128) ? "--dtype fp32" : needs);
      unmeasured("fp32 bwd" + tag, 0.85, (has64 && has128) ? "--dtype fp32" : needs);
    }
  }
  // PyTorch eager on the same shapes: its rows of this run (each right after loom's; the default
  // where torch imports, or --torch) or --torch-json (bench/torch_compare.py --json, an earlier
  // run on the same machine). Each loom row is compared with the PyTorch row of its exact shape;
  // a loom row without one, or with one of no positive rate, is "not measured", never a verdict.
  nlohmann::json tj;
  std::string torch_source;
  if (torch) {
    tj["results"] = torch_rows;
    tj["torch"] = torch_rows.empty() ? std::string("?") : torch_rows[0].value("torch", "?");
    tj["attention"] = torch_rows.empty() ? std::string("?") : torch_rows[0].value("attention", "?");
    torch_source = "each PyTorch row right after loom's, this run";
  } else if (!tp.file.is_null()) {
    tj = tp.file;
    torch_source = o.torch_json;
  }
  const std::vector<TorchRow> trows =  // checked already: by torch_row, or read_torch_json
      tj.is_null()
          ? std::vector<TorchRow>()
          : torch_rows_of(tj, torch ? std::string("--torch") : "--torch-json " + o.torch_json);
  if (!tj.is_null()) {
    // A file written before torch_compare.py named its attention timed the textbook formulation.
    const std::string tv = tj.value("torch", std::string("?"));
    const std::string ta = tj.value("attention", std::string("unnamed: the textbook formulation"));
    std::printf("\nloom / PyTorch %s eager, %s (%s), rows of the same shape:\n", tv.c_str(),
                ta.c_str(), torch_source.c_str());
    doc["torch"] = tj;
    for (size_t i = 0; i < trows.size(); ++i) {
      const TorchRow& t = trows[i];
      const std::string tag =
          shape_tag(t.dtype, t.seq_q, t.seq_k, t.heads, t.kv_heads, t.dim, t.causal, t.threads);
      // A row of the shape of an earlier one (a file that repeats a row, or joins two runs):
      // loom's row is compared with the first only, and this one said to be ignored (it was "no
      // loom row of this shape" beside the loom row of that very shape).
      size_t first = 0;
      while (first < i && !same_torch_shape(trows[first], t)) ++first;
      bool matched = false;
      for (const Row& r : done) matched = matched || torch_match(trows, r) == &t;
      if (first < i)
        std::printf(
            "  torch%s: fwd %.1f, bwd %.1f GFLOP/s: a repeated row (results[%zu] has this shape; "
            "only "
            "the first of a shape is used), ignored\n",
            tag.c_str(), t.fwd_gflops, t.bwd_gflops, first);
      else if (!matched)
        std::printf(
            "  torch%s: fwd %.1f, bwd %.1f GFLOP/s: no loom row of this shape in this "
            "run, compared with nothing\n",
            tag.c_str(), t.fwd_gflops, t.bwd_gflops);
      else if (!(t.fwd_gflops > 0 && t.bwd_gflops > 0))  // once skipped without a word
        std::printf(
            "  torch%s: fwd %.1f, bwd %.1f GFLOP/s (a rate that is not positive measured "
            "nothing: no verdict over it)\n",
            tag.c_str(), t.fwd_gflops, t.bwd_gflops);
      else
        std::printf("  torch%s: fwd %.1f, bwd %.1f GFLOP/s\n", tag.c_str(), t.fwd_gflops,
                    t.bwd_gflops);
    }
  }
  // The loom / torch targets: on the fp32 one-thread rows of the last --seq (not the ring rows).
  for (const Row& r : done) {
    if (r.sq != big || r.sk != big || r.threads != 1 || r.dtype != "fp32") continue;
    const std::string tag =
        shape_tag(r.dtype, r.sq, r.sk, r.heads, r.kv_heads, r.dim, r.causal, r.threads);
    const TorchRow* t = torch_match(trows, r);
    std::vector<std::pair<const char*, double>> kinds = {{"fwd", r.causal ? 5.0 : 2.5}};
    if (!r.causal) kinds.push_back({"bwd", 1.5});
    for (const auto& [kind, goal] : kinds) {
      const std::string what = std::string("loom / torch ") + kind + "," + tag;
      const bool fwd = std::string(kind) == "fwd";
      const double trate = t == nullptr ? 0.0 : fwd ? t->fwd_gflops : t->bwd_gflops;
      if (t != nullptr && trate > 0)
        target(what, (fwd ? r.fwd_gflops() : r.bwd_gflops()) / trate, goal, Basis::kGflopsQuotient);
      else if (t != nullptr)
        unmeasured(what, goal,
                   "a PyTorch row with a positive rate (its row of this shape has none)");
      else if (tj.is_null())
        unmeasured(what, goal,
                   "PyTorch's rows (" +
                       (tp.skipped.empty() ? std::string("--torch or --torch-json")
                                           : "skipped: " + tp.skipped) +
                       ")");
      else if (r.kv_heads != r.heads)  // PyTorch's rows run every head's own k and v
        unmeasured(
            what, goal,
            "--kv-heads equal to --heads (PyTorch runs no GQA: it has no row of --kv-heads " +
                std::to_string(r.kv_heads) + " below --heads " + std::to_string(r.heads) + ")");
      else
        unmeasured(what, goal, "a PyTorch row of this shape (there is none)");
    }
  }
  // ggml's rows: loom's forward over ggml's on each shape (no target: the issue names none).
  if (!ggml_rows.empty()) {
    std::printf("\nloom / ggml %s (ggml_flash_attn_ext, forward), same shapes:\n",
                ggml_rows[0].value("ggml", std::string("?")).c_str());
    for (const auto& g : ggml_rows)
      std::printf(
          "  fp32 Sq=%lld H=%lld Hkv=%lld D=%lld %s 1 thr: ggml %.1f GFLOP/s, loom / ggml "
          "%.2f\n",
          static_cast<long long>(g.value("seq", int64_t{0})),
          static_cast<long long>(g.value("heads", int64_t{0})),
          static_cast<long long>(g.value("kv_heads", int64_t{0})),
          static_cast<long long>(g.value("dim", int64_t{0})),
          g.value("mask", std::string()).c_str(), g.value("fwd_gflops", 0.0),
          g.value("loom_over_ggml_fwd", 0.0));
    doc["ggml"] = ggml_rows;
  }
  doc["targets"] = targets;
  if (g_cpu_time) doc["timing"] = "process CPU time for 1-thread rows (--cpu-time)";
  doc["kernel_path"] = kernel_path();
  doc["results"] = rows;
  if (!o.json.empty()) write_output(o.json, doc.dump(2) + "\n");
  return 0;
}

// ---------------------------------------------------------------------------------------------
// --thread-scaling R: does a second thread speed the kernels up as far as this machine lets
// anything speed up right now? The sweep's "2 thr / 1 thr" lines divide rows timed a minute or more
// apart, on VMs whose speed drifts by 10-25 % from minute to minute and whose second core is at
// times busy with other work (their own sgemm's 2-thread / 1-thread read 1.48 to 1.96 between
// sessions). Here each dtype and D of the sweep (S = the last --seq, full mask) runs R rounds of
//   sgemm window (1 thread), call (1 thread), sgemm window (N threads), call (N threads),
// the four in reverse order on odd rounds (a steady drift then favours neither count), each window
// as long as the untimed warm-up call of its thread count. A round gives the kernel's scaling
// t1 / tN and the sgemm's gN / g1 from the same seconds, and their quotient: the kernel's scaling
// over the machine's. Printed: each kernel's medians and ranges over the rounds, and with N = 2,
// issue 10's two-thread target (>= 1.85) against the kernel's median (its AVX2 list; the AVX-512
// one has none).
struct ScalingRound {
  double t1 = 0, tn = 0;  // kernel call, seconds: 1 thread, N threads
  double g1 = 0, gn = 0;  // sgemm windows, GFLOP/s
  double loom() const { return t1 / tn; }
  double sgemm() const { return gn / g1; }
};

// R rounds of call(threads) at 1 and n threads beside sgemm windows of each count (above).
template <class F>
std::vector<ScalingRound> time_scaling(F&& call, int rounds, int n, int64_t gemm_n) {
  // OpenMP's and OpenBLAS's workers spin for a while after a parallel call; on a machine with few
  // cores they would slow whatever runs next. A pause (untimed) after each item lets them go idle.
  auto pause = [] { std::this_thread::sleep_for(std::chrono::milliseconds(200)); };
  auto timed = [&](int threads) {
    Stopwatch sw;
    call(threads);
    const double t = sw.elapsed_s();
    pause();
    return t;
  };
  SgemmWindow w1(gemm_n, 1, timed(1)), wn(gemm_n, n, timed(n));
  pause();
  auto window = [&](SgemmWindow& w) {
    const double g = w.gflops();
    pause();
    return g;
  };
  std::vector<ScalingRound> out(static_cast<size_t>(rounds));
  for (int i = 0; i < rounds; ++i) {
    ScalingRound& r = out[static_cast<size_t>(i)];
    if (i % 2 == 0) {
      r.g1 = window(w1), r.t1 = timed(1), r.gn = window(wn), r.tn = timed(n);
    } else {
      r.tn = timed(n), r.gn = window(wn), r.t1 = timed(1), r.g1 = window(w1);
    }
  }
  return out;
}

int run_thread_scaling(const Options& o) {
  const int n = o.threads > 0 ? o.threads : omp_get_max_threads();
  LOOM_CHECK(n >= 2, InvalidArgument,
             "--thread-scaling compares 1 thread with N >= 2, but --threads gives "
                 << n << (o.threads > 0 ? "" : " (OpenMP's default on this machine)"));
  nlohmann::json doc;
  doc["gemm"] = gemm_doc(o);
  if (!run_check(o, {false}, {1, n}, doc)) return 1;
  const int64_t s = o.seqs.back();
  const std::string path = kernel_path();
  std::printf(
      "thread scaling, %s path: %d rounds of [sgemm 1 thr, call 1 thr, sgemm %d thr, call %d thr] "
      "(reversed on odd rounds), S=%lld H=%lld Hkv=%lld, full mask; sgemm %s, M = N = K = %lld\n",
      path.c_str(), o.thread_scaling, n, n, static_cast<long long>(s),
      static_cast<long long>(o.heads), static_cast<long long>(o.kv_heads),
      gemm_description().c_str(), static_cast<long long>(o.gemm_n));
  const std::string ratio = std::to_string(n) + "/1 median (range)";
  std::printf("\n%5s %4s %4s | %-22s | %-22s | %-22s\n", "dtype", "D", "",
              ("loom " + ratio).c_str(), ("sgemm " + ratio).c_str(), "loom / sgemm (range)");
  nlohmann::json results = nlohmann::json::array();
  struct Line {
    std::string what;
    double value;
  };
  std::vector<Line> lines;
  for (const std::string& dtype : o.dtypes)
    for (int64_t d : o.dims) {
      auto measure = [&](auto& problem) {
        for (const bool fwd : {true, false}) {  // the forward's rounds leave its out for delta
          const char* kernel = fwd ? "fwd" : "bwd";
          if (!fwd) problem.prepare_backward();
          const std::vector<ScalingRound> rounds = time_scaling(
              [&](int threads) {
                if (fwd)
                  problem.forward(threads);
                else
                  problem.backward(threads);
              },
              o.thread_scaling, n, o.gemm_n);
          std::vector<double> lo, sg, q;
          nlohmann::json jr = nlohmann::json::array();
          for (const ScalingRound& r : rounds) {
            lo.push_back(r.loom());
            sg.push_back(r.sgemm());
            q.push_back(r.loom() / r.sgemm());
            jr.push_back({{"t1_s", r.t1}, {"tn_s", r.tn}, {"sgemm1", r.g1}, {"sgemmn", r.gn}});
          }
          auto cell = [](const std::vector<double>& x) {
            char buf[64];
            std::snprintf(buf, sizeof buf, "%.2f (%.2f-%.2f)", median(x),
                          *std::min_element(x.begin(), x.end()),
                          *std::max_element(x.begin(), x.end()));
            return std::string(buf);
          };
          std::printf("%5s %4lld %4s | %-22s | %-22s | %-22s\n", dtype.c_str(),
                      static_cast<long long>(d), kernel, cell(lo).c_str(), cell(sg).c_str(),
                      cell(q).c_str());
          std::fflush(stdout);
          results.push_back({{"dtype", dtype},
                             {"seq", s},
                             {"dim", d},
                             {"heads", o.heads},
                             {"kv_heads", o.kv_heads},
                             {"kernel", kernel},
                             {"threads", n},
                             {"rounds", jr},
                             {"loom_median", median(lo)},
                             {"sgemm_median", median(sg)},
                             {"quotient_median", median(q)}});
          lines.push_back({dtype + " " + kernel + " 2 thr / 1 thr, paired median, full, S=" +
                               std::to_string(s) + " D=" + std::to_string(d),
                           median(lo)});
        }
      };
      if (dtype == "bf16") {
        Problem<bf16> p(o, s, s, d, false);
        measure(p);
      } else {
        Problem<float> p(o, s, s, d, false);
        measure(p);
      }
    }
  // Issue 10's two-thread target (>= 1.85 x one thread) is for two threads: another count's
  // medians are in the table above, without a verdict.
  nlohmann::json targets = nlohmann::json::array();
  if (!avx512_path(path)) {
    print_targets_header(path, "loom's median over the rounds", doc);
    doc["target_bases"] = print_bases({Basis::kPairedMedian});
    for (const Line& l : lines) {
      if (n == 2)
        print_target(targets, l.what, l.value, 1.85, Basis::kPairedMedian);
      else
        print_unmeasured(targets, l.what, 1.85,
                         "--threads 2 (this run timed " + std::to_string(n) +
                             " threads: its medians above are not judged)");
    }
  }
  std::printf(
      "(loom / sgemm near 1 or above: the kernels scale as far as the machine did in the same "
      "seconds)\n");
  doc["kernel_path"] = path;
  doc["thread_scaling"] = {{"rounds", o.thread_scaling}, {"threads", n}, {"results", results}};
  doc["targets"] = targets;
  if (!o.json.empty()) write_output(o.json, doc.dump(2) + "\n");
  return 0;
}
}  // namespace
}  // namespace loom

int main(int argc, char** argv) {
  loom::Options o;
  CLI::App app{"bench_kernels: blockwise attention GFLOP/s next to the measured sgemm rate"};
  // Every value is checked here, before anything runs: --seq -5 aborted (std::length_error),
  // --gemm-n 0 printed "inf: met" for every target over it, --dtype fp16 ran fp32 rows labelled
  // fp32, and --json onto a directory failed after the whole sweep.
  const CLI::Range kSeq(int64_t{1}, int64_t{1} << 22), kDim(int64_t{1}, int64_t{loom::kMaxHeadDim});
  const CLI::Range kCount(int64_t{1}, int64_t{1} << 16), kBlock(int64_t{1}, int64_t{4096});
  app.add_option("--seq", o.seqs, "sequence lengths")
      ->delimiter(',')
      ->check(kSeq)
      ->capture_default_str();
  app.add_option("--dim", o.dims, "head dims")->delimiter(',')->check(kDim)->capture_default_str();
  app.add_option("--dtype", o.dtypes, "storage types: fp32, bf16")
      ->delimiter(',')
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  app.add_option("--ring", o.ring, "ring-step rows: queries = keys = this, full mask (0: none)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 22))
      ->capture_default_str();
  app.add_option("--heads", o.heads, "query heads")->check(kCount)->capture_default_str();
  app.add_option("--kv-heads", o.kv_heads, "kv heads (divides --heads)")
      ->check(kCount)
      ->capture_default_str();
  app.add_option("--block-q", o.block_q, "tile rows")->check(kBlock)->capture_default_str();
  app.add_option("--block-k", o.block_k, "tile columns")->check(kBlock)->capture_default_str();
  app.add_option("--threads", o.threads, "threads of the 'all threads' rows (0: OpenMP default)")
      ->check(CLI::Range(0, 1024))
      ->capture_default_str();
  app.add_option("--gemm-n", o.gemm_n, "sgemm size (M = N = K)")
      ->check(CLI::Range(int64_t{16}, int64_t{16384}))
      ->capture_default_str();
  app.add_option("--min-time", o.min_time, "seconds of repetitions per measurement")
      ->check(CLI::Range(1e-3, 3600.0))
      ->capture_default_str();
  app.add_flag("--no-check", o.no_check,
               "skip the check of every timed configuration against the fp64 reference");
  auto* torch_json = app.add_option(
      "--torch-json", o.torch_json,
      "bench/torch_compare.py --json output on the same shapes: adds the PyTorch ratios (read "
      "before anything is timed; rows match loom's by dtype, Sq, Sk, H, Hkv, D, mask and threads)");
  auto* torch_flag =
      app.add_flag("--torch", o.torch,
                   "require PyTorch eager (bench/torch_compare.py) on each fp32 one-thread shape "
                   "right after loom's row, the PyTorch ratios from the same minute (the default "
                   "where --torch-python can import torch)")
          ->excludes("--torch-json");
  app.add_flag("--no-torch", o.no_torch, "leave PyTorch's rows out")
      ->excludes(torch_flag)
      ->excludes(torch_json);
  app.add_flag("--no-ggml", o.no_ggml,
               "leave ggml's rows out (they run where ggml_compare was built: -DLOOM_GGML_DIR)");
  app.add_option("--torch-python", o.torch_python,
                 "the Python with torch (default /usr/bin/python3; not with --no-torch or "
                 "--torch-json, which run no Python)")
      ->excludes("--no-torch")
      ->excludes(torch_json);
  auto* cpu_time =
      app.add_flag("--cpu-time", loom::g_cpu_time,
                   "time one-thread rows by the process CPU clock (for loaded machines)");
  // The modes other than the sweep ignore what they do not print: a combination one of them
  // would ignore is refused (--tile-ops --sgemm-window ran only the sgemm, and --json beside
  // either wrote nothing and left a stale file in place).
  auto* tile_ops =
      app.add_flag("--tile-ops", o.tile_ops,
                   "time the tile operations of every runnable target on one work tile instead "
                   "(wall clock; no JSON)")
          ->excludes(cpu_time)
          ->excludes(torch_flag)
          ->excludes(torch_json);
  auto* sgemm_window =
      app.add_option(
             "--sgemm-window", o.sgemm_window,
             "only print the one-thread sgemm rate over windows of back-to-back calls this "
             "many seconds long (to set beside a `loom attn` run of calls as long; no JSON)")
          ->check(CLI::Range(1e-3, 3600.0))
          ->excludes(tile_ops)
          ->excludes(torch_flag)
          ->excludes(torch_json);
  app.add_option("--thread-scaling", o.thread_scaling,
                 "instead of the sweep: this many rounds of each kernel at 1 and --threads threads "
                 "side by side with sgemm windows of both counts (loom's scaling beside the "
                 "machine's, from the same seconds; full mask, the last --seq; wall clock)")
      ->check(CLI::Range(1, 1000))
      ->excludes(cpu_time)
      ->excludes(tile_ops)
      ->excludes(sgemm_window)
      ->excludes(torch_flag)
      ->excludes(torch_json);
  app.add_flag("--keep-openblas-core", o.keep_openblas_core,
               "time OpenBLAS's sgemm with the core it (or OPENBLAS_CORETYPE) chose, even where "
               "its instruction set is not the kernel path's");
  app.add_option("--json", o.json,
                 "also write the results as JSON to this file (the sweep and --thread-scaling; "
                 "-: standard output, the table then on standard error)")
      ->excludes(tile_ops)
      ->excludes(sgemm_window);
  if (const auto rc = loom::parse_command_line(app, argc, argv, "bench_kernels")) return *rc;
  // The modes other than the sweep use few of the options: any other option given beside one is
  // refused, one line and exit 2, naming both (--tile-ops --seq 128, --sgemm-window --no-check,
  // --thread-scaling --ring 64 ran and ignored it). Options left at their defaults are not given.
  struct Mode {
    const char* name;
    bool on;
    std::vector<std::string> uses;
  };
  const Mode modes[] = {
      {"--sgemm-window", o.sgemm_window > 0, {"--gemm-n", "--cpu-time", "--keep-openblas-core"}},
      {"--thread-scaling",
       o.thread_scaling > 0,
       {"--seq", "--dim", "--dtype", "--heads", "--kv-heads", "--block-q", "--block-k", "--threads",
        "--gemm-n", "--no-check", "--json", "--keep-openblas-core"}},
      {"--tile-ops", o.tile_ops, {"--dim", "--keep-openblas-core"}},
  };
  for (const Mode& m : modes) {
    if (!m.on) continue;
    for (const CLI::Option* opt : app.get_options()) {
      const std::string name = opt->get_name();
      if (opt->count() == 0 || name == m.name || name == "--help" ||
          std::find(m.uses.begin(), m.uses.end(), name) != m.uses.end())
        continue;
      std::string uses;
      for (size_t i = 0; i < m.uses.size(); ++i)
        uses += (i == 0 ? "" : i + 1 == m.uses.size() ? " and " : ", ") + m.uses[i];
      std::fprintf(stderr, "bench_kernels: %s excludes %s (%s uses only %s) (see --help)\n", m.name,
                   name.c_str(), m.name, uses.c_str());
      return 2;
    }
    break;  // the first mode on is the one that runs (two modes: refused above, by CLI11)
  }
  // Each dtype, sequence length and head dim once, in the order given (--dtype fp32,fp32 printed
  // every row twice; --seq 128 128 four times as many rows, every target line twice).
  auto once = [](auto& values) {
    std::remove_reference_t<decltype(values)> kept;
    for (const auto& v : values)
      if (std::find(kept.begin(), kept.end(), v) == kept.end()) kept.push_back(v);
    values = kept;
  };
  once(o.dtypes);
  once(o.seqs);
  once(o.dims);
  // One value where a mode times one: --tile-ops one tile of one D, --thread-scaling one S (each
  // timed only the last value given).
  if (o.tile_ops && o.dims.size() > 1) {
    std::fprintf(stderr,
                 "bench_kernels: --tile-ops times one tile of one head dim: give one --dim (got "
                 "%zu) (see --help)\n",
                 o.dims.size());
    return 2;
  }
  if (o.thread_scaling > 0 && o.seqs.size() > 1) {
    std::fprintf(stderr,
                 "bench_kernels: --thread-scaling times one sequence length: give one --seq (got "
                 "%zu) (see --help)\n",
                 o.seqs.size());
    return 2;
  }
  if (o.heads % o.kv_heads != 0) {  // both >= 1: their ranges
    std::fprintf(stderr,
                 "bench_kernels: --heads %lld must be a positive multiple of --kv-heads %lld (see "
                 "--help)\n",
                 static_cast<long long>(o.heads), static_cast<long long>(o.kv_heads));
    return 2;  // a bad command line, as bench_cli.h's (it was 1, a failed check's status)
  }
  try {  // the output naming the input: a bad command line too
    loom::check_distinct_outputs({{"--torch-json", o.torch_json}, {"--json", o.json}}, 1);
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "bench_kernels: %s\n", e.what());
    return 2;
  }
  if (!o.keep_openblas_core) loom::match_openblas_core(argv);
  try {
    // Before the sweep: the output can be written and is not the input it would replace, and
    // PyTorch's rows can be had (--torch-json read and checked, --torch's Python imports torch).
    if (!o.json.empty()) loom::check_output_writable(o.json, "--json");
    // --json -: the JSON alone on standard output (it was mixed into the table there, which
    // then goes to standard error): written to a copy of descriptor 1, not inherited by children.
    o.json = loom::json_alone_on_stdout(o.json);
    if (o.sgemm_window > 0) {
#if LOOM_BENCH_OPENBLAS
      openblas_set_num_threads(1);
#endif
      // --cpu-time times the windows by the process's CPU clock (as the sweep's one-thread
      // rows): said on the line, which read the same either way.
      std::printf("sgemm (%s), 1 thread, M = N = K = %lld, windows of %.2f s (%s): %.1f GFLOP/s\n",
                  loom::gemm_description().c_str(), static_cast<long long>(o.gemm_n),
                  o.sgemm_window, loom::g_cpu_time ? "process CPU time, --cpu-time" : "wall clock",
                  loom::sgemm_window_gflops(o.gemm_n, 1, o.sgemm_window));
      return 0;
    }
    if (o.thread_scaling > 0) return loom::run_thread_scaling(o);
    if (o.tile_ops) return loom::run_tile_ops(o);
    return loom::run(o, loom::plan_torch(o));
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "bench_kernels: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "bench_kernels: out of memory (lower --seq, --heads or --gemm-n)\n");
    return 1;
  } catch (const std::exception& e) {  // never an abort: one line, as every error
    std::fprintf(stderr, "bench_kernels: %s\n", e.what());
    return 1;
  }
}
