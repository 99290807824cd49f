// The local backend: every shared communicator body on world sizes 1, 2, 3, 4, 7 and 8; failure
// propagation through run_local; fault injection (kill, drop, delay) proving that every rank
// gets an error within twice the timeout; the mesh for every factorisation of 8 (and sizes whose
// product overflows); that the local backend keeps no channel nothing uses; parsing and
// environment helpers.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dist/comm_bodies.h"
#include "loom/comm.h"
#include "loom/error.h"
#include "loom/timer.h"

namespace loom {
namespace detail {
// src/comm/local/local.cc, for this test only: the local backend's channels alive now.
int64_t local_channels_alive();
}  // namespace detail

namespace {

constexpr double kTestTimeout = 10;  // generous: a body that hangs still ends

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// --- the shared bodies ---------------------------------------------------------------------------

struct BodyCase {
  size_t body;
  int ranks;
};

void PrintTo(const BodyCase& c, std::ostream* os) {
  *os << test::comm_bodies()[c.body].name << " on " << c.ranks << " ranks";
}

class CommLocal : public ::testing::TestWithParam<BodyCase> {};

TEST_P(CommLocal, Body) {
  const test::CommBody& body = test::comm_bodies()[GetParam().body];
  run_local(
      GetParam().ranks,
      [&](Communicator& c) {
        EXPECT_EQ(c.backend(), "local");
        EXPECT_EQ(c.timeout_s(), kTestTimeout);
        body.fn(c);
      },
      {}, kTestTimeout);
}

std::vector<BodyCase> all_cases() {
  std::vector<BodyCase> cases;
  for (size_t b = 0; b < test::comm_bodies().size(); ++b) {
    for (int ranks : {1, 2, 3, 4, 7, 8}) cases.push_back({b, ranks});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Bodies, CommLocal, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<BodyCase>& info) {
                           return test::comm_bodies()[info.param.body].name + "_ranks" +
                                  std::to_string(info.param.ranks);
                         });

// --- run_local failure propagation
// -----------------------------------------------------------------

// What each rank saw: whether it failed, when (seconds after start), and the message.
struct Outcome {
  bool failed = false;
  double at = 0;
  std::string what;
};

struct RunResult {
  std::vector<Outcome> ranks;
  std::exception_ptr root;
  std::string root_what;
  double elapsed = 0;
};

RunResult run_recorded(int ranks, const std::function<void(Communicator&)>& fn,
                       const FaultPlan& plan, double timeout) {
  RunResult run;
  run.ranks.resize(ranks);
  std::mutex mu;
  const double start = now_s();
  try {
    run_local(
        ranks,
        [&](Communicator& c) {
          try {
            fn(c);
          } catch (const std::exception& e) {
            std::lock_guard<std::mutex> lock(mu);
            run.ranks[c.rank()] = {true, now_s() - start, e.what()};
            throw;
          }
        },
        plan, timeout);
  } catch (const std::exception& e) {
    run.root = std::current_exception();
    run.root_what = e.what();
  }
  run.elapsed = now_s() - start;
  return run;
}

TEST(RunLocal, RethrowsTheRootCauseAndFailsOthersFast) {
  const RunResult run = run_recorded(
      4,
      [](Communicator& c) {
        if (c.rank() == 2) throw std::runtime_error("boom on purpose");
        int64_t x = 0;
        c.irecv(&x, sizeof x, (c.rank() + 1) % 4, 0)->wait();  // nobody sends
      },
      {}, kTestTimeout);
  ASSERT_TRUE(run.root);
  EXPECT_THROW(std::rethrow_exception(run.root), std::runtime_error);
  EXPECT_EQ(run.root_what, "boom on purpose");
  for (int r : {0, 1, 3}) {
    EXPECT_TRUE(run.ranks[r].failed) << r;
    EXPECT_TRUE(contains(run.ranks[r].what, "rank 2 failed: boom on purpose")) << run.ranks[r].what;
    EXPECT_TRUE(contains(run.ranks[r].what, "rank " + std::to_string(r))) << run.ranks[r].what;
  }
  EXPECT_LT(run.elapsed, kTestTimeout / 2);
}

TEST(RunLocal, ReceiveFromReturnedRankFailsAtOnce) {
  const RunResult run = run_recorded(
      2,
      [](Communicator& c) {
        if (c.rank() == 1) return;
        int64_t x = 0;
        c.irecv(&x, sizeof x, 1, 0)->wait();
      },
      {}, kTestTimeout);
  ASSERT_TRUE(run.root);
  EXPECT_TRUE(contains(run.root_what, "rank 0")) << run.root_what;
  EXPECT_TRUE(contains(run.root_what, "rank 1 has returned")) << run.root_what;
  EXPECT_LT(run.elapsed, kTestTimeout / 2);
}

TEST(RunLocal, SplitGroupsArePoisonedWithTheWorld) {
  // Rank 3 gives up only once ranks 0 and 1 have posted their receive inside the pair, so their
  // failure comes through the pair (not through the world's split, which they may still be
  // finishing otherwise: a race this test once lost under the sanitizers). Bounded: after 5 s it
  // gives up anyway.
  std::atomic<int> posted{0};
  const RunResult run = run_recorded(
      4,
      [&](Communicator& c) {
        auto pair = c.split(c.rank() / 2, 0);  // {0, 1} and {2, 3}
        if (c.rank() == 3) {
          const double t0 = now_s();
          while (posted.load() < 2 && now_s() - t0 < 5.0) std::this_thread::yield();
          throw std::runtime_error("rank three gives up");
        }
        if (c.rank() < 2) {
          int64_t x = 0;  // both wait for each other inside the pair: only poisoning ends this
          auto request = pair->irecv(&x, sizeof x, 1 - pair->rank(), 5);
          ++posted;
          request->wait();
        } else {
          c.barrier();
        }
      },
      {}, kTestTimeout);
  EXPECT_EQ(run.root_what, "rank three gives up");
  for (int r : {0, 1, 2}) {
    EXPECT_TRUE(contains(run.ranks[r].what, "rank 3 failed")) << run.ranks[r].what;
  }
  EXPECT_TRUE(contains(run.ranks[0].what, "(world rank 0)")) << run.ranks[0].what;
  EXPECT_LT(run.elapsed, kTestTimeout / 2);
}

TEST(RunLocal, CollectiveTimesOutOnEveryWaitingRank) {
  constexpr double kT = 1.0;
  const RunResult run = run_recorded(
      4,
      [](Communicator& c) {
        if (c.rank() == 0) {  // late, but still alive
          std::this_thread::sleep_for(std::chrono::duration<double>(2.1 * kT));
          return;
        }
        std::vector<char> recv(4);
        const char mine = 'a';
        c.all_gather(&mine, 1, recv.data());
      },
      {}, kT);
  ASSERT_TRUE(run.root);
  EXPECT_THROW(std::rethrow_exception(run.root), Timeout);
  EXPECT_TRUE(contains(run.root_what, "all_gather")) << run.root_what;
  EXPECT_TRUE(contains(run.root_what, "rank 0")) << run.root_what;
  for (int r = 1; r < 4; ++r) {
    EXPECT_TRUE(run.ranks[r].failed);
    EXPECT_GE(run.ranks[r].at, kT * 0.95) << run.ranks[r].what;
    EXPECT_LT(run.ranks[r].at, 2 * kT) << run.ranks[r].what;
  }
}

// --- reuse after a failure ----------------------------------------------------------------------

// A rank that catches a Timeout and goes on must not receive the late peer's message of the
// failed operation as the answer to its next one: rank 1 sends call 1's value late, then call
// 2's; rank 0's call 1 times out, and its call 2 received call 1's value (1, not 2), without an
// error. Now every later operation of the communicator throws CommError at once, naming the
// Timeout.
TEST(CommFailure, ReuseAfterTimeoutIsRefusedNotFedAStaleMessage) {
  std::atomic<bool> rank0_done{false};
  run_local(
      2,
      [&](Communicator& c) {
        if (c.rank() == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(600));
          for (int64_t call : {1, 2}) c.isend(&call, sizeof call, 0, 7)->wait();
          // Stays until rank 0 has finished: its waits would otherwise fail on "rank 1 has
          // returned" rather than on what this test is about.
          const double t0 = now_s();
          while (!rank0_done.load() && now_s() - t0 < 5.0)
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
          return;
        }
        int64_t got = 0;
        EXPECT_THROW(c.irecv(&got, sizeof got, 1, 7)->wait(0.3), Timeout);
        std::this_thread::sleep_for(std::chrono::milliseconds(600));  // both messages are here
        got = 0;
        const double start = now_s();
        try {
          c.irecv(&got, sizeof got, 1, 7)->wait(2.0);
          ADD_FAILURE() << "the receive after a Timeout returned, with " << got << " (call 2 "
                        << "sent 2)";
        } catch (const Timeout& e) {
          ADD_FAILURE() << "waited instead of refusing: " << e.what();
        } catch (const CommError& e) {
          EXPECT_TRUE(contains(e.what(), "rank 0: irecv: this communicator failed earlier"))
              << e.what();
          EXPECT_TRUE(contains(e.what(), "timed out after 0.3")) << e.what();
          EXPECT_TRUE(contains(e.what(), "create a new one")) << e.what();
        }
        EXPECT_LT(now_s() - start, 0.5);
        EXPECT_EQ(got, 0);
        rank0_done = true;
      },
      {}, kTestTimeout);
}

// On one rank, a communicator, the one it was split from and its splits fail together: after
// the failed operation this rank skipped the rest of its program's operations on every one of
// them, and its peers' messages for those may sit in any of them.
TEST(CommFailure, TheSplitTreeFailsTogether) {
  // A receive from itself that nothing sends: a Timeout on one rank with nobody else involved.
  const auto time_out = [](Communicator& c) {
    int64_t v = 0;
    EXPECT_THROW(c.irecv(&v, sizeof v, 0, 3)->wait(0.05), Timeout);
  };
  const auto refused = [](const char* what, const std::function<void()>& op) {
    try {
      op();
      ADD_FAILURE() << what << " did not throw";
    } catch (const Timeout& e) {
      ADD_FAILURE() << what << " waited: " << e.what();
    } catch (const CommError& e) {
      EXPECT_TRUE(contains(e.what(), "failed earlier")) << what << ": " << e.what();
      EXPECT_TRUE(contains(e.what(), "timed out")) << what << ": " << e.what();
    }
  };
  run_local(1, [&](Communicator& world) {  // the parent fails: its splits are refused
    auto child = world.split(0, 0);
    auto grandchild = child->split(0, 0);
    time_out(world);
    refused("the child's barrier", [&] { child->barrier(); });
    refused("the grandchild's barrier", [&] { grandchild->barrier(); });
    refused("a new split", [&] { world.split(0, 0); });
  });
  run_local(1, [&](Communicator& world) {  // a split fails: the parent and siblings are refused
    auto a = world.split(0, 0);
    auto b = world.split(0, 0);
    time_out(*a);
    refused("the parent's barrier", [&] { world.barrier(); });
    refused("the sibling's all_reduce", [&] {
      int64_t x = 1;
      b->all_reduce(&x, 1, DType::i64, ReduceOp::sum);
    });
  });
  run_local(1, [&](Communicator& world) {  // a receive posted before the failure
    int64_t v = 0, w = 0;
    WorkPtr early = world.irecv(&v, sizeof v, 0, 4);
    time_out(world);
    refused("wait of a receive posted before", [&] { early->wait(); });
    refused("test of a receive posted before", [&] { early->test(); });
    // Bad arguments are refused before anything is posted and leave a communicator usable.
    run_local(1, [&](Communicator& fresh) {
      EXPECT_THROW(fresh.irecv(&w, sizeof w, 5, 0), InvalidArgument);
      fresh.isend(&w, sizeof w, 0, 1)->wait();
      fresh.irecv(&w, sizeof w, 0, 1)->wait();
      fresh.barrier();
    });
  });
}

TEST(RunLocal, RejectsBadArguments) {
  EXPECT_THROW(run_local(0, [](Communicator&) {}), InvalidArgument);
  FaultPlan plan;
  plan.kill_rank = 4;
  EXPECT_THROW(run_local(
                   4, [](Communicator&) {}, plan),
               InvalidArgument);
  // An empty function threw std::bad_function_call from the rank threads.
  EXPECT_THROW(run_local(2, std::function<void(Communicator&)>{}), InvalidArgument);
  int calls = 0;
  run_local(1, [&](Communicator& c) {
    ++calls;
    EXPECT_EQ(c.size(), 1);
    EXPECT_EQ(c.split(-1, 0), nullptr);
  });
  EXPECT_EQ(calls, 1);
}

TEST(RunLocal, BatchP2pRefusesAnOpThatIsNeitherSendNorRecv) {
  // Its slot was left null and the caller's wait crashed on it; nothing is posted now.
  run_local(2, [](Communicator& c) {
    char a = 0, b = 0;
    const int peer = 1 - c.rank();
    std::vector<P2POp> ops = {{P2POp::send, &a, 1, peer}, {P2POp::recv, &b, 1, peer}};
    ops[c.rank()].kind = static_cast<P2POp::Kind>(5);
    EXPECT_THROW(c.batch_p2p(ops), InvalidArgument);
    // Nothing was posted: a good batch still pairs up.
    ops[c.rank()].kind = c.rank() == 0 ? P2POp::send : P2POp::recv;
    a = static_cast<char>(10 + c.rank());
    for (auto& w : c.batch_p2p(ops)) w->wait();
    EXPECT_EQ(b, static_cast<char>(10 + peer));
  });
}

// --- fault injection ----------------------------------------------------------------------------

// A training-like loop: a ring step and an all_reduce per iteration.
void training_loop(Communicator& c) {
  const int n = c.size(), r = c.rank();
  std::vector<char> block(1024, static_cast<char>(r)), next(1024);
  std::vector<float> grad(16, 1.0f);
  for (int it = 0; it < 20; ++it) {
    std::vector<P2POp> ops = {{P2POp::send, block.data(), block.size(), (r + 1) % n},
                              {P2POp::recv, next.data(), next.size(), (r - 1 + n) % n}};
    for (auto& w : c.batch_p2p(ops)) w->wait();
    std::swap(block, next);
    c.all_reduce(grad.data(), grad.size(), DType::f32, ReduceOp::sum);
  }
}

void expect_all_failed_within(const RunResult& run, double limit) {
  for (size_t r = 0; r < run.ranks.size(); ++r) {
    EXPECT_TRUE(run.ranks[r].failed) << "rank " << r << " saw no error";
    EXPECT_LT(run.ranks[r].at, limit) << "rank " << r << ": " << run.ranks[r].what;
  }
}

TEST(Faults, KillFailsEveryRankFast) {
  constexpr double kT = 1.0;
  for (int ranks : {2, 4, 7}) {
    for (const std::string& spec :
         std::vector<std::string>{"kill:0", "kill:1,at=5", "kill:" + std::to_string(ranks - 1)}) {
      SCOPED_TRACE(spec + " on " + std::to_string(ranks) + " ranks");
      const FaultPlan plan = parse_fault(spec);
      const RunResult run = run_recorded(ranks, training_loop, plan, kT);
      const std::string killed = "rank " + std::to_string(plan.kill_rank);
      ASSERT_TRUE(run.root);
      EXPECT_THROW(std::rethrow_exception(run.root), CommError);
      EXPECT_EQ(run.root_what, killed + " was killed (fault injection)");
      expect_all_failed_within(run, 2 * kT);
      for (int r = 0; r < ranks; ++r) {
        if (r == plan.kill_rank) continue;
        EXPECT_TRUE(contains(run.ranks[r].what, killed + " failed")) << run.ranks[r].what;
      }
    }
  }
}

TEST(Faults, DroppedMessageTimesOutItsReceiverAndFailsTheRest) {
  constexpr double kT = 1.0;
  // Rank 1's first send is its ring message to rank 2: rank 2 times out after kT, the others
  // (waiting in a barrier with a longer timeout) fail as soon as rank 2 does.
  const RunResult run = run_recorded(
      4,
      [](Communicator& c) {
        const int n = c.size(), r = c.rank();
        char out = static_cast<char>(r), in = 0;
        std::vector<P2POp> ops = {{P2POp::send, &out, 1, (r + 1) % n},
                                  {P2POp::recv, &in, 1, (r - 1 + n) % n}};
        for (auto& w : c.batch_p2p(ops)) w->wait();
        c.barrier(3 * kT);
      },
      parse_fault("drop:1,at=0"), kT);
  ASSERT_TRUE(run.root);
  EXPECT_THROW(std::rethrow_exception(run.root), Timeout);
  EXPECT_TRUE(contains(run.root_what, "rank 2")) << run.root_what;
  EXPECT_TRUE(contains(run.root_what, "rank 1")) << run.root_what;
  EXPECT_GE(run.ranks[2].at, 0.95 * kT);
  expect_all_failed_within(run, 2 * kT);
  for (int r : {0, 1, 3}) {
    EXPECT_TRUE(contains(run.ranks[r].what, "rank 2 failed")) << run.ranks[r].what;
  }
}

TEST(Faults, DropMidRunNeverHangs) {
  constexpr double kT = 1.0;
  for (const char* spec : {"drop:2", "drop:0,at=7"}) {
    SCOPED_TRACE(spec);
    const RunResult run = run_recorded(3, training_loop, parse_fault(spec), kT);
    ASSERT_TRUE(run.root);
    EXPECT_THROW(std::rethrow_exception(run.root), Timeout);
    EXPECT_TRUE(contains(run.root_what, "timed out")) << run.root_what;
    expect_all_failed_within(run, 2 * kT);
  }
}

TEST(Faults, DelayedRankStillGivesCorrectResults) {
  constexpr int kDelayMs = 150;
  std::atomic<double> slowest_recv{0};
  run_local(
      3,
      [&](Communicator& c) {
        const int n = c.size(), r = c.rank();
        int64_t out = 10 + r, in = -1;
        WorkPtr recv = c.irecv(&in, sizeof in, (r - 1 + n) % n, 0);
        const double start = now_s();
        c.isend(&out, sizeof out, (r + 1) % n, 0)->wait();
        recv->wait();
        if (r == 2) slowest_recv = now_s() - start;  // the message from the delayed rank 1
        EXPECT_EQ(in, 10 + (r - 1 + n) % n);
        int64_t sum = r;
        c.all_reduce(&sum, 1, DType::i64, ReduceOp::sum);
        EXPECT_EQ(sum, 3);
      },
      parse_fault("delay:1:" + std::to_string(kDelayMs)), kTestTimeout);
  EXPECT_GE(slowest_recv.load(), kDelayMs * 1e-3 * 0.95);
}

TEST(Faults, DelayPastTheTimeoutBecomesTimeout) {
  constexpr double kT = 1.0;
  const RunResult run = run_recorded(2, training_loop, parse_fault("delay:1:3000"), kT);
  ASSERT_TRUE(run.root);
  EXPECT_THROW(std::rethrow_exception(run.root), Timeout);
  EXPECT_TRUE(contains(run.root_what, "rank 0")) << run.root_what;
  EXPECT_TRUE(contains(run.root_what, "rank 1")) << run.root_what;
  expect_all_failed_within(run, 2 * kT);
}

TEST(Faults, ParseFault) {
  FaultPlan p = parse_fault("kill:3");
  EXPECT_EQ(p.kill_rank, 3);
  EXPECT_EQ(p.kill_at_op, 1);  // default: the second op
  EXPECT_TRUE(p.any());
  p = parse_fault("kill:0,at=0");
  EXPECT_EQ(p.kill_rank, 0);
  EXPECT_EQ(p.kill_at_op, 0);
  p = parse_fault("drop:2,at=12");
  EXPECT_EQ(p.drop_rank, 2);
  EXPECT_EQ(p.drop_at_op, 12);
  EXPECT_EQ(p.kill_rank, -1);
  p = parse_fault("drop:5");
  EXPECT_EQ(p.drop_at_op, 1);
  p = parse_fault("delay:1:250");
  EXPECT_EQ(p.delay_rank, 1);
  EXPECT_EQ(p.delay_ms, 250);
  EXPECT_FALSE(FaultPlan{}.any());
  for (const char* bad :
       {"", "kill", "kill:", "kill:x", "kill:-1", "kill:1:2", "kill:1,at=", "kill:1,when=3",
        "drop:1,at=-2", "delay:1", "delay:1:2,at=3", "delay:a:5", "explode:1",
        // Past an int: these were truncated (kill:4294967297 named rank 1, kill:2147483648 a
        // negative rank, i.e. no fault, delay:0:4294967295 -1 ms).
        "kill:2147483648", "kill:4294967297", "drop:4294967296", "delay:2147483648:5",
        "delay:0:4294967295"}) {
    try {
      parse_fault(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(contains(e.what(), "'" + std::string(bad) + "'")) << e.what();
    }
  }
}

// --- mesh ---------------------------------------------------------------------------------------

TEST(Mesh, EveryFactorisationOfEight) {
  const auto shapes = test::mesh_factorisations(8);
  EXPECT_EQ(shapes.size(), 20u);  // 2^3 over four factors: C(6, 3)
  for (const MeshShape& shape : shapes) {
    run_local(
        8, [&](Communicator& c) { test::check_mesh(c, shape); }, {}, kTestTimeout);
  }
}

TEST(Mesh, RefusesShapesThatDoNotTileTheWorld) {
  constexpr int kMax = std::numeric_limits<int>::max();
  // 4 x 1073741826 is 8 in int; kMax^4 overflows even int64.
  for (MeshShape shape : {MeshShape{2, 2, 2, 2}, MeshShape{1, 1, 3, 3}, MeshShape{0, 8, 1, 1},
                          MeshShape{2, -1, -2, 2}, MeshShape{1, 1, 1, 1},
                          MeshShape{4, 1, 1, 1073741826}, MeshShape{kMax, kMax, kMax, kMax}}) {
    run_local(
        8,
        [&](Communicator& c) {
          try {
            build_mesh(c, shape);
            ADD_FAILURE() << "accepted a mesh of " << shape.ranks() << " ranks";
          } catch (const InvalidArgument& e) {
            const std::string msg = e.what();
            for (const std::string& part : std::vector<std::string>{
                     "dp=" + std::to_string(shape.dp), "tp=" + std::to_string(shape.tp),
                     "ulysses=" + std::to_string(shape.ulysses),
                     "ring=" + std::to_string(shape.ring), "world of 8"}) {
              EXPECT_TRUE(contains(msg, part)) << msg;
            }
          }
        },
        {}, kTestTimeout);
  }
}

// The size of a mesh given on the command line is counted in int64: in int, --dp 4 --ring
// 1073741825 was 4 ranks and passed loom train's check against --ranks 4.
TEST(Mesh, RanksAreCountedWithoutWrapping) {
  constexpr int kMax = std::numeric_limits<int>::max();
  EXPECT_EQ((MeshShape{2, 1, 2, 2}).ranks(), 8);
  EXPECT_EQ((MeshShape{2, 1, 2, 2}).world(), 8);
  EXPECT_EQ((MeshShape{4, 1, 1, 1073741825}).ranks(), int64_t{4294967300});
  EXPECT_EQ((MeshShape{1, kMax, kMax, 1}).ranks(), int64_t{kMax} * kMax);
  EXPECT_EQ((MeshShape{kMax, kMax, kMax, 2}).ranks(), std::numeric_limits<int64_t>::max());
}

// --- memory of the local backend -----------------------------------------------------------------

// A channel of the local backend (one per receiver, source and tag) lasts only while a message
// or a receive uses it. They were kept for ever: one all_gather over 256 ranks left 65280 of
// them (107 MiB), and p2p on a new tag each time grew without bound (3.26 GB after 300k tags).
// The ranks meet on a std::barrier, outside the communicator, so nothing is in flight when rank 0
// counts.
TEST(LocalMemory, ChannelsLastOnlyWhileInUse) {
  constexpr int kRanks = 8, kTags = 500;
  const int64_t before = detail::local_channels_alive();
  std::barrier<> meet(kRanks);
  std::vector<int64_t> seen;  // by rank 0, after each phase
  auto quiet = [&](Communicator& c) {
    meet.arrive_and_wait();
    if (c.rank() == 0) seen.push_back(detail::local_channels_alive() - before);
    meet.arrive_and_wait();
  };
  run_local(
      kRanks,
      [&](Communicator& c) {
        const int r = c.rank(), next = (r + 1) % kRanks, prev = (r + kRanks - 1) % kRanks;
        // p2p on a new tag each time, the receive posted first.
        for (int tag = 0; tag < kTags; ++tag) {
          int in = -1;
          WorkPtr recv = c.irecv(&in, sizeof in, prev, tag);
          c.isend(&r, sizeof r, next, tag)->wait(kTestTimeout);
          recv->wait(kTestTimeout);
          EXPECT_EQ(in, prev);
        }
        quiet(c);
        // The sends first: every message queues on its own channel, then is received.
        for (int tag = 0; tag < kTags; ++tag) c.isend(&tag, sizeof tag, next, tag)->wait();
        for (int tag = 0; tag < kTags; ++tag) {
          int in = -1;
          c.irecv(&in, sizeof in, prev, tag)->wait(kTestTimeout);
          EXPECT_EQ(in, tag);
        }
        quiet(c);
        // A receive cancelled unfinished (its Work destroyed) leaves nothing behind either.
        for (int tag = 0; tag < kTags; ++tag) {
          int in = -1;
          EXPECT_FALSE(c.irecv(&in, sizeof in, prev, kTags + tag)->test());
        }
        quiet(c);
        // Collectives: every pair of ranks exchanges messages.
        for (int i = 0; i < 20; ++i) {
          std::vector<int> all(kRanks, -1);
          c.all_gather(&r, sizeof r, all.data());
          for (int p = 0; p < kRanks; ++p) EXPECT_EQ(all[p], p);
          double top = r;
          c.all_reduce(&top, 1, DType::f64, ReduceOp::max);
          EXPECT_EQ(top, kRanks - 1);
          c.barrier();
        }
        quiet(c);
        // Queued messages are kept until received: one per rank here.
        c.isend(&r, sizeof r, next, 7)->wait();
        quiet(c);
        int in = -1;
        c.irecv(&in, sizeof in, prev, 7)->wait(kTestTimeout);
        EXPECT_EQ(in, prev);
      },
      {}, kTestTimeout);
  EXPECT_EQ(seen, (std::vector<int64_t>{0, 0, 0, 0, kRanks}));
  EXPECT_EQ(detail::local_channels_alive(), before);
}

// --- the agreement: what the ranks pass to a collective ------------------------------------------

// Runs body on `ranks` ranks; each must throw InvalidArgument saying `needle`, at once, and the
// communicator stays usable: an all_reduce after it gives every rank the right sum.
void expect_refused_on_every_rank(int ranks, const std::string& needle,
                                  const std::function<void(Communicator&)>& body) {
  SCOPED_TRACE(needle);
  std::vector<std::string> seen(ranks);
  const double start = now_s();
  run_local(
      ranks,
      [&](Communicator& c) {
        try {
          body(c);
          seen[c.rank()] = "returned";
        } catch (const InvalidArgument& e) {
          seen[c.rank()] = e.what();
        } catch (const std::exception& e) {
          seen[c.rank()] = std::string("not InvalidArgument: ") + e.what();
        }
        int64_t sum = c.rank();
        c.all_reduce(&sum, 1, DType::i64, ReduceOp::sum);
        EXPECT_EQ(sum, int64_t{ranks} * (ranks - 1) / 2);
      },
      {}, kTestTimeout);
  EXPECT_LT(now_s() - start, kTestTimeout / 4);
  for (int r = 0; r < ranks; ++r) {
    EXPECT_TRUE(contains(seen[r], needle)) << "rank " << r << ": " << seen[r];
    EXPECT_TRUE(contains(seen[r], "rank " + std::to_string(r) + ": ")) << seen[r];
  }
}

// comm.h promised that the local backend checks the ranks' sizes and throws on every rank, but
// the same bytes under another dtype went through (f32 x 8 against f64 x 4: both got 256), as did
// f64 against i64 (rank 1 got inf) and sum against max (different answers); a one-sided
// all_to_all size mismatch threw on the receiving rank only, and barrier against all_gather ended
// in a Timeout. Each is now one InvalidArgument on every rank, before anything is posted.
TEST(CollectiveAgreement, DifferentCallsAreRefusedOnEveryRank) {
  expect_refused_on_every_rank(
      2, "rank 0 called all_reduce of 8 f32 elements (sum) but rank 1 all_reduce of 4 f64",
      [](Communicator& c) {
        std::vector<int64_t> b(4, 1);
        c.all_reduce(b.data(), c.rank() == 0 ? 8 : 4, c.rank() == 0 ? DType::f32 : DType::f64,
                     ReduceOp::sum);
      });
  expect_refused_on_every_rank(
      2,
      "rank 0 called reduce_scatter of 2 f64 elements per rank (sum) but rank 1 "
      "reduce_scatter of 2 i64 elements per rank (sum)",
      [](Communicator& c) {
        std::vector<int64_t> send(4, 1), recv(2);
        c.reduce_scatter(send.data(), recv.data(), 2, c.rank() == 0 ? DType::f64 : DType::i64,
                         ReduceOp::sum);
      });
  expect_refused_on_every_rank(
      3, "(sum) but rank 2 reduce_scatter of 2 f32 elements per rank (max)", [](Communicator& c) {
        std::vector<float> send(6, 1.0f + c.rank()), recv(2);
        c.reduce_scatter(send.data(), recv.data(), 2, DType::f32,
                         c.rank() == 2 ? ReduceOp::max : ReduceOp::sum);
      });
  expect_refused_on_every_rank(3, "but rank 2 all_reduce of 8 f32", [](Communicator& c) {
    std::vector<float> b(8, 1.0f);
    c.all_reduce(b.data(), c.rank() == 2 ? 8 : 6, DType::f32, ReduceOp::sum);
  });
  expect_refused_on_every_rank(3, "rank 0 called all_gather of 4 bytes but rank 1 all_gather of 8",
                               [](Communicator& c) {
                                 double x = 0;
                                 std::vector<char> all(24);
                                 c.all_gather(&x, c.rank() == 1 ? 8 : 4, all.data());
                               });
  expect_refused_on_every_rank(2, "rank 0 called barrier but rank 1 all_gather of 4 bytes",
                               [](Communicator& c) {
                                 if (c.rank() == 0) return c.barrier();
                                 int x = 0, all[2];
                                 c.all_gather(&x, sizeof x, all);
                               });
  expect_refused_on_every_rank(3, "rank 0 called split but rank 1 barrier", [](Communicator& c) {
    if (c.rank() == 1) return c.barrier();
    c.split(0, 0);
  });
  // all_to_all: rank 0 sends 8 bytes to rank 1, which expects 4; ranks 0 and 2 throw too.
  expect_refused_on_every_rank(
      3, "all_to_all: rank 0 sends 8 bytes to rank 1, which expects 4 from it",
      [](Communicator& c) {
        size_t sb[3] = {4, 4, 4}, so[3] = {0, 8, 16}, rb[3] = {4, 4, 4}, ro[3] = {0, 8, 16};
        if (c.rank() == 0) sb[1] = 8;
        char send[24] = {}, recv[24] = {};
        c.all_to_all(send, sb, so, recv, rb, ro);
      });
  // In a split: named with the world ranks.
  run_local(
      4,
      [](Communicator& world) {
        auto pair = world.split(world.rank() % 2, 0);  // {0, 2} and {1, 3}
        int64_t x = 1;
        try {
          pair->all_reduce(&x, 1, pair->rank() == 0 ? DType::i64 : DType::f64, ReduceOp::sum);
          ADD_FAILURE() << "rank " << world.rank() << ": no error";
        } catch (const InvalidArgument& e) {
          EXPECT_TRUE(contains(e.what(), "rank 0 (world rank " + std::to_string(world.rank() % 2) +
                                             ") called all_reduce of 1 i64 elements"))
              << e.what();
        }
      },
      {}, kTestTimeout);
}

// all_gather with send = recv gave 100, 100, 100 for 100, 101, 102 (rank 0's block arrived before
// ranks 1 and 2 sent theirs). Only the in-place form (send = recv + rank x bytes) may overlap;
// overlapping buffers are refused on every rank, naming the rank whose buffers they are.
TEST(CollectiveAgreement, OverlappingBuffersAreRefusedOnEveryRank) {
  expect_refused_on_every_rank(3, "on rank 1, all_gather's send buffer (4 bytes) overlaps",
                               [](Communicator& c) {
                                 std::vector<int> buf(3, -1);
                                 buf[0] = 100 + c.rank();
                                 c.all_gather(buf.data(), 4, buf.data());
                               });
  run_local(3, [](Communicator& c) {  // in place: correct
    std::vector<int> buf(3, -1);
    buf[c.rank()] = 100 + c.rank();
    c.all_gather(buf.data() + c.rank(), 4, buf.data());
    EXPECT_EQ(buf, (std::vector<int>{100, 101, 102}));
  });
  expect_refused_on_every_rank(
      2, "reduce_scatter's receive buffer (8 bytes) overlaps its send", [](Communicator& c) {
        std::vector<double> buf(2, 1.0);
        c.reduce_scatter(buf.data(), buf.data() + c.rank(), 1, DType::f64, ReduceOp::sum);
      });
  expect_refused_on_every_rank(2, "all_to_all's send part for rank 0 overlaps its receive part",
                               [](Communicator& c) {
                                 std::vector<char> buf(8);
                                 c.all_to_all(buf.data(), buf.data(), 4);
                               });
  expect_refused_on_every_rank(2, "all_to_all's receive part for rank 0 overlaps its receive part",
                               [](Communicator& c) {
                                 std::vector<char> send(8), recv(8);
                                 const size_t sb[2] = {4, 4}, so[2] = {0, 4}, ro[2] = {0, 2};
                                 c.all_to_all(send.data(), sb, so, recv.data(), sb, ro);
                               });
  run_local(2, [](Communicator& c) {  // sends may share bytes: the same block to both ranks
    const char send[4] = {'a', 'b', 'c', static_cast<char>('0' + c.rank())};
    char recv[8] = {};
    const size_t sb[2] = {4, 4}, so[2] = {0, 0}, ro[2] = {0, 4};
    c.all_to_all(send, sb, so, recv, sb, ro);
    EXPECT_EQ(std::string(recv, 8), "abc0abc1");
  });
}

// Sizes no memory holds: a local isend of SIZE_MAX bytes, and run_local(INT_MAX), threw
// std::bad_alloc (not a loom error); a message that cannot be copied is OutOfMemory naming it.
TEST(CollectiveAgreement, ImpossibleSizesAreLoomErrors) {
  run_local(2, [](Communicator& c) {
    int x = 0;
    try {
      c.isend(&x, SIZE_MAX, 1 - c.rank());
      ADD_FAILURE() << "sent SIZE_MAX bytes";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(contains(e.what(), "18446744073709551615 bytes is more than any buffer holds"))
          << e.what();
    }
    EXPECT_THROW(c.irecv(&x, size_t{1} << 63, 1 - c.rank()), InvalidArgument);
    std::vector<char> all(2);
    EXPECT_THROW(c.all_gather(&x, SIZE_MAX / 2 + 1, all.data()), InvalidArgument);
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
    // Sanitizers abort on an allocation this large instead of failing it.
    if (c.rank() == 0) {
      try {
        c.isend(&x, size_t{1} << 62, 1);  // no receive posted: a copy of 4 EiB
        ADD_FAILURE() << "copied 4 EiB";
      } catch (const OutOfMemory& e) {
        EXPECT_TRUE(contains(e.what(), "could not allocate 4611686018427387904 bytes")) << e.what();
      }
    }
#endif
  });
  for (const int ranks : {(1 << 22) + 1, std::numeric_limits<int>::max()}) {
    try {
      run_local(ranks, [](Communicator&) { ADD_FAILURE() << "a rank ran"; });
      ADD_FAILURE() << ranks << " ranks ran";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(contains(e.what(), "run_local: " + std::to_string(ranks) + " ranks")) << e.what();
    }
  }
}

// --- helpers ------------------------------------------------------------------------------------

TEST(CommHelpers, DtypeSize) {
  EXPECT_EQ(dtype_size(DType::f32), 4u);
  EXPECT_EQ(dtype_size(DType::f64), 8u);
  EXPECT_EQ(dtype_size(DType::i64), 8u);
}

// Sets an environment variable for one scope.
class EnvVar {
 public:
  EnvVar(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (value) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~EnvVar() {
    if (had_) {
      setenv(name_, old_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

TEST(CommHelpers, DefaultTimeoutFromEnvironment) {
  {
    EnvVar e("LOOM_TIMEOUT_S", nullptr);
    EXPECT_EQ(Communicator::default_timeout_s(), 60);
  }
  {
    EnvVar e("LOOM_TIMEOUT_S", "2.5");
    EXPECT_EQ(Communicator::default_timeout_s(), 2.5);
    run_local(2, [](Communicator& c) { EXPECT_EQ(c.timeout_s(), 2.5); });
    run_local(
        2, [](Communicator& c) { EXPECT_EQ(c.timeout_s(), 0.75); }, {}, 0.75);
    // run_local's own timeout is held to the same range (inf made every wait spin).
    for (double bad : {std::numeric_limits<double>::infinity(), std::nan(""), 0.0, 2e9})
      EXPECT_THROW(run_local(
                       2, [](Communicator&) {}, {}, bad),
                   InvalidArgument)
          << bad;
  }
  {
    EnvVar e("LOOM_TIMEOUT_S", "");  // empty: unset
    EXPECT_EQ(Communicator::default_timeout_s(), 60);
  }
  // Refused, not 60 s; and below a millisecond, hex or with spaces (1e-9 "timed out after 0 s").
  for (const char* bad : {"0", "-3", "abc", "5s", "nan", "inf", "1e-9", "0x10", " 5", "5 "}) {
    EnvVar e("LOOM_TIMEOUT_S", bad);
    EXPECT_THROW(Communicator::default_timeout_s(), InvalidArgument) << "'" << bad << "'";
  }
  // A timeout given stands in for the variable, whatever it holds (an invalid one made every
  // communicator's construction throw, a timeout given or not); the default still refuses it.
  {
    EnvVar e("LOOM_TIMEOUT_S", "abc");
    run_local(
        2,
        [](Communicator& c) {
          EXPECT_EQ(c.timeout_s(), 0.75);
          c.barrier();
          auto sub = c.split(0, c.rank());
          EXPECT_EQ(sub->timeout_s(), 0.75);
        },
        {}, 0.75);
    EXPECT_THROW(run_local(2, [](Communicator&) {}), InvalidArgument);
  }
}

TEST(CommHelpers, LaunchedByMpirun) {
  EnvVar a("OMPI_COMM_WORLD_SIZE", nullptr), b("PMI_SIZE", nullptr), c("PMIX_RANK", nullptr),
      d("PMI_RANK", nullptr), e("MV2_COMM_WORLD_SIZE", nullptr), f("MPI_LOCALNRANKS", nullptr),
      g("SLURM_STEP_NUM_TASKS", nullptr);
  EXPECT_FALSE(launched_by_mpirun());
  {
    EnvVar one("OMPI_COMM_WORLD_SIZE", "1");
    EXPECT_FALSE(launched_by_mpirun());
  }
  {
    EnvVar four("OMPI_COMM_WORLD_SIZE", "4");
    EXPECT_TRUE(launched_by_mpirun());
  }
  {
    EnvVar pmi("PMI_SIZE", "2");
    EXPECT_TRUE(launched_by_mpirun());
  }
  {
    EnvVar pmix("PMIX_RANK", "3");
    EXPECT_TRUE(launched_by_mpirun());
  }
  // Rank 0 of srun --mpi=pmix: no size of PMIx's own, the step's task count from Slurm.
  for (const char* rank : {"PMIX_RANK", "PMI_RANK"}) {
    EnvVar zero(rank, "0");
    EXPECT_FALSE(launched_by_mpirun()) << rank;  // a PMI(x) singleton
    {
      EnvVar tasks("SLURM_STEP_NUM_TASKS", "4");
      EXPECT_TRUE(launched_by_mpirun()) << rank;
    }
    EnvVar one("SLURM_STEP_NUM_TASKS", "1");
    EXPECT_FALSE(launched_by_mpirun()) << rank;
  }
  {  // srun without an MPI plugin: independent processes, each its own local run
    EnvVar tasks("SLURM_STEP_NUM_TASKS", "4");
    EXPECT_FALSE(launched_by_mpirun());
    // mpirun -np 1 inside a step of several tasks: Open MPI's own size says one process
    EnvVar zero("PMIX_RANK", "0"), size("OMPI_COMM_WORLD_SIZE", "1");
    EXPECT_FALSE(launched_by_mpirun());
  }
}

TEST(CommHelpers, StubRefusesClearly) {
  if (mpi_available()) GTEST_SKIP() << "this build has the MPI backend (tested under mpirun)";
  try {
    mpi_world();
    ADD_FAILURE() << "mpi_world() returned without MPI";
  } catch (const NotSupported& e) {
    EXPECT_TRUE(contains(e.what(), "no MPI backend")) << e.what();
  }
  mpi_abort(1);  // a no-op without MPI
}

}  // namespace
}  // namespace loom
