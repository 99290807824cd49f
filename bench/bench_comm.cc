// bench_comm: an nccl-tests style harness for the Communicator backends.
//
// For each operation (ring step, all_to_all, all_gather, all_reduce) and each size of a sweep
// (doubling from --min-bytes to --max-bytes) every rank runs --warmup untimed and --iters timed
// calls between two barriers; the time of a size is the slowest rank's mean per call. Then, with
// the check on (the default, as nccl-tests' -c 1), one more call on fresh data is compared
// with the expected result and the wrong elements are counted over all ranks (any: exit 1).
// A bad command line (an option or value, --ops, the sizes) is one line and exit 2 before
// anything runs; buffers the machine cannot hold are one line and exit 1.
//
// Sizes and bandwidths follow nccl-tests (doc/PERFORMANCE.md there), in GB/s = 1e9 bytes/s:
//   ring_step   size = bytes each rank sends to its successor     busbw = algbw
//   all_to_all  size = bytes of one rank's send buffer (P parts)  busbw = algbw * (P-1)/P
//   all_gather  size = bytes of one rank's receive buffer         busbw = algbw * (P-1)/P
//   all_reduce  size = bytes of the buffer                        busbw = algbw * 2(P-1)/P
// with algbw = size / time. Data are f32 small integers, so sums are exact.
//
// A size below one f32 element per rank buffer (all_to_all and all_gather: one for each rank) is
// skipped, one "# skipped" line per op saying so; a sweep in which every size of every op is
// skipped measures nothing and is refused (exit 2).
//
//   bench_comm --ranks 2                      local backend, 2 ranks (threads)
//   mpirun -n 2 bench_comm                    MPI backend (--ranks is refused: -np sets them)
//   bench_comm --ranks 4 --ops all_reduce --min-bytes 1K --max-bytes 1M --json out.json
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "bench_cli.h"
#include "loom/comm.h"
#include "loom/error.h"
#include "loom/io.h"
#include "loom/timer.h"

namespace loom {
namespace {

struct Options {
  int ranks = 2;
  bool ranks_given = false;  // --ranks on the command line (refused with the MPI backend)
  std::string backend = "auto";
  std::string min_bytes = "1K", max_bytes = "64M";
  size_t lo = 0, hi = 0;  // min_bytes and max_bytes parsed (check_options)
  int iters = 20, warmup = 5;
  std::vector<std::string> ops = {"ring_step", "all_to_all", "all_gather", "all_reduce"};
  bool no_check = false;
  std::string json;
  double timeout_s = -1;
};

struct Result {
  std::string op;
  size_t bytes = 0;  // nccl-tests "size"
  size_t count = 0;  // f32 elements per rank buffer the size describes
  double time_us = 0;
  double algbw = 0, busbw = 0;  // GB/s
  int64_t wrong = -1;           // -1: not checked
};

float value(int rank, size_t i) {
  return static_cast<float>((rank * 3 + i) % 11);
}

// One operation on preallocated buffers: post, run, check.
class Op {
 public:
  virtual ~Op() = default;
  // Elements of f32 per rank buffer for a given size; 0 if the size is too small.
  virtual size_t count_for(size_t bytes, int ranks) const = 0;
  // The smallest size of a count of at least 1, and what it is, for the "skipped" lines.
  virtual size_t min_bytes(int ranks) const = 0;
  virtual std::string min_bytes_why(int ranks) const = 0;
  virtual double bus_factor(int ranks) const = 0;
  virtual void prepare(Communicator& c, size_t count) = 0;  // fills inputs with check data
  virtual void run(Communicator& c, size_t count) = 0;
  virtual int64_t wrong(Communicator& c, size_t count) const = 0;
  // nccl-tests size of `count` elements.
  virtual size_t size_of(size_t count, int ranks) const = 0;
};

// One f32 element per buffer.
class OneBufferOp : public Op {
 public:
  size_t count_for(size_t bytes, int) const override { return bytes / 4; }
  size_t min_bytes(int) const override { return 4; }
  std::string min_bytes_why(int) const override { return "one f32 element"; }
};

class RingStep final : public OneBufferOp {
 public:
  double bus_factor(int) const override { return 1; }
  size_t size_of(size_t count, int) const override { return count * 4; }
  void prepare(Communicator& c, size_t count) override {
    send_.resize(count);
    recv_.assign(count, -1.0f);
    for (size_t i = 0; i < count; ++i) send_[i] = value(c.rank(), i);
  }
  void run(Communicator& c, size_t count) override {
    const int n = c.size(), r = c.rank();
    std::vector<P2POp> ops = {{P2POp::send, send_.data(), count * 4, (r + 1) % n},
                              {P2POp::recv, recv_.data(), count * 4, (r - 1 + n) % n}};
    for (auto& w : c.batch_p2p(ops)) w->wait();
  }
  int64_t wrong(Communicator& c, size_t count) const override {
    const int prev = (c.rank() - 1 + c.size()) % c.size();
    int64_t bad = 0;
    for (size_t i = 0; i < count; ++i) bad += recv_[i] != value(prev, i);
    return bad;
  }

