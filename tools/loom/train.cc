// `loom train`: trains a byte-level GPT with data, tensor(+sequence) and context parallelism on
// the local backend (--ranks N: threads) or under mpirun, and reports loss, speed, memory and the
// share of time spent in attention.
//
// Every rank runs the same loop (model/trainer.h); world rank 0 prints progress, validation
// lines, the --log JSON lines and the closing summary.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>

#include "commands.h"
#include "loom/comm.h"
#include "loom/cp.h"
#include "loom/error.h"
#include "loom/io.h"
#include "loom/model/trainer.h"
#include "loom/rng.h"
#include "loom/timer.h"
#include "report.h"

namespace loom::tools {

namespace {

using model::Corpus;
using model::StepResult;
using model::TrainConfig;
using model::Trainer;

struct TrainOptions {
  int ranks = 1;
  int dp = 0, tp = 0, ulysses = 0, ring = 0;  // 0: not given (a given 0 is refused: add_train)
  DegreeOptions degrees;  // the registry's degree options but --ulysses (a mesh axis here)
  std::string strategy, layout = "zigzag";
  int64_t seq = 256, layers = 4, dim = 128, heads = 4, kv_heads = 2, ffn = 0;
  int64_t steps = 300, batch = 8, warmup = -1;
  double lr = 3e-3, weight_decay = 0.1, clip = 1.0;
  uint64_t seed = 1;
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  bool resume = false, checkpoint_activations = false, pack_documents = false, quiet = false;
  std::string dtype = "fp32", data, log;
  int64_t eval_every = 50, eval_batches = 4;
  int threads = 1;
  int64_t keep_checkpoints = 0;  // 0: keep all
  std::string data_limit = "1G";
  std::string memory_limit;  // empty: the machine's available memory
  bool ranks_given = false;
};

// The --log file: one JSON line per step, every write checked. A regular file (or a symlink to
// one) is locked for the run (lock_or_refuse), truncated on a fresh run and, on --resume, cut
// back to the checkpoint's step, so a resumed run never repeats a step's line; a device or FIFO
// is written directly, without blocking: a reader that stops reading fails the run after
// LOOM_TIMEOUT_S (write_nonblocking; it hung for ever); "-" is standard output (it opened, and
// appended to, a file named "-").
class StepLog {
 public:
  StepLog(const std::string& path, bool resume, int64_t resumed_step) : path_(path) {
    if (path == "-") {
      fd_ = STDOUT_FILENO;
      own_ = false;
      return;
    }
    if (const int fd = own_stream_fd(path); fd >= 0) {  // /dev/stdout, /dev/fd/N: never truncated
      fd_ = fd;
      own_ = false;
      return;
    }
    const std::string target = resolve_output_path(path);
    struct stat st;
    const bool exists = ::stat(target.c_str(), &st) == 0;
    const bool regular = !exists || S_ISREG(st.st_mode);
    LOOM_CHECK(!exists || !S_ISDIR(st.st_mode), IoError,
               "cannot write --log " << path << ": it is a directory");
    fd_ = ::open(
        target.c_str(),
        regular ? O_RDWR | O_APPEND | O_CREAT | O_CLOEXEC : O_WRONLY | O_NONBLOCK | O_CLOEXEC,
        0666);
    LOOM_CHECK(fd_ >= 0, IoError,
               "cannot write --log " << path << " ("
                                     << (errno == ENXIO ? "a FIFO that nobody reads; start the "
                                                          "reader first"
                                                        : std::strerror(errno))
                                     << ")");
    if (!regular) {
      stream_ = true;
      return;
    }
    // Locked before anything is cut: a second run naming the same log (two runs interleaved
    // their lines into it, both exit 0) is refused and leaves it alone. The lines kept on
    // --resume are a prefix of the file, so cutting back is one ftruncate, as is a fresh run's
    // truncation.
    try {
      lock_or_refuse(fd_, path, "--log");
      const size_t keep = resume ? lines_up_to(target, resumed_step).size() : 0;
      LOOM_CHECK(::ftruncate(fd_, static_cast<off_t>(keep)) == 0, IoError,
                 "cannot write --log " << path << " (" << std::strerror(errno) << ")");
    } catch (...) {
      ::close(fd_);
      throw;
    }
  }
  ~StepLog() {
    if (fd_ >= 0 && own_) ::close(fd_);
  }
  // Flushes the lines written so far to disk (a regular log): before a checkpoint that covers
  // their steps, so a crash cannot leave `latest` past the log's last line. Devices, FIFOs and
  // standard output have nothing to sync.
  void sync() {
    if (!own_ || ::fsync(fd_) == 0 || errno == EINVAL || errno == EROFS || errno == ENOTSUP) return;
    LOOM_CHECK(false, IoError,
               "--log " << path_ << ": sync failed (" << std::strerror(errno)
                        << "); stopping rather than writing a checkpoint past the log");
  }
  void write(const std::string& line) {
    if (stream_) {
      write_nonblocking(fd_, line.data(), line.size(), "--log " + path_);
      return;
    }
    size_t done = 0;
    while (done < line.size()) {
      const ssize_t w = ::write(fd_, line.data() + done, line.size() - done);
      if (w < 0 && errno == EINTR) continue;
      LOOM_CHECK(w > 0, IoError,
                 "--log " << path_ << ": write failed (" << std::strerror(errno)
                          << "); stopping rather than losing log lines");
      done += static_cast<size_t>(w);
    }
  }

