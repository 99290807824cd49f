// bench_comm: an nccl-tests style harness for the Communicator backends.
//
// For each operation (ring step, all_to_all, all_gather, all_reduce) and each size of a sweep
// (doubling from --min-bytes to --max-bytes) every rank runs --warmup untimed and --iters timed
// calls between two barriers; the time of a size is the slowest rank's mean per call. Then, with
// the check on (the default, as nccl-tests' -c 1), one more call on fresh data is compared
// with the expected result and the wrong elements are counted over all ranks.
//
// Sizes and bandwidths follow nccl-tests (doc/PERFORMANCE.md there), in GB/s = 1e9 bytes/s:
//   ring_step   size = bytes each rank sends to its successor     busbw = algbw
//   all_to_all  size = bytes of one rank's send buffer (P parts)  busbw = algbw * (P-1)/P
//   all_gather  size = bytes of one rank's receive buffer         busbw = algbw * (P-1)/P
//   all_reduce  size = bytes of the buffer                        busbw = algbw * 2(P-1)/P
// with algbw = size / time. Data are f32 small integers, so sums are exact.
//
//   bench_comm --ranks 2                      local backend, 2 ranks (threads)
//   mpirun -n 2 bench_comm                    MPI backend
//   bench_comm --ranks 4 --ops all_reduce --min-bytes 1K --max-bytes 1M --json out.json
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <new>
#include <string>
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
  virtual double bus_factor(int ranks) const = 0;
  virtual void prepare(Communicator& c, size_t count) = 0;  // fills inputs with check data
  virtual void run(Communicator& c, size_t count) = 0;
  virtual int64_t wrong(Communicator& c, size_t count) const = 0;
  // nccl-tests size of `count` elements.
  virtual size_t size_of(size_t count, int ranks) const = 0;
};

