// The subcommands of the loom tool.
#pragma once

#include <CLI/CLI.hpp>

namespace loom::tools {

// Registers `loom attn`; its callback runs the job and sets exit_code().
void add_attn_command(CLI::App& app);
// Registers `loom train` (tools/loom/train.cc).
void add_train_command(CLI::App& app);
// Registers `loom verify` (tools/loom/verify.cc).
void add_verify_command(CLI::App& app);

// The exit code the chosen subcommand asked for (0 on success, 1 on a failed check).
int exit_code();
void set_exit_code(int code);

}  // namespace loom::tools