 private:
  // The leading lines of an existing log whose "step" is <= step (a torn last line is dropped),
  // which must be one per step, in order, up to `step` itself.
  // A file whose first line is not a step line (nor the start of one, torn by a kill) is not a
  // loom train log: refused, not cut back to nothing (a file of notes was replaced, exit 0).
  static std::string lines_up_to(const std::string& path, int64_t step) {
    InputFile f(path, "--log");
    const std::string text = f.read_rest(size_t{1} << 32);
    auto require_log = [&](bool is_log) {
      LOOM_CHECK(is_log, InvalidArgument,
                 "--resume: --log " << path
                                    << " is not a loom train log (its first line is not a step "
                                       "line); give the log of the run being resumed, or a new "
                                       "path");
    };
    require_log(text.empty() || text[0] == '{');
    std::istringstream in(text);
    std::string line, keep;
    bool first = true;
    int64_t last = -1;  // the step of the last line kept
    while (std::getline(in, line)) {
      if (in.eof()) break;  // no newline: a line torn by a kill
      nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      const bool step_line =
          !j.is_discarded() && j.contains("step") && j["step"].is_number_integer();
      if (first) require_log(step_line);
      first = false;
      // A damaged line inside the log (not the torn last one): cutting there dropped the valid
      // lines after it, up to the checkpoint's step, exit 0.
      LOOM_CHECK(step_line, InvalidArgument,
                 "--resume: --log " << path << " line "
                                    << (std::count(keep.begin(), keep.end(), '\n') + 1)
                                    << " is not a step line (the log is damaged); repair or "
                                       "remove that line, or give a new --log");
      const int64_t at = j["step"].get<int64_t>();
      if (at > step) break;
      // One line per step, in order: a log with a gap went on from the checkpoint's step as if
      // it were whole (lines 4 to 6 of a run checkpointed at 6 missing, exit 0).
      LOOM_CHECK(last < 0 || at == last + 1, InvalidArgument,
                 "--resume: --log " << path << " line "
                                    << (std::count(keep.begin(), keep.end(), '\n') + 1)
                                    << " is step " << at << " after step " << last
                                    << " (the log is not one line per step, in order); give the "
                                       "run's own log, or a new --log");
      last = at;
      keep += line + "\n";
    }
    LOOM_CHECK(
        last < 0 || last == step, InvalidArgument,
        "--resume: --log " << path << " ends at step " << last << ", before the checkpoint's step "
                           << step << " ("
                           << (last + 1 == step ? "that step's line is"
                                                : "the lines of steps " + std::to_string(last + 1) +
                                                      " to " + std::to_string(step) + " are")
                           << " missing); give the run's own log, or a new --log");
    return keep;
  }
  std::string path_;
  int fd_ = -1;
  bool own_ = true;      // false for standard output
  bool stream_ = false;  // a device or FIFO loom opened: written by write_nonblocking
};

// Whether `name` is a checkpoint as save_checkpoint names it: "step-" and at least 8 digits (the
// step, zero-padded), ".ckpt". (Any "step-????????.ckpt" counted: step-zzzzzzzz.ckpt was the
// newest, and --keep-checkpoints deleted real ones in its place.)
bool is_checkpoint_name(const std::string& name) {
  constexpr size_t kPrefix = 5, kSuffix = 5;  // "step-", ".ckpt"
  if (name.size() < kPrefix + 8 + kSuffix || name.rfind("step-", 0) != 0 ||
      name.compare(name.size() - kSuffix, kSuffix, ".ckpt") != 0)
    return false;
  return std::all_of(name.begin() + kPrefix, name.end() - kSuffix,
                     [](char c) { return c >= '0' && c <= '9'; });
}

// Whether `name` is a temporary of loom's own writes into a checkpoint directory: that of
// `latest` or of a checkpoint, exactly as io.cc names it (temporary_pid). Its pid, else -1.
long checkpoint_temp_pid(const std::string& name) {
  const size_t t = name.find(".tmp.");
  if (t == std::string::npos) return -1;
  const std::string stem = name.substr(0, t);
  if (stem != "latest" && !is_checkpoint_name(stem)) return -1;
  return temporary_pid(name, stem);
}

// The names in --checkpoint-dir; a directory that cannot be listed is refused (unlisted, a run's
// checkpoints went unseen and were replaced).
std::vector<std::string> checkpoint_dir_names(const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<std::string> names;
  std::error_code ec;
  fs::directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) names.push_back(it->path().filename().string());
  LOOM_CHECK(!ec, IoError,
             "--checkpoint-dir " << dir << " cannot be listed (" << ec.message()
                                 << "); it must be a directory this user can list and write");
  return names;
}

// Keeps the newest `keep` step-*.ckpt files of dir (and always the one `latest` names).
void prune_checkpoints(const std::string& dir, int64_t keep) {
  namespace fs = std::filesystem;
  if (keep <= 0) return;
  std::string latest;
  {
    std::ifstream l(fs::path(dir) / "latest");
    l >> latest;
  }
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (is_checkpoint_name(n) && e.is_regular_file(ec)) names.push_back(n);
  }
  // Zero-padded step numbers: by step (a step past 8 digits is a longer name).
  std::sort(names.begin(), names.end(), [](const std::string& a, const std::string& b) {
    return a.size() != b.size() ? a.size() < b.size() : a < b;
  });
  const int64_t drop = static_cast<int64_t>(names.size()) - keep;
  for (int64_t i = 0; i < drop; ++i)
    if (names[i] != latest) fs::remove(fs::path(dir) / names[i], ec);
}

// Refuses a file (--log, --data: `option`) that is one of --checkpoint-dir's files: `latest`,
// `step-*.ckpt`, or a temporary (`*.tmp.*`: the writers' temporaries, which the start of a run
// sweeps away once their process is gone). The log and a checkpoint overwrote each other (--log
// CK/latest: exit 0 and the log lost), as the corpus and the pointer did (--data CK/latest). Other
// names in the directory are the user's to use (--log CK/train.jsonl).
// `named` is how the message names the file ("--log x.jsonl").
void check_outside_checkpoints(const std::string& named, const std::string& log,
                               const std::string& dir) {
  namespace fs = std::filesystem;
  if (log.empty() || log == "-" || dir.empty()) return;
  std::string d = dir;
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  const fs::path file = fs::path(output_key(log)).lexically_normal();
  if (file.parent_path() != fs::path(output_key(d)).lexically_normal()) return;
  const std::string name = file.filename().string();
  const bool checkpoint =
      name == "latest" || (name.rfind("step-", 0) == 0 && name.find(".ckpt") != std::string::npos);
  LOOM_CHECK(!checkpoint && name.find(".tmp.") == std::string::npos, InvalidArgument,
             named << " collides with the checkpoints in --checkpoint-dir " << dir
                   << " (latest, step-*.ckpt and their .tmp. temporaries are theirs); give "
                   << "it another name or directory");
}

