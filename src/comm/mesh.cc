// The dp x tp x cp(ulysses x ring) mesh.
//
// World rank w decomposes with tp innermost, then ulysses, then ring, then dp:
//   w = ((dp_i * ring + ring_i) * ulysses + uly_i) * tp + tp_i.
// Each group is one split of the world: its color is the index of the coordinates it does not
// span, its key the coordinate it does (for cp: ring_i * ulysses + uly_i), so ranks inside a
// group are ordered by that coordinate. dp_cp (every rank holding the same tp piece) is ordered
// by world rank. These are the only groups loom's algorithms use: CpAttention takes cp and its
// ulysses and ring axes, the trainer tp, dp and dp_cp.
#include <cstdint>
#include <string>
#include <vector>

#include "loom/comm.h"
#include "loom/error.h"

namespace loom {

namespace {

// Every rank of the world must build the same mesh: a rank with ulysses 4 among ranks with
// 2 x 2 split other groups than its peers (its ulysses group held 2 ranks while its shape said 4)
// and returned without an error. One all-gather of five int64 per rank, as long on every rank
// whatever the shapes, before anything is split.
constexpr int64_t kMeshMagic = int64_t{0x6c6f6f6d30};  // "loom", build_mesh
constexpr int kMeshSlots = 5;

std::string shape_text(const int64_t* s) {
  return "dp=" + std::to_string(s[1]) + " x tp=" + std::to_string(s[2]) +
         " x ulysses=" + std::to_string(s[3]) + " x ring=" + std::to_string(s[4]);
}

void check_ranks_agree(Communicator& world, const MeshShape& shape) {
  const int n = world.size();
  if (n == 1) return;
  const int64_t mine[kMeshSlots] = {kMeshMagic, shape.dp, shape.tp, shape.ulysses, shape.ring};
  std::vector<int64_t> all(static_cast<size_t>(kMeshSlots) * n);
  world.all_gather(mine, sizeof mine, all.data());
  const int64_t* first = all.data();
  for (int r = 1; r < n; ++r) {
    const int64_t* theirs = all.data() + static_cast<size_t>(r) * kMeshSlots;
    LOOM_CHECK(theirs[0] == kMeshMagic && first[0] == kMeshMagic, InvalidArgument,
               "build_mesh: rank " << (first[0] == kMeshMagic ? r : 0)
                                   << " is not building a mesh while the others are: every rank "
                                      "of the world must call build_mesh together");
    bool same = true;
    for (int i = 1; i < kMeshSlots; ++i) same = same && theirs[i] == first[i];
    LOOM_CHECK(same, InvalidArgument,
               "build_mesh: the ranks disagree on the mesh: rank "
                   << r << " has " << shape_text(theirs) << ", rank 0 " << shape_text(first)
                   << "; every rank must build the same mesh");
  }
}

}  // namespace

namespace detail {
Mesh build_agreed_mesh(Communicator& world, const MeshShape& shape);
}  // namespace detail

Mesh build_mesh(Communicator& world, const MeshShape& shape) {
  // First, so that every rank throws the same error (a shape that does not fit the world is
  // refused on every rank alike once they agree).
  check_ranks_agree(world, shape);
  return detail::build_agreed_mesh(world, shape);
}

namespace detail {

// build_mesh for a shape its ranks are known to agree on (CpAttention's, from the configuration
// its constructor's exchange compared): no exchange of its own. Declared where it is called.
Mesh build_agreed_mesh(Communicator& world, const MeshShape& shape) {
  const int dp = shape.dp, tp = shape.tp, uly = shape.ulysses, ring = shape.ring;
  LOOM_CHECK(dp >= 1 && tp >= 1 && uly >= 1 && ring >= 1 && shape.ranks() == world.size(),
             InvalidArgument,
             "mesh dp=" << dp << " x tp=" << tp << " x ulysses=" << uly << " x ring=" << ring
                        << " does not match the world of " << world.size()
                        << " ranks (every size must be >= 1 and their product the world size)");
  Mesh mesh;
  mesh.shape = shape;
  const int w = world.rank();
  mesh.tp_rank = w % tp;
  mesh.uly_rank = (w / tp) % uly;
  mesh.ring_rank = (w / (tp * uly)) % ring;
  mesh.dp_rank = w / (tp * uly * ring);
  const int t = mesh.tp_rank, u = mesh.uly_rank, r = mesh.ring_rank, d = mesh.dp_rank;

  mesh.tp = world.split((d * ring + r) * uly + u, t);
  mesh.ulysses = world.split((d * ring + r) * tp + t, u);
  mesh.ring = world.split((d * uly + u) * tp + t, r);
  mesh.cp = world.split(d * tp + t, mesh.cp_rank());
  mesh.dp = world.split(mesh.cp_rank() * tp + t, d);
  mesh.dp_cp = world.split(t, w);
  return mesh;
}

}  // namespace detail

}  // namespace loom
