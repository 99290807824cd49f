// attend_workspace_bytes (loom/attention.h) against what the kernels allocate. This binary
// replaces the global operator new and delete, plain and aligned (the kernels' tiles and copies
// are aligned; their plans are std::vectors), to count the bytes live at once; each case runs its
// calls on a fresh thread, so the buffer a thread keeps between calls starts empty and is counted
// where it is allocated. The bound must hold for every sequence of calls within its sizes and
// proportions (halves first, as a ring step's segment pairs; forward then backward and the
// reverse), on the CPU's best path and on one without bf16 dot products, and be no looser than 2x
// the measured peak for the large shapes, where the copies dominate.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "../src/kernels/tile_ops.h"
#include "loom/attention.h"
#include "loom/bf16.h"
#include "loom/error.h"
#include "loom/tensor.h"

namespace {

std::atomic<int64_t> g_live{0}, g_peak{0};

// Every block carries a header of max(alignment, 16) bytes in front of it; its size is in the
// header's last 8 bytes.
size_t header_for(size_t align) {
  return align < 16 ? 16 : align;
}

void* tracked_new(size_t size, size_t align) {
  const size_t header = header_for(align);
  const size_t total = (header + size + header - 1) / header * header;
  auto* base = static_cast<unsigned char*>(std::aligned_alloc(header, total));
  if (base == nullptr) return nullptr;
  unsigned char* p = base + header;
  reinterpret_cast<size_t*>(p)[-1] = size;
  const int64_t live = g_live.fetch_add(static_cast<int64_t>(size)) + static_cast<int64_t>(size);
  for (int64_t peak = g_peak.load(); live > peak && !g_peak.compare_exchange_weak(peak, live);) {
  }
  return p;
}

void tracked_delete(void* ptr, size_t align) {
  if (ptr == nullptr) return;
  auto* p = static_cast<unsigned char*>(ptr);
  g_live.fetch_sub(static_cast<int64_t>(reinterpret_cast<size_t*>(p)[-1]));
  std::free(p - header_for(align));
}

// Allocations larger than this fail as the system's would (std::bad_alloc): the kernels' answer
// to a failed allocation is tested with it.
std::atomic<size_t> g_refuse_above{SIZE_MAX};

void* throwing_new(size_t size, size_t align) {
  if (size > g_refuse_above.load()) throw std::bad_alloc();
  void* p = tracked_new(size, align);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

constexpr size_t kPlain = __STDCPP_DEFAULT_NEW_ALIGNMENT__;

}  // namespace

void* operator new(size_t n) {
  return throwing_new(n, kPlain);
}
void* operator new[](size_t n) {
  return throwing_new(n, kPlain);
}
void* operator new(size_t n, std::align_val_t a) {
  return throwing_new(n, static_cast<size_t>(a));
}
void* operator new[](size_t n, std::align_val_t a) {
  return throwing_new(n, static_cast<size_t>(a));
}
void* operator new(size_t n, const std::nothrow_t&) noexcept {
  return tracked_new(n, kPlain);
}
void* operator new[](size_t n, const std::nothrow_t&) noexcept {
  return tracked_new(n, kPlain);
}
void* operator new(size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return tracked_new(n, static_cast<size_t>(a));
}
void* operator new[](size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return tracked_new(n, static_cast<size_t>(a));
}
void operator delete(void* p) noexcept {
  tracked_delete(p, kPlain);
}
void operator delete[](void* p) noexcept {
  tracked_delete(p, kPlain);
}
void operator delete(void* p, size_t) noexcept {
  tracked_delete(p, kPlain);
}
void operator delete[](void* p, size_t) noexcept {
  tracked_delete(p, kPlain);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
  tracked_delete(p, kPlain);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
  tracked_delete(p, kPlain);
}
void operator delete(void* p, std::align_val_t a) noexcept {
  tracked_delete(p, static_cast<size_t>(a));
}
void operator delete[](void* p, std::align_val_t a) noexcept {
  tracked_delete(p, static_cast<size_t>(a));
}
void operator delete(void* p, size_t, std::align_val_t a) noexcept {
  tracked_delete(p, static_cast<size_t>(a));
}
void operator delete[](void* p, size_t, std::align_val_t a) noexcept {
  tracked_delete(p, static_cast<size_t>(a));
}
void operator delete(void* p, std::align_val_t a, const std::nothrow_t&) noexcept {
  tracked_delete(p, static_cast<size_t>(a));
}
void operator delete[](void* p, std::align_val_t a, const std::nothrow_t&) noexcept {
  tracked_delete(p, static_cast<size_t>(a));
}

namespace loom {
namespace {

// The most bytes live at once, beyond those live before, while `calls` runs on a fresh thread
// (the thread's own state is allocated before the count starts).
int64_t measured_peak(const std::function<void()>& calls) {
  int64_t peak = 0;
  std::thread([&] {
    const int64_t base = g_live.load();
    g_peak.store(base);
    calls();
    peak = g_peak.load() - base;
  }).join();
  return peak;
}

// Sets LOOM_KERNEL for its lifetime ("" leaves the path to the CPU).
class ScopedPath {
 public:
  explicit ScopedPath(const std::string& path) : set_(!path.empty()) {
    if (set_) ::setenv("LOOM_KERNEL", path.c_str(), 1);
  }
  ~ScopedPath() {
    if (set_) ::unsetenv("LOOM_KERNEL");
  }
  ScopedPath(const ScopedPath&) = delete;
  ScopedPath& operator=(const ScopedPath&) = delete;