// The file --data reads, as the checks against loom train's outputs see it: the path itself,
// or for "-" the file standard input is redirected from, as /proc/self/fd/0 (which output_key
// and check_distinct_outputs follow to that file, as they do --data /dev/stdin); "" when standard
// input is not a regular file (a pipe or a terminal: no output can overwrite it). Unkeyed,
// `--data - < corpus.txt --log corpus.txt` replaced the corpus with the log's lines, exit 0.
std::string data_file(const std::string& data) {
  if (data != "-") return data;
  struct stat st;
  return ::fstat(STDIN_FILENO, &st) == 0 && S_ISREG(st.st_mode) ? "/proc/self/fd/0" : "";
}

// How messages name --data: "--data corpus.txt", or "--data - (standard input, /x/corpus.txt)".
std::string data_named(const std::string& data) {
  if (data != "-") return "--data " + data;
  const std::string file = data_file(data);
  return "--data - (standard input" + (file.empty() ? "" : ", " + output_key(file)) + ")";
}

// Where the default corpus lives: ./data/kjv.txt, else <dir of the loom binary>/../data/kjv.txt.
std::string default_data() {
  namespace fs = std::filesystem;
  if (fs::exists("data/kjv.txt")) return "data/kjv.txt";
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const fs::path p = exe.parent_path().parent_path() / "data" / "kjv.txt";
    if (fs::exists(p)) return p.string();
  }
  LOOM_CHECK(false, IoError,
             "no --data FILE given and data/kjv.txt (the King James Bible, written by "
             "scripts/setup.sh) was not found; give --data FILE");
  return {};
}

MeshShape mesh_of(const TrainOptions& o, int world) {
  MeshShape s;
  const bool any = o.dp || o.tp || o.ulysses || o.ring;
  s.dp = o.dp ? o.dp : 1;
  s.tp = o.tp ? o.tp : 1;
  s.ulysses = o.ulysses ? o.ulysses : 1;
  s.ring = o.ring ? o.ring : (any ? 1 : world);  // only --ranks N: all of it is context ranks
  // ... on the strategy's axis: --ranks N --strategy ulysses is a ulysses group of N (the mesh's
  // cp axes must be the strategy's: model::validate)
  if (!any && !o.strategy.empty() && parse_strategy(o.strategy) == Strategy::ulysses)
    std::swap(s.ulysses, s.ring);
  LOOM_CHECK(s.dp >= 1 && s.tp >= 1 && s.ulysses >= 1 && s.ring >= 1, InvalidArgument,
             "--dp, --tp, --ulysses and --ring must be >= 1");
  const int64_t ranks = s.ranks();  // saturates: "at least" INT64_MAX
  LOOM_CHECK(ranks == world, InvalidArgument,
             "the mesh --dp " << s.dp << " x --tp " << s.tp << " x --ulysses " << s.ulysses
                              << " x --ring " << s.ring << " = "
                              << (ranks == INT64_MAX ? "at least " : "") << ranks
                              << " ranks does not match the " << world
                              << " ranks of this run (--ranks or mpirun -np)");
  return s;
}

Strategy strategy_of(const TrainOptions& o, const MeshShape& s) {
  return o.strategy.empty() ? model::default_strategy(s) : parse_strategy(o.strategy);
}

std::string human_time(double s) {
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%dh%02dm", int(s / 3600), int(s / 60) % 60);
  else if (s >= 60)
    std::snprintf(buf, sizeof buf, "%dm%02ds", int(s / 60), int(s) % 60);
  else
    std::snprintf(buf, sizeof buf, "%.1fs", s);
  return buf;
}

// What --memory-limit (or, without it, the available memory) bounds in this process, and its
// name for check_memory: the local backend's `here` ranks run in this one process; under mpirun
// a limit bounds this rank's process (it counted every rank of the node there, and refused runs
// whose processes fitted), and without one the node's `here` ranks together must fit in its
// available memory.
struct TrainMemory {
  double bytes;
  std::string what;
};

// With checkpoints (`checkpoints`, `resume`), what saving and loading them adds
// (model::checkpoint_bytes): it counted none of it, and a run estimated at 347 MiB peaked at
// 1.42 GiB.
TrainMemory train_memory(const TrainConfig& c, int here, bool mpi, bool limited, double data_bytes,
                         bool checkpoints, bool resume) {
  const std::string ranks = std::to_string(here) + " rank" + (here > 1 ? "s" : "");
  auto ckpt = [&](int n) { return checkpoints ? model::checkpoint_bytes(c, n, resume) : 0.0; };
  if (!mpi)
    return {estimate_train_bytes(c, here, data_bytes) + ckpt(here),
            "loom train with " + ranks + " in this process"};
  if (limited) return {estimate_train_bytes(c, 1, data_bytes) + ckpt(1), "this rank of loom train"};
  return {here * estimate_train_bytes(c, 1, data_bytes) + ckpt(here),
          "loom train with " + ranks + " on this node"};
}

struct Summary {  // filled by world rank 0
  double first_loss = NAN, last_loss = NAN, val_loss = NAN;
  int64_t first_step = 0, last_step = 0, tokens = 0;
  double seconds = 0;
  std::vector<model::RankReport> ranks;
  std::string resumed_from;
};

