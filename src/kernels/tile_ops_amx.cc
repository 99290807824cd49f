// The AMX part of the amx path (see tile_ops.h): TileOps::gemm_bf16 and dot_bf16 on Intel's
// Advanced Matrix Extensions (AMX-TILE + AMX-BF16, Sapphire Rapids and later Xeons), the rest of
// the table being avx512bf16's. One TDPBF16PS multiplies a 16-row x 16-pair tile of A by a 16-pair
// x 16-column tile of B into a 16 x 16 fp32 tile of C: 8192 multiply-adds (one core of the Xeon of
// docs/performance.md round 22 ran them at 1.8 TFLOP/s, 13x its fp32 sgemm). Highway 1.0.3 has no
// AMX, so this stays hand-written, like the vdpbf16ps GEMM of tile_ops_avx512bf16.cc.
//
// This file is compiled with AMX and AVX-512 flags (src/kernels/CMakeLists.txt) while the rest of
// loom is not, so nothing here may be reached unless the CPU reports AMX-TILE, AMX-BF16 and
// avx512_bf16 and Linux granted this process the tile data (kernel_targets() checks all of that
// before it marks the path runnable), and this file must not emit out-of-line copies of inline
// functions or templates that other files also use: it calls no std:: algorithms or containers,
// only intrinsics, memcpy/memset/malloc and its own internal-linkage functions.
//
// Operands are gemm_bf16's: A(i, t) the bf16 pair a[i lda + 2t .. + 1], B(t, j) the pair
// b[t ldb + 2j .. + 1]. A tile of A is 16 rows of 16 pairs (64 bytes a row, lda * 2 bytes apart);
// a tile of B is 16 pair rows of 16 columns (ldb * 2 bytes apart): both are read in place. One
// tile configuration serves every call: tmm0-3 accumulate a 32 x 32 block of C (2 x 2 tiles),
// tmm4-5 hold two row tiles of A, tmm6-7 two column tiles of B.
//
// Every element of C is the same chain: zero, then one TDPBF16PS per step of 16 pairs in order,
// the last step zero padded when K2 is not a multiple of 16, whatever the element's place in its
// tile or in C (rows past a multiple of 16 go through a zero-padded copy of those rows, not
// another instruction). So dot_bf16, which runs that chain for one row and one column on the same
// instruction, gives every element bitwise (compute_delta relies on it), and gemm_bf16 ends with
// C = alpha * chain (+ C) as the vdpbf16ps GEMM does.
#include "tile_ops.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdlib>
#include <cstring>
#endif

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC bug 105593, as tile_ops_avx512bf16.cc
#endif

namespace loom::kernels {

#if defined(__x86_64__)
namespace {

constexpr int64_t kT = 16;  // rows of a tile; pairs (A) or columns (B, C) per tile row

// The LDTILECFG operand (palette 1): per tile register, bytes per row and rows.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-7 all 16 rows of 64 bytes: C 16 x 16 fp32, A 16 rows x 16 pairs, B 16 pair rows x 16
// columns.
constexpr TileConfig make_config() {
  TileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = kT;
  }
  return c;
}
constexpr TileConfig kConfig = make_config();

// Loads the one configuration for this call on this thread and releases the tiles at the end
// (the configuration is per thread; releasing returns the tile state to its initial, cheap to
// save, state between calls).
class TileScope {
 public:
  TileScope() { _tile_loadconfig(&kConfig); }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// Per-thread scratch for the zero-padded copies (grown as needed, freed with the thread).
class Scratch {
 public:
  ~Scratch() { std::free(p_); }
  uint32_t* get(int64_t words) {
    if (words > size_) {
      std::free(p_);
      const int64_t bytes = (words * 4 + 63) / 64 * 64;
      p_ = static_cast<uint32_t*>(std::aligned_alloc(64, static_cast<size_t>(bytes)));
      if (p_ == nullptr) std::abort();  // a few hundred KiB at most (kMaxBlock rows)
      size_ = bytes / 4;
    }
    return p_;
  }

