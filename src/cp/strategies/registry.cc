// The strategy registry: the list of entries, the names, and the one function holding the head
// and group constraints (check_cp_config). Adding a strategy: its file, and one line below.
#include <sstream>

#include "strategy.h"

namespace loom {

namespace cp_detail {

const std::vector<StrategyEntry>& registry() {
  static const std::vector<StrategyEntry> entries = {
      kRingEntry, kUlyssesEntry, kHybridEntry, kAllgatherEntry, kRing2dEntry,
  };
  return entries;
}

const StrategyEntry& entry(Strategy s) {
  for (const StrategyEntry& e : registry())
    if (e.id == s) return e;
  throw InvalidArgument("unregistered strategy id " + std::to_string(static_cast<int>(s)));
}

}  // namespace cp_detail

const std::vector<StrategyInfo>& strategies() {
  static const std::vector<StrategyInfo> infos = [] {
    std::vector<StrategyInfo> v;
    for (const cp_detail::StrategyEntry& e : cp_detail::registry())
      v.push_back(StrategyInfo{e.id, e.name, e.summary, e.option});
    return v;
  }();
  return infos;
}

std::string strategy_choices() {
  const auto& all = cp_detail::registry();
  std::string s;
  for (size_t i = 0; i < all.size(); ++i) {
    if (i) s += i + 1 == all.size() ? " or " : ", ";
    s += all[i].name;
  }
  return s;
}

Strategy parse_strategy(const std::string& name) {
  for (const cp_detail::StrategyEntry& e : cp_detail::registry())
    if (name == e.name) return e.id;
  throw InvalidArgument("unknown strategy '" + name + "' (choose " + strategy_choices() + ")");
}

std::string to_string(Strategy s) {
  return cp_detail::entry(s).name;
}

CpShape check_cp_config(const CpConfig& cfg, int ranks, int64_t heads, int64_t kv_heads) {
  LOOM_CHECK(heads >= 1 && kv_heads >= 1, InvalidArgument,
             "heads and kv-heads must be positive (got " << heads << ", " << kv_heads << ")");
  LOOM_CHECK(heads % kv_heads == 0, InvalidArgument,
             "heads (" << heads << ") must be a multiple of kv-heads (" << kv_heads << ")");
  LOOM_CHECK(ranks >= 1, InvalidArgument, "a cp group needs >= 1 ranks, got " << ranks);
  const cp_detail::StrategyEntry& e = cp_detail::entry(cfg.strategy);
  CpShape shape;
  shape.inner = e.inner_degree(ranks, cfg);
  shape.outer = ranks / shape.inner;
  const int U = shape.inner;
  if (e.splits_heads && U > 1) {
    LOOM_CHECK(heads % U == 0, InvalidArgument,
               e.name << ": heads (" << heads << ") must be divisible by the ulysses degree (" << U
                      << ")");
    LOOM_CHECK(kv_heads % U == 0 || U % kv_heads == 0, InvalidArgument,
               e.name << ": kv-heads (" << kv_heads << ") and the ulysses degree (" << U
                      << ") must divide one another (scatter KV heads when kv-heads % U == 0, "
                         "replicate them when U % kv-heads == 0); heads = "
                      << heads);
    shape.replicate_kv = kv_heads % U != 0;
  }
  return shape;
}

}  // namespace loom