void train_rank(Communicator& world, const TrainOptions& o, const TrainConfig& cfg,
                const Corpus& corpus, Summary& sum) {
  const bool lead = world.rank() == 0;
  Trainer tr(world, cfg, corpus);
  if (o.resume) {
    tr.load_checkpoint(o.checkpoint_dir);
    if (lead) sum.resumed_from = o.checkpoint_dir + " at step " + std::to_string(tr.step());
  }
  std::unique_ptr<StepLog> log;
  if (lead && !o.log.empty()) log = std::make_unique<StepLog>(o.log, o.resume, tr.step());
  const bool tty = isatty(2);
  double last_print = 0;
  Stopwatch clock;
  sum.first_step = tr.step() + 1;
  while (tr.step() < cfg.steps) {
    const StepResult r = tr.train_step();
    double val = NAN;
    const bool eval_now = o.eval_every > 0 && (r.step % o.eval_every == 0 || r.step == cfg.steps);
    if (eval_now) val = tr.evaluate();
    // The step's log line goes out before its checkpoint: a kill between the two left `latest` at
    // step N and the log at N - 1, and --resume (which cuts the log back to the checkpoint's
    // step) went on from N + 1 without line N. The other way round, a resume cuts the extra line.
    if (log) {
      const double tps = r.seconds > 0 ? static_cast<double>(r.tokens) / r.seconds : 0;
      nlohmann::json j = {{"step", r.step},      {"loss", r.loss},           {"lr", r.lr},
                          {"tokens_per_s", tps}, {"grad_norm", r.grad_norm}, {"seconds", r.seconds},
                          {"tokens", r.tokens}};
      if (!std::isnan(val)) j["val_loss"] = val;
      log->write(j.dump() + "\n");
    }
    if (!o.checkpoint_dir.empty() &&
        ((o.checkpoint_every > 0 && r.step % o.checkpoint_every == 0) || r.step == cfg.steps)) {
      if (log) log->sync();  // the lines the checkpoint covers reach the disk first
      tr.save_checkpoint(o.checkpoint_dir);
      if (lead) prune_checkpoints(o.checkpoint_dir, o.keep_checkpoints);
      // Test hook (docs/reliability.md): LOOM_TEST_KILL_AFTER_CHECKPOINT=N kills the process
      // right after step N's checkpoint, as a kill -9 at that moment would.
      if (const char* e = std::getenv("LOOM_TEST_KILL_AFTER_CHECKPOINT");
          lead && e && std::atoll(e) == r.step)
        ::raise(SIGKILL);
    }
    if (!lead) continue;
    if (std::isnan(sum.first_loss)) sum.first_loss = r.loss;
    sum.last_loss = r.loss;
    sum.last_step = r.step;
    if (!std::isnan(val)) sum.val_loss = val;
    if (!o.quiet) {
      const double done = static_cast<double>(r.step - sum.first_step + 1);
      const double eta = clock.elapsed_s() / done * static_cast<double>(cfg.steps - r.step);
      const double avg_tps = static_cast<double>(tr.tokens_trained()) / tr.seconds_training();
      if (!std::isnan(val)) {
        std::fprintf(stderr, "%sstep %lld: validation loss %.4f\n", tty ? "\r\033[K" : "",
                     static_cast<long long>(r.step), val);
      }
      if (tty || r.step == sum.first_step || clock.elapsed_s() - last_print >= 1.0 ||
          r.step == cfg.steps) {
        std::fprintf(stderr, "%sstep %lld/%lld  loss %.4f  lr %.2e  %.0f tok/s  ETA %s%s",
                     tty ? "\r\033[K" : "", static_cast<long long>(r.step),
                     static_cast<long long>(cfg.steps), r.loss, r.lr, avg_tps,
                     human_time(eta).c_str(), tty ? "" : "\n");
        last_print = clock.elapsed_s();
      }
    }
  }
  if (lead && !o.quiet && tty) std::fprintf(stderr, "\n");
  std::vector<model::RankReport> reps = tr.reports();
  if (lead) {
    sum.ranks = reps;
    sum.tokens = tr.tokens_trained();
    sum.seconds = tr.seconds_training();
  }
}

void print_summary(const TrainConfig& c, const Corpus& corpus, const Summary& s, int threads,
                   const std::string& backend) {
  const MeshShape& m = c.par.mesh;
  std::printf(
      "loom train: dp=%d tp=%d ulysses=%d ring=%d (%d rank%s x %d thread%s, %s backend), "
      "%s attention, %s layout, %s%s%s\n",
      m.dp, m.tp, m.ulysses, m.ring, m.world(), m.world() == 1 ? "" : "s", threads,
      threads == 1 ? "" : "s", backend.c_str(), to_string(c.par.strategy).c_str(),
      to_string(c.par.layout).c_str(), model::to_string(c.precision).c_str(),
      c.checkpoint_activations ? ", activation checkpointing" : "",
      c.pack_documents ? ", packed documents" : "");
  std::printf(
      "  model     layers=%lld dim=%lld heads=%lld kv-heads=%lld ffn=%lld seq=%lld "
      "batch=%lld\n",
      (long long)c.model.layers, (long long)c.model.dim, (long long)c.model.heads,
      (long long)c.model.kv_heads, (long long)c.model.ffn_dim(), (long long)c.seq,
      (long long)c.batch);
  std::printf("  data      %s: %lld documents, %lld train bytes, %lld validation bytes\n",
              corpus.source.c_str(), (long long)corpus.documents, (long long)corpus.train.size(),
              (long long)corpus.val.size());
  if (!s.resumed_from.empty()) std::printf("  resumed   from %s\n", s.resumed_from.c_str());
  if (s.last_step >= s.first_step) {
    std::printf("  loss      step %lld: %.4f -> step %lld: %.4f", (long long)s.first_step,
                s.first_loss, (long long)s.last_step, s.last_loss);
    if (!std::isnan(s.val_loss)) std::printf("   validation %.4f", s.val_loss);
    std::printf("\n");
  }
  std::printf("  speed     %.0f tokens/s (%lld tokens in %s)\n",
              s.seconds > 0 ? static_cast<double>(s.tokens) / s.seconds : 0.0, (long long)s.tokens,
              human_time(s.seconds).c_str());
  std::printf("  %-4s %12s %12s %10s %14s %14s %14s %14s\n", "rank", "attention_s", "other_fb_s",
              "update_s", "activations", "model+adam", "peak (sum)", "process RSS");
  for (size_t r = 0; r < s.ranks.size(); ++r) {
    const model::RankReport& x = s.ranks[r];
    std::printf("  %-4zu %12.3f %12.3f %10.3f %14s %14s %14s %14s\n", r, x.attention_s,
                x.total_s - x.attention_s, x.update_s, human_bytes(x.act_bytes_peak).c_str(),
                human_bytes(x.state_bytes).c_str(),
                human_bytes(x.act_bytes_peak + x.state_bytes).c_str(),
                human_bytes(x.peak_rss).c_str());
  }
  std::printf(
      "  times     of the training steps (validation not counted): attention_s: CpAttention "
      "forward + backward (with its communication); other_fb_s: the rest of forward + backward; "
      "update_s: gradient sums, clipping, AdamW\n");
  std::printf(
      "  memory    activations: peak bytes kept for backward (computed per rank); process RSS: "
      "peak resident set of the rank's process (%s)\n",
      backend == "local" ? "the local backend's ranks share one process" : "one per rank");
}

