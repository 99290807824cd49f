// ulysses: one all-to-all from "my tokens, all heads" to "all tokens, H / P heads", one local
// attend, and the inverse all-to-all (DeepSpeed-Ulysses). Traffic per rank does not grow with P,
// but P must divide the head count (or KV heads are replicated when P % Hkv == 0). It is hybrid
// (hybrid.cc) with a single group of all P ranks.
#include "strategy.h"

namespace loom::cp_detail {

namespace {
int all_ranks_inner(int P, const CpConfig&) {
  return P;
}
}  // namespace

constexpr const char* kUlyssesSummary =
    "all-to-all to whole sequences of H/P heads, one attend, all-to-all back (heads % P == 0)";
extern constinit const StrategyEntry kUlyssesEntry{.id = Strategy::ulysses,
                                                   .summary = kUlyssesSummary,
                                                   .splits_heads = true,
                                                   .inner_degree = all_ranks_inner,
                                                   .make = make_hybrid,
                                                   .working_bytes = hybrid_working_bytes};

}  // namespace loom::cp_detail
