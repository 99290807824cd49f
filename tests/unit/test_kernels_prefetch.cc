// kernels: TileOps::gemm_panels_next on every compiled instruction-set target that this CPU runs
// (the others are named as skipped). Its prefetch regions are hints (tile_ops.h): whatever they
// name (several 2-D regions, a null or empty one, a page that is not readable at all) the product
// must be bitwise the one gemm_panels computes, and that one within fp32 rounding of an fp64
// product. TileOps::gemm_panels_bf16 (B as bf16 panels, widened inside) must be bitwise
// gemm_panels on the widened B, with or without regions, reading no more scratch than it is given.
// And TileOps::dot is the chain of multiply-adds each element of every GEMM entry point computes
// (tile_ops.h; compute_delta relies on it), for either layout of A and for K = 128 (the kernels'
// D and tile side) as for the K around it; the same for the bf16 dot products and dot_bf16.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernel_targets.h"
#include "loom/bf16.h"

namespace loom::kernels {
namespace {

using KernelsPrefetch = PerKernelTarget;

TEST_P(KernelsPrefetch, RegionsNeverChangeTheProduct) {
  const TileOps* ops = ops_or_skip();
  if (ops == nullptr) GTEST_SKIP() << GetParam() << ": this CPU cannot run this target";
  // C [M, N] = alpha A B (+ C), A row-major [M, K], B in column panels of kNr (K x kNr each).
  const int64_t M = 40, N = 48, K = 36;
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> a(M * K), b(K * N), c0(M * N), c_ref(M * N), bound(M * N);
  for (float& x : a) x = normal(gen);
  for (float& x : b) x = normal(gen);
  for (float& x : c0) x = normal(gen);
  const auto bp = [&](int64_t k, int64_t j) { return b[(j / kNr) * K * kNr + k * kNr + j % kNr]; };

  // A page nobody may read, and a region far beyond the buffers: prefetching them must not fault.
  const long page = sysconf(_SC_PAGESIZE);
  void* guard =
      mmap(nullptr, static_cast<size_t>(page), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(guard, MAP_FAILED);
  std::vector<float> other(4096, 1.0f);
  const PrefetchRegion regions[] = {
      {other.data(), 16, 200, 1024},   // 2-D: 16 rows of 200 bytes, 1 KiB apart
      {nullptr, 8, 64, 64},            // null: skipped
      {other.data(), 0, 64, 64},       // no rows: skipped
      {guard, 1, page, 0},             // unreadable page
      {other.data() + 100, 3, 17, 4},  // rows overlapping, not line aligned
  };

  for (const bool accumulate : {false, true}) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double sum = 0.0, sum_abs = 0.0;
        for (int64_t k = 0; k < K; ++k) {
          sum += double{a[i * K + k]} * double{bp(k, j)};
          sum_abs += std::fabs(double{a[i * K + k]} * double{bp(k, j)});
        }
        const double add = accumulate ? c0[i * N + j] : 0.0;
        c_ref[i * N + j] = static_cast<float>(0.5 * sum + add);
        // fp32 sums of K products, then alpha (exact) and the addition: at most K + 2 roundings
        // of 2^-24 relative each on the magnitudes involved (the standard gamma_K bound).
        bound[i * N + j] = static_cast<float>((K + 2) * 0x1p-24 * (0.5 * sum_abs + std::fabs(add)));
      }
    std::vector<float> plain = c0;
    ops->gemm_panels(M, N, K, a.data(), K, 1, b.data(), K * kNr, 0.5f, accumulate, plain.data(), N);
    for (int64_t n = 0; n <= 5; ++n) {  // the first n regions (0: none, the up-front prefetch)
      std::vector<float> next = c0;
      ops->gemm_panels_next(M, N, K, a.data(), K, 1, b.data(), K * kNr, 0.5f, accumulate,
                            next.data(), N, regions, n);
      for (int64_t e = 0; e < M * N; ++e)
        ASSERT_EQ(next[e], plain[e])
            << "regions " << n << " accumulate " << accumulate << " at " << e;
    }
    for (int64_t e = 0; e < M * N; ++e) ASSERT_NEAR(plain[e], c_ref[e], bound[e]) << "at " << e;
  }
  munmap(guard, static_cast<size_t>(page));
}

TEST_P(KernelsPrefetch, Bf16PanelsAreTheProductOfTheWidenedPanels) {
  const TileOps* ops = ops_or_skip();
  if (ops == nullptr) GTEST_SKIP() << GetParam() << ": this CPU cannot run this target";
  std::mt19937 gen(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> other(4096, 1.0f);
  const PrefetchRegion regions[] = {{other.data(), 16, 200, 1024}, {nullptr, 8, 64, 64}};
  // N = 16: one panel (the remainder loop on 16-lane targets); 48: three panels, so a register
  // block of two vectors spans two panels on 16-lane targets; 128 x 128: the kernels' tile.
  const int64_t shapes[][3] = {{12, 16, 8}, {40, 48, 36}, {128, 128, 128}};
  for (const auto& shape : shapes) {
    const int64_t M = shape[0], N = shape[1], K = shape[2];
    SCOPED_TRACE(::testing::Message() << M << " x " << N << " x " << K);
    std::vector<float> a(M * K), wide(K * N), c0(M * N);
    std::vector<uint16_t> narrow(K * N);
    for (float& x : a) x = normal(gen);
    for (float& x : c0) x = normal(gen);
    for (int64_t e = 0; e < K * N; ++e) {
      const bf16 x = to_bf16(normal(gen));
      narrow[e] = x.bits;
      wide[e] = to_float(x);
    }
    for (const bool accumulate : {false, true}) {
      std::vector<float> plain = c0;
      ops->gemm_panels(M, N, K, a.data(), K, 1, wide.data(), K * kNr, 0.5f, accumulate,
                       plain.data(), N);
      for (int64_t n = 0; n <= 2; ++n) {
        std::vector<float> scratch(2 * K * kNr);  // exactly what the contract asks for
        std::vector<float> c = c0;
        ops->gemm_panels_bf16(M, N, K, a.data(), K, 1, narrow.data(), K * kNr, 0.5f, accumulate,
                              c.data(), N, scratch.data(), regions, n);
        for (int64_t e = 0; e < M * N; ++e)
          ASSERT_EQ(c[e], plain[e])
              << "regions " << n << " accumulate " << accumulate << " at " << e;
      }
    }
  }
}

TEST_P(KernelsPrefetch, EveryGemmElementIsTheDotChain) {
  const TileOps* ops = ops_or_skip();
  if (ops == nullptr) GTEST_SKIP() << GetParam() << ": this CPU cannot run this target";
  std::mt19937 gen(13);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // M = 128: the register blocks and both bottom-edge forms; N = 48: two-vector and one-vector
  // column blocks on 16-lane targets; K = 128 and its neighbours, 64, and a short one.
  const int64_t M = 128, N = 48;
  for (const int64_t K : {int64_t{128}, int64_t{127}, int64_t{129}, int64_t{64}, int64_t{5}}) {
    std::vector<float> a(M * K), b(K * N), panels(K * N), c0(M * N);
    for (float& x : a) x = normal(gen);
    for (float& x : b) x = normal(gen);
    for (float& x : c0) x = normal(gen);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < N; ++j)
        panels[(j / kNr) * K * kNr + k * kNr + j % kNr] = b[k * N + j];
    for (const bool transposed : {false, true}) {  // A(i, k) at a[i K + k], or at a[k M + i]
      const int64_t a_rs = transposed ? 1 : K, a_ks = transposed ? M : 1;
      for (const bool accumulate : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "K " << K << (transposed ? " A^T" : " A")
                                          << (accumulate ? " accumulate" : ""));
        std::vector<float> plain = c0, panel = c0, next = c0;
        ops->gemm(M, N, K, a.data(), a_rs, a_ks, b.data(), N, 0.5f, accumulate, plain.data(), N);
        ops->gemm_panels(M, N, K, a.data(), a_rs, a_ks, panels.data(), K * kNr, 0.5f, accumulate,
                         panel.data(), N);
        const PrefetchRegion region{b.data(), 1, 256, 0};
        ops->gemm_panels_next(M, N, K, a.data(), a_rs, a_ks, panels.data(), K * kNr, 0.5f,
                              accumulate, next.data(), N, &region, 1);
        std::vector<float> ai(K), bj(K);
        for (int64_t i = 0; i < M; ++i)
          for (int64_t j = 0; j < N; ++j) {
            for (int64_t k = 0; k < K; ++k) {
              ai[k] = a[i * a_rs + k * a_ks];
              bj[k] = b[k * N + j];
            }
            // alpha = 0.5 scales exactly, so one rounding of the addition remains either way.
            const float d = 0.5f * ops->dot(ai.data(), bj.data(), K);
            const float want = accumulate ? d + c0[i * N + j] : d;
            ASSERT_EQ(plain[i * N + j], want) << "gemm at " << i << ", " << j;
            ASSERT_EQ(panel[i * N + j], want) << "gemm_panels at " << i << ", " << j;
            ASSERT_EQ(next[i * N + j], want) << "gemm_panels_next at " << i << ", " << j;
          }
      }
    }
  }
}

