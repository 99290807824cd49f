// Internal to src/cp: the Ulysses all-to-all transposes between "my tokens, all heads" and
// "all tokens of the group, my heads".
#pragma once

#include <vector>

#include "engine.h"

namespace loom::cp_detail {

// Row counts of the U members of a ulysses group, in group order.
struct UlyssesGroup {
  // The inner axis of e (a ulysses group of U consecutive cp ranks) and its members' rows.
  static UlyssesGroup of(const Engine& e);
  Communicator* comm = nullptr;
  std::vector<int64_t> rows;  // rows[p]: tokens member p holds
  int64_t total() const;
  int64_t offset(int p) const;
};

// x [n, Hx, D] -> out [N, Hx/U, D] (member u receives heads [u Hx/U, (u+1) Hx/U) of every
// member's rows, stacked in member order).
// T: float or bf16 (the storage type of q, k, v, out, dout); gradients travel as float.
template <class T>
Tensor<T> seq_to_head(Engine& e, const UlyssesGroup& g, View3<const T> x);
// KV replication (U % Hkv == 0): member u receives KV head u / (U / Hkv) of every member's rows:
// out [N, 1, D].
template <class T>
Tensor<T> seq_to_head_replicated(Engine& e, const UlyssesGroup& g, View3<const T> x);
// The inverse of seq_to_head: y [N, Hl, D] -> x [n, Hl U, D] (overwritten).
template <class T>
void head_to_seq(Engine& e, const UlyssesGroup& g, const Tensor<T>& y, View3<T> x);
// The adjoint of seq_to_head_replicated: y [N, 1, D] holds gradients for KV head u / (U / Hkv);
// x [n, Hkv, D] is overwritten with the sum over members of their gradients for each head.
void head_to_seq_replicated(Engine& e, const UlyssesGroup& g, const Tensor<float>& y,
                            View3<float> x);
// lse [H, n] -> [H/U, N] and back.
std::vector<float> lse_to_head(Engine& e, const UlyssesGroup& g, const float* lse, int64_t heads);
void lse_to_seq(Engine& e, const UlyssesGroup& g, const std::vector<float>& lsel, int64_t heads,
                float* lse);

}  // namespace loom::cp_detail
