// The public contracts around CpAttention on the local backend: the groups a caller gives
// (CpGroups) are checked to be the strategy's axes, build_mesh checks that every rank asked for
// the same mesh, a hand-built verify::Sharding is checked before unsharding, and a rank count no
// memory holds is OutOfMemory naming its size.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "loom/comm.h"
#include "loom/cp.h"
#include "loom/error.h"
#include "loom/rng.h"
#include "loom/tensor.h"
#include "loom/verify.h"

namespace loom::testing {
namespace {

constexpr double kTestTimeout = 20;  // run_local's, s: a wrong group must fail long before
constexpr int64_t S = 64, H = 4, HKV = 2, D = 16;

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// One rank's forward and backward outputs, as flat vectors.
struct Outputs {
  std::vector<float> out, lse, dq, dk, dv;
};

// Runs forward and backward of `strategy` (degree 2, zigzag) on this rank with the groups given,
// on deterministic inputs; returns what this rank computed.
Outputs run(const CpGroups& groups, Strategy strategy) {
  Communicator& cp = *groups.cp;
  const int P = cp.size(), me = cp.rank();
  const ShardPlan plan = ShardPlan::make(Layout::zigzag, S, P);
  CpConfig cfg;
  cfg.strategy = strategy;
  cfg.kernel.scale = 0.25f;
  cfg.kernel.threads = 1;
  cfg.kernel.mask.causal = true;
  set_degree(cfg, 2);
  CpAttention att(groups, plan, cfg, H, HKV, D);
  std::vector<int64_t> t(S);
  for (int64_t i = 0; i < S; ++i) t[i] = i;
  Tensor<float> gq({S, H, D}), gk({S, HKV, D}), gv({S, HKV, D}), gdo({S, H, D});
  fill_normal(gq.view3(), t.data(), 1, "q");
  fill_normal(gk.view3(), t.data(), 1, "k");
  fill_normal(gv.view3(), t.data(), 1, "v");
  fill_normal(gdo.view3(), t.data(), 1, "dout");
  const Tensor<float> q = plan.shard(gq, me), k = plan.shard(gk, me), v = plan.shard(gv, me),
                      dout = plan.shard(gdo, me);
  const int64_t n = q.size(0);
  Tensor<float> out({n, H, D}), lse({H, n}), dq({n, H, D}), dk({n, HKV, D}), dv({n, HKV, D});
  att.forward(q.view3(), k.view3(), v.view3(), out.view3(), lse.data());
  att.backward(q.view3(), k.view3(), v.view3(), out.view3(), dout.view3(), lse.data(), dq.view3(),
               dk.view3(), dv.view3());
  return Outputs{out.vec(), lse.vec(), dq.vec(), dk.vec(), dv.vec()};
}

void expect_same(const Outputs& a, const Outputs& b, const std::string& what) {
  EXPECT_EQ(a.out, b.out) << what;
  EXPECT_EQ(a.lse, b.lse) << what;
  EXPECT_EQ(a.dq, b.dq) << what;
  EXPECT_EQ(a.dk, b.dk) << what;
  EXPECT_EQ(a.dv, b.dv) << what;
}

// Runs body on n local ranks; what each rank's body ended in: its InvalidArgument's message, or
// "(accepted)".
std::vector<std::string> outcomes(int n, const std::function<void(Communicator&)>& body) {
  std::mutex mu;
  std::vector<std::string> messages;
  run_local(
      n,
      [&](Communicator& world) {
        std::string said = "(accepted)";
        try {
          body(world);
        } catch (const InvalidArgument& e) {
          said = e.what();
        }
        std::lock_guard<std::mutex> lock(mu);
        messages.push_back(said);
      },
      {}, kTestTimeout);
  return messages;
}

// The groups a rank gives: inner and outer, made by `make` from the world (nullptr: none).
using MakeGroups = std::function<void(Communicator& world, std::unique_ptr<Communicator>& inner,
                                      std::unique_ptr<Communicator>& outer)>;

// Every rank of 4 constructs `strategy` with the groups `make` gives; each must throw
// InvalidArgument, the same message on every rank, containing every part.
void expect_refused(Strategy strategy, const MakeGroups& make,
                    const std::vector<std::string>& parts) {
  const std::vector<std::string> messages = outcomes(4, [&](Communicator& world) {
    std::unique_ptr<Communicator> inner, outer;
    make(world, inner, outer);
    run(CpGroups{&world, inner.get(), outer.get()}, strategy);
  });
  ASSERT_EQ(messages.size(), 4u);
  for (const std::string& m : messages) {
    EXPECT_EQ(m, messages[0]) << "every rank must throw the same error";
    for (const std::string& part : parts) EXPECT_TRUE(contains(m, part)) << m;
  }
}

// Groups of the right sizes but not the strategy's axes: inner = {0, 2}, {1, 3} where the inner
// axis is {0, 1}, {2, 3} (hybrid was off by 0.67 in out with no error, ring2d timed out), the
// right members in reverse order (off by 1.2), members that have the right places but are not
// the axis ({0, 3}, {2, 1}), and a group given on some ranks only. Each is one InvalidArgument
// on every rank, before any message of the strategy.
TEST(CpGroupsCheck, GroupsThatAreNotTheAxesAreRefused) {
  for (Strategy s : {Strategy::hybrid, Strategy::ring2d}) {
    SCOPED_TRACE(std::string(s.name()));
    expect_refused(s,
                   [](Communicator& w, auto& inner, auto& outer) {
                     inner = w.split(w.rank() % 2, w.rank());
                     outer = w.split(w.rank() / 2, w.rank());
                   },
                   {"cp rank 1 is rank 0 of the inner group it gives",
                    "holds cp ranks 0, 1 in cp order", "must be rank 1", "build_mesh"});
    expect_refused(s,
                   [](Communicator& w, auto& inner, auto& outer) {
                     inner = w.split(w.rank() / 2, -w.rank());
                     outer = w.split(w.rank() % 2, w.rank());
                   },
                   {"cp rank 0 is rank 1 of the inner group it gives", "must be rank 0"});
    expect_refused(
        s,
        [](Communicator& w, auto& inner, auto& outer) {
          inner = w.split(w.rank() / 2, w.rank());
          outer = w.split(w.rank() % 2, -w.rank());
        },
        {"cp rank 0 is rank 1 of the outer group it gives", "holds cp ranks 0, 2 in cp order"});
    expect_refused(s,
                   [](Communicator& w, auto& inner, auto& outer) {
                     const int r = w.rank();
                     inner = w.split(r == 0 || r == 3 ? 0 : 1, r % 2);
                     outer = w.split(r % 2, r);
                   },
                   {"the inner group cp rank 0 gives holds cp rank 3 as its rank 1",
                    "its rank 1 must be cp rank 1"});
    expect_refused(s,
                   [](Communicator& w, auto& inner, auto& outer) {
                     auto in = w.split(w.rank() / 2, w.rank());
                     outer = w.split(w.rank() % 2, w.rank());
                     if (w.rank() != 0) inner = std::move(in);
                   },
                   {"rank 1 gives an inner group of 2 ranks, rank 0 no inner group", "or none"});
  }
}

// Two cp groups of 4 (world of 8): inner groups that pair cp rank 0 of one with cp rank 1 of the
// other have the right places and cp ranks, but hold a rank of another cp group.
TEST(CpGroupsCheck, GroupsAcrossCpGroupsAreRefused) {
  const std::vector<std::string> messages = outcomes(8, [&](Communicator& world) {
    const int w = world.rank(), d = w / 4, c = w % 4;
    auto cp = world.split(d, c);
    const int mixed = c % 2 == 1 ? 1 - d : d;
    auto inner = world.split(mixed * 2 + c / 2, c);
    auto outer = cp->split(c % 2, c);
    run(CpGroups{cp.get(), inner.get(), outer.get()}, Strategy::hybrid);
  });
  ASSERT_EQ(messages.size(), 8u);
  for (const std::string& m : messages)
    EXPECT_TRUE(contains(m, "the inner group cp rank 0 gives holds a rank of another cp group"))
        << m;
}

// The right groups give bitwise what the groups CpAttention splits from cp give: build_mesh's,
// splits of cp, and wrong sizes on every rank (not used, as the contract says).
TEST(CpGroupsCheck, TheAxesGiveTheSameResultsAsNoGroups) {
  for (Strategy s : {Strategy::hybrid, Strategy::ring2d}) {
    SCOPED_TRACE(std::string(s.name()));
    run_local(
        4,
        [&](Communicator& world) {
          const Outputs none = run(CpGroups{&world, nullptr, nullptr}, s);
          Mesh mesh = build_mesh(world, MeshShape{1, 1, 2, 2});
          expect_same(run(CpGroups{mesh.cp.get(), mesh.ulysses.get(), mesh.ring.get()}, s), none,
                      "build_mesh's groups");
          auto inner = world.split(world.rank() / 2, world.rank());
          auto outer = world.split(world.rank() % 2, world.rank());
          expect_same(run(CpGroups{&world, inner.get(), outer.get()}, s), none, "splits of cp");
          expect_same(run(CpGroups{&world, inner.get(), nullptr}, s), none, "inner only");
          expect_same(run(CpGroups{&world, &world, &world}, s), none, "wrong sizes: not used");
        },
        {}, kTestTimeout);
  }
}

// build_mesh with another shape on one rank: rank 0 held a ulysses group of 2 while its shape
// said 4, with no error. Now InvalidArgument on every rank naming both shapes.
TEST(MeshCheck, RanksWithOtherShapesAreRefused) {
  const std::vector<std::string> messages = outcomes(4, [](Communicator& world) {
    build_mesh(world, world.rank() == 0 ? MeshShape{1, 1, 4, 1} : MeshShape{1, 1, 2, 2});
  });
  ASSERT_EQ(messages.size(), 4u);
  for (const std::string& m : messages)
    EXPECT_TRUE(contains(m,
                         "rank 1 has dp=1 x tp=1 x ulysses=2 x ring=2, rank 0 dp=1 x tp=1 x "
                         "ulysses=4 x ring=1"))
        << m;
}

// ---------------------------------------------------------------------------------------------
// verify::Sharding built by hand.

// unshard_rows and unshard_cols check the sharding first: a token past seq and fewer token lists
// than ranks wrote out of bounds (SIGSEGV), a token listed twice left a row zero.
TEST(ShardingCheck, HandBuiltShardingsAreChecked) {
  const verify::Sharding good = verify::make_sharding("zigzag", S, 4);
  EXPECT_NO_THROW(good.check());
  std::vector<Tensor<double>> rows, cols;
  for (int r = 0; r < 4; ++r) {
    rows.emplace_back(std::vector<int64_t>{16, H, D});
    cols.emplace_back(std::vector<int64_t>{H, 16});
  }
  EXPECT_EQ(verify::unshard_rows(good, rows, "out").shape(), (std::vector<int64_t>{S, H, D}));
  const auto expect_refused = [&](const verify::Sharding& sh, const std::string& part) {
    for (int cols_too = 0; cols_too < 2; ++cols_too) {
      try {
        if (cols_too)
          verify::unshard_cols(sh, cols, "lse");
        else
          verify::unshard_rows(sh, rows, "out");
        ADD_FAILURE() << part << ": accepted";
      } catch (const InvalidArgument& e) {
        EXPECT_TRUE(contains(e.what(), part)) << e.what();
      }
    }
  };
  verify::Sharding sh = good;
  sh.tokens[0][0] = 9999;
  expect_refused(sh, "Sharding: tokens[0][0] = 9999 is outside [0, 64)");
  sh = good;
  sh.tokens.pop_back();
  expect_refused(sh, "Sharding: ranks is 4 but tokens holds the lists of 3 ranks");
  sh = good;
  sh.tokens[0][0] = sh.tokens[0][1];
  expect_refused(sh, "is listed twice");
  sh = good;
  sh.tokens[0].push_back(0);
  expect_refused(sh, "the ranks' tokens list 65 tokens but seq is 64");
  sh = good;
  sh.chunk_rank.pop_back();
  expect_refused(sh, "chunk_rank names the ranks of");
  sh = good;
  sh.chunk_rank[0] = 3;
  expect_refused(sh, "chunks[0] belongs to rank 3 (chunk_rank) but its token 0 is on rank 0");
  sh = good;
  std::swap(sh.chunks[0][0], sh.chunks[0][1]);
  expect_refused(sh, "chunks[0] is not ascending at 1");
  sh = good;
  sh.seq = 0;
  expect_refused(sh, "Sharding: seq must be >= 1, got 0");
}

// ---------------------------------------------------------------------------------------------
// Rank counts no memory holds.

// Runs `call` in a child process whose address space is limited to its current size plus
// 1 GiB, and expects OutOfMemory whose message contains every part and names at least
// `min_mib` MiB (the size that failed: 2^31 - 1 ranks' lists are about 48 GiB). The parent's
// memory is never at stake whatever the machine's overcommit policy.
void expect_oom_in_child(const std::function<void()>& call, const std::vector<std::string>& parts,
                         double min_mib) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the sanitizers reserve more address space than the limit leaves";
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
  GTEST_SKIP() << "the sanitizers reserve more address space than the limit leaves";
#endif
#endif
  std::fflush(nullptr);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    long pages = 0;
    std::ifstream statm("/proc/self/statm");
    statm >> pages;
    const rlim_t limit = static_cast<rlim_t>(pages) * sysconf(_SC_PAGESIZE) + (rlim_t{1} << 30);
    const rlimit rl{limit, limit};
    if (setrlimit(RLIMIT_AS, &rl) != 0) _exit(10);
    try {
      call();
      std::fprintf(stderr, "accepted\n");
      _exit(1);
    } catch (const OutOfMemory& e) {
      const std::string m = e.what();
      bool ok = true;
      for (const std::string& part : parts) ok = ok && contains(m, part);
      const size_t at = m.find(" MiB");
      const size_t from = at == std::string::npos ? 0 : m.rfind(' ', at - 1) + 1;
      const double mib = at == std::string::npos ? 0 : std::atof(m.substr(from, at - from).c_str());
      if (!ok || mib < min_mib) {
        std::fprintf(stderr, "OutOfMemory: %s\n", m.c_str());
        _exit(3);
      }
      _exit(0);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "not OutOfMemory: %s\n", e.what());
      _exit(2);
    }
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died with signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "see the child's line on stderr";
}

