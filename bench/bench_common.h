// Helpers shared by the C++ benchmarks (bench_kernels, ggml_compare): their random inputs and the
// relative error of their correctness checks.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "loom/tensor.h"

namespace loom::bench {

// A tensor of the given shape, each element drawn from N(0, 1) by std::mt19937(seed).
inline Tensor<float> random_normal(std::vector<int64_t> shape, uint32_t seed) {
  Tensor<float> x(std::move(shape));
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& e : x.vec()) e = normal(gen);
  return x;
}

// ||x - ref|| / ||ref|| (||x - ref|| when ref is 0), infinite when x holds a non-finite value: the
// measure of tests/unit/tolerance.h, against which the checks' limits are written.
inline double rel_error(const std::vector<float>& x, const std::vector<double>& ref) {
  double err = 0, norm = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) return INFINITY;
    err += (x[i] - ref[i]) * (x[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  return norm > 0 ? std::sqrt(err / norm) : std::sqrt(err);
}

}  // namespace loom::bench
