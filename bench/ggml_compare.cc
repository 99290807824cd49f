// ggml_compare: the ggml CPU flash-attention kernel (ggml_flash_attn_ext) on one of bench_kernels'
// shapes, for its optional `ggml` rows. Optional: ggml is not in Debian, so this program is
// built only when CMake finds a ggml build (-DLOOM_GGML_DIR=<its install prefix>, see
// bench/kernels.cmake and docs/performance.md); bench_kernels runs it where it was built.
//
// Forward only (ggml's attention backward, ggml_flash_attn_back, predates flash_attn_ext and is
// not the kernel llama.cpp runs). q is fp32 [S, H, D] as in loom, k and v [S, Hkv, D] fp32 or f16
// (--kv-type), viewed as ggml's [D, S, H] and [D, S, Hkv] by a permutation of strides, no copy;
// the output [D, H, S] is loom's [S, H, D] memory order. GQA (--kv-heads below --heads) is
// ggml's broadcast: query head h reads kv head h / (H / Hkv), as loom's kernels do (bench_kernels
// passes its --kv-heads, so a ggml row beside a GQA row times the same work). Causal is ggml's
// additive f16 mask (0 or -inf, S x S). Rates are the useful FLOPs of bench_kernels (4 D per
// visible (query, key, head)) over the fastest of --reps calls after one warm-up, with the graph
// built once.
//
// Before timing, a check (on by default, bench_kernels' -c): ggml's output on a small problem of
// the same mask and D against loom's fp64 reference on the same values (f16 k and v rounded to
// f16 first), within loom's fp32 tolerance, 1e-5 relative: ggml's tiled CPU path computes in
// fp32 (measured 3e-7 to 5e-7 for fp32 and f16 k and v, S = 200, D = 128, ggml 0.21.0). A
// larger error is a failed check and exit 1.
//
//   build/bench/ggml_compare --seq 4096 --dim 128 --heads 8 --kv-heads 2 --mask full --reps 5
//       --json g.json
#include <ggml-cpu.h>
#include <ggml.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_cli.h"
#include "bench_common.h"
#include "loom/attention.h"
#include "loom/error.h"
#include "loom/io.h"
#include "loom/tensor.h"

namespace {

struct Options {
  int64_t seq = 4096, dim = 128, heads = 8, kv_heads = 0;  // kv_heads 0: --heads
  std::string mask = "full", kv_type = "fp32", json;
  int reps = 3, threads = 1;
  bool no_check = false;
};

// One ggml graph computing flash_attn_ext on [S, H, D] inputs (ggml's context owns the tensors).
class Attention {
 public:
  Attention(int64_t s, int64_t h, int64_t hkv, int64_t d, bool causal, bool f16_kv, int threads)
      : s_(s), h_(h), d_(d), threads_(threads) {
    const size_t kv_bytes = static_cast<size_t>(s * hkv * d) * (f16_kv ? 2 : 4);
    const size_t bytes = static_cast<size_t>(3 * s * h * d) * 4 + 2 * kv_bytes +
                         (causal ? static_cast<size_t>(s * s) * 2 : 0) + (64u << 20);
    ggml_init_params p{bytes, nullptr, false};
    ctx_ = ggml_init(p);
    const ggml_type kv = f16_kv ? GGML_TYPE_F16 : GGML_TYPE_F32;
    // Stored [S, H, D] (ggml's ne = {D, H, S}); attention reads [D, S, H]: dims 1 and 2 swapped.
    // k and v have Hkv heads, which ggml broadcasts over the query heads.
    q_ = ggml_new_tensor_3d(ctx_, GGML_TYPE_F32, d, h, s);
    k_ = ggml_new_tensor_3d(ctx_, kv, d, hkv, s);
    v_ = ggml_new_tensor_3d(ctx_, kv, d, hkv, s);
    ggml_tensor* mask = nullptr;
    if (causal) {
      mask = ggml_new_tensor_2d(ctx_, GGML_TYPE_F16, s, s);
      auto* m = static_cast<ggml_fp16_t*>(mask->data);
      const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), ninf = ggml_fp32_to_fp16(-INFINITY);
      for (int64_t i = 0; i < s; ++i)
        for (int64_t j = 0; j < s; ++j) m[i * s + j] = j <= i ? zero : ninf;
    }
    out_ =
        ggml_flash_attn_ext(ctx_, ggml_permute(ctx_, q_, 0, 2, 1, 3),
                            ggml_permute(ctx_, k_, 0, 2, 1, 3), ggml_permute(ctx_, v_, 0, 2, 1, 3),
                            mask, 1.0f / std::sqrt(static_cast<float>(d)), 0.0f, 0.0f);
    ggml_flash_attn_ext_set_prec(out_, GGML_PREC_F32);
    graph_ = ggml_new_graph(ctx_);
    ggml_build_forward_expand(graph_, out_);
  }
  ~Attention() { ggml_free(ctx_); }
  Attention(const Attention&) = delete;
  Attention& operator=(const Attention&) = delete;