// The bf16 dot products (targets with gemm_bf16, else skipped with the reason): gemm_bf16 within
// fp32 rounding of the fp64 product of the bf16 values (its products are exact), every element
// bitwise dot_bf16's chain (compute_delta relies on it for the bf16-dot backward), and to_bf16 /
// to_bf16_pairs the round-to-nearest-even bf16 of each value in their layouts.
TEST_P(KernelsPrefetch, Bf16DotsAreExactProductsAndTheDotChain) {
  const TileOps* ops = ops_or_skip();
  if (ops == nullptr) GTEST_SKIP() << GetParam() << ": this CPU cannot run this target";
  if (ops->gemm_bf16 == nullptr) {
    EXPECT_EQ(ops->to_bf16_pairs, nullptr);
    EXPECT_EQ(ops->dot_bf16, nullptr);
    GTEST_SKIP() << GetParam() << ": no bf16 dot products on this target (bf16 is widened)";
  }
  ASSERT_NE(ops->to_bf16, nullptr);
  ASSERT_NE(ops->to_bf16_pairs, nullptr);
  ASSERT_NE(ops->dot_bf16, nullptr);
  std::mt19937 gen(17);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // M = 60: the 8-row and 4-row blocks of vdpbf16ps; AMX's 32-row and 16-row blocks and 12 rows
  // past them. N = 48: two-vector and one-vector (two-tile and one-tile) column blocks.
  const int64_t M = 60, N = 48;
  for (const int64_t K2 : {int64_t{64}, int64_t{1}, int64_t{37}}) {
    SCOPED_TRACE(::testing::Message() << "K2 " << K2);
    // af rounded up to to_bf16's multiple of 16 (M * 2 K2 is not one at M = 60, K2 = 1 or 37).
    std::vector<float> af(round_up(M * 2 * K2, 16)), bf(2 * K2 * N), c0(M * N);
    for (float& x : af) x = normal(gen);
    for (float& x : bf) x = normal(gen);
    for (float& x : c0) x = normal(gen);
    // A [M, 2 K2] row-major: pairs along its rows. B [2 K2, N] in row pairs (to_bf16_pairs).
    std::vector<uint16_t> a(af.size()), b(bf.size());
    ops->to_bf16(af.data(), a.data(), static_cast<int64_t>(af.size()));
    ops->to_bf16_pairs(bf.data(), 2 * K2, N, b.data());
    for (size_t i = 0; i < af.size(); ++i) ASSERT_EQ(a[i], to_bf16(af[i]).bits) << i;
    for (int64_t r = 0; r < 2 * K2; ++r)
      for (int64_t j = 0; j < N; ++j)
        ASSERT_EQ(b[(r / 2) * 2 * N + 2 * j + (r & 1)], to_bf16(bf[r * N + j]).bits)
            << r << ", " << j;
    for (const bool accumulate : {false, true}) {
      std::vector<float> c = c0, one = c0;
      ops->gemm_bf16(M, N, K2, a.data(), 2 * K2, b.data(), 2 * N, 0.5f, accumulate, c.data(), N);
      ops->gemm_bf16(M, N, K2, a.data(), 2 * K2, b.data(), 2 * N, 1.0f, accumulate, one.data(), N);
      std::vector<uint16_t> bj(2 * K2);
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) {
          double exact = 0, mag = 0;
          for (int64_t t = 0; t < 2 * K2; ++t) {
            const double x =
                static_cast<double>(to_float(bf16{a[i * 2 * K2 + t]})) *
                static_cast<double>(to_float(bf16{b[(t / 2) * 2 * N + 2 * j + (t & 1)]}));
            exact += x;
            mag += std::fabs(x);
            bj[t] = b[(t / 2) * 2 * N + 2 * j + (t & 1)];
          }
          const double base = accumulate ? c0[i * N + j] : 0.0;
          // fp32 sums of exact products: |error| <= (2 K2 + 1) 2^-24 (sum |x| + |c|).
          const double bound = (2 * K2 + 2) * std::ldexp(1.0, -24) * (0.5 * mag + std::fabs(base));
          ASSERT_LE(std::fabs(c[i * N + j] - (0.5 * exact + base)), bound) << i << ", " << j;
          const float d = ops->dot_bf16(a.data() + i * 2 * K2, bj.data(), K2);
          ASSERT_EQ(one[i * N + j], accumulate ? d + c0[i * N + j] : d) << i << ", " << j;
        }
    }
  }
}

