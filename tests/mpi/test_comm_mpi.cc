// The shared communicator bodies (tests/dist/comm_bodies.h) on the MPI backend, one process per
// rank under mpirun. Every process runs the same tests in the same order, so the collectives in
// them line up; ctest runs one mpirun per operation with a --gtest_filter (tests/comm.cmake).
// Only rank 0 prints gtest's full report; other ranks print their failures, prefixed.
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>

#include "dist/comm_bodies.h"
#include "loom/comm.h"

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
