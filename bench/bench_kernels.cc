// bench_kernels: forward and backward GFLOP/s of the blockwise kernels next to the same machine's
// measured sgemm rate.
//
// For each shape of the sweep (--seq x --dim x causal/full x {1 thread, all threads}; --heads
// query heads, --kv-heads kv heads) the forward is one attend over all keys plus finish, the
// backward one attend_backward (delta precomputed). Each is run until --min-time seconds have
// passed (at least once, after one untimed warm-up when a call is short) and the fastest call is
// reported. Useful FLOPs count only visible (query, key, head) triples, as reported by the
// kernel: forward 4 * D * pairs, backward 2.5x that.
//
// The sgemm rate is measured in the same run, right before each row, C = A B with M = N = K =
// --gemm-n, with the thread count of the row: OpenBLAS's cblas_sgemm where CMake found it (threads
// set with openblas_set_num_threads, the run-time form of OPENBLAS_NUM_THREADS), else a naive
// blocked sgemm. The ratio columns are kernel GFLOP/s over that rate: on shared machines ratios
// drift less than absolute times.
//
// Before timing, a small problem (S = 256, causal, GQA, tiles that do not divide S) is checked
// against the fp64 reference (relative norm error <= 1e-5, the kFp32RelTol of the tests); a
// failed check exits non-zero. --no-check skips it.
//
//   bench_kernels                                  the default sweep, a table
//   bench_kernels --seq 1024 --dim 64 --json out.json
#include <omp.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "loom/attention.h"
#include "loom/error.h"
#include "loom/tensor.h"
#include "loom/timer.h"

#if LOOM_BENCH_OPENBLAS
#include <cblas.h>
#endif

namespace loom {
namespace {

constexpr double kCheckTol = 1e-5;  // = kFp32RelTol of tests/unit/tolerance.h

struct Options {
  std::vector<int64_t> seqs = {1024, 4096};
  std::vector<int64_t> dims = {64, 128};
  int64_t heads = 8, kv_heads = 8;
  int64_t block_q = 64, block_k = 64;
  int threads = 0;  // "all threads"; 0: omp_get_max_threads()
  int64_t gemm_n = 1024;
  double min_time = 0.5;
  bool no_check = false;
  std::string json;
};

Tensor<float> random_normal(std::vector<int64_t> shape, uint32_t seed) {
  Tensor<float> x(std::move(shape));
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& e : x.vec()) e = normal(gen);
  return x;
}

// Seconds of the fastest call of f: calls until min_time has passed, after one untimed warm-up
// when the first call was short.
template <class F>
double best_time(F&& f, double min_time) {
  Stopwatch first;
  f();
  double best = first.elapsed_s();
  if (best >= min_time) return best;
  Stopwatch total;
  while (total.elapsed_s() < min_time) {
    Stopwatch sw;
    f();
    best = std::min(best, sw.elapsed_s());
  }
  return best;
}

// ---------------------------------------------------------------------------------------------
// sgemm

#if LOOM_BENCH_OPENBLAS
const char* kGemmName = "openblas";
void sgemm(int64_t n, const float* a, const float* b, float* c, int threads) {
  openblas_set_num_threads(threads);
  const int ni = static_cast<int>(n);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, ni, ni, 1.0f, a, ni, b, ni, 0.0f, c,
              ni);
}
#else
const char* kGemmName = "naive-blocked";
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

double sgemm_gflops(int64_t n, int threads, double min_time) {
  const Tensor<float> a = random_normal({n, n}, 1), b = random_normal({n, n}, 2);
  Tensor<float> c({n, n});
  const double t = best_time([&] { sgemm(n, a.data(), b.data(), c.data(), threads); }, min_time);
  return 2.0 * static_cast<double>(n * n * n) / t * 1e-9;
}

// ---------------------------------------------------------------------------------------------
// Kernels

struct Row {
  int64_t seq, heads, kv_heads, dim;
  bool causal;
  int threads;
  int64_t visible_pairs;
  double fwd_s, bwd_s, fwd_gflops, bwd_gflops, gemm_gflops;
};

