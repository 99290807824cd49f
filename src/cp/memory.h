// Internal to src/cp: the memory seam. Everything the strategies do to memory goes through one
// Memory object: the buffers they reuse across calls, strided pack/unpack between a View3 and
// contiguous rows, zero, add, copy, and the events that time their steps. The kernels and the
// Communicator are the only other things a strategy calls.
//
// This is the CPU implementation (memory_cpu.cc): host buffers, plain copies and loops, host
// clock events. A CUDA build would provide another memory_*.cc with the same declarations
// (device buffers from a caching allocator, cudaMemcpy2DAsync / small kernels on the compute
// stream, cudaEvent_t events); see docs/design-gpu.md. Strategies do not change.
//
// Not thread-safe: one Memory per CpAttention, used by the thread that calls it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "loom/tensor.h"

namespace loom::cp_detail {

class Memory {
 public:
  // A buffer slot reused across calls: at least `count` elements of T, contents unspecified
  // (grows, never shrinks). Slots are numbered by their user; a pointer stays valid until the
  // same slot is asked for with a larger count.
  static constexpr size_t kSlots = 16;
  template <class T>
  T* buffer(size_t slot, size_t count) {
    return static_cast<T*>(raw(slot, count * sizeof(T)));
  }

  // Copies a (possibly strided) view into contiguous rows at dst, and back.
  template <class T>
  void pack(View3<const T> x, T* dst);
  template <class T>
  void unpack(const T* src, View3<T> x);
  // x = 0 over the view, or over n contiguous floats.
  void zero(View3<float> x);
  void zero(float* p, size_t n);
  // dst[i] = a[i] + b[i] (dst may alias a or b).
  void add(float* dst, const float* a, const float* b, size_t n);
  // x += src, src contiguous rows of the view's shape.
  void add(View3<float> x, const float* src);
  template <class T>
  void copy(T* dst, const T* src, size_t n);
  // Bytes the slots hold (slots never shrink, so this is also their peak).
  size_t held_bytes() const {
    size_t n = 0;
    for (const Buf& b : bufs_) n += b.bytes;
    return n;
  }

  // Events order and time the work of a step. On the CPU an event is the host clock at the
  // moment it is recorded, and elapsed(a, b) is b - a in seconds.
  using Event = double;
  Event record() const;
  static double elapsed(Event a, Event b) { return b - a; }

 private:
  void* raw(size_t slot, size_t bytes);
  struct Buf {
    std::unique_ptr<std::byte[]> p;
    size_t bytes = 0;
  };
  std::array<Buf, kSlots> bufs_;
};

}  // namespace loom::cp_detail