// ShardPlan::make with 2^31 - 1 ranks threw std::bad_alloc from its per-rank lists (cp.h promises
// OutOfMemory naming the size), and verify() with as many ranks said OutOfMemory naming
// 0.000976562 MiB, the 64 tokens' lists, where 48 GiB of per-rank lists had failed.
TEST(RankCounts, RankCountsNoMemoryHoldsAreOutOfMemoryNamingTheirSize) {
  const double min_mib = 48.0 * 1024;  // 2^31 lists of 24 bytes
  expect_oom_in_child([] { ShardPlan::make(Layout::stripe, 10, INT_MAX); },
                      {"a shard plan of 10 tokens over 2147483647 ranks", "too many ranks"},
                      min_mib);
  verify::Problem p;
  p.q = Tensor<double>({S, H, D});
  p.k = Tensor<double>({S, HKV, D});
  p.v = Tensor<double>({S, HKV, D});
  verify::Candidate c;
  c.out = Tensor<double>({S, H, D});
  verify::Options o;
  o.convention = "stripe";
  o.ranks = INT_MAX;
  expect_oom_in_child([&] { verify::verify(p, c, o); },
                      {"the stripe sharding of 64 tokens over 2147483647 ranks", "too many ranks"},
                      min_mib);
  // Ranks past the sequence's tokens are allowed: they hold no rows.
  const ShardPlan plan = ShardPlan::make(Layout::stripe, 3, 5);
  EXPECT_EQ(plan.rows(4), 0);
}

}  // namespace
}  // namespace loom::testing
