// The subcommands of the loom tool.
#pragma once

#include <CLI/CLI.hpp>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "loom/cp.h"

namespace loom::tools {

// Registers `loom attn`; its callback runs the job and sets exit_code().
void add_attn_command(CLI::App& app);
// Registers `loom train` (tools/loom/train.cc).
void add_train_command(CLI::App& app);
// Registers `loom plan` (tools/loom/plan.cc).
void add_plan_command(CLI::App& app);
// Registers `loom verify` (tools/loom/verify.cc).
void add_verify_command(CLI::App& app);

// Adds a check to every integer option of `command`: a value must be a plain integer that fits
// its type (CLI11 alone would turn "99999999999999999999" into INT64_MAX), and unsigned ones
// must not be negative.
void strict_integers(CLI::App* command);

// The degree options of the strategy registry on a command line: one option per distinct flag
// the registered strategies declare (--ulysses, --inner, ...), its help naming the strategies
// that take it. Nothing here names a strategy: a new one's option appears by itself.
class DegreeOptions {
 public:
  // Adds the options to `command`, but the flags in `skip` (options the command has already with
  // another meaning, such as loom train's mesh --ulysses).
  void add_to(CLI::App* command, const std::set<std::string>& skip = {});
  // Checks the given values against cfg.strategy (shown as `strategy`): its own option, unless
  // skipped, must be given (N >= 1), and every other must not; then sets it in cfg (set_degree).
  // InvalidArgument naming the option.
  void apply(CpConfig& cfg, const std::string& strategy) const;
  // The options as given, in flag order, without the leading "--" ({"inner", 2}; 0: not given).
  std::vector<std::pair<std::string, int>> values() const;

 private:
  std::map<std::string, int> values_;  // flag -> N (0: not given); map nodes keep their address
};

// The exit code the chosen subcommand asked for (0 on success, 1 on a failed check).
int exit_code();
void set_exit_code(int code);

}  // namespace loom::tools