// The bf16-dot x86-64 targets are the avx512 table with their own bf16 GEMM (tile_ops.h): amx
// differs from avx512bf16 only in gemm_bf16 and dot_bf16, runs only where avx512bf16 runs, and is
// the automatic choice wherever it runs (LOOM_KERNEL unset). Skipped, with the reason, on builds
// without the amx target (64-bit Arm).
TEST(KernelTargets, AmxIsTheAvx512bf16TableWithTileGemmsAndComesFirst) {
  const TileOps* amx = find_target("amx");
  if (amx == nullptr) GTEST_SKIP() << "amx: not compiled into this build (not x86-64 Linux)";
  const TileOps* dots = find_target("avx512bf16");
  const TileOps* wide = find_target("avx512");
  ASSERT_NE(dots, nullptr);
  ASSERT_NE(wide, nullptr);
  EXPECT_EQ(amx->gemm, wide->gemm);
  EXPECT_EQ(amx->gemm_panels_next, wide->gemm_panels_next);
  EXPECT_EQ(amx->softmax_update, wide->softmax_update);
  EXPECT_EQ(amx->probs, wide->probs);
  EXPECT_EQ(amx->to_bf16, dots->to_bf16);
  EXPECT_EQ(amx->to_bf16_pairs, dots->to_bf16_pairs);
  EXPECT_NE(amx->gemm_bf16, nullptr);
  EXPECT_NE(amx->gemm_bf16, dots->gemm_bf16);
  EXPECT_NE(amx->dot_bf16, dots->dot_bf16);
  bool amx_runs = false, dots_run = false;
  for (const KernelTarget& t : kernel_targets()) {
    if (std::string(t.name) == "amx") amx_runs = t.runnable;
    if (std::string(t.name) == "avx512bf16") dots_run = t.runnable;
  }
  EXPECT_TRUE(!amx_runs || dots_run) << "amx runnable where avx512bf16 is not";
  if (amx_runs) {
    EXPECT_STREQ(best_ops().name, "amx");
  } else {
    EXPECT_STRNE(best_ops().name, "amx");
  }
}

