// libFuzzer target: the --docs parser and the per-document layouts. Any text is parsed or
// refused with InvalidArgument; a parsed list that sums to S gives plans that hold every token
// exactly once.
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
  for (int64_t l : docs) {
    if (l <= 0) __builtin_trap();  // the parser promised positive lengths
    seq += l;
    if (seq > 4096) return 0;  // keep plans small
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