int run_train(const TrainOptions& o) {
  TrainConfig c;
  c.model.layers = o.layers;
  c.model.dim = o.dim;
  c.model.heads = o.heads;
  c.model.kv_heads = o.kv_heads;
  c.model.ffn = o.ffn;
  c.seq = o.seq;
  c.batch = o.batch;
  c.steps = o.steps;
  c.warmup = o.warmup;
  c.lr = o.lr;
  c.weight_decay = o.weight_decay;
  c.clip = o.clip;
  c.seed = o.seed;
  c.precision = model::parse_precision(o.dtype);
  c.checkpoint_activations = o.checkpoint_activations;
  c.pack_documents = o.pack_documents;
  c.eval_batches = o.eval_batches;
  c.par.layout = parse_layout(o.layout);
  LOOM_CHECK(
      o.threads >= 0 && o.threads <= kMaxThreads, InvalidArgument,
      "--threads must be in [0, " << kMaxThreads << "] (0: cores / ranks), got " << o.threads);
  LOOM_CHECK(!o.resume || !o.checkpoint_dir.empty(), InvalidArgument,
             "--resume needs --checkpoint-dir DIR (the directory to resume from)");
  LOOM_CHECK(o.eval_every >= 0, InvalidArgument,
             "--eval-every must be >= 0 (0: never), got " << o.eval_every);
  LOOM_CHECK(o.checkpoint_every >= 0, InvalidArgument,
             "--checkpoint-every must be >= 0 (0: at the end only), got " << o.checkpoint_every);
  // Checkpoint options without a directory wrote nothing, exit 0.
  LOOM_CHECK(!o.checkpoint_dir.empty() || (o.checkpoint_every == 0 && o.keep_checkpoints == 0),
             InvalidArgument,
             (o.checkpoint_every ? "--checkpoint-every" : "--keep-checkpoints")
                 << " needs --checkpoint-dir DIR (where the checkpoints go)");
  LOOM_CHECK(o.keep_checkpoints >= 0, InvalidArgument,
             "--keep-checkpoints must be >= 0 (0: keep all), got " << o.keep_checkpoints);
  LOOM_CHECK(std::isfinite(o.lr) && o.lr > 0, InvalidArgument,
             "--lr must be a positive finite number, got " << o.lr);
  LOOM_CHECK(std::isfinite(o.weight_decay) && o.weight_decay >= 0, InvalidArgument,
             "--weight-decay must be a finite number >= 0, got " << o.weight_decay);
  LOOM_CHECK(std::isfinite(o.clip) && o.clip >= 0, InvalidArgument,
             "--clip must be a finite number >= 0 (0: off), got " << o.clip);
  LOOM_CHECK(o.warmup >= -1, InvalidArgument,
             "--warmup must be >= 0, or -1 for the default, got " << o.warmup);
  LOOM_CHECK(o.ffn >= 0, InvalidArgument, "--ffn must be >= 0 (0: 4 x dim), got " << o.ffn);
  LOOM_CHECK(o.eval_batches >= 1, InvalidArgument,
             "--eval-batches must be >= 1, got " << o.eval_batches);
  check_distinct_outputs({{"--log", o.log}, {"--checkpoint-dir", o.checkpoint_dir}});
  check_outside_checkpoints("--log " + o.log, o.log, o.checkpoint_dir);
  // The corpus there too was replaced by a checkpoint (--data CK/latest, or --data - <
  // CK/latest).
  check_outside_checkpoints(data_named(o.data), data_file(o.data), o.checkpoint_dir);
  // A fresh run's checkpoint directory is made before --log is checked, so that a log inside it
  // (CK/train.jsonl, which docs/train.md allows) is checked in the directory it will be written
  // to ("cannot write into CK (No such file or directory)" refused it).
  if (!o.checkpoint_dir.empty() && !o.resume) {
    std::error_code ec;
    std::filesystem::create_directories(o.checkpoint_dir, ec);
    std::error_code is_dir_ec;
    const bool made = std::filesystem::is_directory(o.checkpoint_dir, is_dir_ec);
    LOOM_CHECK(made, IoError,
               "cannot create --checkpoint-dir "
                   << o.checkpoint_dir << " ("
                   << (ec ? ec.message()
                          : std::string("it exists and is not a directory, or a path above it is "
                                        "not one"))
                   << ")");
  }
  // An unwritable --log fails here, before the corpus is read and any rank starts (nothing is
  // truncated yet), tried for real as loom attn's outputs are: access() says yes to root on
  // /proc, so --log /proc/version failed only once the ranks ran. An existing file must be
  // writable itself too: the truncation keeps its permission bits, then the log appends to it.
  if (!o.log.empty() && o.log != "-" && own_stream_fd(o.log) < 0) {
    // Truncated and written in place, never renamed over: a writable log another user owns in
    // a sticky directory is usable (the rename check would refuse it).
    check_output_writable(o.log, "--log", false, false);
    const std::string target = resolve_output_path(o.log);
    // Only the writer (rank 0): a pid is judged on this node, in this PID namespace, so another
    // rank took a running job's temporary for a dead one's and deleted it (io.h).
    if (launcher_rank() <= 0) clean_stale_temps(target);
    struct stat st;
    LOOM_CHECK(::stat(target.c_str(), &st) != 0 || !S_ISREG(st.st_mode) ||
                   ::access(target.c_str(), W_OK) == 0,
               IoError, "cannot write --log " << o.log << " (" << std::strerror(errno) << ")");
  }

  std::unique_ptr<Communicator> mpi;
  int world = o.ranks, here = o.ranks;
  if (launched_by_mpirun()) {
    LOOM_CHECK(!o.ranks_given, InvalidArgument,
               "--ranks is for the local backend; under mpirun the number of ranks is mpirun's "
               "-np (drop --ranks)");
    // Open MPI gives standard input to rank 0 alone: the others read nothing and were refused
    // as reading "other --data than rank 0".
    LOOM_CHECK(o.data != "-", InvalidArgument,
               "--data - (standard input) cannot be used under mpirun, which gives standard "
               "input to rank 0 only; name a file every rank can read");
    mpi = mpi_world();
    world = mpi->size();
    here = std::max(1, mpi_ranks_on_this_node());
  }
  LOOM_CHECK(world >= 1, InvalidArgument, "--ranks must be >= 1, got " << world);
  c.par.mesh = mesh_of(o, world);
  c.par.strategy = strategy_of(o, c.par.mesh);
  {  // the strategy's degree option (hybrid's --ulysses is the mesh's; model::cp_config)
    CpConfig d;
    d.strategy = c.par.strategy;
    o.degrees.apply(d, to_string(c.par.strategy));
    c.par.inner = d.inner;
    c.par.degree = d.degree;
  }
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = o.threads ? o.threads : std::max(1, hw / here);
  c.par.threads = threads;
  model::validate(c, world);
  const std::string data = o.data.empty() ? default_data() : o.data;
  // The log is truncated when the run starts: naming the corpus there destroyed it, as did
  // `--data - < corpus.txt` (standard input's file was not compared).
  check_distinct_outputs({{data == "-" ? data_named(data) : "--data", data_file(data)},
                          {"--log", o.log},
                          {"--checkpoint-dir", o.checkpoint_dir}});
  const int64_t data_limit = parse_size(o.data_limit, "--data-limit");
  std::string text;
  try {
    InputFile f(data, "--data");
    text = f.read_rest(static_cast<size_t>(data_limit), "--data-limit");
  } catch (const IoError& e) {
    throw IoError(std::string("cannot read ") + e.what(), __FILE__, __LINE__);
  }
  // Under mpirun: every rank the same command line and the same --data bytes (commands.h).
  if (mpi) agree_across_ranks(*mpi, fnv1a64(text.data(), text.size()), "--data");
  const int64_t limit = o.memory_limit.empty() ? -1 : parse_size(o.memory_limit, "--memory-limit");
  const TrainMemory m = train_memory(c, here, mpi != nullptr, limit >= 0, double(text.size()),
                                     !o.checkpoint_dir.empty(), o.resume);
  // Under `ulimit -v` or `-d` OpenBLAS's buffers count too: a rank that could not map its own
  // waited inside OpenBLAS for ever.
  check_memory(m.bytes, limit, m.what, "--memory-limit", blas_mapped_bytes(here, threads));
  const Corpus corpus = model::make_corpus(text, data == "-" ? "standard input" : data);
  text = std::string();
  LOOM_CHECK(o.eval_every == 0 || corpus.val.size() >= o.seq + 1, InvalidArgument,
             "the validation split of " << corpus.source << " has " << corpus.val.size()
                                        << " bytes but --seq " << o.seq << " needs " << o.seq + 1
                                        << " for one window; give more --data or --eval-every 0");
  // Every evaluation runs --eval-batches distinct windows of the split: more than there are is a
  // mistake (99999999999 grew past 7.9 GB before the first evaluation).
  const int64_t windows = corpus.val.size() - o.seq;
  LOOM_CHECK(o.eval_every == 0 || o.eval_batches <= windows, InvalidArgument,
             "--eval-batches " << o.eval_batches << " is more than the " << windows
                               << " distinct validation windows of " << o.seq << " tokens in "
                               << corpus.source << " (" << corpus.val.size()
                               << " validation bytes); give at most " << windows);
  // Packed, a window predicts only bytes of its own document: validation tails of one byte each
  // predicted nothing, and every validation loss was dropped, exit 0.
  if (o.eval_every > 0) {
    int64_t predicted = 0;
    for (const int64_t off : model::val_offsets(corpus.val, o.seq, o.eval_batches)) {
      predicted += model::make_sequence(corpus.val, off, o.seq, o.pack_documents).predicted();
      if (predicted > 0) break;
    }
    LOOM_CHECK(predicted > 0, InvalidArgument,
               "--eval-every " << o.eval_every << ": the " << o.eval_batches
                               << " validation windows of " << corpus.source
                               << " predict no byte under --pack-documents (the documents' "
                                  "validation tails in them are single bytes); give longer "
                                  "documents, drop --pack-documents, or give --eval-every 0");
  }
  // One run at a time writes a checkpoint directory: two runs sharing one both exited 0, each
  // overwriting the other's `latest` and step files. The process that writes them (world rank 0)
  // holds the lock until the run ends; a second run, fresh or --resume, is refused before it
  // starts.
  std::unique_ptr<DirectoryLock> dir_lock;
  if (!o.checkpoint_dir.empty()) {
    // --resume names the directory a run wrote: a checkpoint file given instead was read, and
    // the run failed at its first save, after training ("cannot create --checkpoint-dir").
    LOOM_CHECK(!o.resume || std::filesystem::is_directory(o.checkpoint_dir), InvalidArgument,
               "--resume: --checkpoint-dir " << o.checkpoint_dir
                                             << " is not a directory (give the directory the run "
                                                "wrote; its 'latest' names the checkpoint)");
    if (!mpi || mpi->rank() == 0)
      dir_lock = std::make_unique<DirectoryLock>(o.checkpoint_dir, "--checkpoint-dir");
    // A fresh run into another run's checkpoints replaced its `latest` and step files, and
    // --keep-checkpoints then pruned by step number across both runs.
    const std::vector<std::string> names = checkpoint_dir_names(o.checkpoint_dir);
    if (!o.resume) {
      for (const std::string& n : names) {
        LOOM_CHECK(n != "latest" && !(n.rfind("step-", 0) == 0 && n.size() > 5 &&
                                      n.compare(n.size() - 5, 5, ".ckpt") == 0),
                   InvalidArgument,
                   "--checkpoint-dir " << o.checkpoint_dir << " holds a run's checkpoints (" << n
                                       << "): give --resume to continue that run, or another "
                                          "directory (or empty this one) for a new run");
      }
    }
    // Unwritable (a read-only directory, /proc, /sys) was found at the first save, after the
    // training up to it: tried for real now, as --log is.
    check_output_writable((std::filesystem::path(o.checkpoint_dir) / "latest").string(),
                          "--checkpoint-dir");
    // Temporaries of killed runs (their pid is gone): loom's own only, `latest.tmp.<pid>-<n>`
    // and `step-<step>.ckpt.tmp.<pid>-<n>` as regular files. Any name holding ".tmp." went
    // (a user's thesis.tex.tmp.4242 was deleted). Only by the holder of the lock, once it holds
    // it: a pid is looked up on this node, in this PID namespace, so every rank of a second job
    // (refused by the lock on its rank 0) deleted the running job's temporary from another node
    // or namespace, where its writer's pid is not seen, and that job failed at its rename.
    if (dir_lock) {
      for (const std::string& n : names) {
        const long pid = checkpoint_temp_pid(n);
        const std::string file = (std::filesystem::path(o.checkpoint_dir) / n).string();
        struct stat st;
        if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH &&
            ::lstat(file.c_str(), &st) == 0 && S_ISREG(st.st_mode))
          ::unlink(file.c_str());
      }
    }
  }
  model::set_blas_threads(threads);

  Summary sum;
  std::string backend = "local";
  if (mpi) {
    backend = mpi->backend();
    train_rank(*mpi, o, c, corpus, sum);
    if (mpi->rank() != 0) return 0;
  } else {
    run_local(world, [&](Communicator& w) { train_rank(w, o, c, corpus, sum); });
  }
  // With the log on standard output, the summary stays off it (docs/cli.md, "Files").
  if (o.log != "-") print_summary(c, corpus, sum, threads, backend);
  return 0;
}

