// bench/bench_cli.h: the benchmarks' command-line parse, as loom's: a bad command line is one
// line, "<program>: <what> (see --help)", and exit status 2 (CLI11's own codes were 105, 109...);
// --help prints and exits 0.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>

#include "loom/error.h"

namespace loom {

// Parses argv into `app`: nothing when the run goes on, else the exit status to return. quiet:
// print nothing (bench_comm's ranks above 0 under mpirun, which parse the command line rank 0
// parses and prints the error of: it was printed once per rank).
inline std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv,
                                             const std::string& program, bool quiet = false) {
  app.failure_message([program](const CLI::App*, const CLI::Error& e) {
    return program + ": " + e.what() + " (see --help)\n";
  });
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (quiet) return e.get_exit_code() == 0 ? 0 : 2;
    return app.exit(e) == 0 ? 0 : 2;
  }
  return std::nullopt;
}

// --json -: the JSON alone on standard output (it was mixed into the table there). Moves the
// table (everything printed on stdout from here on) to standard error and returns the path the
// JSON is then written to, a copy of descriptor 1 that children do not inherit; any other path
// is returned as it is. IoError when descriptor 1 cannot be copied.
inline std::string json_alone_on_stdout(const std::string& json) {
  if (json != "-") return json;
  std::fflush(stdout);
  const int fd = fcntl(STDOUT_FILENO, F_DUPFD_CLOEXEC, 3);
  LOOM_CHECK(fd >= 0 && dup2(STDERR_FILENO, STDOUT_FILENO) >= 0, IoError,
             "--json -: cannot use standard output (" << std::strerror(errno) << ")");
  return "/dev/fd/" + std::to_string(fd);
}

}  // namespace loom
