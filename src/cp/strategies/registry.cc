// The strategy registry: the list of entries, the names, and the one function holding the head
// and group constraints (check_cp_config). Adding a strategy: its file, and one line below.
#include <algorithm>
#include <sstream>
#include <string_view>

#include "strategy.h"

namespace loom {

namespace cp_detail {

// The built-ins, each defined by its file. Adding one: its file, and two lines here (its
// entry's declaration, and its place in the registration order below).
extern const StrategyEntry kRingEntry;
extern const StrategyEntry kUlyssesEntry;
extern const StrategyEntry kHybridEntry;
extern const StrategyEntry kAllgatherEntry;
extern const StrategyEntry kRing2dEntry;

namespace {

// The entries and their public descriptions, in registration order.
struct Registry {
  std::vector<StrategyEntry> entries;
  std::vector<StrategyInfo> infos;
  Registry() {
    for (const StrategyEntry* e : {
             &kRingEntry,
             &kUlyssesEntry,
             &kHybridEntry,
             &kAllgatherEntry,
             &kRing2dEntry,
         })
      add(*e);
  }
  void add(const StrategyEntry& e) {
    entries.push_back(e);
    infos.push_back(info_of(e));
  }
  static StrategyInfo info_of(const StrategyEntry& e) {
    return StrategyInfo{e.id, std::string(e.id.name()), e.summary, e.degree.flag, e.degree.help};
  }
};

[[noreturn]] void throw_unknown_strategy(std::string_view name) {
  throw InvalidArgument("unknown strategy '" + std::string(name) + "' (choose " +
                        strategy_choices() + ")");
}

Registry& the_registry() {
  static Registry r;
  return r;
}

}  // namespace

const std::vector<StrategyEntry>& registry() {
  return the_registry().entries;
}

const StrategyEntry& entry(Strategy s) {
  for (const StrategyEntry& e : registry())
    if (e.id == s) return e;
  throw_unknown_strategy(s.name());
}

void register_strategy(const StrategyEntry& e) {
  Registry& r = the_registry();
  LOOM_CHECK(!e.id.name().empty(), InvalidArgument, "register_strategy: the name is empty");
  for (const StrategyEntry& x : r.entries)
    LOOM_CHECK(!(x.id == e.id), InvalidArgument,
               "register_strategy: '" << e.id.name() << "' is already registered");
  LOOM_CHECK(
      e.inner_degree && e.make && e.working_bytes, InvalidArgument,
      "register_strategy: '" << e.id.name() << "' needs inner_degree, make and working_bytes");
  const std::string_view flag = e.degree.flag ? e.degree.flag : "";
  LOOM_CHECK(flag.empty() || e.degree.value, InvalidArgument,
             "register_strategy: '" << e.id.name() << "' declares " << flag
                                    << " without the CpConfig value it sets");
  // The command line builds the option from the flag, and errors name it ("--group 3",
  // "group=3"): a value needs a flag of the form --name.
  LOOM_CHECK(!e.degree.value || (flag.size() > 2 && flag.starts_with("--") && flag[2] != '-'),
             InvalidArgument,
             "register_strategy: '" << e.id.name() << "' sets a CpConfig value through option '"
                                    << flag << "', which is not of the form --name");
  r.add(e);
}

std::string degree_text(const StrategyEntry& e, const CpConfig& cfg, int64_t n) {
  const std::string_view flag = e.degree.flag;
  std::ostringstream os;
  if (cfg.option_spelling == OptionSpelling::keyword)
    os << flag.substr(2) << '=' << n;
  else
    os << flag << ' ' << n;
  return os.str();
}

// The working-set pieces (strategy.h).
double state_bytes(const CpProblem& p, int64_t rows, int64_t heads) {
  return 4.0 * double(rows) * double(heads) * double(p.head_dim + 2);
}

double kernel_bytes(const CpProblem& p, int64_t sq, int64_t sk, int64_t heads, int64_t kv_heads) {
  if (heads < 1 || kv_heads < 1 || p.head_dim < 1) return 0;  // no kernel call
  KernelConfig kc;
  kc.threads = p.threads;
  kc.block_q = p.block_q;
  kc.block_k = p.block_k;
  return double(attend_workspace_bytes(sq, sk, heads, kv_heads, p.head_dim, p.dtype_bytes == 2,
                                       p.backward, kc));
}

double local_messages(int R, std::vector<double> sizes) {
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  double b = 0;
  for (double size : sizes) b += size * (R - 1) / 2;
  return b;
}

double ring_pass_bytes(const CpProblem& p, int R, int64_t rows, int64_t kv_heads) {
  if (R <= 1) return 0;
  const double cap = 2.0 * double(rows) * double(kv_heads) * double(p.head_dim);  // k and v
  double b = 2 * cap * p.dtype_bytes + (p.backward ? 5 * cap * 4 : 0);
  if (p.local_backend) b += cap * p.dtype_bytes + (p.backward ? cap * 4 : 0);
  return b;
}

}  // namespace cp_detail

const std::vector<StrategyInfo>& strategies() {
  return cp_detail::the_registry().infos;
}

const StrategyInfo& strategy_info(Strategy s) {
  for (const StrategyInfo& info : strategies())
    if (info.id == s) return info;
  cp_detail::throw_unknown_strategy(s.name());
}

std::string strategy_choices() {
  const auto& all = cp_detail::registry();
  std::string s;
  for (size_t i = 0; i < all.size(); ++i) {
    if (i) s += i + 1 == all.size() ? " or " : ", ";
    s += all[i].id.name();
  }
  return s;
}

Strategy parse_strategy(const std::string& name) {
  for (const cp_detail::StrategyEntry& e : cp_detail::registry())
    if (name == e.id.name()) return e.id;
  cp_detail::throw_unknown_strategy(name);
}

std::string to_string(Strategy s) {
  return std::string(s.name());
}

void set_degree(CpConfig& cfg, int value) {
  const cp_detail::StrategyEntry& e = cp_detail::entry(cfg.strategy);
  LOOM_CHECK(e.degree.value, InvalidArgument,
             "strategy " << e.id.name() << " takes no degree option (got " << value << ")");
  cfg.*e.degree.value = value;
}

double strategy_working_bytes(const CpConfig& cfg, const CpProblem& p) {
  // A negative size gave a negative estimate, which a memory limit took as "fits".
  LOOM_CHECK(p.seq >= 0 && p.rows >= 0 && p.heads >= 0 && p.kv_heads >= 0 && p.head_dim >= 0,
             InvalidArgument,
             "strategy_working_bytes: sizes must be >= 0 (seq "
                 << p.seq << ", rows " << p.rows << ", heads " << p.heads << ", kv_heads "
                 << p.kv_heads << ", head_dim " << p.head_dim << ")");
  LOOM_CHECK(p.ranks >= 1, InvalidArgument,
             "strategy_working_bytes: ranks must be >= 1, got " << p.ranks);
  LOOM_CHECK(p.threads >= 1, InvalidArgument,
             "strategy_working_bytes: threads must be >= 1, got " << p.threads);
  LOOM_CHECK(
      p.dtype_bytes == 2 || p.dtype_bytes == 4, InvalidArgument,
      "strategy_working_bytes: dtype_bytes must be 2 (bf16) or 4 (fp32), got " << p.dtype_bytes);
  CpProblem with_shape = p;
  with_shape.shape = check_cp_config(cfg, p.ranks, p.heads, p.kv_heads);
  return cp_detail::entry(cfg.strategy).working_bytes(with_shape);
}

CpShape check_cp_config(const CpConfig& cfg, int ranks, int64_t heads, int64_t kv_heads) {
  LOOM_CHECK(heads >= 1 && kv_heads >= 1, InvalidArgument,
             "heads and kv-heads must be positive (got " << heads << ", " << kv_heads << ")");
  LOOM_CHECK(heads % kv_heads == 0, InvalidArgument,
             "heads (" << heads << ") must be a multiple of kv-heads (" << kv_heads << ")");
  LOOM_CHECK(ranks >= 1, InvalidArgument, "a cp group needs >= 1 ranks, got " << ranks);
  const cp_detail::StrategyEntry& e = cp_detail::entry(cfg.strategy);
  if (e.degree.value) {
    // One rule for every degree option, named as the caller spells it: "--ulysses 3" on the
    // command line, "ulysses=3" in Python (which rewrote the command line's text before).
    // A degree below 1 is its own error: -4 divides 4, and "must divide" named the wrong rule.
    const int n = cfg.*e.degree.value;
    LOOM_CHECK(n >= 1, InvalidArgument,
               e.id.name() << ": " << cp_detail::degree_text(e, cfg, n)
                           << " must be >= 1 (a divisor of the number of ranks " << ranks << ")");
    LOOM_CHECK(ranks % n == 0, InvalidArgument,
               e.id.name() << ": " << cp_detail::degree_text(e, cfg, n)
                           << " must divide the number of ranks " << ranks);
  }
  CpShape shape;
  shape.inner = e.inner_degree(ranks, cfg);
  shape.outer = ranks / shape.inner;
  const int U = shape.inner;
  if (e.splits_heads && U > 1) {
    LOOM_CHECK(heads % U == 0, InvalidArgument,
               e.id.name() << ": heads (" << heads << ") must be divisible by the ulysses degree ("
                           << U << ")");
    LOOM_CHECK(kv_heads % U == 0 || U % kv_heads == 0, InvalidArgument,
               e.id.name() << ": kv heads (" << kv_heads << ") and the ulysses degree (" << U
                           << ") must divide one another (scatter KV heads when kv heads % U == 0, "
                              "replicate them when U % kv heads == 0); heads = "
                           << heads);
    shape.replicate_kv = kv_heads % U != 0;
  }
  return shape;
}

}  // namespace loom
