// loom/bf16.h: the bfloat16 storage type and its conversions.
//
// bf16 is the upper half of an IEEE fp32. float -> bf16 rounds to nearest, ties to even; NaN
// stays NaN (quiet), +-Inf stay Inf, values past the largest bf16 round to Inf as IEEE says.
// bf16 -> float is exact. Arithmetic is never done in bf16: convert, compute in fp32.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace loom {

struct bf16 {
  uint16_t bits = 0;
};

inline bf16 to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  bf16 r;
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign, force quiet bit
    r.bits = static_cast<uint16_t>((u >> 16) | 0x0040u);
    return r;
  }
  const uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;  // round to nearest even
  r.bits = static_cast<uint16_t>(u >> 16);
  return r;
}

// A double rounded to the nearest bf16 (ties to even) in one rounding: through float rounded to
// odd, which keeps the 16 bits below bf16's last one exact enough. Rounding to the nearest float
// first rounded twice (1 + 2^-8 + 2^-30 became 1, not 1 + 2^-7).
inline bf16 to_bf16(double d) {
  float f = static_cast<float>(d);
  if (std::isfinite(f) && static_cast<double>(f) != d) {
    if (std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u |= 1u;  // sticky: the value lies strictly between this float and the next
    std::memcpy(&f, &u, 4);
  }
  return to_bf16(f);
}

inline float to_float(bf16 b) {
  const uint32_t u = static_cast<uint32_t>(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace loom
