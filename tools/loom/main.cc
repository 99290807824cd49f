// loom: the command-line tool. One file per subcommand; this one only dispatches and turns
// errors into one clear line and a non-zero exit.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "commands.h"
#include "loom/comm.h"
#include "loom/error.h"

int main(int argc, char** argv) {
  CLI::App app{"loom: exact attention over sequences split across ranks (context parallelism)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "loom 0.1.0");
  loom::tools::add_attn_command(app);
  loom::tools::add_train_command(app);
  loom::tools::add_verify_command(app);
  try {
    app.parse(argc, argv);
    return loom::tools::exit_code();
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const loom::CommError& e) {
    std::fprintf(stderr, "loom: error: %s\n", e.what());
    if (loom::launched_by_mpirun()) loom::mpi_abort(1);  // end the other ranks now
    return 1;
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "loom: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom: error: %s\n", e.what());
    return 1;
  }
}
