// Context-parallel attention test bodies, shared by the local-backend tests and the mpirun tests.
#pragma once

#include <string>
#include <vector>

#include "loom/comm.h"
#include "loom/cp.h"

namespace loom::testing {

struct CpCase {
  Strategy strategy = Strategy::ring;
  Layout layout = Layout::zigzag;
  int ulysses = 1;
  int inner = 0;  // ring2d: ranks per inner ring
  int64_t S = 51, H = 4, HKV = 4, D = 16;
  bool causal = true;
  int64_t window = 0;
  std::vector<int64_t> docs;
  uint64_t seed = 7;
  bool bf16 = false;  // bf16 storage of q, k, v, out, dout (tolerances in tests/unit/tolerance.h)
  std::string name() const;
};

// Runs forward and backward on this rank of `world` (world.size() ranks) and compares every
// rank's rows with the one-process fp64 reference; throws (with the relative errors) on a
// mismatch beyond kFp32RelTol. Returns the forward step tile counts of this rank.
std::vector<int64_t> run_cp_case(Communicator& world, const CpCase& c);

}  // namespace loom::testing
