// Ulysses: all-to-all between "my tokens, all heads" and "all tokens, my heads".
//
// Attention heads are independent. In a group of U ranks, member u sends to member p the rows it
// holds for p's slice of heads; after the exchange member u holds every row of the group for its
// own heads, stacked in member order, and a single local attend computes them exactly (the
// positions travel implicitly: every member knows every member's token list from the plan).
// The inverse all-to-all returns outputs (and gradients) to the members that own the tokens.
// GQA: KV heads are scattered like query heads when Hkv % U == 0; when U % Hkv == 0 each KV head
// is replicated to the U / Hkv members whose query heads read it, and in backward the members'
// gradients for a replicated head are summed on the way back.
#include "ulysses.h"

#include <algorithm>

namespace loom::cp_detail {

UlyssesGroup UlyssesGroup::of(const Engine& e) {
  UlyssesGroup g;
  g.comm = e.inner ? e.inner : &e.cp;
  const int U = e.shape.inner, first = (e.me / U) * U;
  for (int u = 0; u < U; ++u) g.rows.push_back(e.plan.rows(first + u));
  return g;
}

int64_t UlyssesGroup::total() const {
  int64_t t = 0;
  for (int64_t r : rows) t += r;
  return t;
}

int64_t UlyssesGroup::offset(int p) const {
  int64_t t = 0;
  for (int i = 0; i < p; ++i) t += rows[i];
  return t;
}

namespace {

// all_to_all of element counts, recorded as a blocking collective.
template <class T>
void a2a(Engine& e, const UlyssesGroup& g, const std::vector<T>& send,
         const std::vector<size_t>& scount, std::vector<T>& recv,
         const std::vector<size_t>& rcount) {
  const int U = static_cast<int>(g.rows.size());
  std::vector<size_t> sb(U), so(U), rb(U), ro(U);
  size_t s_off = 0, r_off = 0;
  for (int p = 0; p < U; ++p) {
    sb[p] = scount[p] * sizeof(T);
    so[p] = s_off;
    s_off += sb[p];
    rb[p] = rcount[p] * sizeof(T);
    ro[p] = r_off;
    r_off += rb[p];
  }
  recv.assign(r_off / sizeof(T), T{});
  e.rec.collective(SpanKind::a2a, [&] {
    g.comm->all_to_all(send.data(), sb.data(), so.data(), recv.data(), rb.data(), ro.data());
  });
}

}  // namespace

template <class T>
Tensor<T> seq_to_head(Engine& e, const UlyssesGroup& g, View3<const T> x) {
  const int U = static_cast<int>(g.rows.size());
  const int64_t hl = x.h / U, d = x.d, n = x.s;
  std::vector<T> send(static_cast<size_t>(n * x.h * d));
  std::vector<size_t> sc(U), rc(U);
  // send block p: [n, hl, d] of heads [p hl, (p+1) hl)
  for (int p = 0; p < U; ++p) {
    e.mem.pack<T>(x.heads(p * hl, hl), send.data() + p * n * hl * d);
    sc[p] = static_cast<size_t>(n * hl * d);
    rc[p] = static_cast<size_t>(g.rows[p] * hl * d);
  }
  std::vector<T> recv;
  a2a(e, g, send, sc, recv, rc);
  Tensor<T> out({g.total(), hl, d});
  out.vec() = std::move(recv);  // [member][rows][hl][d] == [N][hl][d]
  return out;
}

template <class T>
Tensor<T> seq_to_head_replicated(Engine& e, const UlyssesGroup& g, View3<const T> x) {
  const int U = static_cast<int>(g.rows.size());
  const int64_t hkv = x.h, d = x.d, n = x.s, per = U / hkv;
  std::vector<T> send(static_cast<size_t>(U * n * d));
  std::vector<size_t> sc(U), rc(U);
  for (int p = 0; p < U; ++p) {
    e.mem.pack<T>(x.heads(p / per, 1), send.data() + p * n * d);
    sc[p] = static_cast<size_t>(n * d);
    rc[p] = static_cast<size_t>(g.rows[p] * d);
  }
  std::vector<T> recv;
  a2a(e, g, send, sc, recv, rc);
  Tensor<T> out({g.total(), 1, d});
  out.vec() = std::move(recv);
  return out;
}

template <class T>
void head_to_seq(Engine& e, const UlyssesGroup& g, const Tensor<T>& y, View3<T> x) {
  const int U = static_cast<int>(g.rows.size());
  const int64_t hl = y.size(1), d = y.size(2), n = x.s;
  std::vector<size_t> sc(U), rc(U);
  for (int p = 0; p < U; ++p) {
    sc[p] = static_cast<size_t>(g.rows[p] * hl * d);
    rc[p] = static_cast<size_t>(n * hl * d);
  }
  std::vector<T> recv;
  a2a(e, g, y.vec(), sc, recv, rc);
  for (int p = 0; p < U; ++p) e.mem.unpack<T>(recv.data() + p * n * hl * d, x.heads(p * hl, hl));
}

void head_to_seq_replicated(Engine& e, const UlyssesGroup& g, const Tensor<float>& y,
                            View3<float> x) {
  const int U = static_cast<int>(g.rows.size());
  const int64_t hkv = x.h, d = x.d, n = x.s, per = U / hkv;
  std::vector<size_t> sc(U), rc(U);
  for (int p = 0; p < U; ++p) {
    sc[p] = static_cast<size_t>(g.rows[p] * d);
    rc[p] = static_cast<size_t>(n * d);
  }
  std::vector<float> recv;
  a2a(e, g, y.vec(), sc, recv, rc);
  e.mem.zero(x);
  for (int p = 0; p < U; ++p) e.mem.add(x.heads(p / per, 1), recv.data() + p * n * d);
}

std::vector<float> lse_to_head(Engine& e, const UlyssesGroup& g, const float* lse, int64_t heads) {
  const int U = static_cast<int>(g.rows.size());
  const int64_t hl = heads / U, n = g.rows[g.comm->rank()], N = g.total();
  // send to p: [hl][n] for heads [p hl, (p+1) hl) -- contiguous in lse [H, n]
  std::vector<float> send(lse, lse + heads * n);
  std::vector<size_t> sc(U), rc(U);
  for (int p = 0; p < U; ++p) {
    sc[p] = static_cast<size_t>(hl * n);
    rc[p] = static_cast<size_t>(hl * g.rows[p]);
  }
  std::vector<float> recv;
  a2a(e, g, send, sc, recv, rc);
  std::vector<float> out(static_cast<size_t>(hl * N));
  size_t at = 0;
  for (int p = 0; p < U; ++p) {
    const int64_t off = g.offset(p);
    for (int64_t h = 0; h < hl; ++h)
      for (int64_t i = 0; i < g.rows[p]; ++i) out[h * N + off + i] = recv[at++];
  }
  return out;
}

void lse_to_seq(Engine& e, const UlyssesGroup& g, const std::vector<float>& lsel, int64_t heads,
                float* lse) {
  const int U = static_cast<int>(g.rows.size());
  const int64_t hl = heads / U, n = g.rows[g.comm->rank()], N = g.total();
  std::vector<float> send;
  send.reserve(static_cast<size_t>(hl * N));
  std::vector<size_t> sc(U), rc(U);
  for (int p = 0; p < U; ++p) {
    const int64_t off = g.offset(p);
    for (int64_t h = 0; h < hl; ++h)
      for (int64_t i = 0; i < g.rows[p]; ++i) send.push_back(lsel[h * N + off + i]);
    sc[p] = static_cast<size_t>(hl * g.rows[p]);
    rc[p] = static_cast<size_t>(hl * n);
  }
  std::vector<float> recv;
  a2a(e, g, send, sc, recv, rc);
  // from p: [hl][n] for heads [p hl, (p+1) hl) == lse[p hl .. ] rows, contiguous
  e.mem.copy(lse, recv.data(), static_cast<size_t>(heads * n));
}

template Tensor<float> seq_to_head<float>(Engine&, const UlyssesGroup&, View3<const float>);
template Tensor<bf16> seq_to_head<bf16>(Engine&, const UlyssesGroup&, View3<const bf16>);
template Tensor<float> seq_to_head_replicated<float>(Engine&, const UlyssesGroup&,
                                                     View3<const float>);
template Tensor<bf16> seq_to_head_replicated<bf16>(Engine&, const UlyssesGroup&, View3<const bf16>);
template void head_to_seq<float>(Engine&, const UlyssesGroup&, const Tensor<float>&, View3<float>);
template void head_to_seq<bf16>(Engine&, const UlyssesGroup&, const Tensor<bf16>&, View3<bf16>);

}  // namespace loom::cp_detail