void declare_train(CLI::App* c, TrainOptions& opts) {
  TrainOptions* o = &opts;
  c->add_option("--ranks", o->ranks,
                "ranks on the local backend (threads); with no mesh sizes given, "
                "all of them form the context-parallel ring")
      ->capture_default_str();
  // 0 stands for "not given" in TrainOptions, so a given 0 is refused here, not taken as unset.
  const CLI::Range kPositiveInt(1, std::numeric_limits<int>::max());
  c->add_option("--dp", o->dp, "data-parallel ranks (default 1)")->check(kPositiveInt);
  c->add_option("--tp", o->tp, "tensor(+sequence)-parallel ranks (default 1)")->check(kPositiveInt);
  c->add_option("--ulysses", o->ulysses, "ulysses degree of the context-parallel group (default 1)")
      ->check(kPositiveInt);
  c->add_option("--ring", o->ring,
                "ring degree of the context-parallel group (default 1, or --ranks when no mesh "
                "size is given)")
      ->check(kPositiveInt);
  c->add_option("--strategy", o->strategy,
                "attention over the cp group (default: hybrid when ulysses and ring > 1, ulysses "
                "when only ulysses > 1, else ring); it must match the mesh: hybrid needs "
                "--ulysses > 1, ulysses --ring 1, any other --ulysses 1; " +
                    strategy_help());
  o->degrees.add_to(c, {"--ulysses"});
  c->add_option("--layout", o->layout, "contiguous, zigzag or stripe")->capture_default_str();
  c->add_option("--seq", o->seq, "tokens (bytes) per sequence")->capture_default_str();
  c->add_option("--layers", o->layers, "decoder layers")->capture_default_str();
  c->add_option("--dim", o->dim, "model width")->capture_default_str();
  c->add_option("--heads", o->heads, "query heads")->capture_default_str();
  c->add_option("--kv-heads", o->kv_heads, "key/value heads (GQA)")->capture_default_str();
  c->add_option("--ffn", o->ffn, "SwiGLU hidden units (0: 4 x dim)")->capture_default_str();
  c->add_option("--steps", o->steps, "total optimizer steps")->capture_default_str();
  c->add_option("--batch", o->batch, "sequences per step (global; a multiple of --dp)")
      ->capture_default_str();
  c->add_option("--lr", o->lr, "peak learning rate (AdamW)")->capture_default_str();
  c->add_option("--warmup", o->warmup, "warmup steps (-1: min(100, steps / 10))")
      ->capture_default_str();
  c->add_option("--weight-decay", o->weight_decay, "AdamW weight decay of the matrices")
      ->capture_default_str();
  c->add_option("--clip", o->clip, "clip the global gradient norm to this (0: off)")
      ->capture_default_str();
  c->add_option("--seed", o->seed, "seed of the initialisation and the data draw")
      ->capture_default_str();
  c->add_option("--checkpoint-dir", o->checkpoint_dir,
                "write checkpoints here (at the end and every --checkpoint-every steps)");
  c->add_option("--checkpoint-every", o->checkpoint_every, "steps between checkpoints (0: end)")
      ->capture_default_str();
  c->add_flag("--resume", o->resume, "continue from the latest checkpoint in --checkpoint-dir");
  c->add_flag("--checkpoint-activations", o->checkpoint_activations,
              "keep only each layer's input; recompute the layer in backward");
  c->add_option("--dtype", o->dtype, "fp32 or bf16 (bf16 GEMMs, fp32 master weights)")
      ->capture_default_str();
  c->add_option("--data", o->data, "text file to train on (default: data/kjv.txt)");
  c->add_flag("--pack-documents", o->pack_documents,
              "attention stays inside documents (document mask, per-document zigzag)");
  c->add_option("--log", o->log, "write one JSON object per step to this file");
  c->add_option("--eval-every", o->eval_every, "steps between validation losses (0: never)")
      ->capture_default_str();
  c->add_option("--eval-batches", o->eval_batches, "validation windows per evaluation")
      ->capture_default_str();
  c->add_flag("--quiet", o->quiet, "no progress lines on stderr");
  c->add_option("--keep-checkpoints", o->keep_checkpoints,
                "keep only the newest N checkpoints in --checkpoint-dir (0: all)")
      ->capture_default_str();
  add_memory_limit_option(c, o->memory_limit);
  c->add_option("--data-limit", o->data_limit,
                "refuse a --data file larger than this (e.g. 4G); --data - reads standard input")
      ->capture_default_str();
  c->add_option("--threads", o->threads,
                "OpenMP and OpenBLAS threads per rank (0: cores / ranks); 1 by default because "
                "spin-waiting threads on a shared machine cost more than they give")
      ->capture_default_str();
}

}  // namespace