Row run_shape(const Options& o, int64_t s, int64_t d, bool causal, int threads,
              double gemm_gflops) {
  const int64_t h = o.heads, hkv = o.kv_heads;
  const Tensor<float> q = random_normal({s, h, d}, 11), k = random_normal({s, hkv, d}, 12),
                      v = random_normal({s, hkv, d}, 13), dout = random_normal({s, h, d}, 14);
  std::vector<int64_t> pos(static_cast<size_t>(s));
  std::iota(pos.begin(), pos.end(), 0);
  const Tokens t{pos.data(), nullptr, s};
  KernelConfig cfg;
  cfg.mask = Mask{causal, 0};
  cfg.scale = 1.0f / std::sqrt(static_cast<float>(d));
  cfg.threads = threads;
  cfg.block_q = o.block_q;
  cfg.block_k = o.block_k;

  SoftmaxState st(s, h, d);
  Tensor<float> out({s, h, d});
  std::vector<float> lse(static_cast<size_t>(h * s)), delta(static_cast<size_t>(h * s));
  KernelStats stats;
  const double fwd_s = best_time(
      [&] {
        st.reset();
        stats = attend(st.view(), q.view3(), k.view3(), v.view3(), t, t, cfg);
        finish(st.view(), out.view3(), lse.data(), s);
      },
      o.min_time);
  compute_delta(out.view3(), dout.view3(), delta.data(), s);
  Tensor<float> dq({s, h, d}), dk({s, hkv, d}), dv({s, hkv, d});
  const double bwd_s = best_time(
      [&] {
        attend_backward(q.view3(), k.view3(), v.view3(), dout.view3(), lse.data(), delta.data(), s,
                        t, t, cfg, dq.view3(), dk.view3(), dv.view3());
      },
      o.min_time);
  const double fwd_flops = 4.0 * static_cast<double>(d) * static_cast<double>(stats.visible_pairs);
  return Row{s,
             h,
             hkv,
             d,
             causal,
             threads,
             stats.visible_pairs,
             fwd_s,
             bwd_s,
             fwd_flops / fwd_s * 1e-9,
             2.5 * fwd_flops / bwd_s * 1e-9,
             gemm_gflops};
}

// ---------------------------------------------------------------------------------------------
// Correctness check

