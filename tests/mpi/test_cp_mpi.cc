// Context-parallel attention under mpirun: the shared test bodies (tests/dist/cp_bodies.h) on
// the MPI backend, one process per rank. Every process runs the same cases in the same order; a
// mismatch on any rank fails the test on every rank (the failure flag is all-reduced).
#include <gtest/gtest.h>

#include <memory>

#include "dist/cp_bodies.h"
#include "loom/comm.h"

namespace loom::testing {
namespace {

std::unique_ptr<Communicator> g_world;

// Runs the case on every rank; returns the failure text of this rank ("" when it passed) and
// fails the test on every rank if any rank failed.
void run_everywhere(const CpCase& c) {
  std::string error;
  try {
    run_cp_case(*g_world, c);
  } catch (const std::exception& e) {
    error = e.what();
  }
  int64_t failed = error.empty() ? 0 : 1;
  g_world->all_reduce(&failed, 1, DType::i64, ReduceOp::max);
  EXPECT_EQ(failed, 0) << c.name()
                       << " failed on some rank; this rank: " << (error.empty() ? "passed" : error);
}

// c under every mask: causal, full, a causal window, packed documents.
void run_every_mask(CpCase c) {
  run_everywhere(c);
  c.causal = false;
  run_everywhere(c);
  c.causal = true;
  c.window = 9;
  run_everywhere(c);
  c.window = 0;
  c.docs = {20, 1, 30};
  run_everywhere(c);
}

TEST(CpMpi, RingEveryLayoutAndMask) {
  for (Layout l : {Layout::contiguous, Layout::zigzag, Layout::stripe}) {
    CpCase c;
    c.strategy = Strategy::ring;
    c.layout = l;
    c.H = 4;
    c.HKV = 2;
    run_every_mask(c);
  }
}

// ring2d over the same matrix as ring, GQA included: inner rings of 2 ranks (np 4), or one inner
// ring of 3 and one of 1 (np 3).
TEST(CpMpi, Ring2dEveryLayoutMaskAndGqa) {
  const int P = g_world->size();
  for (int inner : {P % 2 == 0 ? 2 : 3, 1}) {
    for (Layout l : {Layout::contiguous, Layout::zigzag, Layout::stripe}) {
      for (int64_t hkv : {4, 2, 1}) {
        CpCase c;
        c.strategy = Strategy::ring2d;
        c.inner = inner;
        c.layout = l;
        c.H = 4;
        c.HKV = hkv;
        run_every_mask(c);
      }
    }
  }
}

TEST(CpMpi, UlyssesScatterAndReplicate) {
  const int P = g_world->size();
  CpCase c;
  c.strategy = Strategy::ulysses;
  c.H = 2 * P;
  c.HKV = P;  // scattered
  run_everywhere(c);
  c.HKV = 1;  // replicated
  c.layout = Layout::stripe;
  run_everywhere(c);
}

TEST(CpMpi, HybridAndAllGather) {
  const int P = g_world->size();
  CpCase c;
  c.H = 8;
  c.HKV = 2;
  if (P % 2 == 0) {
    c.strategy = Strategy::hybrid;
    c.ulysses = 2;
    run_everywhere(c);
  }
  c.strategy = Strategy::allgather;
  c.ulysses = 1;
  c.docs = {30, 21};
  run_everywhere(c);
}

}  // namespace
}  // namespace loom::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  loom::testing::g_world = loom::mpi_world();
  if (loom::testing::g_world->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int64_t rc = RUN_ALL_TESTS();
  loom::testing::g_world->all_reduce(&rc, 1, loom::DType::i64, loom::ReduceOp::max);
  loom::testing::g_world.reset();
  return static_cast<int>(rc);
}
