// The subcommands of the loom tool.
#pragma once

#include <CLI/CLI.hpp>

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

// The exit code the chosen subcommand asked for (0 on success, 1 on a failed check).
int exit_code();
void set_exit_code(int code);

}  // namespace loom::tools
