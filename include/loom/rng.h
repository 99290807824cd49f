// loom/rng.h: counter-based random numbers (Philox-4x32-10).
//
// The value generated for element (t, h, d) of a named tensor depends only on
// (seed, name, global token t, h, d). A rank that holds some tokens of a sequence generates
// exactly the values a one-rank run generates for those tokens, with no communication.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "loom/tensor.h"

namespace loom {

// One Philox-4x32-10 block: 4 random 32-bit words for a 128-bit counter and a 64-bit key.
std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> counter, uint64_t key);

// FNV-1a 64 of bytes, continuing from h (the offset basis by default): checkpoint checksums, the
// CLI's and loom.torch's agreement fingerprints, rng_key's name hash.
uint64_t fnv1a64(const void* data, size_t bytes, uint64_t h = 0xcbf29ce484222325ull);

// A 64-bit key from the user seed and a tensor name (FNV-1a of the name mixed with the seed).
uint64_t rng_key(uint64_t seed, std::string_view name);

// A standard normal for element (t, h, d) under key.
float normal_at(uint64_t key, int64_t t, int64_t h, int64_t d);

// Fills x[i, h, d] with normal_at(rng_key(seed, name), global_t[i], h, d) * stddev.
// global_t has x.s entries: the global token index of each row. InvalidArgument for negative
// sizes, or a null global_t or x.data where there are elements to fill.
void fill_normal(View3<float> x, const int64_t* global_t, uint64_t seed, std::string_view name,
                 float stddev = 1.0f);

}  // namespace loom
