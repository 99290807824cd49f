// Argument checks shared by the kernel entry points (internal to src/kernels).
//
// Every public kernel function checks its arguments once, here, and then trusts them: the hot
// loops assert nothing. The messages carry both values of a failed comparison (LOOM_CHECK_OP).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "loom/attention.h"
#include "loom/error.h"
#include "loom/tensor.h"

namespace loom::kernels {

constexpr int64_t kMaxHeadDim = 256;

// A view's sizes are non-negative and its strides leave room for its rows and heads. A writable
// view (View3<T> with T not const: every output, out, dq, dk, dv, merge's out_a) must also not
// overlap itself, ss >= (h - 1) hs + d (loom/tensor.h): with hs = 2D and ss = H x D, row i's head
// 1 was row i + 1's head 0, and finish() wrote out with a relative error of 0.88, accepted.
// Inputs may overlap (ss >= H x D suffices: they are only read).
template <class T>
void check_view(const View3<T>& x, const char* name) {
  LOOM_CHECK(x.s >= 0 && x.h >= 0 && x.d >= 0, InvalidArgument,
             name << ": negative size [" << x.s << ", " << x.h << ", " << x.d << "]");
  LOOM_CHECK(x.s == 0 || x.h == 0 || x.d == 0 || x.data != nullptr, InvalidArgument,
             name << ": null data for a non-empty view");
  if (x.h > 1) LOOM_CHECK_GE(x.hs, x.d, InvalidArgument, name << ": head stride too small");
  // h * d can overflow int64 (h = 2^60, d = 16 wrapped to 0 and passed): compared as h <= ss / d.
  if (x.s > 1 && x.d > 0)
    LOOM_CHECK(
        x.ss >= 0 && x.h <= x.ss / x.d, InvalidArgument,
        name << ": row stride too small (" << x.ss << " for " << x.h << " heads of " << x.d << ")");
  if constexpr (!std::is_const_v<T>) {
    // (h - 1) hs <= ss - d, in a form that cannot overflow (ss >= h d >= d here).
    LOOM_CHECK(x.s <= 1 || x.h <= 1 || x.d == 0 || (x.ss - x.d) / (x.h - 1) >= x.hs,
               InvalidArgument,
               name << ": row stride " << x.ss << " is smaller than (heads - 1) x head stride + "
                    << "head dim = (" << x.h << " - 1) x " << x.hs << " + " << x.d
                    << ": the output's rows would overlap");
  }
}

template <class T>
void check_same_shape(const View3<T>& a, const View3<T>& b, const char* what) {
  LOOM_CHECK(a.s == b.s && a.h == b.h && a.d == b.d, InvalidArgument,
             what << ": shapes differ, [" << a.s << ", " << a.h << ", " << a.d << "] vs [" << b.s
                  << ", " << b.h << ", " << b.d << "]");
}

inline void check_tokens(const Tokens& t, int64_t rows, const char* name) {
  LOOM_CHECK_EQ(t.n, rows, InvalidArgument, name << ": token count must equal the rows");
  LOOM_CHECK(t.n == 0 || t.pos != nullptr, InvalidArgument, name << ": positions are required");
}

inline void check_mask(const Mask& mask) {
  LOOM_CHECK_GE(mask.window, 0, InvalidArgument, "mask window must be >= 0");
}

// q [Sq, H, D], k and v [Sk, Hkv, D], with their tokens.
template <class T>
void check_qkv(const View3<const T>& q, const View3<const T>& k, const View3<const T>& v,
               const Tokens& qt, const Tokens& kt) {
  check_view(q, "q");
  check_view(k, "k");
  check_view(v, "v");
  check_same_shape(k, v, "k and v");
  LOOM_CHECK_EQ(q.d, k.d, InvalidArgument, "q and k must have the same head dim");
  LOOM_CHECK(q.d >= 1 && q.d <= kMaxHeadDim, InvalidArgument,
             "head dim must be in [1, " << kMaxHeadDim << "], got " << q.d);
  LOOM_CHECK_GT(k.h, 0, InvalidArgument, "kv heads must be positive");
  LOOM_CHECK_GT(q.h, 0, InvalidArgument, "query heads must be positive");
  LOOM_CHECK_EQ(q.h % k.h, 0, InvalidArgument, "query heads must be a multiple of kv heads");
  check_tokens(qt, q.s, "query tokens");
  check_tokens(kt, k.s, "key tokens");
}

template <class S>
void check_scale(S scale) {
  LOOM_CHECK(std::isfinite(scale) && scale > 0, InvalidArgument,
             "softmax scale must be positive and finite, got " << scale);
}

}  // namespace loom::kernels
