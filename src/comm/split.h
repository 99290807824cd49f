// Internal to src/comm: the collective part of Communicator::split, written once for the
// backends that build a split's group themselves (local, torch; MPI calls MPI_Comm_split).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "collectives.h"

namespace loom::detail {

// The new group of one split, as this group's ranks.
struct SplitGroup {
  std::vector<int> members;  // ranks (of this group) of color's group, by (key, rank)
  int new_rank = -1;         // this rank's place among them; -1 for color < 0
};

// Exchanges every rank's (color, key) over t's all_gather (bounded by deadline) and returns the
// group of this rank's color. Every rank of the group calls it, those with color < 0 included.
inline SplitGroup split_group(Transport& t, int color, int key, Deadline deadline) {
  const int n = t.transport_size();
  const int64_t mine[2] = {color, key};
  std::vector<int64_t> all(2 * static_cast<size_t>(n));
  all_gather(t, mine, sizeof mine, all.data(), deadline);
  SplitGroup g;
  if (color < 0) return g;
  for (int p = 0; p < n; ++p) {
    if (all[2 * p] == color) g.members.push_back(p);
  }
  std::stable_sort(g.members.begin(), g.members.end(),
                   [&](int a, int b) { return all[2 * a + 1] < all[2 * b + 1]; });
  const auto me = std::find(g.members.begin(), g.members.end(), t.transport_rank());
  g.new_rank = static_cast<int>(me - g.members.begin());
  return g;
}

}  // namespace loom::detail
