// The subcommands of the loom tool.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "loom/cp.h"

namespace loom::model {
struct TrainConfig;
}

namespace loom::tools {

// The most OpenMP threads per rank --threads accepts (loom attn, loom train, loom plan): the
// kernels' own limit (2147483647 was accepted and handed to OpenMP).
inline constexpr int kMaxThreads = kMaxKernelThreads;

// Registers `loom attn`; its callback runs the job and sets exit_code().
void add_attn_command(CLI::App& app);
// Registers `loom train` (tools/loom/train.cc).
void add_train_command(CLI::App& app);
// Registers `loom plan` (tools/loom/plan.cc).
void add_plan_command(CLI::App& app);
// Registers `loom verify` (tools/loom/verify.cc).
void add_verify_command(CLI::App& app);

// Adds a check to every integer option of `command`: a value must be a plain decimal integer
// that fits its type (CLI11 alone would turn "99999999999999999999" into INT64_MAX, and read "064"
// as octal 52), and unsigned ones must not be negative; and a check to every other option that
// takes a value: the value must not be empty.
void strict_integers(CLI::App* command);

// Refuses (InvalidArgument) a given --scale that float32, in which the kernels take it, holds
// only as 0 or as a subnormal (loom attn's and loom verify's check).
void check_scale_in_float32(double scale);

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

// Registers subcommand `name` on a fresh options object O: declare(c, o) adds its options (then
// every integer one gets strict_integers), and when the subcommand is parsed run(c, o) runs it
// and returns the exit code.
template <class O>
void add_command(CLI::App& app, const std::string& name, const std::string& help,
                 const std::function<void(CLI::App*, O&)>& declare,
                 const std::function<int(const CLI::App*, O&)>& run);

// The mask options loom attn and loom verify share: --causal / --no-causal, --window W and
// --docs L1,L2,... Returns the --docs option (to see whether it was given).
CLI::Option* add_mask_options(CLI::App* command, bool& causal, int64_t& window, std::string& docs);

// The most rows a rank of `ranks` can hold of S tokens in any layout, ceil(S / ranks) + 2, for
// the memory estimates: saturated at INT64_MAX (S near 2^63 overflowed to a negative count, and
// the estimate went wrong or threw an internal error; such a problem is far above any limit).
inline int64_t rank_rows_bound(int64_t S, int64_t ranks) {
  const int64_t per_rank = S / ranks + (S % ranks != 0 ? 1 : 0);
  return per_rank > INT64_MAX - 2 ? INT64_MAX : per_rank + 2;
}

// --memory-limit SIZE (loom attn, loom train, loom verify): refuse runs estimated above it.
void add_memory_limit_option(CLI::App* command, std::string& limit);

// Peak bytes of `loom train` in one process holding `ranks_here` ranks of configuration c, with
// a corpus of data_bytes (tools/loom/train.cc); loom plan --train-step checks its measured rank
// against it too.
double estimate_train_bytes(const model::TrainConfig& c, int ranks_here, double data_bytes);
// The address space OpenBLAS will map beyond what is mapped now, for check_memory's
// `mapped_bytes`: a buffer of kOpenBlasBufferBytes (loom/io.h), with the thread's stack and
// malloc arena, for each of `callers` threads calling it at once (the ranks of this process),
// and a buffer and a stack for each thread it starts to reach `threads` (set_blas_threads). Under
// `ulimit -v` a rank that could not map its buffer waited in OpenBLAS for ever (loom train --ranks
// 4 under ulimit -v 600000 hung).
double blas_mapped_bytes(int callers, int threads);
// The address space threads map beyond a run's estimate, for check_memory's `mapped_bytes`: a
// stack for each of `rank_threads` threads (the local backend's, one a rank) and for each thread
// past the first of `threads` in each of `ranks_here` ranks (OpenMP's workers), and a malloc
// arena for each thread that allocates (the rank threads; the workers with `workers_allocate`),
// as many as glibc makes; and OpenBLAS's buffers that its threads have still to map as the
// library starts them (*blas_missing: whether there are such). A stack is the stack limit (ulimit
// -s; 8 MiB where it is unlimited) and a page of guard, a worker's OMP_STACKSIZE where that is
// set; an arena reserves 64 MiB (glibc's HEAP_MAX_SIZE), at most MALLOC_ARENA_MAX or 8 a core
// beyond the main thread's. loom attn and loom verify count their threads with it.
double threads_mapped_bytes(int rank_threads, int ranks_here, int threads, bool workers_allocate,
                            bool* blas_missing = nullptr);

// Flushes standard output: "" when everything written to it so far arrived, else the error line
// ("standard output: write failed (No space left on device)"). main.cc checks it at the end of
// every command, write_outputs before it writes any file.
std::string stdout_write_error();

// Writes a run's outputs ({path, bytes}; empty paths skipped) as a unit, as far as the file
// system allows: a failed write of any one leaves every regular-file output as it was (a new one
// not created, an old one unchanged). Outputs written in place, which cannot be staged or undone
// (standard output "-", the process's own streams such as /dev/stdout, a device, a FIFO), are
// written first, one after another; then every regular file (or missing path) is staged next to
// its target, and the staged files are renamed over their targets only once all of them are
// written, each keeping its target's permission bits as write_output does. Only a rename that
// fails midway (after earlier ones) can leave some replaced. Build every output's bytes first,
// then call this once. Throws IoError naming the output's path, as write_output does.
void write_outputs(const std::vector<std::pair<std::string, std::string>>& outputs);

// The command line (main's argv past the program name), for agree_across_ranks.
void set_command_line(int argc, char** argv);
// Under mpirun every rank parses its own command line and reads its own input files: ranks started
// with other arguments (MPMD) or reading other bytes (node-local files that differ) posted
// messages of other sizes (a SIGSEGV inside MPI, MPI_ERR_TRUNCATE), or paired steps of different
// problems and exited 0 with wrong results. One all-gather of a hash of each: InvalidArgument on
// every rank, naming the first rank that differs from rank 0. `inputs_hash`: of the bytes the
// rank read (0 when it read none); `inputs_what` names them in the message.
// (The hashes: fnv1a64, loom/rng.h.)
void agree_across_ranks(Communicator& world, uint64_t inputs_hash, const std::string& inputs_what);

// The exit code the chosen subcommand asked for (0 on success, 1 on a failed check).
int exit_code();
void set_exit_code(int code);

template <class O>
void add_command(CLI::App& app, const std::string& name, const std::string& help,
                 const std::function<void(CLI::App*, O&)>& declare,
                 const std::function<int(const CLI::App*, O&)>& run) {
  auto o = std::make_shared<O>();
  CLI::App* c = app.add_subcommand(name, help);
  declare(c, *o);
  strict_integers(c);
  c->callback([c, o, run]() { set_exit_code(run(c, *o)); });
}

}  // namespace loom::tools
