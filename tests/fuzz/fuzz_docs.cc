// libFuzzer target: the --docs parser and the per-document layouts. Any text is parsed or
// refused with InvalidArgument; a parsed list that sums to S gives plans that hold every token
// exactly once. Lists whose sum overflows int64 or exceeds the plan size are handed to
// ShardPlan::make too, which must refuse them with InvalidArgument (under UBSan, a wrapping
// sum is a crash), so the fuzzer reaches the sums of any size, not only the small ones.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "loom/cp.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int ranks = 1 + data[0] % 8;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  std::vector<int64_t> docs;
  try {
    docs = loom::parse_doc_lengths(text);
  } catch (const loom::InvalidArgument&) {
    return 0;
  }
  int64_t seq = 0;
  bool overflow = false;
  for (int64_t l : docs) {
    if (l <= 0) __builtin_trap();  // the parser promised positive lengths
    overflow = overflow || __builtin_add_overflow(seq, l, &seq);
  }
  if (overflow || seq > 4096) {
    // The sum cannot be a plan this harness builds: make() must refuse a mismatching length
    // (the wrapped sum, or the true sum plus one) before allocating anything.
    const int64_t claimed = overflow ? (seq >= 1 ? seq : 1) : seq + 1;
    try {
      (void)loom::ShardPlan::make(loom::Layout::zigzag, claimed, ranks, docs);
    } catch (const loom::InvalidArgument&) {
      return 0;
    }
    __builtin_trap();  // accepted lengths that do not sum to the sequence
  }
  for (loom::Layout layout :
       {loom::Layout::contiguous, loom::Layout::zigzag, loom::Layout::stripe}) {
    const loom::ShardPlan p = loom::ShardPlan::make(layout, seq, ranks, docs);
    std::vector<int> seen(static_cast<size_t>(seq), 0);
    for (int r = 0; r < ranks; ++r)
      for (int64_t t : p.tokens[r]) ++seen[static_cast<size_t>(t)];
    for (int c : seen)
      if (c != 1) __builtin_trap();
  }
  return 0;
}
