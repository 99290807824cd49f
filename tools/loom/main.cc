// loom: the command-line tool. One file per subcommand; this one only dispatches and turns
// errors into one clear line and a non-zero exit.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <thread>

#include <unistd.h>

#include "commands.h"
#include "loom/comm.h"
#include "loom/error.h"
#include "loom/io.h"

extern "C" int openblas_get_num_threads(void);

namespace {

// The OpenBLAS buffers mapped so far: whole 128 MiB blocks of anonymous private read-write
// memory in /proc/self/maps (at the start of main nothing else maps that much; adjacent buffers
// show as one region). -1 when the maps cannot be read.
int64_t blas_buffers_mapped() {
  std::FILE* f = std::fopen("/proc/self/maps", "r");
  if (!f) return -1;
  int64_t buffers = 0;
  char line[4096];
  while (std::fgets(line, sizeof line, f)) {
    unsigned long long start = 0, end = 0, inode = 0;
    char perms[8] = {};
    int path_at = 0;
    if (std::sscanf(line, "%llx-%llx %7s %*s %*s %llu %n", &start, &end, perms, &inode, &path_at) <
        4)
      continue;
    const bool anonymous = inode == 0 && (line[path_at] == '\0' || line[path_at] == '\n');
    if (anonymous && std::strcmp(perms, "rw-p") == 0)
      buffers += static_cast<int64_t>((end - start) >> 27);  // 128 MiB blocks
  }
  std::fclose(f);
  return buffers;
}

// OpenBLAS starts its threads as the library loads, before main, and each maps a buffer of
// loom::kOpenBlasBufferBytes (128 MiB), retrying for ever where an address-space limit (ulimit -v
// or -d) leaves no room for it; at exit its handler waits for that thread. Every command under
// such a limit hung, `loom --version` included, spinning a core (the run itself went through).
// Refused before anything runs, in one line, where the buffers its threads still lack do not fit
// what the limit leaves, and ended with _exit: a return would wait for those threads too.
void refuse_blas_without_room() {
  const int threads = openblas_get_num_threads();
  if (threads < 2) return;  // no threads of its own (OPENBLAS_NUM_THREADS=1)
  std::string which;
  const int64_t room = loom::address_space_room(&which);
  if (room < 0) return;
  const int64_t mapped = blas_buffers_mapped();
  const int64_t missing = std::max<int64_t>(0, (threads - 1) - std::max<int64_t>(0, mapped));
  if (room >= missing * loom::kOpenBlasBufferBytes) return;
  std::fprintf(
      stderr,
      "loom: error: %s, leaves %s (%lld KiB), too little for the %lld KiB buffer that "
      "OpenBLAS still has to map for %lld of its threads (it would wait for the room "
      "for ever); raise the limit, or set OPENBLAS_NUM_THREADS=1\n",
      which.c_str(), loom::human_bytes(double(room)).c_str(), static_cast<long long>(room / 1024),
      static_cast<long long>(loom::kOpenBlasBufferBytes / 1024), static_cast<long long>(missing));
  std::fflush(stderr);
  ::_exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  refuse_blas_without_room();
  // A reader that goes away (a FIFO --log, `--log - | head`) killed the process by SIGPIPE with
  // no message (exit 141), mid-run; ignored, the failed write is the error that names the output.
  std::signal(SIGPIPE, SIG_IGN);
  // So did a file size limit (ulimit -f) by SIGXFSZ (exit 153), its temporaries left behind;
  // ignored, the write fails with EFBIG: "write failed (File too large)", temporaries removed.
  std::signal(SIGXFSZ, SIG_IGN);
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
  loom::tools::set_command_line(argc, argv);
  // The first argument is the command, or one of loom's own options (--help, -h, --version).
  // CLI11 checks that a command was given before it looks at unexpected arguments, so `loom run`
  // and `loom --bogus` said "A subcommand is required", naming neither, and `loom run --help`
  // printed the top-level help with exit status 0.
  const std::string unknown = [&]() -> std::string {
    if (argc < 2) return "";  // no command: CLI11 says one is required
    const std::string first = argv[1];
    if (first == "--help" || first == "-h" || first == "--version") return "";
    std::string names;
    const auto commands = app.get_subcommands([](const CLI::App*) { return true; });
    for (size_t i = 0; i < commands.size(); ++i) {
      if (commands[i]->get_name() == first) return "";
      names += (i == 0 ? "" : i + 1 == commands.size() ? " or " : ", ") + commands[i]->get_name();
    }
    if (first.size() > 1 && first[0] == '-')
      return "unknown option '" + first + "': before the command (" + names +
             ") loom takes only --help and --version";
    return "unknown command '" + first + "'; choose " + names;
  }();
  // Under mpirun, a rank that fails ends the whole job at once (MPI_Abort), whatever the error:
  // before, only a CommError did, and the other ranks waited out their timeout on a rank that had
  // raised InvalidArgument or IoError (a bad LOOM_TIMEOUT_S, an unreadable --data or checkpoint
  // on one rank), then reported a misleading timeout of their own. The line names the rank.
  const bool mpi = loom::launched_by_mpirun();
  const long rank = mpi ? loom::launcher_rank() : -1;
  const std::string who = rank >= 0 ? "rank " + std::to_string(rank) + ": " : std::string();
  auto fail = [&](const char* what) {
    // A communication error names this rank already ("rank 0: send to rank 1 ... timed out").
    // In a split group it reads "rank 1 (world rank 3): ...", which was prefixed again.
    const std::string me = who.empty() ? who : who.substr(0, who.size() - 2);  // "rank N"
    const std::string text = what;
    const std::string head = text.substr(0, text.find(':'));
    const bool named =
        !who.empty() && (head == me || (head.compare(0, 5, "rank ") == 0 &&
                                        head.find("(world " + me + ")") != std::string::npos));
    std::fprintf(stderr, "loom: error: %s%s\n", named ? "" : who.c_str(), what);
    if (mpi) loom::mpi_abort(1);  // ends the other ranks now (a no-op before MPI started)
    return 1;
  };
  // The text report goes to standard output through stdio: a failed write (a full disk, a
  // closed stdout) is an error like any other write's, not exit 0 with the report lost. Exit
  // status 1 (2 for loom verify, whose 1 means "a tensor failed": docs/verify.md).
  auto stdout_failed = [&](const std::string& why) {
    const int rc = fail(why.c_str());
    return app.got_subcommand("verify") ? 2 : rc;
  };
  if (!unknown.empty()) {
    if (mpi && rank > 0) std::this_thread::sleep_for(std::chrono::seconds(2));  // as below
    std::fprintf(stderr, "loom: error: %s (see loom --help)\n", unknown.c_str());
    return 2;
  }
  try {
    app.parse(argc, argv);
    const int rc = loom::tools::exit_code();
    const std::string why = loom::tools::stdout_write_error();
    return why.empty() ? rc : stdout_failed(why);
  } catch (const CLI::ParseError& e) {
    // Under mpirun every rank parses the same command line: rank 0 prints the usage error and
    // its exit ends the job (every rank printed it).
    if (mpi && rank > 0 && e.get_exit_code() != 0)
      std::this_thread::sleep_for(std::chrono::seconds(2));
    const int rc = app.exit(e);
    if (rc != 0) return 2;
    const std::string why = loom::tools::stdout_write_error();
    return why.empty() ? 0 : stdout_failed(why);
  } catch (const loom::Error& e) {
    // Under mpirun the ranks run one command line on the same inputs (agree_across_ranks), so
    // an error (a strategy's rule, a size, a damaged checkpoint, non-finite training, a rank that
    // stopped and makes the others time out) is usually every rank's, or several ranks': each
    // printed it, then Open MPI its banner. The other ranks give rank 0 two seconds to print its
    // line and end the job; one that is still running then (its error was its own, or rank 0 is
    // the one that stopped) prints and ends it.
    if (mpi && rank > 0) std::this_thread::sleep_for(std::chrono::seconds(2));
    return fail(e.what());
  } catch (const std::bad_alloc&) {
    return fail(
        "out of memory (an allocation outside loom's tensors failed); make the problem smaller "
        "or lower --ranks");
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}
