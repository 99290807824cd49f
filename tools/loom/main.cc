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

#include <sys/resource.h>
#include <unistd.h>

#include "commands.h"
#include "loom/comm.h"
#include "loom/error.h"
#include "loom/io.h"

extern "C" int openblas_get_num_threads(void);

namespace {

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
  const int64_t mapped = loom::openblas_buffers_mapped();
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

// Every thread's stack is the stack limit (ulimit -s): glibc gives each new thread (the local
// backend's ranks, OpenMP's and OpenBLAS's) a stack of that size, less the static thread-local
// storage (OpenBLAS alone has 60 KiB), and the main thread's stack may grow to it. Under a small
// limit loom crashed (SIGSEGV, exit 139): `ulimit -s 72` ended loom attn, train and plan that way.
// Measured in steps of 8 KiB, loom attn (every strategy, bf16, head dim 256, --input, --check,
// --backward, --output, --json, --trace, --fault), train (every mesh axis, bf16, checkpointed
// activations, checkpoints), plan (search, --simulate, --train-step, --calibrate) and verify need
// at most 88 KiB; loom train --resume needs 136 KiB (a rank thread reads the checkpoint through
// loom::InputFile's 64 KiB buffer on its stack). 512 KiB gives nearly four times that; the main
// thread's stack also holds the arguments and the environment, which Linux bounds to 128 KiB at
// such limits. Refused before anything runs, every command alike.
constexpr unsigned long long kStackNeedBytes = 512 << 10;

void refuse_small_stack() {
  struct rlimit stack;
  if (::getrlimit(RLIMIT_STACK, &stack) != 0 || stack.rlim_cur == RLIM_INFINITY ||
      stack.rlim_cur >= kStackNeedBytes)
    return;
  // Formatted into a buffer and written whole: fprintf to the unbuffered stderr formats through
  // an 8 KiB buffer on the stack, which crashed under `ulimit -s 16` (below that, a library's
  // constructor crashes before main).
  char line[320];
  const int n = std::snprintf(
      line, sizeof line,
      "loom: error: the stack limit (ulimit -s) of %llu KiB is below the %llu KiB loom needs "
      "(each of its threads gets a stack of that size); raise it (ulimit -s %llu or more; 8192 "
      "is the usual default)\n",
      static_cast<unsigned long long>(stack.rlim_cur) / 1024, kStackNeedBytes / 1024,
      kStackNeedBytes / 1024);
  if (n > 0) {
    const ssize_t written = ::write(STDERR_FILENO, line, std::min(size_t(n), sizeof line - 1));
    (void)written;  // nothing more to say where stderr cannot be written
  }
  ::_exit(1);  // as refuse_blas_without_room below: nothing has run
}

// A usage error's text. CLI11 says "--iters: At Most 1 required but received 2" for an option
// given twice, which does not say that it was repeated.
std::string usage_text(const CLI::Error& e) {
  const std::string what = e.what();
  const std::string mark = ": At Most 1 required but received ";
  const size_t at = what.find(mark);
  if (at != std::string::npos && what.compare(0, 1, "-") == 0)
    return what.substr(0, at) + " was given " + what.substr(at + mark.size()) +
           " times; give it once";
  // CLI11's "Could not convert: --devices = 1000000000000000000" named no range: a whole number
  // there is past a 32-bit option's range (strict_integers lets through what fits 64 bits), and
  // anything else was no number at all (--scale abc).
  const std::string convert = "Could not convert: ";
  const size_t eq = what.find(" = ");
  if (what.compare(0, convert.size(), convert) == 0 && eq != std::string::npos &&
      what.compare(convert.size(), 1, "-") == 0) {
    const std::string option = what.substr(convert.size(), eq - convert.size());
    const std::string value = what.substr(eq + 3);
    const size_t sign = value.size() > 1 && (value[0] == '-' || value[0] == '+') ? 1 : 0;
    const bool whole =
        value.size() > sign && value.find_first_not_of("0123456789", sign) == std::string::npos;
    return whole ? option + ": " + value +
                       " is out of range (past a 32-bit integer's -2147483648 to 2147483647)"
                 : option + ": '" + value + "' is not a number";
  }
  return what;
}

}  // namespace