 private:
  std::vector<float> send_, recv_;
};

// Ops whose receive buffer is one block of `count` elements from each rank (all_to_all,
// all_gather): the nccl-tests size is the whole receive buffer and the bus factor (P - 1) / P.
// In a correct result block p holds value(sender_key(p, rank, P), i).
class BlockOp : public Op {
 public:
  size_t count_for(size_t bytes, int ranks) const override { return bytes / 4 / ranks; }
  size_t min_bytes(int ranks) const override { return 4 * static_cast<size_t>(ranks); }
  std::string min_bytes_why(int ranks) const override {
    return "one f32 element for each of the " + std::to_string(ranks) + " ranks";
  }
  double bus_factor(int ranks) const override { return double(ranks - 1) / ranks; }
  size_t size_of(size_t count, int ranks) const override { return count * 4 * ranks; }
  int64_t wrong(Communicator& c, size_t count) const override {
    const int n = c.size();
    int64_t bad = 0;
    for (int p = 0; p < n; ++p) {
      for (size_t i = 0; i < count; ++i)
        bad += recv_[p * count + i] != value(sender_key(p, c.rank(), n), i);
    }
    return bad;
  }

 protected:
  // The value key of the block rank `from` sends to `rank`.
  virtual int sender_key(int from, int rank, int ranks) const = 0;
  std::vector<float> send_, recv_;
};

class AllToAll final : public BlockOp {
 public:
  void prepare(Communicator& c, size_t count) override {
    const int n = c.size();
    send_.resize(count * n);
    recv_.assign(count * n, -1.0f);
    for (int p = 0; p < n; ++p) {
      for (size_t i = 0; i < count; ++i) send_[p * count + i] = value(c.rank() * n + p, i);
    }
  }
  void run(Communicator& c, size_t count) override {
    c.all_to_all(send_.data(), recv_.data(), count * 4);
  }

 private:
  int sender_key(int from, int rank, int ranks) const override { return from * ranks + rank; }
};

class AllGather final : public BlockOp {
 public:
  void prepare(Communicator& c, size_t count) override {
    send_.resize(count);
    recv_.assign(count * c.size(), -1.0f);
    for (size_t i = 0; i < count; ++i) send_[i] = value(c.rank(), i);
  }
  void run(Communicator& c, size_t count) override {
    c.all_gather(send_.data(), count * 4, recv_.data());
  }

 private:
  int sender_key(int from, int, int) const override { return from; }
};

class AllReduce final : public OneBufferOp {
 public:
  double bus_factor(int ranks) const override { return 2.0 * (ranks - 1) / ranks; }
  size_t size_of(size_t count, int) const override { return count * 4; }
  void prepare(Communicator& c, size_t count) override {
    buf_.resize(count);
    for (size_t i = 0; i < count; ++i) buf_[i] = value(c.rank(), i);
  }
  // Timed calls keep reducing the same buffer (as nccl-tests' in-place runs do); only the
  // call after prepare() is checked.
  void run(Communicator& c, size_t count) override {
    c.all_reduce(buf_.data(), count, DType::f32, ReduceOp::sum);
  }
  int64_t wrong(Communicator& c, size_t count) const override {
    int64_t bad = 0;
    for (size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int p = 0; p < c.size(); ++p) want += value(p, i);
      bad += buf_[i] != want;
    }
    return bad;
  }