double rel_error(const std::vector<float>& x, const std::vector<double>& ref) {
  double err = 0, norm = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) return INFINITY;
    err += (x[i] - ref[i]) * (x[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  return norm > 0 ? std::sqrt(err / norm) : std::sqrt(err);
}

// The largest relative error of out, lse, dq, dk, dv on a small zigzag-shaped problem.
double check(int threads) {
  const int64_t s = 256, h = 4, hkv = 2, d = 64;
  const Tensor<float> q = random_normal({s, h, d}, 21), k = random_normal({s, hkv, d}, 22),
                      v = random_normal({s, hkv, d}, 23), dout = random_normal({s, h, d}, 24);
  // Rank 1 of 4 in a zigzag layout of 1024 tokens: chunks 1 and 6 of 128.
  std::vector<int64_t> pos(static_cast<size_t>(s));
  for (int64_t i = 0; i < s; ++i) pos[i] = i < 128 ? 128 + i : 6 * 128 + (i - 128);
  const Tokens t{pos.data(), nullptr, s};
  KernelConfig cfg;
  cfg.mask = Mask{true, 0};
  cfg.scale = 0.125f;
  cfg.threads = threads;
  cfg.block_q = 48;
  cfg.block_k = 40;
  SoftmaxState st(s, h, d);
  attend(st.view(), q.view3(), k.view3(), v.view3(), t, t, cfg);
  Tensor<float> out({s, h, d}), dq({s, h, d}), dk({s, hkv, d}), dv({s, hkv, d});
  std::vector<float> lse(static_cast<size_t>(h * s)), delta(static_cast<size_t>(h * s));
  finish(st.view(), out.view3(), lse.data(), s);
  compute_delta(out.view3(), dout.view3(), delta.data(), s);
  attend_backward(q.view3(), k.view3(), v.view3(), dout.view3(), lse.data(), delta.data(), s, t, t,
                  cfg, dq.view3(), dk.view3(), dv.view3());

  const Tensor<double> qd = convert<double>(q), kd = convert<double>(k), vd = convert<double>(v),
                       dd = convert<double>(dout);
  Tensor<double> ref_out({s, h, d}), ref_dq({s, h, d}), ref_dk({s, hkv, d}), ref_dv({s, hkv, d});
  std::vector<double> ref_lse(static_cast<size_t>(h * s));
  reference_forward(qd.view3(), kd.view3(), vd.view3(), t, t, cfg.mask, cfg.scale, ref_out.view3(),
                    ref_lse.data());
  reference_backward(qd.view3(), kd.view3(), vd.view3(), dd.view3(), t, t, cfg.mask, cfg.scale,
                     ref_dq.view3(), ref_dk.view3(), ref_dv.view3());
  return std::max({rel_error(out.vec(), ref_out.vec()), rel_error(lse, ref_lse),
                   rel_error(dq.vec(), ref_dq.vec()), rel_error(dk.vec(), ref_dk.vec()),
                   rel_error(dv.vec(), ref_dv.vec())});
}

int run(const Options& o) {
  const int all = o.threads > 0 ? o.threads : omp_get_max_threads();
  std::vector<int> thread_counts = {1};
  if (all > 1) thread_counts.push_back(all);
  nlohmann::json doc;
  doc["gemm"] = {{"impl", kGemmName}, {"n", o.gemm_n}};
  doc["block"] = {o.block_q, o.block_k};

  if (!o.no_check) {
    const double err = check(all);
    const bool ok = err <= kCheckTol;
    std::printf("check: %s (max relative error %.2e vs fp64 reference, limit %.0e)\n",
                ok ? "ok" : "FAILED", err, kCheckTol);
    doc["check"] = {{"ok", ok}, {"max_rel_error", err}};
    if (!ok) return 1;
  }

  std::printf("sgemm: %s, M = N = K = %lld, measured right before each row with its threads\n",
              kGemmName, static_cast<long long>(o.gemm_n));
  std::printf("\n%6s %3s %4s %4s %6s %3s %7s | %9s %8s %6s | %9s %8s %6s\n", "S", "H", "Hkv", "D",
              "mask", "thr", "sgemm", "fwd ms", "GFLOP/s", "/gemm", "bwd ms", "GFLOP/s", "/gemm");
  nlohmann::json rows = nlohmann::json::array();
  for (int64_t s : o.seqs) {
    for (int64_t d : o.dims) {
      for (bool causal : {true, false}) {
        for (int threads : thread_counts) {
          // The sgemm rate right before the row: on a shared machine the load drifts, and a ratio
          // of two measurements minutes apart would mostly measure that drift.
          const double gemm = sgemm_gflops(o.gemm_n, threads, o.min_time);
#if LOOM_BENCH_OPENBLAS
          // OpenBLAS's worker threads keep spinning for a while after a call; on a machine with
          // few cores they would compete with the kernels' OpenMP threads. Let them go idle.
          openblas_set_num_threads(1);
          if (threads > 1) std::this_thread::sleep_for(std::chrono::milliseconds(500));
#endif
          const Row r = run_shape(o, s, d, causal, threads, gemm);
          std::printf(
              "%6lld %3lld %4lld %4lld %6s %3d %7.1f | %9.1f %8.1f %6.2f | %9.1f %8.1f %6.2f\n",
              static_cast<long long>(r.seq), static_cast<long long>(r.heads),
              static_cast<long long>(r.kv_heads), static_cast<long long>(r.dim),
              r.causal ? "causal" : "full", r.threads, r.gemm_gflops, r.fwd_s * 1e3, r.fwd_gflops,
              r.fwd_gflops / r.gemm_gflops, r.bwd_s * 1e3, r.bwd_gflops,
              r.bwd_gflops / r.gemm_gflops);
          std::fflush(stdout);
          rows.push_back({{"seq", r.seq},
                          {"heads", r.heads},
                          {"kv_heads", r.kv_heads},
                          {"dim", r.dim},
                          {"causal", r.causal},
                          {"threads", r.threads},
                          {"visible_pairs", r.visible_pairs},
                          {"fwd_s", r.fwd_s},
                          {"bwd_s", r.bwd_s},
                          {"fwd_gflops", r.fwd_gflops},
                          {"bwd_gflops", r.bwd_gflops},
                          {"gemm_gflops", r.gemm_gflops},
                          {"fwd_ratio", r.fwd_gflops / r.gemm_gflops},
                          {"bwd_ratio", r.bwd_gflops / r.gemm_gflops}});
        }
      }
    }
  }
  doc["results"] = rows;
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    LOOM_CHECK(f.good(), IoError, "cannot write " << o.json);
    f << doc.dump(2) << "\n";
  }
  return 0;
}

}  // namespace
}  // namespace loom

int main(int argc, char** argv) {
  loom::Options o;
  CLI::App app{"bench_kernels: blockwise attention GFLOP/s next to the measured sgemm rate"};
  app.add_option("--seq", o.seqs, "sequence lengths")->delimiter(',');
  app.add_option("--dim", o.dims, "head dims")->delimiter(',');
  app.add_option("--heads", o.heads, "query heads");
  app.add_option("--kv-heads", o.kv_heads, "kv heads (divides --heads)");
  app.add_option("--block-q", o.block_q, "tile rows");
  app.add_option("--block-k", o.block_k, "tile columns");
  app.add_option("--threads", o.threads, "threads of the 'all threads' rows (0: OpenMP default)");
  app.add_option("--gemm-n", o.gemm_n, "sgemm size (M = N = K)");
  app.add_option("--min-time", o.min_time, "seconds of repetitions per measurement");
  app.add_flag("--no-check", o.no_check, "skip the correctness check");
  app.add_option("--json", o.json, "also write the results as JSON to this file");
  CLI11_PARSE(app, argc, argv);
  try {
    return loom::run(o);
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "bench_kernels: %s\n", e.what());
    return 1;
  }
}