 private:
  uint32_t* p_ = nullptr;
  int64_t size_ = 0;
};

thread_local Scratch t_scratch;

// Where one row tile of A (16 rows) is read: its full steps in place (or from a padded copy of
// the rows), its last, partial step from a zero-padded copy 64 bytes a row.
struct RowTile {
  const uint16_t* full;  // step s at full + 32 s
  int64_t full_stride;   // bytes
  const uint16_t* tail;  // 16 rows x 16 pairs, 64 bytes apart (partial step only)
};

// The same for one column tile of B (16 columns): its last step's pair rows in a zero-padded copy.
struct ColTile {
  const uint16_t* full;  // step s at full + s * 16 * ldb
  int64_t full_stride;   // bytes
  int64_t step;          // elements between steps
  const uint16_t* tail;
  int64_t tail_stride;  // bytes
};

// C[32 x 32] (RT row tiles, CT column tiles) = chain over the steps, into out (ldo floats).
template <int RT, int CT>
inline __attribute__((always_inline)) void block(int64_t full_steps, bool partial, const RowTile* r,
                                                 const ColTile* c, float* out, int64_t ldo) {
  _tile_zero(0);
  if (CT == 2) _tile_zero(1);
  if (RT == 2) _tile_zero(2);
  if (RT == 2 && CT == 2) _tile_zero(3);
  for (int64_t s = 0; s <= full_steps; ++s) {
    if (s == full_steps) {
      if (!partial) break;
      _tile_loadd(4, r[0].tail, 64);
      if (RT == 2) _tile_loadd(5, r[1].tail, 64);
      _tile_loadd(6, c[0].tail, c[0].tail_stride);
      if (CT == 2) _tile_loadd(7, c[1].tail, c[1].tail_stride);
    } else {
      _tile_loadd(4, r[0].full + 32 * s, r[0].full_stride);
      if (RT == 2) _tile_loadd(5, r[1].full + 32 * s, r[1].full_stride);
      _tile_loadd(6, c[0].full + s * c[0].step, c[0].full_stride);
      if (CT == 2) _tile_loadd(7, c[1].full + s * c[1].step, c[1].full_stride);
    }
    _tile_dpbf16ps(0, 4, 6);
    if (CT == 2) _tile_dpbf16ps(1, 4, 7);
    if (RT == 2) _tile_dpbf16ps(2, 5, 6);
    if (RT == 2 && CT == 2) _tile_dpbf16ps(3, 5, 7);
  }
  const int64_t ob = ldo * 4;
  _tile_stored(0, out, ob);
  if (CT == 2) _tile_stored(1, out + kT, ob);
  if (RT == 2) _tile_stored(2, out + kT * ldo, ob);
  if (RT == 2 && CT == 2) _tile_stored(3, out + kT * ldo + kT, ob);
}

// c[rows, cols] = alpha * t (+ c), cols % 16 == 0; t has row stride ldt.
inline void finish(const float* t, int64_t ldt, int64_t rows, int64_t cols, float alpha,
                   bool accumulate, float* c, int64_t ldc) {
  const __m512 al = _mm512_set1_ps(alpha);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; j += kT) {
      const __m512 x = _mm512_loadu_ps(t + i * ldt + j);
      float* cp = c + i * ldc + j;
      _mm512_storeu_ps(
          cp, accumulate ? _mm512_fmadd_ps(al, x, _mm512_loadu_ps(cp)) : _mm512_mul_ps(al, x));
    }
}

void gemm_amx(int64_t M, int64_t N, int64_t K2, const uint16_t* a, int64_t lda, const uint16_t* b,
              int64_t ldb, float alpha, bool accumulate, float* c, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  const int64_t full_steps = K2 > 0 ? K2 / kT : 0, rem = K2 > 0 ? K2 % kT : 0;
  const bool partial = rem > 0;
  const int64_t m_full = M / kT * kT, m_rows = M - m_full;  // rows past the last full tile
  const int64_t m_pad = m_full + (m_rows > 0 ? kT : 0);
  // Scratch (32-bit words, one pair each): the last step of A for every row, 16 pairs a row
  // (m_pad x 16); the last step's pair rows of B, zero padded to 16 (16 x N); the rows past the
  // last full tile, zero padded to 16 rows (16 x K2 pairs).
  const int64_t a_tail_words = partial ? m_pad * kT : 0;
  const int64_t b_tail_words = partial ? kT * N : 0;
  const int64_t rows_words = m_rows > 0 ? kT * K2 : 0;
  uint32_t* scratch = t_scratch.get(a_tail_words + b_tail_words + rows_words + 1);
  uint32_t* a_tail = scratch;
  uint32_t* b_tail = a_tail + a_tail_words;
  uint32_t* a_rows = b_tail + b_tail_words;
  if (partial) {
    std::memset(a_tail, 0, static_cast<size_t>(a_tail_words) * 4);
    for (int64_t i = 0; i < M; ++i)
      std::memcpy(a_tail + i * kT, a + i * lda + 2 * full_steps * kT, static_cast<size_t>(rem) * 4);
    std::memset(b_tail, 0, static_cast<size_t>(b_tail_words) * 4);
    for (int64_t t = 0; t < rem; ++t)
      std::memcpy(b_tail + t * N, b + (full_steps * kT + t) * ldb, static_cast<size_t>(N) * 4);
  }
  if (m_rows > 0) {
    std::memset(a_rows, 0, static_cast<size_t>(rows_words) * 4);
    for (int64_t i = 0; i < m_rows; ++i)
      std::memcpy(a_rows + i * K2, a + (m_full + i) * lda, static_cast<size_t>(K2) * 4);
  }
  auto row_tile = [&](int64_t i0) {
    const uint16_t* tail = reinterpret_cast<const uint16_t*>(a_tail + i0 * kT);
    if (i0 < m_full) return RowTile{a + i0 * lda, lda * 2, tail};
    return RowTile{reinterpret_cast<const uint16_t*>(a_rows), K2 * 4, tail};
  };
  auto col_tile = [&](int64_t j0) {
    return ColTile{b + 2 * j0, ldb * 2, kT * ldb, reinterpret_cast<const uint16_t*>(b_tail + j0),
                   N * 4};
  };

  TileScope tiles;
  alignas(64) float out[2 * kT * 2 * kT];  // one 32 x 32 block of the chains
  constexpr int64_t ldo = 2 * kT;
  for (int64_t i0 = 0; i0 < M; i0 += 2 * kT) {
    const bool two_rows = i0 + kT < M;
    const int64_t rows = M - i0 < 2 * kT ? M - i0 : 2 * kT;
    const RowTile r[2] = {row_tile(i0), two_rows ? row_tile(i0 + kT) : row_tile(i0)};
    for (int64_t j0 = 0; j0 < N; j0 += 2 * kT) {
      const bool two_cols = j0 + kT < N;
      const ColTile ct[2] = {col_tile(j0), two_cols ? col_tile(j0 + kT) : col_tile(j0)};
      if (two_rows && two_cols) {
        block<2, 2>(full_steps, partial, r, ct, out, ldo);
      } else if (two_rows) {
        block<2, 1>(full_steps, partial, r, ct, out, ldo);
      } else if (two_cols) {
        block<1, 2>(full_steps, partial, r, ct, out, ldo);
      } else {
        block<1, 1>(full_steps, partial, r, ct, out, ldo);
      }
      finish(out, ldo, rows, two_cols ? 2 * kT : kT, alpha, accumulate, c + i0 * ldc + j0, ldc);
    }
  }
}

// One element of gemm_amx's C with alpha 1: the same chain on the same instruction, for row 0 of a
// tile whose 16 rows all hold a (stride 0) and column 0 of a tile whose pair row t starts at pair
// t of b (stride 4 bytes), each step's pairs copied into zero-padded buffers.
float dot_amx(const uint16_t* a, const uint16_t* b, int64_t n2) {
  alignas(64) uint32_t a_step[kT];
  alignas(64) uint32_t b_step[2 * kT] = {};  // pair rows overlap: row t reads words t .. t + 15
  alignas(64) float out[kT * kT];
  TileScope tiles;
  _tile_zero(0);
  for (int64_t s = 0; s * kT < n2; ++s) {
    const int64_t n = n2 - s * kT < kT ? n2 - s * kT : kT;
    std::memset(a_step, 0, sizeof(a_step));
    std::memset(b_step, 0, sizeof(b_step));
    std::memcpy(a_step, a + 2 * s * kT, static_cast<size_t>(n) * 4);
    std::memcpy(b_step, b + 2 * s * kT, static_cast<size_t>(n) * 4);
    _tile_loadd(4, a_step, 0);
    _tile_loadd(6, b_step, 4);
    _tile_dpbf16ps(0, 4, 6);
  }
  _tile_stored(0, out, kT * 4);
  return out[0];
}

}  // namespace

void amx_gemm(int64_t M, int64_t N, int64_t K2, const uint16_t* a, int64_t lda, const uint16_t* b,
              int64_t ldb, float alpha, bool accumulate, float* c, int64_t ldc) {
  gemm_amx(M, N, K2, a, lda, b, ldb, alpha, accumulate, c, ldc);
}

float amx_dot(const uint16_t* a, const uint16_t* b, int64_t n2) {
  return dot_amx(a, b, n2);
}

#endif

}  // namespace loom::kernels
