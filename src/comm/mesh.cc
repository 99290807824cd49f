// The dp x tp x cp(ulysses x ring) mesh.
//
// World rank w decomposes with tp innermost, then ulysses, then ring, then dp:
//   w = ((dp_i * ring + ring_i) * ulysses + uly_i) * tp + tp_i.
// Each group is one split of the world: its color is the index of the coordinates it does not
// span, its key the coordinate it does (for cp: ring_i * ulysses + uly_i), so ranks inside a
// group are ordered by that coordinate. dp_cp (every rank holding the same tp piece) is ordered
// by world rank. These are the only groups loom's algorithms use: CpAttention takes cp and its
// ulysses and ring axes, the trainer tp, dp and dp_cp.
#include "loom/comm.h"
#include "loom/error.h"

namespace loom {

Mesh build_mesh(Communicator& world, const MeshShape& shape) {
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

}  // namespace loom
