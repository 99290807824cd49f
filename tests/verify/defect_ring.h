// tests/verify/defect_ring.h: a ring attention simulated in one process from loom's fp32 kernels
// (attend, finish, merge, attend_backward), with known defects injected. It is the library of
// broken implementations that `loom verify` must name: every defect here is a mistake seen in
// the field (issue 15), made on purpose.
//
// Ring schedule: at step s rank r holds the KV block (shard) of rank (r - s) mod P, as loom's ring
// and ring-flash-attention do. Shards come from a verify::Sharding (any convention).
#pragma once

#include <cstdint>
#include <string>

#include "loom/attention.h"
#include "loom/tensor.h"
#include "loom/verify.h"

namespace loom::test {

enum class Defect {
  none,
  dropped_step,  // skip the attend of ring step `step` (on `rank`, or every rank when -1)
  doubled_step,  // attend the block of ring step `step` twice
  mask_offset,   // key positions shifted by `offset` chunks (the mask is off by that many)
  zigzag_order,  // every rank writes its two chunks in swapped order
  bf16_steps,    // the running output is rounded to bf16 after every step's merge
  no_lse_merge,  // out += partial output of each step (the first seed's loop), no lse weighting
  stale_kv,      // backward: at ring step `step` the KV block of step - 1 is used again
  wrong_scale,   // softmax scale 1/D instead of 1/sqrt(D)
  gqa_mapping,   // query head h reads KV head h mod Hkv instead of h / (H / Hkv)
  // forward: at ring step `step` the KV block of step - 1 is used again
  stale_kv_forward,
  // ring step 0 (the rank's own block) attended without the causal mask
  diagonal_unmasked,
  // key positions shifted by -`offset` tokens (the causal mask j <= i + offset) at ring step 0
  // (`step` 0), at steps 1.. (`step` 1), or at every step (`step` -1)
  token_offset,
};

struct Injected {
  Defect kind = Defect::none;
  int step = -1;
  int rank = -1;   // -1: every rank
  int offset = 0;  // mask_offset: chunks
};

struct RingInputs {
  Tensor<float> q, k, v, dout;  // global [S, H, D], [S, Hkv, D]
  Mask mask;
  float scale = 0;
};

// Global-order results of the simulated ring: out [S,H,D], lse [H,S], dq, dk, dv.
struct RingOutputs {
  Tensor<float> out, lse, dq, dk, dv;
};

RingOutputs run_defect_ring(const RingInputs& in, const verify::Sharding& sh, const Injected& inj,
                            bool backward);

// Converts to the verify types.
verify::Problem to_problem(const RingInputs& in);
verify::Candidate to_candidate(const RingOutputs& o, bool backward);

}  // namespace loom::test
