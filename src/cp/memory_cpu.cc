// The CPU implementation of the memory seam (memory.h): host buffers and copies, the host clock.
// This is the code the strategies used to carry inline, moved here unchanged.
#include <algorithm>
#include <cassert>
#include <cstring>
#include <new>
#include <sstream>

#include "loom/bf16.h"
#include "loom/error.h"
#include "loom/io.h"
#include "loom/timer.h"
#include "memory.h"

namespace loom::cp_detail {

void* Memory::raw(size_t slot, size_t bytes) {
  assert(slot < kSlots);
  Buf& b = bufs_[slot];
  if (bytes > b.bytes) {
    b.p.reset();  // the old buffer is not needed beside the new one
    b.bytes = 0;
    try {
      b.p.reset(new std::byte[bytes]);
    } catch (const std::bad_alloc&) {  // OutOfMemory, as error.h promises, not std::bad_alloc
      std::ostringstream os;
      os << "out of memory for a strategy buffer of " << human_bytes(static_cast<double>(bytes))
         << " (slot " << slot << ")";
      throw OutOfMemory(os.str(), __FILE__, __LINE__);
    }
    b.bytes = bytes;
  }
  return b.p.get();
}

template <class T>
void Memory::pack(View3<const T> x, T* dst) {
  const int64_t w = x.h * x.d;
  if (x.s * w == 0) return;
  if (x.contiguous()) {
    std::memcpy(dst, x.data, sizeof(T) * static_cast<size_t>(x.s * w));
    return;
  }
  for (int64_t i = 0; i < x.s; ++i)
    for (int64_t h = 0; h < x.h; ++h)
      std::memcpy(dst + i * w + h * x.d, x.row(i, h), sizeof(T) * static_cast<size_t>(x.d));
}

template <class T>
void Memory::unpack(const T* src, View3<T> x) {
  const int64_t w = x.h * x.d;
  for (int64_t i = 0; i < x.s; ++i)
    for (int64_t h = 0; h < x.h; ++h)
      std::memcpy(x.row(i, h), src + i * w + h * x.d, sizeof(T) * static_cast<size_t>(x.d));
}

void Memory::zero(View3<float> x) {
  for (int64_t i = 0; i < x.s; ++i)
    for (int64_t h = 0; h < x.h; ++h) std::fill_n(x.row(i, h), x.d, 0.0f);
}

void Memory::zero(float* p, size_t n) {
  std::fill_n(p, n, 0.0f);
}

void Memory::add(float* dst, const float* a, const float* b, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = a[i] + b[i];
}

void Memory::add(View3<float> x, const float* src) {
  const int64_t w = x.h * x.d;
  for (int64_t i = 0; i < x.s; ++i)
    for (int64_t h = 0; h < x.h; ++h) {
      float* dst = x.row(i, h);
      const float* s = src + i * w + h * x.d;
      for (int64_t c = 0; c < x.d; ++c) dst[c] += s[c];
    }
}

template <class T>
void Memory::copy(T* dst, const T* src, size_t n) {
  if (n) std::memcpy(dst, src, n * sizeof(T));
}

Memory::Event Memory::record() const {
  return now_s();
}

template void Memory::pack<float>(View3<const float>, float*);
template void Memory::pack<bf16>(View3<const bf16>, bf16*);
template void Memory::unpack<float>(const float*, View3<float>);
template void Memory::unpack<bf16>(const bf16*, View3<bf16>);
template void Memory::copy<float>(float*, const float*, size_t);
template void Memory::copy<bf16>(bf16*, const bf16*, size_t);

}  // namespace loom::cp_detail
