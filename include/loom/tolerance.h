// loom/tolerance.h: the written-down tolerances of every comparison with the fp64 reference
// (tests, `loom attn --check`), as normwise relative errors ||x - ref|| / ||ref||. Their
// derivation is in tests/unit/tolerance.h. They are never loosened to make a comparison pass.
#pragma once

namespace loom {

// fp32 storage and accumulation.
inline constexpr double kFp32RelTol = 1e-5;
// bf16 storage: u = 2^-8 is bf16's unit roundoff.
inline constexpr double kBf16Unit = 1.0 / 256.0;
inline constexpr double kBf16OutRelTol = 2 * kBf16Unit;  // out in bf16
inline constexpr double kBf16AccRelTol = kBf16Unit;      // out finished to fp32 (bf16-dot path)
// dq, dk, dv (lse: kFp32RelTol). dv = p^T dout takes p rounded to bf16 on the bf16-dot path
// (avx512bf16), as the forward's p v does; the widening paths keep dv within kFp32RelTol.
inline constexpr double kBf16GradRelTol = 2 * kBf16Unit;

}  // namespace loom
