// The single-rank building blocks: GEMMs through OpenBLAS, and the pointwise and row-wise layers
// of the GPT with their backward passes. Reductions over a row are accumulated in double, so the
// float and double instantiations differ only by the storage rounding.
#include "ops.h"

#include <cblas.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>

extern "C" void openblas_set_num_threads(int);

namespace loom::model {

namespace {
CBLAS_TRANSPOSE tr(bool t) {
  return t ? CblasTrans : CblasNoTrans;
}
}  // namespace

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, tr(trans_a), tr(trans_b), static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda),
              b, static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
          const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
          int64_t ldc) {
  if (m == 0 || n == 0) return;
  cblas_dgemm(CblasRowMajor, tr(trans_a), tr(trans_b), static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda),
              b, static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

namespace {
using SbgemmFn = void (*)(CBLAS_ORDER, CBLAS_TRANSPOSE, CBLAS_TRANSPOSE, blasint, blasint, blasint,
                          float, const bfloat16*, blasint, const bfloat16*, blasint, float, float*,
                          blasint);
// OpenBLAS declares cblas_sbgemm in cblas.h but only builds it with BUILD_BFLOAT16 (Debian 12's
// 0.3.21 does not), so it is looked up at run time.
SbgemmFn find_sbgemm() {
  static const SbgemmFn fn = reinterpret_cast<SbgemmFn>(dlsym(RTLD_DEFAULT, "cblas_sbgemm"));
  return fn;
}
}  // namespace

bool have_bf16_gemm() {
  return find_sbgemm() != nullptr;
}

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const bf16* a,
          int64_t lda, const bf16* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  static_assert(sizeof(bf16) == sizeof(bfloat16), "bf16 must be OpenBLAS's bfloat16");
  if (SbgemmFn fn = find_sbgemm()) {
    fn(CblasRowMajor, tr(trans_a), tr(trans_b), static_cast<blasint>(m), static_cast<blasint>(n),
       static_cast<blasint>(k), alpha, reinterpret_cast<const bfloat16*>(a),
       static_cast<blasint>(lda), reinterpret_cast<const bfloat16*>(b), static_cast<blasint>(ldb),
       beta, c, static_cast<blasint>(ldc));
    return;
  }
  // No bf16 GEMM: widen the bf16 operands (exactly) and multiply in fp32.
  const int64_t na = (trans_a ? k : m) * lda, nb = (trans_b ? n : k) * ldb;
  std::vector<float> fa(static_cast<size_t>(na)), fb(static_cast<size_t>(nb));
  for (int64_t i = 0; i < na; ++i) fa[i] = to_float(a[i]);
  for (int64_t i = 0; i < nb; ++i) fb[i] = to_float(b[i]);
  gemm(trans_a, trans_b, m, n, k, alpha, fa.data(), lda, fb.data(), ldb, beta, c, ldc);
}

void to_bf16(const float* x, int64_t n, bf16* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = loom::to_bf16(x[i]);
}

void set_blas_threads(int threads) {
  openblas_set_num_threads(std::max(1, threads));
}

template <class T>
void rmsnorm_forward(const T* x, const T* g, int64_t n, int64_t c, T eps, T* y, T* inv_rms) {
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * c;
    double ss = 0;
    for (int64_t j = 0; j < c; ++j) ss += static_cast<double>(xi[j]) * xi[j];
    const T r = static_cast<T>(1.0 / std::sqrt(ss / static_cast<double>(c) + eps));
    inv_rms[i] = r;
    T* yi = y + i * c;
    for (int64_t j = 0; j < c; ++j) yi[j] = xi[j] * r * g[j];
  }
}

