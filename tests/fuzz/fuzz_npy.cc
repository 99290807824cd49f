// libFuzzer target: the .npy parser must accept or refuse (IoError) any byte string, never
// crash, read out of bounds, or allocate without bound.
#include <cstddef>
#include <cstdint>

#include "loom/npy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const loom::Tensor<double> t = loom::parse_npy(data, size, "fuzz.npy");
    // A parsed array's size must agree with the bytes it came from.
    if (static_cast<size_t>(t.numel()) * 4 > size) __builtin_trap();
  } catch (const loom::IoError&) {
  }
  return 0;
}
