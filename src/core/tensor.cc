// Tensor helpers: shape formatting and element-wise conversions.
#include <sstream>

#include "loom/bf16.h"
#include "loom/tensor.h"

namespace loom {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

void throw_tensor_alloc(const std::vector<int64_t>& shape, int64_t count, size_t element_bytes) {
  std::ostringstream os;
  os << "out of memory: cannot allocate "
     << static_cast<double>(count) * static_cast<double>(element_bytes) / (1 << 20)
     << " MiB for a tensor of shape " << shape_str(shape) << " (" << element_bytes
     << "-byte elements)";
  throw OutOfMemory(os.str(), __FILE__, __LINE__);
}

namespace {
template <class To, class From>
To convert_one(From x) {
  if constexpr (std::is_same_v<To, bf16>) {
    return to_bf16(static_cast<float>(x));
  } else if constexpr (std::is_same_v<From, bf16>) {
    return static_cast<To>(to_float(x));
  } else {
    return static_cast<To>(x);
  }
}
}  // namespace

template <class To, class From>
Tensor<To> convert(const Tensor<From>& x) {
  Tensor<To> y(x.shape());
  const int64_t n = x.numel();
  for (int64_t i = 0; i < n; ++i) y[i] = convert_one<To, From>(x[i]);
  return y;
}

template Tensor<double> convert(const Tensor<float>&);
template Tensor<float> convert(const Tensor<double>&);
template Tensor<bf16> convert(const Tensor<float>&);
template Tensor<float> convert(const Tensor<bf16>&);

}  // namespace loom