class RingStep final : public Op {
 public:
  size_t count_for(size_t bytes, int) const override { return bytes / 4; }
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

class AllReduce final : public Op {
 public:
  size_t count_for(size_t bytes, int) const override { return bytes / 4; }
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

// Everything the sweep would refuse or run out of, checked before any rank starts: every op
// known (--ops ring_step,foo ran the whole ring_step sweep first, and under mpirun Open MPI's
// unpack errors followed the refusal), the sizes parsed and in order, and the largest size's
// buffers within the memory available (--max-bytes 4T ended in a bare std::bad_alloc). `ranks`:
// the ranks this process holds (the local backend's threads; 1 under MPI).
void check_options(Options& o, int ranks) {
  for (const std::string& name : o.ops) make_op(name);
  LOOM_CHECK(!o.ops.empty(), InvalidArgument, "--ops: give at least one op");
  o.lo = static_cast<size_t>(parse_size(o.min_bytes, "--min-bytes"));
  o.hi = static_cast<size_t>(parse_size(o.max_bytes, "--max-bytes"));
  LOOM_CHECK(o.lo <= o.hi, InvalidArgument,
             "--min-bytes " << o.min_bytes << " must not exceed --max-bytes " << o.max_bytes);
  size_t top = o.lo;  // the largest size the doubling sweep reaches
  while (top <= o.hi / 2) top *= 2;
  double need = 0;
  for (const std::string& name : o.ops)
    need = std::max(need, buffer_bytes(name, static_cast<double>(top), ranks));
  need *= ranks;
  const int64_t avail = available_memory_bytes();
  LOOM_CHECK(avail < 0 || need <= static_cast<double>(avail), InvalidArgument,
             "--max-bytes " << o.max_bytes << ": the sweep's largest size needs at least "
                            << human_bytes(need) << " of buffers (" << ranks << " rank"
                            << (ranks == 1 ? "" : "s") << " in this process) but "
                            << human_bytes(static_cast<double>(avail))
                            << " of memory is available; lower --max-bytes");
}

// The whole sweep on one rank; rank 0 returns the results.
std::vector<Result> sweep(Communicator& c, const Options& o) {
  const size_t lo = o.lo, hi = o.hi;
  const int n = c.size();
  std::vector<Result> results;
  for (const std::string& name : o.ops) {
    auto op = make_op(name);
    for (size_t bytes = lo; bytes <= hi; bytes *= 2) {
      const size_t count = op->count_for(bytes, n);
      if (count == 0) continue;
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
      r.op = name;
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

void print(const std::vector<Result>& results, const Options& o, const std::string& backend,
           int ranks) {
  std::printf("# bench_comm: backend %s, %d ranks, %d iters, %d warmup, check %s\n",
              backend.c_str(), ranks, o.iters, o.warmup, o.no_check ? "off" : "on");
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

void write_json(const std::vector<Result>& results, const Options& o, const std::string& backend,
                int ranks) {
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
  write_output(o.json, j.dump(2) + "\n");  // atomically, every write checked (loom/io.h)
}

int run(Options& o) {
  const bool use_mpi = o.backend == "mpi" || (o.backend == "auto" && launched_by_mpirun());
  LOOM_CHECK(o.iters >= 1 && o.warmup >= 0, InvalidArgument,
             "--iters must be >= 1 and --warmup >= 0, got " << o.iters << " and " << o.warmup);
  check_options(o, use_mpi ? 1 : o.ranks);
  std::vector<Result> results;
  int ranks = 0;
  bool failed = false;
  int64_t wrong = 0;
  if (use_mpi) {
    auto world = mpi_world();
    if (o.timeout_s > 0) world->set_timeout_s(o.timeout_s);
    ranks = world->size();
    results = sweep(*world, o);
    if (world->rank() != 0) return 0;
  } else {
    LOOM_CHECK_GE(o.ranks, 1, InvalidArgument, "--ranks must be positive");
    ranks = o.ranks;
    run_local(
        o.ranks,
        [&](Communicator& c) {
          auto mine = sweep(c, o);
          if (c.rank() == 0) results = std::move(mine);
        },
        {}, o.timeout_s);
  }
  const std::string backend = use_mpi ? "mpi" : "local";
  print(results, o, backend, ranks);
  if (!o.json.empty()) write_json(results, o, backend, ranks);
  for (const Result& r : results) wrong += std::max<int64_t>(r.wrong, 0);
  failed = wrong > 0;
  if (failed) std::fprintf(stderr, "bench_comm: %lld wrong elements\n", (long long)wrong);
  return failed ? 2 : 0;
}

}  // namespace
}  // namespace loom

int main(int argc, char** argv) {
  loom::Options o;
  CLI::App app{"bench_comm: nccl-tests style benchmark of loom's communication backends"};
  // Values checked before anything runs (--ranks 0 printed an internal expression, --timeout -1
  // was taken, --json onto a directory failed after the sweep).
  app.add_option("--ranks", o.ranks, "ranks of the local backend (threads)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--backend", o.backend, "auto (mpi under mpirun, else local), local or mpi")
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
                 "anything runs)")
      ->delimiter(',');
  app.add_flag("--no-check", o.no_check, "skip the correctness check");
  app.add_option("--json", o.json,
                 "also write the results to this JSON file (-: standard output, the table then "
                 "goes to standard error)");
  app.add_option("--timeout", o.timeout_s, "seconds before a wait fails (default LOOM_TIMEOUT_S)")
      ->check(CLI::Range(1e-3, 1e9));
  if (const auto rc = loom::parse_command_line(app, argc, argv, "bench_comm")) return *rc;
  try {
    if (!o.json.empty()) loom::check_output_writable(o.json, "--json");
    // --json -: the JSON alone on standard output, the table on standard error (both went to
    // standard output, unparseable).
    o.json = loom::json_alone_on_stdout(o.json);
    return loom::run(o);
  } catch (const std::bad_alloc&) {  // the estimate above leaves out the backend's staging
    std::fprintf(stderr, "bench_comm: out of memory at a size up to --max-bytes %s; lower it\n",
                 o.max_bytes.c_str());
    if (loom::launched_by_mpirun()) loom::mpi_abort(1);
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_comm: %s\n", e.what());
    if (loom::launched_by_mpirun()) loom::mpi_abort(1);
    return 1;
  }
}