template <class T>
void rmsnorm_backward(const T* x, const T* g, const T* inv_rms, const T* dy, int64_t n, int64_t c,
                      T* dx, T* dg, bool accumulate) {
  // y = xhat * g with xhat = x r:  dxhat = dy g,  dx = r (dxhat - xhat mean(dxhat xhat)).
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * c;
    const T* dyi = dy + i * c;
    const T r = inv_rms[i];
    double dot = 0;
    for (int64_t j = 0; j < c; ++j) {
      const T xhat = xi[j] * r;
      dg[j] += dyi[j] * xhat;
      dot += static_cast<double>(dyi[j]) * g[j] * xhat;
    }
    const T mean = static_cast<T>(dot / static_cast<double>(c));
    T* dxi = dx + i * c;
    for (int64_t j = 0; j < c; ++j) {
      const T v = r * (dyi[j] * g[j] - xi[j] * r * mean);
      dxi[j] = accumulate ? dxi[j] + v : v;
    }
  }
}

template <class T>
void rope(T* x, int64_t n, int64_t heads, int64_t d, const int64_t* pos, double theta,
          bool inverse) {
  const int64_t half = d / 2;
  std::vector<double> freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    freq[i] = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(d));
  std::vector<T> cs(static_cast<size_t>(half)), sn(static_cast<size_t>(half));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const double ang = static_cast<double>(pos[t]) * freq[i];
      cs[i] = static_cast<T>(std::cos(ang));
      sn[i] = static_cast<T>(inverse ? -std::sin(ang) : std::sin(ang));
    }
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + (t * heads + h) * d;
      for (int64_t i = 0; i < half; ++i) {
        const T a = v[2 * i], b = v[2 * i + 1];
        v[2 * i] = a * cs[i] - b * sn[i];
        v[2 * i + 1] = a * sn[i] + b * cs[i];
      }
    }
  }
}

template <class T>
void swiglu_forward(const T* u, const T* g, int64_t count, T* a) {
  for (int64_t i = 0; i < count; ++i) {
    const T s = T(1) / (T(1) + std::exp(-u[i]));
    a[i] = u[i] * s * g[i];
  }
}

template <class T>
void swiglu_backward(const T* u, const T* g, const T* da, int64_t count, T* du, T* dg) {
  for (int64_t i = 0; i < count; ++i) {
    const T s = T(1) / (T(1) + std::exp(-u[i]));
    const T silu = u[i] * s;
    dg[i] = da[i] * silu;
    du[i] = da[i] * g[i] * s * (T(1) + u[i] * (T(1) - s));
  }
}

template <class T>
double cross_entropy(const T* logits, const int32_t* target, int64_t n, int64_t v, T scale,
                     T* dlogits) {
  double loss = 0;
  for (int64_t i = 0; i < n; ++i) {
    const T* li = logits + i * v;
    T* di = dlogits + i * v;
    if (target[i] < 0) {
      std::fill_n(di, v, T(0));
      continue;
    }
    T mx = li[0];
    for (int64_t j = 1; j < v; ++j) mx = std::max(mx, li[j]);
    double sum = 0;
    for (int64_t j = 0; j < v; ++j) sum += std::exp(static_cast<double>(li[j] - mx));
    const double lse = static_cast<double>(mx) + std::log(sum);
    loss += lse - static_cast<double>(li[target[i]]);
    for (int64_t j = 0; j < v; ++j)
      di[j] = static_cast<T>(std::exp(static_cast<double>(li[j]) - lse)) * scale;
    di[target[i]] -= scale;
  }
  return loss;
}

#define LOOM_MODEL_OPS(T)                                                                         \
  template void rmsnorm_forward<T>(const T*, const T*, int64_t, int64_t, T, T*, T*);              \
  template void rmsnorm_backward<T>(const T*, const T*, const T*, const T*, int64_t, int64_t, T*, \
                                    T*, bool);                                                    \
  template void rope<T>(T*, int64_t, int64_t, int64_t, const int64_t*, double, bool);             \
  template void swiglu_forward<T>(const T*, const T*, int64_t, T*);                               \
  template void swiglu_backward<T>(const T*, const T*, const T*, int64_t, T*, T*);                \
  template double cross_entropy<T>(const T*, const int32_t*, int64_t, int64_t, T, T*);
LOOM_MODEL_OPS(float)
LOOM_MODEL_OPS(double)
#undef LOOM_MODEL_OPS

}  // namespace loom::model