 private:
  std::vector<float> buf_;
};

std::unique_ptr<Op> make_op(const std::string& name) {
  if (name == "ring_step") return std::make_unique<RingStep>();
  if (name == "all_to_all") return std::make_unique<AllToAll>();
  if (name == "all_gather") return std::make_unique<AllGather>();
  if (name == "all_reduce") return std::make_unique<AllReduce>();
  throw InvalidArgument(
      "--ops: unknown op '" + name + "' (ring_step, all_to_all, all_gather, all_reduce)", __FILE__,
      __LINE__);
}

// The bytes one rank's buffers hold for an op at its largest size (its send and receive
// buffers; the backend's own staging comes on top).
double buffer_bytes(const std::string& op, double bytes, int ranks) {
  if (op == "all_gather") return bytes + bytes / ranks;  // its send block and the gathered whole
  if (op == "all_reduce") return bytes;                  // in place
  return 2 * bytes;                                      // ring_step, all_to_all: send + receive
}

// The command line's own errors, the same on every rank under mpirun, checked before any rank
// starts: every op known, each named once (--ops ring_step,ring_step printed every row twice),
// and the sizes parsed and in order. (--ops ring_step,foo ran the whole ring_step sweep first, and
// under mpirun Open MPI's unpack errors followed the refusal.)
void check_options(Options& o) {
  for (const std::string& name : o.ops) make_op(name);
  LOOM_CHECK(!o.ops.empty(), InvalidArgument, "--ops: give at least one op");
  std::vector<std::string> once;
  for (const std::string& name : o.ops)
    if (std::find(once.begin(), once.end(), name) == once.end()) once.push_back(name);
  o.ops = once;
  o.lo = static_cast<size_t>(parse_size(o.min_bytes, "--min-bytes"));
  o.hi = static_cast<size_t>(parse_size(o.max_bytes, "--max-bytes"));
  LOOM_CHECK(o.lo <= o.hi, InvalidArgument,
             "--min-bytes " << o.min_bytes << " must not exceed --max-bytes " << o.max_bytes);
}

// The sizes of the doubling sweep.
std::vector<size_t> sweep_sizes(const Options& o) {
  std::vector<size_t> sizes;
  for (size_t bytes = o.lo; bytes <= o.hi; bytes *= 2) {
    sizes.push_back(bytes);
    if (bytes > o.hi / 2) break;  // the next would pass --max-bytes (or overflow)
  }
  return sizes;
}

// The largest size's buffers within the memory available (--max-bytes 4T ended in a bare
// std::bad_alloc). `ranks`: the ranks this process holds (the local backend's threads; 1 under
// MPI). This node's memory: under mpirun it may differ from rank to rank.
void check_buffers_fit(const Options& o, int ranks) {
  const double top = static_cast<double>(sweep_sizes(o).back());
  double need = 0;
  for (const std::string& name : o.ops) need = std::max(need, buffer_bytes(name, top, ranks));
  need *= ranks;
  const int64_t avail = available_memory_bytes();
  LOOM_CHECK(avail < 0 || need <= static_cast<double>(avail), InvalidArgument,
             "--max-bytes " << o.max_bytes << ": the sweep's largest size needs at least "
                            << human_bytes(need) << " of buffers (" << ranks << " rank"
                            << (ranks == 1 ? "" : "s") << " in this process) but "
                            << human_bytes(static_cast<double>(avail))
                            << " of memory is available; lower --max-bytes");
}

// What the sweep runs on `ranks` ranks: each op's sizes, and those it skips (below one f32
// element per rank buffer: they were left out without a word, and a sweep of nothing printed the
// header alone, wrote "results": [] and exited 0).
struct OpPlan {
  std::string op;
  std::vector<size_t> sizes, skipped;
  size_t min_bytes = 0;
  std::string min_bytes_why;
};

std::vector<OpPlan> plan_sweep(const Options& o, int ranks) {
  std::vector<OpPlan> plan;
  for (const std::string& name : o.ops) {
    const auto op = make_op(name);
    OpPlan p{name, {}, {}, op->min_bytes(ranks), op->min_bytes_why(ranks)};
    for (const size_t bytes : sweep_sizes(o))
      (op->count_for(bytes, ranks) == 0 ? p.skipped : p.sizes).push_back(bytes);
    plan.push_back(p);
  }
  return plan;
}

// "4 and 8 B".
std::string sizes_text(const std::vector<size_t>& sizes) {
  std::string s;
  for (size_t i = 0; i < sizes.size(); ++i)
    s += (i == 0 ? "" : i + 1 == sizes.size() ? " and " : ", ") + std::to_string(sizes[i]);
  return s + " B";
}

// The refusal of a sweep that measures nothing ("": it measures something).
std::string nothing_measured(const Options& o, const std::vector<OpPlan>& plan, int ranks) {
  std::string needs;
  for (const OpPlan& p : plan) {
    if (!p.sizes.empty()) return "";
    needs += (needs.empty() ? "" : ", ") + p.op + " " + std::to_string(p.min_bytes) + " B";
  }
  return "--max-bytes " + o.max_bytes + " on " + std::to_string(ranks) +
         " ranks measures nothing: the smallest size each op runs is " + needs +
         " (one f32 element per buffer; all_to_all and all_gather one for each rank); raise "
         "--max-bytes";
}

// The whole sweep on one rank; rank 0 returns the results.
std::vector<Result> sweep(Communicator& c, const Options& o, const std::vector<OpPlan>& plan) {
  const int n = c.size();
  std::vector<Result> results;
  for (const OpPlan& p : plan) {
    auto op = make_op(p.op);
    for (const size_t bytes : p.sizes) {
      const size_t count = op->count_for(bytes, n);
      op->prepare(c, count);
      for (int i = 0; i < o.warmup; ++i) op->run(c, count);
      c.barrier();
      const double start = now_s();
      for (int i = 0; i < o.iters; ++i) op->run(c, count);
      double per_call = (now_s() - start) / std::max(1, o.iters);
      c.all_reduce(&per_call, 1, DType::f64, ReduceOp::max);
      int64_t wrong = -1;
      if (!o.no_check) {
        op->prepare(c, count);
        op->run(c, count);
        wrong = op->wrong(c, count);
        c.all_reduce(&wrong, 1, DType::i64, ReduceOp::sum);
      }
      Result r;
      r.op = p.op;
      r.count = count;
      r.bytes = op->size_of(count, n);
      r.time_us = per_call * 1e6;
      r.algbw = r.bytes / per_call / 1e9;
      r.busbw = r.algbw * op->bus_factor(n);
      r.wrong = wrong;
      results.push_back(r);
    }
  }
  return results;
}

void print(const std::vector<Result>& results, const std::vector<OpPlan>& plan, const Options& o,
           const std::string& backend, int ranks) {
  std::printf("# bench_comm: backend %s, %d ranks, %d iters, %d warmup, check %s\n",
              backend.c_str(), ranks, o.iters, o.warmup, o.no_check ? "off" : "on");
  for (const OpPlan& p : plan)
    if (!p.skipped.empty())
      std::printf("# skipped: %s at %s (it needs at least %zu B: %s)\n", p.op.c_str(),
                  sizes_text(p.skipped).c_str(), p.min_bytes, p.min_bytes_why.c_str());
  std::string last;
  for (const Result& r : results) {
    if (r.op != last) {
      std::printf("#\n# %-10s %12s %12s %12s %12s %12s %8s\n", "op", "size(B)", "count(f32)",
                  "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong");
      last = r.op;
    }
    const std::string wrong = r.wrong < 0 ? "N/A" : std::to_string(r.wrong);
    std::printf("  %-10s %12zu %12zu %12.1f %12.3f %12.3f %8s\n", r.op.c_str(), r.bytes, r.count,
                r.time_us, r.algbw, r.busbw, wrong.c_str());
  }
  std::fflush(stdout);
}

void write_json(const std::vector<Result>& results, const std::vector<OpPlan>& plan,
                const Options& o, const std::string& backend, int ranks) {
  nlohmann::json j;
  j["bench"] = "comm";
  j["backend"] = backend;
  j["ranks"] = ranks;
  j["iters"] = o.iters;
  j["warmup"] = o.warmup;
  j["check"] = !o.no_check;
  j["results"] = nlohmann::json::array();
  for (const Result& r : results) {
    j["results"].push_back({{"op", r.op},
                            {"bytes", r.bytes},
                            {"count", r.count},
                            {"time_us", r.time_us},
                            {"algbw_gbs", r.algbw},
                            {"busbw_gbs", r.busbw},
                            {"wrong", r.wrong}});
  }
  j["skipped"] = nlohmann::json::array();
  for (const OpPlan& p : plan)
    if (!p.skipped.empty())
      j["skipped"].push_back({{"op", p.op}, {"bytes", p.skipped}, {"min_bytes", p.min_bytes}});
  write_output(o.json, j.dump(2) + "\n");  // atomically, every write checked (loom/io.h)
}

// The sweep (options checked in main): on the MPI backend, or on the local one with o.ranks
// ranks. The table and --json come from rank 0.
int run(const Options& o, bool use_mpi) {
  std::vector<Result> results;
  std::vector<OpPlan> plan;
  int ranks = 0;
  bool failed = false;
  int64_t wrong = 0;
  if (use_mpi) {
    auto world = mpi_world();
    if (o.timeout_s > 0) world->set_timeout_s(o.timeout_s);
    ranks = world->size();
    plan = plan_sweep(o, ranks);  // the same on every rank: each refuses, rank 0 says why
    if (const std::string why = nothing_measured(o, plan, ranks); !why.empty()) {
      if (world->rank() == 0) std::fprintf(stderr, "bench_comm: %s\n", why.c_str());
      return 2;
    }
    results = sweep(*world, o, plan);
    if (world->rank() != 0) return 0;
  } else {
    ranks = o.ranks;
    plan = plan_sweep(o, ranks);
    if (const std::string why = nothing_measured(o, plan, ranks); !why.empty()) {
      std::fprintf(stderr, "bench_comm: %s\n", why.c_str());
      return 2;
    }
    run_local(
        o.ranks,
        [&](Communicator& c) {
          auto mine = sweep(c, o, plan);
          if (c.rank() == 0) results = std::move(mine);
        },
        {}, o.timeout_s);
  }
  const std::string backend = use_mpi ? "mpi" : "local";
  print(results, plan, o, backend, ranks);
  if (!o.json.empty()) write_json(results, plan, o, backend, ranks);
  for (const Result& r : results) wrong += std::max<int64_t>(r.wrong, 0);
  failed = wrong > 0;
  if (failed) std::fprintf(stderr, "bench_comm: %lld wrong elements\n", (long long)wrong);
  return failed ? 1 : 0;  // a failed check (2 is for a bad command line)
}

}  // namespace
}  // namespace loom

