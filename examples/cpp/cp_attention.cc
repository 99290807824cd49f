// A context-parallel attention from C++, against an installed loom (docs/library.md).
//
// One causal GQA problem (S = 512 tokens, 4 query heads over 2 KV heads, head dim 64) is split
// over 4 ranks of the local backend (threads of this process) and run, forward and backward, with
// three strategies: ring on the zigzag layout, Ulysses on the contiguous one and their hybrid
// (Ulysses groups of 2, a ring of 2 groups). Every result is gathered back into global token
// order and compared with the fp64 reference under loom/tolerance.h's written tolerances.
// Exit status: 0 when everything matches, 1 on a mismatch, 2 on an error.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <vector>

#include "loom/attention.h"
#include "loom/comm.h"
#include "loom/cp.h"
#include "loom/error.h"
#include "loom/rng.h"
#include "loom/tensor.h"
#include "loom/tolerance.h"

namespace {

constexpr int kRanks = 4;
constexpr int64_t kSeq = 512, kHeads = 4, kKvHeads = 2, kDim = 64;

// ||x - ref|| / ||ref|| (absolute where ref is all zero): loom/tolerance.h's measure.
template <class X>
double rel_err(const loom::Tensor<X>& x, const loom::Tensor<double>& ref) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    const double d = static_cast<double>(x[i]) - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// The global inputs and their fp64 reference results.
struct Problem {
  loom::Tensor<float> q{kSeq, kHeads, kDim}, k{kSeq, kKvHeads, kDim}, v{kSeq, kKvHeads, kDim},
      dout{kSeq, kHeads, kDim};
  loom::Tensor<double> out{kSeq, kHeads, kDim}, lse{kHeads, kSeq}, dq{kSeq, kHeads, kDim},
      dk{kSeq, kKvHeads, kDim}, dv{kSeq, kKvHeads, kDim};
  loom::KernelConfig kernel;
  loom::CheckLimits tol;  // the tolerance of each result (loom::check_limits)
};

// What one strategy computed, in global token order (lse [H, S]).
struct Result {
  loom::Tensor<float> out{kSeq, kHeads, kDim}, lse{kHeads, kSeq}, dq{kSeq, kHeads, kDim},
      dk{kSeq, kKvHeads, kDim}, dv{kSeq, kKvHeads, kDim};
  int64_t bytes_sent = 0;  // by all ranks, forward and backward
};

// One rank's shard of the inputs and its outputs.
struct RankData {
  loom::Tensor<float> out, lse, dq, dk, dv;
  int64_t bytes_sent = 0;
};

Result run(const Problem& p, loom::Strategy strategy, int degree, loom::Layout layout) {
  const loom::ShardPlan plan = loom::ShardPlan::make(layout, kSeq, kRanks);
  std::vector<RankData> ranks(kRanks);
  // Every rank is a thread with its own Communicator; an exception on one rank fails the others'
  // waits and is rethrown here.
  loom::run_local(kRanks, [&](loom::Communicator& comm) {
    const int r = comm.rank();
    loom::CpConfig cfg;
    cfg.strategy = strategy;
    cfg.kernel = p.kernel;
    if (degree > 0) loom::set_degree(cfg, degree);  // hybrid's Ulysses degree
    loom::CpAttention attention(comm, plan, cfg, kHeads, kKvHeads, kDim);  // collective

    const int64_t n = plan.rows(r);
    const loom::Tensor<float> q = plan.shard(p.q, r), k = plan.shard(p.k, r),
                              v = plan.shard(p.v, r), dout = plan.shard(p.dout, r);
    RankData& mine = ranks[static_cast<size_t>(r)];  // this rank's slot only
    mine.out = loom::Tensor<float>({n, kHeads, kDim});
    mine.lse = loom::Tensor<float>({kHeads, n});
    mine.dq = loom::Tensor<float>({n, kHeads, kDim});
    mine.dk = loom::Tensor<float>({n, kKvHeads, kDim});
    mine.dv = loom::Tensor<float>({n, kKvHeads, kDim});
    attention.forward(q.view3(), k.view3(), v.view3(), mine.out.view3(), mine.lse.data());
    attention.backward(q.view3(), k.view3(), v.view3(), mine.out.view3(), dout.view3(),
                       mine.lse.data(), mine.dq.view3(), mine.dk.view3(), mine.dv.view3());
    mine.bytes_sent = attention.metrics().bytes_sent;
  });

  Result res;
  for (int r = 0; r < kRanks; ++r) {
    const RankData& d = ranks[static_cast<size_t>(r)];
    plan.unshard(d.out, r, res.out);
    plan.unshard(d.dq, r, res.dq);
    plan.unshard(d.dk, r, res.dk);
    plan.unshard(d.dv, r, res.dv);
    plan.unshard_lse(d.lse, r, res.lse);
    res.bytes_sent += d.bytes_sent;
  }
  return res;
}

int run_example() {
  Problem p;
  std::vector<int64_t> positions(kSeq);
  std::iota(positions.begin(), positions.end(), 0);
  loom::fill_normal(p.q.view3(), positions.data(), 1, "q");
  loom::fill_normal(p.k.view3(), positions.data(), 1, "k");
  loom::fill_normal(p.v.view3(), positions.data(), 1, "v");
  loom::fill_normal(p.dout.view3(), positions.data(), 1, "dout");
  p.kernel.mask.causal = true;
  p.kernel.scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  p.kernel.threads = 1;  // one OpenMP thread per rank: the ranks are threads already

  // The fp64 reference on the whole sequence, and the tolerances that hold for this problem: the
  // fixed kFp32RelTol inside its regime, else the problem's own bounds.
  const loom::Tensor<double> q = loom::convert<double>(p.q), k = loom::convert<double>(p.k),
                             v = loom::convert<double>(p.v), dout = loom::convert<double>(p.dout);
  const loom::Tokens tokens{positions.data(), nullptr, kSeq};
  const double scale = p.kernel.scale;
  loom::reference_forward(q.view3(), k.view3(), v.view3(), tokens, tokens, p.kernel.mask, scale,
                          p.out.view3(), p.lse.data());
  loom::reference_backward(q.view3(), k.view3(), v.view3(), dout.view3(), tokens, tokens,
                           p.kernel.mask, scale, p.dq.view3(), p.dk.view3(), p.dv.view3());
  // loom's fp32 kernels (loom_kernels: the bounds' refinements for them).
  p.tol = loom::check_limits(q.view3(), k.view3(), v.view3(), dout.view3(), tokens, tokens,
                             p.kernel.mask, scale,
                             loom::CheckedResults{/*bf16=*/false, /*bf16_dots=*/false,
                                                  /*loom_kernels=*/true});
  const std::string& why = p.tol.why;

  std::printf("loom example: S=%lld H=%lld Hkv=%lld D=%lld causal, %d local ranks, kernels %s\n",
              static_cast<long long>(kSeq), static_cast<long long>(kHeads),
              static_cast<long long>(kKvHeads), static_cast<long long>(kDim), kRanks,
              loom::kernel_path());
  std::printf("tolerance: %s\n",
              why.empty() ? "kFp32RelTol = 1e-05 (fixed)" : ("per problem: " + why).c_str());
  struct Case {
    loom::Strategy strategy;
    int degree;
    loom::Layout layout;
  };
  const Case cases[] = {{loom::Strategy::ring, 0, loom::Layout::zigzag},
                        {loom::Strategy::ulysses, 0, loom::Layout::contiguous},
                        {loom::Strategy::hybrid, 2, loom::Layout::zigzag}};
  bool all_ok = true;
  for (const Case& c : cases) {
    const Result r = run(p, c.strategy, c.degree, c.layout);
    const double e[5] = {rel_err(r.out, p.out), rel_err(r.lse, p.lse), rel_err(r.dq, p.dq),
                         rel_err(r.dk, p.dk), rel_err(r.dv, p.dv)};
    const double t[5] = {p.tol.out, p.tol.lse, p.tol.dq, p.tol.dk, p.tol.dv};
    bool ok = true;
    for (int i = 0; i < 5; ++i) ok = ok && e[i] <= t[i];  // NaN fails
    all_ok = all_ok && ok;
    std::printf("%-8s %-10s out %.1e  lse %.1e  dq %.1e  dk %.1e  dv %.1e  sent %.2f MiB  %s\n",
                loom::to_string(c.strategy).c_str(), loom::to_string(c.layout).c_str(), e[0], e[1],
                e[2], e[3], e[4], static_cast<double>(r.bytes_sent) / (1 << 20),
                ok ? "ok" : "MISMATCH");
  }
  std::printf("%s\n", all_ok ? "all match the fp64 reference" : "MISMATCH against the reference");
  return all_ok ? 0 : 1;
}

}  // namespace

int main() {
  try {
    return run_example();
  } catch (const loom::Error& e) {  // InvalidArgument, CommError, Timeout, OutOfMemory, ...
    std::fprintf(stderr, "loom example: %s\n", e.what());
    return 2;
  }
}
