// loom/tensor.h: owning row-major tensors and strided [S, H, D] views.
//
// Tensor<T> owns a contiguous row-major buffer of up to 4 dimensions. View3<T> is a non-owning
// window over an [S, H, D] array whose innermost (D) stride is 1 and whose S and H strides are
// the caller's, so a range of rows or a range of heads of a larger tensor is a view without a
// copy. The kernels and CpAttention take rows laid out one after another (S-major): head stride
// hs >= D and row stride ss >= H x D; an output's rows must also not overlap (ss >= (H - 1) x hs
// + D), and CpAttention's outputs must not share memory with its inputs. A head-major [H, S, D]
// buffer (ss = D, hs = S x D) is refused: copy it to [S, H, D] first.
// Views never outlive the storage they point into (the caller's duty). Neither type is
// internally synchronised: concurrent writes to one tensor need outside coordination.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "loom/error.h"

namespace loom {

// "[4, 8, 64]" for messages.
std::string shape_str(const std::vector<int64_t>& shape);
// Throws OutOfMemory naming the shape and the bytes that could not be allocated.
[[noreturn]] void throw_tensor_alloc(const std::vector<int64_t>& shape, int64_t count,
                                     size_t element_bytes);

template <class T>
struct View3 {
  T* data = nullptr;
  int64_t s = 0, h = 0, d = 0;  // sizes: sequence rows, heads, head dim
  int64_t ss = 0, hs = 0;       // strides (elements) of the S and H axes; D stride is 1

  T& operator()(int64_t i, int64_t j, int64_t k) const { return data[i * ss + j * hs + k]; }
  T* row(int64_t i, int64_t j) const { return data + i * ss + j * hs; }
  // Rows [begin, begin + count) of this view.
  View3 rows(int64_t begin, int64_t count) const {
    return View3{data + begin * ss, count, h, d, ss, hs};
  }
  // Heads [begin, begin + count) of this view.
  View3 heads(int64_t begin, int64_t count) const {
    return View3{data + begin * hs, s, count, d, ss, hs};
  }
  operator View3<const T>() const { return View3<const T>{data, s, h, d, ss, hs}; }
  bool contiguous() const { return hs == d && ss == h * d; }
};

// The contiguous [s, h, d] view of the memory at p.
template <class T>
View3<T> contiguous_view(T* p, int64_t s, int64_t h, int64_t d) {
  return View3<T>{p, s, h, d, h * d, d};
}

template <class T>
class Tensor {
 public:
  // An empty placeholder: shape [] and no element. Not the 0-d tensor Tensor(std::vector<
  // int64_t>{}), whose shape [] holds one element: write_npy refuses it (give it a shape, such as
  // {0} for an empty array).
  Tensor() = default;
  // Throws InvalidArgument for more than 4 dimensions, a negative dimension or an element count
  // beyond int64, and OutOfMemory (naming the shape and size) when the allocation fails.
  explicit Tensor(std::vector<int64_t> shape, T fill = T{}) : shape_(std::move(shape)) {
    LOOM_CHECK(shape_.size() <= 4, InvalidArgument,
               "a tensor has at most 4 dimensions, got " << shape_str(shape_));
    int64_t n = 1;
    for (int64_t x : shape_) {
      LOOM_CHECK(x >= 0, InvalidArgument, "tensor dimension must be >= 0, got " << x);
      LOOM_CHECK(!__builtin_mul_overflow(n, x, &n), InvalidArgument,
                 "tensor shape " << shape_str(shape_) << " has more elements than int64 holds");
    }
    try {
      data_.assign(static_cast<size_t>(n), fill);
    } catch (const std::bad_alloc&) {
      throw_tensor_alloc(shape_, n, sizeof(T));
    } catch (const std::length_error&) {
      throw_tensor_alloc(shape_, n, sizeof(T));
    }
  }
  Tensor(std::initializer_list<int64_t> shape) : Tensor(std::vector<int64_t>(shape)) {}

  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  // Dimension i in [0, dim()); InvalidArgument otherwise (it was std::out_of_range).
  int64_t size(int64_t i) const {
    LOOM_CHECK(i >= 0 && i < dim(), InvalidArgument,
               "dimension " << i << " of a " << dim() << "-d tensor " << shape_str(shape_));
    return shape_[static_cast<size_t>(i)];
  }
  int64_t numel() const { return static_cast<int64_t>(data_.size()); }
  T* data() { return data_.data(); }
  const T* data() const { return data_.data(); }
  T& operator[](int64_t i) { return data_[static_cast<size_t>(i)]; }
  const T& operator[](int64_t i) const { return data_[static_cast<size_t>(i)]; }
  std::vector<T>& vec() { return data_; }
  const std::vector<T>& vec() const { return data_; }
  void fill(T value) { data_.assign(data_.size(), value); }

  // A [S, H, D] view of a 3-d tensor.
  View3<T> view3() {
    LOOM_CHECK_EQ(dim(), 3, InvalidArgument, "view3 needs a 3-d tensor");
    return View3<T>{data(), shape_[0], shape_[1], shape_[2], shape_[1] * shape_[2], shape_[2]};
  }
  View3<const T> view3() const {
    LOOM_CHECK_EQ(dim(), 3, InvalidArgument, "view3 needs a 3-d tensor");
    return View3<const T>{data(),   shape_[0], shape_[1], shape_[2], shape_[1] * shape_[2],
                          shape_[2]};
  }

 private:
  std::vector<int64_t> shape_;
  std::vector<T> data_;
};

// Element-wise conversion between tensor types (float <-> double, float <-> bf16).
template <class To, class From>
Tensor<To> convert(const Tensor<From>& x);

}  // namespace loom