int main(int argc, char** argv) {
  loom::Options o;
  CLI::App app{"bench_comm: nccl-tests style benchmark of loom's communication backends"};
  // Values checked before anything runs (--ranks 0 printed an internal expression, --timeout -1
  // was taken, --json onto a directory failed after the sweep).
  auto* ranks = app.add_option("--ranks", o.ranks,
                               "ranks of the local backend (threads; under mpirun, -np sets them)")
                    ->check(CLI::Range(1, 1024))
                    ->capture_default_str();
  app.add_option("--backend", o.backend,
                 "auto (mpi under mpirun, else local), local (not under mpirun) or mpi")
      ->check(CLI::IsMember({"auto", "local", "mpi"}));
  app.add_option("--min-bytes,-b", o.min_bytes,
                 "smallest size (bytes; K, M, G suffixes, KiB etc. too)");
  app.add_option("--max-bytes,-e", o.max_bytes,
                 "largest size (bytes; K, M, G suffixes, KiB etc. too)");
  app.add_option("--iters,-n", o.iters, "timed calls per size")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  app.add_option("--warmup,-w", o.warmup, "untimed calls per size")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  app.add_option("--ops", o.ops,
                 "ring_step, all_to_all, all_gather, all_reduce (checked before "
                 "anything runs; each runs once)")
      ->delimiter(',');
  app.add_flag("--no-check", o.no_check, "skip the correctness check");
  app.add_option("--json", o.json,
                 "also write the results to this JSON file (-: standard output, the table then "
                 "goes to standard error)");
  app.add_option("--timeout", o.timeout_s, "seconds before a wait fails (default LOOM_TIMEOUT_S)")
      ->check(CLI::Range(1e-3, 1e9));
  // Under mpirun every process runs this command line, and its errors were printed once per
  // rank: an error of the command line itself (the same on every rank) is printed by rank 0
  // alone, the others exit with the same status; --json is rank 0's file, checked there alone.
  const bool mpirun = loom::launched_by_mpirun();
  const long rank = mpirun ? loom::launcher_rank() : -1;
  const bool root = rank <= 0;
  if (const auto rc = loom::parse_command_line(app, argc, argv, "bench_comm", !root)) return *rc;
  o.ranks_given = ranks->count() > 0;
  auto refuse = [&](int code, const std::string& what) {
    if (root) std::fprintf(stderr, "bench_comm: %s\n", what.c_str());
    return code;
  };
  const bool use_mpi = o.backend == "mpi" || (o.backend == "auto" && mpirun);
  if (use_mpi && o.ranks_given)  // it was ignored
    return refuse(2, mpirun ? "--ranks is for the local backend; under mpirun the number of ranks "
                              "is mpirun's -np (drop --ranks)"
                            : "--ranks is for the local backend; --backend mpi takes the ranks "
                              "mpirun starts (drop --ranks, or run under mpirun)");
  if (o.backend == "local" && mpirun)  // every process ran its own sweep, table and --json
    return refuse(2,
                  "--backend local under mpirun: each process would run a sweep of its own, print "
                  "its own table and write the same --json; run it without mpirun (or drop "
                  "--backend local for the MPI backend)");
  try {
    loom::check_options(o);
  } catch (const loom::Error& e) {
    return refuse(2, e.what());  // a bad command line (bench_cli.h), as CLI11's own
  }
  try {
    // This node's memory, which may differ between ranks: a rank above 0 says its own after two
    // seconds, by when a failed rank 0 has ended the job (one line, not one per rank).
    loom::check_buffers_fit(o, use_mpi ? 1 : o.ranks);
    if (root && !o.json.empty()) loom::check_output_writable(o.json, "--json");
  } catch (const loom::Error& e) {
    if (!root) std::this_thread::sleep_for(std::chrono::seconds(2));
    std::fprintf(stderr, "bench_comm: %s%s\n",
                 root ? "" : ("rank " + std::to_string(rank) + ": ").c_str(), e.what());
    return 1;
  }
  try {
    // --json -: the JSON alone on standard output, the table on standard error (both went to
    // standard output, unparseable).
    if (root) o.json = loom::json_alone_on_stdout(o.json);
    return loom::run(o, use_mpi);
  } catch (const std::bad_alloc&) {  // the estimate above leaves out the backend's staging
    std::fprintf(stderr, "bench_comm: out of memory at a size up to --max-bytes %s; lower it\n",
                 o.max_bytes.c_str());
    if (mpirun) loom::mpi_abort(1);
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_comm: %s\n", e.what());
    if (mpirun) loom::mpi_abort(1);
    return 1;
  }
}
