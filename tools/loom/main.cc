// loom: the command-line tool. One file per subcommand; this one only dispatches and turns
// errors into one clear line and a non-zero exit.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <new>
#include <string>

#include "commands.h"
#include "loom/comm.h"
#include "loom/error.h"

int main(int argc, char** argv) {
  CLI::App app{"loom: exact attention over sequences split across ranks (context parallelism)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "loom 0.1.0");
  loom::tools::add_attn_command(app);
  loom::tools::add_train_command(app);
  loom::tools::add_plan_command(app);
  loom::tools::add_verify_command(app);
  // A usage error is one line and exit status 2 (--help and --version print and exit 0).
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return std::string("loom: error: ") + e.what() + " (see loom --help)\n";
  });
  try {
    app.parse(argc, argv);
    return loom::tools::exit_code();
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  } catch (const loom::CommError& e) {
    std::fprintf(stderr, "loom: error: %s\n", e.what());
    if (loom::launched_by_mpirun()) loom::mpi_abort(1);  // end the other ranks now
    return 1;
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "loom: error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr,
                 "loom: error: out of memory (an allocation outside loom's tensors failed); "
                 "make the problem smaller or lower --ranks\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom: error: %s\n", e.what());
    return 1;
  }
}
