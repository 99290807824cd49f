// Command-line code the subcommands share: the registry's degree options.
#include <sstream>

#include "commands.h"
#include "loom/error.h"

namespace loom::tools {

namespace {

// "hybrid" or "hybrid or foo": the strategies whose degree option is `flag`.
std::string strategies_taking(const std::string& flag) {
  std::string names;
  for (const StrategyInfo& s : strategies())
    if (s.option == flag) names += (names.empty() ? "" : " or ") + s.name;
  return names;
}

const StrategyInfo& info_of(Strategy id) {
  for (const StrategyInfo& s : strategies())
    if (s.id == id) return s;
  return strategies().front();  // not reached: cfg.strategy came from parse_strategy
}

}  // namespace

void DegreeOptions::add_to(CLI::App* command, const std::set<std::string>& skip) {
  for (const StrategyInfo& s : strategies()) {
    if (s.option.empty() || skip.count(s.option) || values_.count(s.option)) continue;
    std::string help;
    for (const StrategyInfo& t : strategies())
      if (t.option == s.option) help += (help.empty() ? "" : "; ") + t.name + ": " + t.option_help;
    command->add_option(s.option, values_[s.option], help);
  }
}

void DegreeOptions::apply(CpConfig& cfg, const std::string& strategy) const {
  const StrategyInfo& mine = info_of(cfg.strategy);
  for (const auto& [flag, value] : values_) {
    if (flag == mine.option) {
      LOOM_CHECK(value >= 1, InvalidArgument,
                 "--strategy " << strategy << " needs " << flag << " N (" << mine.option_help
                               << "; docs/strategies.md)");
      set_degree(cfg, value);
    } else {
      LOOM_CHECK(value == 0, InvalidArgument,
                 flag << " is only for --strategy " << strategies_taking(flag)
                      << " (got --strategy " << strategy << ")");
    }
  }
}

std::vector<std::pair<std::string, int>> DegreeOptions::values() const {
  std::vector<std::pair<std::string, int>> v;
  for (const auto& [flag, value] : values_) v.emplace_back(flag.substr(2), value);
  return v;
}

}  // namespace loom::tools