// Automatic dispatch takes vdpbf16ps (avx512bf16) over widening (avx512) on AMD only: on the
// Intel Xeon of docs/performance.md rounds 22-23 avx512bf16's bf16 ran at 0.64-0.68x fp32 and
// avx512's at 1.0x, so on Intel avx512bf16 sits right after avx512 in the list (auto takes it
// only through LOOM_KERNEL), elsewhere right before it. Where amx does not run, auto's choice
// among the three follows.
TEST(KernelTargets, Avx512bf16ComesAheadOfAvx512OnlyOffIntel) {
  const std::vector<KernelTarget>& t = kernel_targets();
  auto index = [&](const char* name) {
    for (size_t i = 0; i < t.size(); ++i)
      if (std::string(t[i].name) == name) return static_cast<int64_t>(i);
    return int64_t{-1};
  };
  const int64_t dots = index("avx512bf16"), wide = index("avx512");
  if (dots < 0) GTEST_SKIP() << "avx512bf16: not compiled into this build (not x86-64)";
  ASSERT_GE(wide, 0);
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool intel = __builtin_cpu_is("intel");
#else
  const bool intel = false;
#endif
  EXPECT_EQ(dots, intel ? wide + 1 : wide - 1) << (intel ? "Intel" : "not Intel");
  const bool amx_runs = index("amx") >= 0 && t[index("amx")].runnable;
  if (!amx_runs && t[dots].runnable) {
    EXPECT_STREQ(best_ops().name, intel ? "avx512" : "avx512bf16");
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, KernelsPrefetch, ::testing::ValuesIn(kernel_target_names()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace loom::kernels
