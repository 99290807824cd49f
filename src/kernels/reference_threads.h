// The fp64 reference's threading (reference.cc), for tests: a call of fewer multiply-adds in all
// than this runs on one thread. Tests lower it so that their small problems take the threaded
// path too (tests/unit/test_reference.cc, SameBitsOnAnyThreadCount).
#pragma once

#include <atomic>

namespace loom::kernels {

extern std::atomic<double> reference_parallel_work;

}  // namespace loom::kernels