  void set(const loom::Tensor<float>& q, const loom::Tensor<float>& k,
           const loom::Tensor<float>& v) {
    std::copy(q.vec().begin(), q.vec().end(), static_cast<float*>(q_->data));
    store(k, k_);
    store(v, v_);
  }
  void run() { ggml_graph_compute_with_ctx(ctx_, graph_, threads_); }
  // The output, [S, H, D].
  std::vector<float> out() const {
    const auto* o = static_cast<const float*>(out_->data);
    return std::vector<float>(o, o + s_ * h_ * d_);
  }

 private:
  static void store(const loom::Tensor<float>& x, ggml_tensor* t) {
    if (t->type == GGML_TYPE_F32) {
      std::copy(x.vec().begin(), x.vec().end(), static_cast<float*>(t->data));
    } else {
      auto* dst = static_cast<ggml_fp16_t*>(t->data);
      for (size_t i = 0; i < x.vec().size(); ++i) dst[i] = ggml_fp32_to_fp16(x.vec()[i]);
    }
  }
  int64_t s_, h_, d_;
  int threads_;
  ggml_context* ctx_ = nullptr;
  ggml_tensor *q_ = nullptr, *k_ = nullptr, *v_ = nullptr, *out_ = nullptr;
  ggml_cgraph* graph_ = nullptr;
};

using loom::bench::random_normal;
using loom::bench::rel_error;

// Positions 0 .. s - 1: one contiguous sequence, for the reference and the pair count.
std::vector<int64_t> positions(int64_t s) {
  std::vector<int64_t> pos(static_cast<size_t>(s));
  for (int64_t i = 0; i < s; ++i) pos[static_cast<size_t>(i)] = i;
  return pos;
}

