// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11).
//
// A counter-based generator: the output is a pure function of (counter, key). loom uses the
// counter (t_lo, t_hi, h, d) and a key made from (seed, tensor name), so the value of any element
// of a generated tensor depends only on its global coordinates and never on how the sequence is
// split across ranks.
#include "loom/rng.h"

#include <cmath>

#include "loom/error.h"

namespace loom {

namespace {
constexpr uint32_t kMul0 = 0xD2511F53u;
constexpr uint32_t kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u;
constexpr uint32_t kWeyl1 = 0xBB67AE85u;

inline void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}
}  // namespace

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> c, uint64_t key) {
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kMul0, c[0], hi0, lo0);
    mulhilo(kMul1, c[2], hi1, lo1);
    c = {hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0};
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return c;
}

uint64_t fnv1a64(const void* data, size_t bytes, uint64_t h) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

uint64_t rng_key(uint64_t seed, std::string_view name) {
  const uint64_t h = fnv1a64(name.data(), name.size());
  // splitmix64 of seed, mixed with the name hash
  uint64_t z = seed + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return z ^ (h * 0x9E3779B97F4A7C15ull);
}

float normal_at(uint64_t key, int64_t t, int64_t h, int64_t d) {
  const uint64_t ut = static_cast<uint64_t>(t);
  const std::array<uint32_t, 4> r =
      philox4x32({static_cast<uint32_t>(ut), static_cast<uint32_t>(ut >> 32),
                  static_cast<uint32_t>(h), static_cast<uint32_t>(d)},
                 key);
  // Box-Muller on two 32-bit uniforms in (0, 1].
  const double u1 = (static_cast<double>(r[0]) + 1.0) * (1.0 / 4294967296.0);
  const double u2 = static_cast<double>(r[1]) * (1.0 / 4294967296.0);
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
}

void fill_normal(View3<float> x, const int64_t* global_t, uint64_t seed, std::string_view name,
                 float stddev) {
  // Checked, as the kernels check their views: a null global_t was dereferenced (SIGSEGV).
  LOOM_CHECK(
      x.s >= 0 && x.h >= 0 && x.d >= 0, InvalidArgument,
      "fill_normal(" << name << "): negative size [" << x.s << ", " << x.h << ", " << x.d << "]");
  const bool empty = x.s == 0 || x.h == 0 || x.d == 0;
  LOOM_CHECK(empty || x.data != nullptr, InvalidArgument,
             "fill_normal(" << name << "): null data for a non-empty view");
  LOOM_CHECK(empty || global_t != nullptr, InvalidArgument,
             "fill_normal(" << name << "): global_t is null; it must hold the global token of "
                            << "each of the " << x.s << " rows");
  const uint64_t key = rng_key(seed, name);
  for (int64_t i = 0; i < x.s; ++i)
    for (int64_t h = 0; h < x.h; ++h) {
      float* row = x.row(i, h);
      for (int64_t d = 0; d < x.d; ++d) row[d] = normal_at(key, global_t[i], h, d) * stddev;
    }
}

}  // namespace loom