 private:
  bool set_;
};

// The paths to measure: the CPU's best, and where it has bf16 dot products the best runnable
// target without them (bf16 storage widened to fp32 takes other buffers).
std::vector<std::string> paths() {
  std::vector<std::string> p = {""};
  if (!kernels::best_ops().gemm_bf16) return p;
  for (const kernels::KernelTarget& t : kernels::kernel_targets())
    if (t.runnable && t.ops->gemm_bf16 == nullptr) {
      p.push_back(t.name);
      break;
    }
  return p;
}

struct Shape {
  int64_t sq, sk, heads, kv_heads, dim;
  bool large;  // the bound must be within 2x of the measured peak
};

template <class T>
Tensor<T> random_rows(int64_t n, int64_t h, int64_t d, uint32_t seed) {
  Tensor<float> x({n, h, d});
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist;
  for (int64_t i = 0; i < x.numel(); ++i) x.data()[i] = dist(gen);
  if constexpr (std::is_same_v<T, float>)
    return x;
  else
    return convert<T>(x);
}

// Runs every call sequence of shape s on storage T, `threads` threads, and checks the bound.
template <class T>
void check_shape(const Shape& s, int threads, bool backward) {
  KernelConfig cfg;
  cfg.scale = 0.125f;
  cfg.threads = threads;
  cfg.mask.window = 128;  // little arithmetic: what the calls allocate does not depend on the mask
  const Tensor<T> q = random_rows<T>(s.sq, s.heads, s.dim, 1);
  const Tensor<T> k = random_rows<T>(s.sk, s.kv_heads, s.dim, 2);
  const Tensor<T> v = random_rows<T>(s.sk, s.kv_heads, s.dim, 3);
  const Tensor<T> dout = random_rows<T>(s.sq, s.heads, s.dim, 4);
  std::vector<int64_t> qpos(static_cast<size_t>(s.sq)), kpos(static_cast<size_t>(s.sk));
  for (int64_t i = 0; i < s.sq; ++i) qpos[i] = s.sk - s.sq + i;  // the queries see every key
  for (int64_t j = 0; j < s.sk; ++j) kpos[j] = j;
  const Tokens qt{qpos.data(), nullptr, s.sq}, kt{kpos.data(), nullptr, s.sk};
  SoftmaxState st(s.sq, s.heads, s.dim);
  Tensor<T> out({s.sq, s.heads, s.dim});
  std::vector<float> lse(static_cast<size_t>(s.heads * s.sq) + 1),
      delta(static_cast<size_t>(s.heads * s.sq) + 1);
  attend(st.view(), q.view3(), k.view3(), v.view3(), qt, kt, cfg);
  finish(st.view(), out.view3(), lse.data(), s.sq);
  compute_delta(View3<const T>(out.view3()), dout.view3(), delta.data(), s.sq);
  Tensor<float> dq({s.sq, s.heads, s.dim}), dk({s.sk, s.kv_heads, s.dim}),
      dv({s.sk, s.kv_heads, s.dim});
  const auto forward = [&](int64_t nq, int64_t nk) {
    attend(st.view().sub_rows(0, nq), q.view3().rows(0, nq), k.view3().rows(0, nk),
           v.view3().rows(0, nk), qt.sub(0, nq), kt.sub(0, nk), cfg);
  };
  const auto backward_call = [&](int64_t nq, int64_t nk) {
    attend_backward(q.view3().rows(0, nq), k.view3().rows(0, nk), v.view3().rows(0, nk),
                    dout.view3().rows(0, nq), lse.data(), delta.data(), s.sq, qt.sub(0, nq),
                    kt.sub(0, nk), cfg, dq.view3().rows(0, nq), dk.view3().rows(0, nk),
                    dv.view3().rows(0, nk));
  };
  const int64_t bound = attend_workspace_bytes(s.sq, s.sk, s.heads, s.kv_heads, s.dim,
                                               std::is_same_v<T, bf16>, backward, cfg);
  const int64_t hq = (s.sq + 1) / 2, hk = (s.sk + 1) / 2;
  std::vector<std::pair<const char*, std::function<void()>>> sequences;
  sequences.emplace_back("whole", [&] { forward(s.sq, s.sk); });
  sequences.emplace_back("halves first", [&] {
    forward(hq, hk);
    forward(s.sq, s.sk);
  });
  if (backward) {
    sequences.emplace_back("forward, backward", [&] {
      forward(s.sq, s.sk);
      backward_call(s.sq, s.sk);
    });
    sequences.emplace_back("backward, forward", [&] {
      backward_call(s.sq, s.sk);
      forward(s.sq, s.sk);
    });
    sequences.emplace_back("halves, then whole", [&] {
      forward(hq, hk);
      backward_call(hq, hk);
      backward_call(s.sq, s.sk);
      forward(s.sq, s.sk);
    });
  }
  int64_t most = 0;
  for (const auto& [name, calls] : sequences) {
    const int64_t peak = measured_peak(calls);
    most = std::max(most, peak);
    EXPECT_LE(peak, bound) << name << ": [" << s.sq << " x " << s.sk << "], heads " << s.heads
                           << "/" << s.kv_heads << ", dim " << s.dim << ", threads " << threads
                           << (std::is_same_v<T, bf16> ? ", bf16" : ", fp32")
                           << (backward ? ", backward" : ", forward") << ", path " << kernel_path();
  }
  std::printf(
      "  %-10s %s %-8s [%5lld x %5lld] h %2lld/%2lld d %3lld t %d: peak %8.2f MiB, "
      "bound %8.2f MiB (%.2fx)\n",
      kernel_path(), std::is_same_v<T, bf16> ? "bf16" : "fp32", backward ? "backward" : "forward",
      static_cast<long long>(s.sq), static_cast<long long>(s.sk), static_cast<long long>(s.heads),
      static_cast<long long>(s.kv_heads), static_cast<long long>(s.dim), threads, most / 1048576.0,
      bound / 1048576.0, most > 0 ? double(bound) / double(most) : 0.0);
  if (s.large) {
    EXPECT_LE(bound, 2 * most) << "a loose bound: [" << s.sq << " x " << s.sk << "], heads "
                               << s.heads << "/" << s.kv_heads << ", path " << kernel_path();
  }
}

TEST(KernelMemory, TheBoundHoldsForEveryCallSequence) {
  const std::vector<Shape> shapes = {
      {5, 7, 2, 1, 16, false},        // tiles larger than the rows
      {300, 200, 4, 2, 64, false},    // GQA, partial tiles
      {2048, 2048, 4, 4, 64, true},   // a ring step of loom attn --seq 8192 on 4 ranks
      {1024, 4096, 8, 1, 128, true},  // GQA: the backward's copy outgrows the kept one
      {64, 16384, 2, 1, 128, true},   // the forward's packed copy of one kv head is 16 MiB
  };
  for (const std::string& path : paths()) {
    const ScopedPath scoped(path);
    for (const Shape& s : shapes)
      for (int threads : {1, 2})
        for (bool backward : {false, true}) {
          check_shape<float>(s, threads, backward);
          check_shape<bf16>(s, threads, backward);
        }
  }
}

TEST(KernelMemory, BadSizesAreRefused) {
  KernelConfig cfg;
  EXPECT_THROW(attend_workspace_bytes(-1, 8, 2, 1, 16, false, true, cfg), InvalidArgument);
  EXPECT_THROW(attend_workspace_bytes(8, -1, 2, 1, 16, false, true, cfg), InvalidArgument);
  EXPECT_THROW(attend_workspace_bytes(8, 8, 3, 2, 16, false, true, cfg), InvalidArgument);
  EXPECT_THROW(attend_workspace_bytes(8, 8, 0, 1, 16, false, true, cfg), InvalidArgument);
  EXPECT_THROW(attend_workspace_bytes(8, 8, 2, 1, 0, false, true, cfg), InvalidArgument);
  EXPECT_THROW(attend_workspace_bytes(8, 8, 2, 1, kMaxHeadDim + 1, false, true, cfg),
               InvalidArgument);
  cfg.threads = -1;
  EXPECT_THROW(attend_workspace_bytes(8, 8, 2, 1, 16, false, true, cfg), InvalidArgument);
  cfg.threads = 1;
  cfg.block_q = 0;
  EXPECT_THROW(attend_workspace_bytes(8, 8, 2, 1, 16, false, true, cfg), InvalidArgument);
  // Rows near 2^63 are a bound, not an error: the backward's per-head rows went through a double
  // that rounded to 2^63, and converted back overflowed ("work_tile_side: n must be >= 0").
  cfg.block_q = 64;
  for (const int64_t n : {INT64_MAX, INT64_MAX - 1, int64_t{1} << 62})
    for (const bool backward : {false, true})
      EXPECT_GT(attend_workspace_bytes(n, n, 2, 1, 16, false, backward, cfg), int64_t{1} << 40)
          << "rows " << n << (backward ? ", backward" : "");
  // Empty calls allocate little, and the bound grows with the sizes.
  EXPECT_GE(attend_workspace_bytes(0, 0, 2, 1, 16, false, true, cfg), 0);
  EXPECT_LT(attend_workspace_bytes(100, 100, 2, 1, 16, false, true, cfg),
            attend_workspace_bytes(1000, 1000, 2, 1, 16, false, true, cfg));
}

// A workspace allocation that fails is OutOfMemory (error.h), not std::bad_alloc, which a caller
// catching loom::Error did not catch. On a fresh thread: a thread keeps its last buffer.
template <class T>
void expect_out_of_memory() {
  const int64_t S = 512, H = 2, D = 64;
  KernelConfig cfg;
  cfg.scale = 0.125f;
  cfg.threads = 1;
  const Tensor<T> q = random_rows<T>(S, H, D, 1), k = random_rows<T>(S, H, D, 2),
                  v = random_rows<T>(S, H, D, 3);
  std::vector<int64_t> pos(static_cast<size_t>(S));
  for (int64_t i = 0; i < S; ++i) pos[i] = i;
  const Tokens t{pos.data(), nullptr, S};
  SoftmaxState st(S, H, D);
  std::vector<float> lse(static_cast<size_t>(H * S)), delta(lse.size());
  Tensor<float> dq({S, H, D}), dk({S, H, D}), dv({S, H, D});
  const auto expect_named = [](const std::function<void()>& call, const char* what) {
    std::string error;
    std::thread([&] {
      g_refuse_above.store(64 << 10);
      try {
        call();
      } catch (const OutOfMemory& e) {
        error = e.what();
      } catch (const std::bad_alloc&) {
        error = "std::bad_alloc";
      }
      g_refuse_above.store(SIZE_MAX);
    }).join();
    EXPECT_NE(error.find(std::string(what) + ": out of memory for the kernels' workspace"),
              std::string::npos)
        << (error.empty() ? "no error" : error);
  };
  expect_named([&] { attend(st.view(), q.view3(), k.view3(), v.view3(), t, t, cfg); }, "attend");
  expect_named(
      [&] {
        attend_backward(q.view3(), k.view3(), v.view3(), q.view3(), lse.data(), delta.data(), S, t,
                        t, cfg, dq.view3(), dk.view3(), dv.view3());
      },
      "attend_backward");
}

TEST(KernelMemory, AFailedAllocationIsOutOfMemory) {
  expect_out_of_memory<float>();
  expect_out_of_memory<bf16>();
}

}  // namespace
}  // namespace loom
