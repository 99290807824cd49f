// The shared communicator bodies (tests/dist/comm_bodies.h) on the MPI backend, one process per
// rank under mpirun. Every process runs the same tests in the same order, so the collectives in
// them line up; ctest runs one mpirun per operation with a --gtest_filter (tests/comm.cmake).
// Only rank 0 prints gtest's full report; other ranks print their failures, prefixed.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dist/comm_bodies.h"
#include "loom/comm.h"
#include "loom/error.h"

namespace loom {
namespace {

std::unique_ptr<Communicator> g_world;

class CommMpi : public ::testing::TestWithParam<size_t> {};

// Each body on a communicator of its own: some fail theirs on purpose (a timeout, a message
// longer than its receive), after which it refuses every operation.
TEST_P(CommMpi, Body) {
  ASSERT_TRUE(g_world);
  std::unique_ptr<Communicator> c = mpi_world();
  c->set_timeout_s(g_world->timeout_s());
  test::comm_bodies()[GetParam()].fn(*c);
}

INSTANTIATE_TEST_SUITE_P(Bodies, CommMpi, ::testing::Range<size_t>(0, test::comm_bodies().size()),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return test::comm_bodies()[info.param].name;
                         });

TEST(CommMpiMesh, EveryFactorisation) {
  for (const MeshShape& shape : test::mesh_factorisations(g_world->size())) {
    test::check_mesh(*g_world, shape);
  }
}

TEST(CommMpiEnv, Backend) {
  EXPECT_TRUE(mpi_available());
  EXPECT_EQ(g_world->backend(), "mpi");
  EXPECT_EQ(launched_by_mpirun(), g_world->size() > 1);
}

// The node's ranks as mpi_world() counted them, from the processor names (the tools size their
// memory check by it): every rank of this test's job, counted here from the host names (a launch
// over several nodes counts its own node's).
TEST(CommMpiEnv, RanksOnThisNode) {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const int64_t mine = static_cast<int64_t>(std::hash<std::string>()(host));
  std::vector<int64_t> all(g_world->size());
  g_world->all_gather(&mine, sizeof mine, all.data());
  EXPECT_EQ(mpi_ranks_on_this_node(), std::count(all.begin(), all.end(), mine));
}

// A new mpi_world() while a rank is stopped ends in Timeout after LOOM_TIMEOUT_S: MPI_Comm_dup
// blocks until every rank calls it, and held rank 0 for ever (comm.h advises a new communicator
// after a Timeout, and the rank that caused it had stopped). Rank 1 stops itself; the others'
// mpi_world() gives up after 1 s (rank 0's must: the ranks above 1 may see rank 1 again in
// time); rank 0 then continues rank 1, whose own mpi_world() completes the duplication the
// others gave up on, and the world goes on. Needs ranks 0 and 1 on one node (to signal).
TEST(CommMpiEnv, NewWorldTimesOutWhileARankIsStopped) {
  const int P = g_world->size(), rank = g_world->rank();
  if (P < 2) GTEST_SKIP() << "needs 2 ranks";
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const int64_t mine[2] = {static_cast<int64_t>(::getpid()),
                           static_cast<int64_t>(std::hash<std::string>()(host))};
  std::vector<int64_t> all(2 * P);
  g_world->all_gather(mine, sizeof mine, all.data());
  if (all[1] != all[3]) GTEST_SKIP() << "ranks 0 and 1 are on different nodes";
  const pid_t stopped = static_cast<pid_t>(all[2]);
  g_world->barrier();
  if (rank == 1) {
    ::raise(SIGSTOP);  // continued by rank 0
    EXPECT_NO_THROW(mpi_world());
  } else {
    if (rank == 0) {  // rank 1 stops at once; mpi_world() must not start before it has
      bool is_stopped = false;
      for (int i = 0; i < 2000 && !is_stopped; ++i) {
        std::ifstream stat("/proc/" + std::to_string(stopped) + "/stat");
        std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
        const size_t paren = text.rfind(')');
        is_stopped =
            paren != std::string::npos && paren + 2 < text.size() && text[paren + 2] == 'T';
        if (!is_stopped) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (!is_stopped) ::kill(stopped, SIGCONT);
      ASSERT_TRUE(is_stopped) << "rank 1 did not stop";
    }
    const char* old = std::getenv("LOOM_TIMEOUT_S");
    const std::string saved = old ? old : "";
    ::setenv("LOOM_TIMEOUT_S", "1", 1);
    const auto start = std::chrono::steady_clock::now();
    bool timed_out = false;
    try {
      mpi_world();
    } catch (const Timeout& e) {
      timed_out = true;
      EXPECT_NE(std::string(e.what()).find("mpi_world"), std::string::npos) << e.what();
    }
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (old) {
      ::setenv("LOOM_TIMEOUT_S", saved.c_str(), 1);
    } else {
      ::unsetenv("LOOM_TIMEOUT_S");
    }
    if (rank == 0) {
      ::kill(stopped, SIGCONT);
      EXPECT_TRUE(timed_out) << "mpi_world() returned while rank 1 was stopped";
      EXPECT_LT(took, 10.0);
    }
  }
  g_world->barrier();
}

// Prints failed assertions with the rank in front (ranks other than 0).
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 result.file_name() ? result.file_name() : "?", result.line_number(),
                 result.message());
  }

 private:
  int rank_;
};

}  // namespace
}  // namespace loom

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  loom::g_world = loom::mpi_world();
  loom::g_world->set_timeout_s(20);
  const int rank = loom::g_world->rank();
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new loom::RankFailurePrinter(rank));
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  // Every rank exits with the worst result of all.
  int64_t worst = failed;
  loom::g_world->all_reduce(&worst, 1, loom::DType::i64, loom::ReduceOp::max);
  loom::g_world.reset();
  return worst != 0 ? 1 : 0;
}
