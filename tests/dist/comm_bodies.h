// Communicator test bodies, written once and run by every rank of a group: on the local backend
// for many world sizes (tests/dist/test_comm_local.cc) and under mpirun
// (tests/mpi/test_comm_mpi.cc). A body checks with gtest EXPECT_*/ADD_FAILURE (thread-safe) and
// throws on communication errors, which the caller turns into a failure.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "loom/comm.h"

namespace loom::test {

struct CommBody {
  std::string name;  // gtest-friendly: letters, digits, underscores
  std::function<void(Communicator&)> fn;
};

// Every body; each works for any group size, 1 included.
const std::vector<CommBody>& comm_bodies();

// Every (dp, tp, ulysses, ring) whose product is `world`.
std::vector<MeshShape> mesh_factorisations(int world);

// Builds the mesh of `shape` over `world` and checks each group's size, members (as world
// ranks, in order) and this rank's coordinates.
void check_mesh(Communicator& world, const MeshShape& shape);

}  // namespace loom::test