int main(int argc, char** argv) {
  refuse_small_stack();
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
    return "loom: error: " + usage_text(e) + " (see loom --help)\n";
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
  // An error found after the ranks started working together (below): under mpirun every rank
  // that fails gets here, usually several for one fault (a rank's error or stop makes the others
  // time out), and each printed its line. The ranks wait before printing, in turn (the times
  // below), while mpi_report_error tells each which ranks the others waited on and whether
  // another has printed already: then this one prints nothing and waits for the job to end.
  auto report = [&](const std::string& what, double wait_s, bool timeout) {
    if (!mpi) return fail(what.c_str());
    std::string hint;
    if (!loom::mpi_report_error(wait_s, &hint)) {
      std::this_thread::sleep_for(std::chrono::seconds(10));  // the printing rank ends the job
      loom::mpi_abort(1);
      return 1;
    }
    return fail((what + (timeout ? hint : std::string())).c_str());
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
    // its exit ends the job (every rank printed it). A rank started with other arguments
    // (MPMD) prints its own after two seconds, naming itself (the line did not say which rank).
    if (mpi && e.get_exit_code() != 0) {
      if (rank > 0) std::this_thread::sleep_for(std::chrono::seconds(2));
      std::fprintf(stderr, "loom: error: %s%s (see loom --help)\n", who.c_str(),
                   usage_text(e).c_str());
      return 2;
    }
    const int rc = app.exit(e);
    if (rc != 0) return 2;
    const std::string why = loom::tools::stdout_write_error();
    return why.empty() ? 0 : stdout_failed(why);
  } catch (const loom::Error& e) {
    // Under mpirun the ranks run one command line on the same inputs (agree_across_ranks), so
    // an error (a strategy's rule, a size, a damaged checkpoint, non-finite training) is usually
    // every rank's, or several ranks': each printed it, then Open MPI its banner. So the first
    // line printed ends the job (fail: MPI_Abort), and the ranks wait before printing, in turn:
    //   rank 0's own error   at once;
    //   another rank's own   after 2 s (rank 0 usually has the same one and prints it first),
    //                        rank r's 0.03 s after rank r - 1's (up to rank 16);
    //   a communication error (CommError, Timeout: usually the consequence of another rank's
    //   error or stop)       rank 0's after 2.5 s, another rank's after 3.5 s, rank r's 0.1 s
    //                        after rank r - 1's (up to rank 16: at most 5 s).
    // A rank's own error thus comes before the timeouts it causes: it waited 2 s behind them, and
    // with LOOM_TIMEOUT_S under 2 s rank 0's timeout ended the job first and hid it. Ranks whose
    // waits end together print in rank order; the others hear of the line printed and print none
    // (every rank that timed out together printed its own: 3 to 5 lines).
    const bool comm = dynamic_cast<const loom::CommError*>(&e) != nullptr;
    const double turn = static_cast<double>(std::clamp(rank - 1, 0L, 15L));
    const double wait_s =
        comm ? (rank > 0 ? 3.5 + 0.1 * turn : 2.5) : (rank > 0 ? 2 + 0.03 * turn : 0);
    return report(e.what(), wait_s, dynamic_cast<const loom::Timeout*>(&e) != nullptr);
  } catch (const std::bad_alloc&) {
    return report(
        "out of memory (an allocation outside loom's tensors failed); make the problem smaller "
        "or lower --ranks",
        rank > 0 ? 2 : 0, false);
  } catch (const std::exception& e) {
    return report(e.what(), rank > 0 ? 2 : 0, false);
  }
}
