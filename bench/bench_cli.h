// bench/bench_cli.h: the benchmarks' command-line parse, as loom's: a bad command line is one
// line, "<program>: <what> (see --help)", and exit status 2 (CLI11's own codes were 105, 109...);
// --help prints and exits 0.
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <string>

namespace loom {

// Parses argv into `app`: nothing when the run goes on, else the exit status to return.
inline std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv,
                                             const std::string& program) {
  app.failure_message([program](const CLI::App*, const CLI::Error& e) {
    return program + ": " + e.what() + " (see --help)\n";
  });
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  return std::nullopt;
}

}  // namespace loom