// ggml's output on a small problem (S = 200, the run's GQA group over at most two kv heads, the
// run's D, mask and k/v type) against loom's fp64 reference on the values ggml was given (f16 k
// and v rounded first).
double check(const Options& o) {
  const int64_t s = 200, hkv = std::min<int64_t>(o.kv_heads, 2), h = o.heads / o.kv_heads * hkv;
  const int64_t d = o.dim;
  const bool causal = o.mask == "causal", f16 = o.kv_type == "f16";
  loom::Tensor<float> q = random_normal({s, h, d}, 31), k = random_normal({s, hkv, d}, 32),
                      v = random_normal({s, hkv, d}, 33);
  if (f16)
    for (loom::Tensor<float>* t : {&k, &v})
      for (float& e : t->vec()) e = ggml_fp16_to_fp32(ggml_fp32_to_fp16(e));
  Attention a(s, h, hkv, d, causal, f16, o.threads);
  a.set(q, k, v);
  a.run();
  const std::vector<int64_t> pos = positions(s);
  const loom::Tokens t{pos.data(), nullptr, s};
  loom::Tensor<double> ref({s, h, d});
  std::vector<double> lse(static_cast<size_t>(h * s));
  loom::reference_forward(loom::convert<double>(q).view3(), loom::convert<double>(k).view3(),
                          loom::convert<double>(v).view3(), t, t, loom::Mask{causal, 0},
                          1.0 / std::sqrt(static_cast<double>(d)), ref.view3(), lse.data());
  return rel_error(a.out(), ref.vec());
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"ggml_compare: ggml's CPU flash attention (ggml_flash_attn_ext) on one shape"};
  app.add_option("--seq", o.seq, "sequence length (queries = keys)")->check(CLI::Range(1, 1 << 20));
  app.add_option("--dim", o.dim, "head dim")->check(CLI::Range(1, 1024));
  app.add_option("--heads", o.heads, "query heads")->check(CLI::Range(1, 1024));
  app.add_option("--kv-heads", o.kv_heads, "k and v heads, dividing --heads (default: --heads)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--mask", o.mask, "full or causal")->check(CLI::IsMember({"full", "causal"}));
  app.add_option("--kv-type", o.kv_type, "k and v storage: fp32 or f16")
      ->check(CLI::IsMember({"fp32", "f16"}));
  app.add_option("--reps", o.reps, "timed calls after one warm-up")->check(CLI::Range(1, 1000));
  app.add_option("--threads", o.threads, "ggml threads")->check(CLI::Range(1, 1024));
  app.add_flag("--no-check", o.no_check, "skip the check against loom's fp64 reference");
  app.add_option("--json", o.json, "write the row as JSON to this file");
  // A bad command line is one line and exit 2, as bench_kernels' (CLI11_PARSE exited with
  // CLI11's own codes, 105, 109...).
  if (const auto rc = loom::parse_command_line(app, argc, argv, "ggml_compare")) return *rc;
  if (o.kv_heads == 0) o.kv_heads = o.heads;
  if (o.heads % o.kv_heads != 0) {
    std::fprintf(stderr,
                 "ggml_compare: --heads %lld must be a positive multiple of --kv-heads %lld (see "
                 "--help)\n",
                 static_cast<long long>(o.heads), static_cast<long long>(o.kv_heads));
    return 2;
  }

  const bool causal = o.mask == "causal", f16 = o.kv_type == "f16";
  nlohmann::json doc;
  doc["ggml"] = ggml_version();
  doc["ggml_commit"] = ggml_commit();
  if (!o.no_check) {
    const double err = check(o);
    const double tol = 1e-5;  // = kFp32RelTol of tests/unit/tolerance.h
    const bool ok = err <= tol;
    std::printf("check: %s (relative error %.2e vs fp64 reference, limit %.0e)\n",
                ok ? "ok" : "FAILED", err, tol);
    doc["check"] = {{"ok", ok}, {"rel_error", err}, {"limit", tol}};
    if (!ok) return 1;
  }
  const int64_t s = o.seq, h = o.heads, hkv = o.kv_heads, d = o.dim;
  Attention a(s, h, hkv, d, causal, f16, o.threads);
  a.set(random_normal({s, h, d}, 11), random_normal({s, hkv, d}, 12),
        random_normal({s, hkv, d}, 13));
  std::vector<double> calls;
  for (int i = 0; i <= o.reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    a.run();
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i > 0) calls.push_back(sec);  // the first call is the warm-up
  }
  const double best = *std::min_element(calls.begin(), calls.end());
  // Useful FLOPs as bench_kernels counts them: 4 D per (query, key, head) the mask allows.
  const std::vector<int64_t> pos = positions(s);
  const loom::Tokens t{pos.data(), nullptr, s};
  const double pairs =
      static_cast<double>(loom::count_visible_pairs(t, t, loom::Mask{causal, 0}, h));
  const double gflops = 4.0 * static_cast<double>(d) * pairs / best * 1e-9;
  std::printf(
      "ggml %s S %lld H %lld Hkv %lld D %lld %s k/v %s, %d thread(s): fwd %.1f ms, %.1f GFLOP/s\n",
      ggml_version(), static_cast<long long>(s), static_cast<long long>(h),
      static_cast<long long>(hkv), static_cast<long long>(d), o.mask.c_str(), o.kv_type.c_str(),
      o.threads, best * 1e3, gflops);
  doc["results"] = nlohmann::json::array({{{"seq", s},
                                           {"heads", h},
                                           {"kv_heads", hkv},
                                           {"dim", d},
                                           {"mask", o.mask},
                                           {"kv_type", o.kv_type},
                                           {"threads", o.threads},
                                           {"fwd_s", best},
                                           {"fwd_gflops", gflops},
                                           {"fwd_calls_s", calls}}});
  if (!o.json.empty()) {
    try {
      loom::write_output(o.json, doc.dump(1) + "\n");
    } catch (const loom::Error& e) {
      std::fprintf(stderr, "ggml_compare: %s\n", e.what());
      return 1;
    }
  }
  return 0;
}