// Peak bytes of the run in this process (`ranks_here` ranks), from the configuration alone. Per
// rank, at its peak (inside the attention backward of the last layer, the first one backward):
//   state       the parameters, gradients and both AdamW moments of its tp piece (fp32, plus a
//               bf16 copy), and from the first update on the gradient sums' scratch and
//               message copies;
//   kept        what every layer keeps for backward (model/gpt.cc's LayerActs: inputs, norms,
//               q, k, v, o, lse, the MLP's u, g and silu(u) g, on the rank's rows; the big ones
//               bf16 with --dtype bf16, but the layer in backward unpacked); with
//               --checkpoint-activations every layer's input and the one layer recomputed;
//   backward    the layer backward's own buffers (the gradients of its gathered rows, of the MLP
//               and of q, k, v), the final norm's, the logits and their gradient, and with bf16
//               the GEMMs' operand copies;
//   attention   the strategy's working set for forward and backward (strategy_working_bytes: its
//               buffers, kept from call to call, the kernels' workspace and, on the local
//               backend, its message copies) and the plan's token lists, as loom attn counts
//               them. It changes with --strategy; uncounted, a run estimated at 333 MiB peaked at
//               587 MiB, and allgather's peaks were up to 1.76 times the estimate;
//   churn       what the allocator keeps of freed buffers, 8% of the three above;
//   batch       the global batch's token windows (every rank draws all of them);
//   thread      the rank's thread, its groups and kernel threads;
// and once, the corpus (the text and its splits) and the process itself. Measured peaks from
// 100 MiB up are 0.77 to 0.97 times this, across the strategies, meshes, dtypes and activation
// checkpointing (docs/train.md). With checkpoints, train_memory adds model::checkpoint_bytes.
double estimate_train_bytes(const TrainConfig& c, int ranks_here, double data_bytes) {
  const model::ModelConfig& m = c.model;
  const MeshShape& s = c.par.mesh;
  const double T = double(s.tp), C = double(m.dim), L = double(m.layers), V = double(m.vocab);
  const double kv = double(m.kv_heads * m.head_dim());
  const double ffn = double(m.ffn_dim()), Fl = ffn / T, qd = C / T, kvd = kv / T;
  const double Hl = double(m.heads) / T;
  const double params = 2 * V * C + L * (2 * C * C + 2 * C * kv + 3 * C * ffn + 2 * C) + C;
  const double local = params / s.tp;
  const bool bf16 = c.precision == model::Precision::bf16;
  // The gradient sums (comm all_reduce) keep a scratch of the other ranks' blocks, and the local
  // backend copies the blocks a rank sends before their receiver is ready (and keeps the copies
  // for reuse): uncounted, a 4-rank run with checkpoints peaked above its estimate.
  const double W = double(s.world());
  const bool local_backend = !launched_by_mpirun();
  const double sums = local * 4 * (W - 1) / W * (local_backend ? 2 : 1);
  const double state = local * 4 * 4 + (bf16 ? local * 2 : 0) + sums;
  // The rank's rows n, its sequence-parallel rows nsp and the gathered rows T * nsp.
  const int64_t per_rank = c.seq / s.cp() + (c.seq % s.cp() != 0 ? 1 : 0);
  const double n = double(per_rank), nsp = std::ceil(n / T), full = T * nsp;
  const double layer32 = 4 * (nsp * (4 * C + 2) + n * (2 * qd + 2 * kvd + Hl + 3 * Fl));
  const double layer16 =
      4 * (nsp * (2 * C + 2) + n * Hl) + 2 * (2 * nsp * C + n * (2 * qd + 2 * kvd + 3 * Fl));
  const double kept = c.checkpoint_activations ? L * 4 * nsp * C + layer32
                      : bf16                   ? (L - 1) * layer16 + layer32
                                               : L * layer32;
  double backward = 4 * (3 * full * C + nsp * C + n * (3 * Fl + 2 * qd + 2 * kvd)) +
                    4 * (nsp * (4 * C + 2) + 2 * nsp * V);
  // bf16 GEMMs: the rounded operands the model keeps (scratch_a, scratch_b), and the fp32 copies
  // of both operands a GEMM makes where OpenBLAS has no bf16 GEMM (the largest: the MLP's and
  // the head's weight gradients).
  if (bf16) {
    const double wide = std::max(Fl, V);
    backward += 4 * std::max(n * std::max(C, Fl), nsp * V) + 4 * (n * (C + wide) + C * wide);
  }
  CpProblem p;
  p.seq = c.seq;
  p.rows = rank_rows_bound(c.seq, s.cp());
  p.heads = m.heads / s.tp;
  p.kv_heads = m.kv_heads / s.tp;
  p.head_dim = m.head_dim();
  p.ranks = s.cp();
  p.backward = true;
  p.dtype_bytes = 4;  // the model rounds q, k, v to bf16 values but stores them as fp32
  p.threads = std::max(1, c.par.threads);
  p.local_backend = local_backend;
  const double attention =
      strategy_working_bytes(model::cp_config(c.par, m.head_dim()), p) + 4 * double(c.seq) * 12;
  // Every rank draws the whole global batch each step (model::Sequence: input, target, rope
  // positions and document lengths, 24 bytes a token, about 200 more a sequence): --batch 2000000
  // passed a limit of 100 MB and grew past 790 MB.
  const double batch = double(c.batch) * (24.0 * double(c.seq) + 200);
  // The allocator keeps pages of freed buffers that the next, differently sized ones do not
  // reuse (a layer's forward buffers, bf16 copies, the sequences of a batch): 8% of what comes
  // and goes (a bf16 run with --checkpoint-activations peaked 4% above the sum without it, and
  // a batch of 4 sequences 4% above one of 1).
  const double churn = 0.08 * (kept + backward + attention);
  // The rank's thread, its groups and what OpenBLAS touches of its buffer, each further kernel
  // thread's stack and OpenMP state (as loom attn counts them); the process itself (the binary,
  // its libraries and OpenBLAS's threads: 12 MiB measured, about 19 MiB under mpirun).
  const double thread = 4.0 * (1 << 20) + 256.0 * 1024 * (p.threads - 1);
  return ranks_here * (state + kept + backward + attention + churn + batch + thread) +
         2 * data_bytes + 20.0 * (1 << 20);
}

void add_train_command(CLI::App& app) {
  add_command<TrainOptions>(
      app, "train", "train a byte-level GPT with data, tensor, sequence and context parallelism",
      declare_train, [](const CLI::App* c, TrainOptions& o) {
        o.ranks_given = c->count("--ranks") > 0;
        return run_train(o);
      });
}

}  // namespace loom::tools
