// model/ops.h: the single-rank building blocks of the GPT trainer, each a forward and its
// hand-written backward. Templated on the element type (float for training, double for the
// finite-difference tests, which run the very same code).
//
// Shapes are row-major and named in the argument lists: x [n, c] is n rows of c values. Backward
// functions ACCUMULATE (+=) into parameter gradients (dg, dw) and OVERWRITE input gradients (dx)
// unless stated otherwise. Nothing here allocates across calls or talks to other ranks; every
// function is safe to call concurrently on disjoint outputs. Preconditions are the caller's
// (checked once at the model's entry), so these run without checks.
#pragma once

#include <cstdint>
#include <vector>

#include "loom/bf16.h"

namespace loom::model {

// C[m, n] = alpha * op(A) op(B) + beta * C, row-major; op(A) is [m, k] (A^T when trans_a), op(B)
// [k, n]. lda/ldb/ldc are the row strides of the stored matrices. cblas_sgemm / cblas_dgemm.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
          const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
          int64_t ldc);
// The same with bf16 operands and fp32 accumulation and output: cblas_sbgemm when the OpenBLAS
// in use has it (have_bf16_gemm()), else the operands are widened exactly to fp32 for sgemm.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const bf16* a,
          int64_t lda, const bf16* b, int64_t ldb, float beta, float* c, int64_t ldc);

bool have_bf16_gemm();

// Rounds n floats to bf16 (nearest even).
void to_bf16(const float* x, int64_t n, bf16* out);

// ---------------------------------------------------------------------------------------------
// RMSNorm: y[i, :] = x[i, :] * inv_rms[i] * g,  inv_rms[i] = 1 / sqrt(mean_j x[i, j]^2 + eps).
template <class T>
void rmsnorm_forward(const T* x, const T* g, int64_t n, int64_t c, T eps, T* y, T* inv_rms);
// dx [n, c] overwritten (or added to when accumulate); dg [c] accumulated.
template <class T>
void rmsnorm_backward(const T* x, const T* g, const T* inv_rms, const T* dy, int64_t n, int64_t c,
                      T* dx, T* dg, bool accumulate);

// ---------------------------------------------------------------------------------------------
// Rotary position embedding on x [n, heads, d] (d even), in place: the pair (2i, 2i+1) of a row
// at position p is rotated by angle p * theta^(-2i/d). inverse = true rotates by minus the angle,
// which is the backward (a rotation's transpose is its inverse).
template <class T>
void rope(T* x, int64_t n, int64_t heads, int64_t d, const int64_t* pos, double theta,
          bool inverse);

// ---------------------------------------------------------------------------------------------
// SwiGLU: a = silu(u) * g elementwise over count values; silu(u) = u / (1 + exp(-u)).
template <class T>
void swiglu_forward(const T* u, const T* g, int64_t count, T* a);
// du, dg overwritten.
template <class T>
void swiglu_backward(const T* u, const T* g, const T* da, int64_t count, T* du, T* dg);

// ---------------------------------------------------------------------------------------------
// Cross-entropy over logits [n, v] with integer targets (target < 0: the row predicts nothing).
// Returns sum over predicting rows of -log softmax(logits[i])[target[i]]. dlogits [n, v] is
// overwritten with scale * (softmax - onehot) for predicting rows and 0 for the others (scale is
// 1 / the number of predicted tokens of the whole global batch, so gradients are of the mean).
template <class T>
double cross_entropy(const T* logits, const int32_t* target, int64_t n, int64_t v, T scale,
                     T* dlogits);

}  // namespace loom::model
