// Ring attention: K,V blocks travel around a ring of R members while each member computes on
// the block in hand.
//
// Forward. At step s member r holds the KV block of member src = r - s (mod R). Before computing
// on it, r posts the block's send to r + 1 and the receive of block src - 1 from r - 1 (double
// buffer), so the transfer travels while the kernel runs; after computing, r waits for both.
// Each step is one attend into the fp32 softmax state; finish() runs once at the end.
//
// Backward. K,V travel the same way. The fp32 dK,dV accumulator of each block follows its block:
// at step s, r computes the block's contribution into a fresh buffer, waits for the accumulator
// that r - 1 sent after its step s - 1 (same block), adds, and sends the sum to r + 1. After the
// last step, r + 1 is the block's owner, so every accumulator arrives home after a full turn
// (R sends), never rounded below fp32. dQ accumulates locally. The kernels use the final lse, so
// partial gradients from different steps simply add.
#include <algorithm>
#include <cstring>

#include "engine.h"
#include "loom/timer.h"

namespace loom::cp_detail {

namespace {
constexpr int kTagKvForward = 101;
constexpr int kTagKvBackward = 102;
constexpr int kTagDkv = 103;

bool segment_pair_empty(const Block& qb, const Segment& qs, const Block& kb, const Segment& ks,
                        const Mask& mask) {
  if (qs.count == 0 || ks.count == 0) return true;
  const int32_t qd = qb.doc.empty() ? 0 : qb.doc[qs.begin];
  const int32_t kd = kb.doc.empty() ? 0 : kb.doc[ks.begin];
  if (qd != kd) return true;  // segments never cross documents
  const int64_t qlo = qb.pos[qs.begin], qhi = qb.pos[qs.begin + qs.count - 1];
  const int64_t klo = kb.pos[ks.begin], khi = kb.pos[ks.begin + ks.count - 1];
  if (mask.causal && klo > qhi) return true;
  if (mask.window > 0) {
    const int64_t gap = std::max(klo - qhi, qlo - khi);
    if (gap >= mask.window) return true;
  }
  return false;
}

template <class T>
View3<T> block_view(T* base, int64_t rows, int64_t heads, int64_t dim) {
  return View3<T>{base, rows, heads, dim, heads * dim, dim};
}

}  // namespace

void add_span(CpMetrics& m, const char* kind, int step, double t0, double t1) {
  if (m.record_spans) m.spans.push_back(CpMetrics::Span{kind, step, t0, t1});
}

Block make_block(const ShardPlan& plan, int first, int count) {
  Block b;
  for (int r = first; r < first + count; ++r) {
    for (const Segment& s : plan.segments[r]) b.segs.push_back(Segment{b.rows + s.begin, s.count});
    b.pos.insert(b.pos.end(), plan.tokens[r].begin(), plan.tokens[r].end());
    b.doc.insert(b.doc.end(), plan.docs[r].begin(), plan.docs[r].end());
    b.rows += plan.rows(r);
  }
  return b;
}

template <class T>
void pack(View3<const T> x, T* dst) {
  const int64_t w = x.h * x.d;
  if (x.s * w == 0) return;
  if (x.contiguous()) {
    std::memcpy(dst, x.data, sizeof(T) * static_cast<size_t>(x.s * w));
    return;
  }
  for (int64_t i = 0; i < x.s; ++i)
    for (int64_t h = 0; h < x.h; ++h)
      std::memcpy(dst + i * w + h * x.d, x.row(i, h), sizeof(T) * static_cast<size_t>(x.d));
}

template <class T>
void unpack(const T* src, View3<T> x) {
  const int64_t w = x.h * x.d;
  for (int64_t i = 0; i < x.s; ++i)
    for (int64_t h = 0; h < x.h; ++h)
      std::memcpy(x.row(i, h), src + i * w + h * x.d, sizeof(T) * static_cast<size_t>(x.d));
}

double timed_wait(Work& w, CpMetrics& m, int step) {
  const double t0 = now_s();
  w.wait();
  const double t1 = now_s();
  m.wait_s += t1 - t0;
  m.comm_s += t1 - t0;
  add_span(m, "wait", step, t0, t1);
  return t1;
}

template <class T>
KernelStats attend_blocks(StateView st, View3<const T> q, const Block& qb, View3<const T> k,
                          View3<const T> v, const Block& kb, const KernelConfig& kc) {
  KernelStats stats;
  for (const Segment& qs : qb.segs) {
    for (const Segment& ks : kb.segs) {
      if (segment_pair_empty(qb, qs, kb, ks, kc.mask)) continue;
      stats += attend(st.sub_rows(qs.begin, qs.count), q.rows(qs.begin, qs.count),
                      k.rows(ks.begin, ks.count), v.rows(ks.begin, ks.count),
                      qb.info().sub(qs.begin, qs.count), kb.info().sub(ks.begin, ks.count), kc);
    }
  }
  return stats;
}

template <class T>
KernelStats attend_backward_blocks(View3<const T> q, const Block& qb, View3<const T> k,
                                   View3<const T> v, const Block& kb, View3<const T> dout,
                                   const float* lse, const float* delta, const KernelConfig& kc,
                                   View3<float> dq, View3<float> dk, View3<float> dv) {
  KernelStats stats;
  for (const Segment& qs : qb.segs) {
    for (const Segment& ks : kb.segs) {
      if (segment_pair_empty(qb, qs, kb, ks, kc.mask)) continue;
      // lse and delta are [H, qb.rows]: the segment's rows start at column qs.begin.
      stats += attend_backward(
          q.rows(qs.begin, qs.count), k.rows(ks.begin, ks.count), v.rows(ks.begin, ks.count),
          dout.rows(qs.begin, qs.count), lse + qs.begin, delta + qs.begin, qb.rows,
          qb.info().sub(qs.begin, qs.count), kb.info().sub(ks.begin, ks.count), kc,
          dq.rows(qs.begin, qs.count), dk.rows(ks.begin, ks.count), dv.rows(ks.begin, ks.count));
    }
  }
  return stats;
}

template <class T>
void ring_forward(Communicator* ring, const std::vector<Block>& blocks, View3<const T> q,
                  View3<const T> k, View3<const T> v, StateView st, const KernelConfig& kc,
                  CpMetrics& m, Workspace& ws) {
  const int R = ring ? ring->size() : 1;
  const int me = ring ? ring->rank() : 0;
  const Block& qb = blocks[me];
  m.step_tiles.assign(R, 0);
  if (R == 1) {
    const double t0 = now_s();
    const KernelStats s = attend_blocks<T>(st, q, qb, k, v, qb, kc);
    const double t1 = now_s();
    m.compute_s += t1 - t0;
    add_span(m, "compute", 0, t0, t1);
    m.tiles += s.tiles;
    m.visible_pairs += s.visible_pairs;
    m.step_tiles[0] = s.tiles;
    return;
  }
  const int64_t hkv = k.h, dim = k.d, row = hkv * dim;
  int64_t max_rows = 0;
  for (const Block& b : blocks) max_rows = std::max(max_rows, b.rows);
  const size_t cap = static_cast<size_t>(2 * max_rows * row);
  T* buf[2] = {ws.get<T>(0, cap), ws.get<T>(1, cap)};
  pack<T>(k, buf[0]);
  pack<T>(v, buf[0] + qb.rows * row);
  int cur = 0;
  const int next = (me + 1) % R, prev = (me - 1 + R) % R;
  for (int s = 0; s < R; ++s) {
    const int src = (me - s + R) % R;
    const int64_t n = blocks[src].rows;
    std::vector<WorkPtr> works;
    double t_post = 0;
    if (s < R - 1) {
      const int64_t n_next = blocks[(src - 1 + R) % R].rows;
      t_post = now_s();
      works = ring->batch_p2p(
          {P2POp{P2POp::send, buf[cur], sizeof(T) * 2 * n * row, next, kTagKvForward},
           P2POp{P2POp::recv, buf[cur ^ 1], sizeof(T) * 2 * n_next * row, prev, kTagKvForward}});
      m.comm_s += now_s() - t_post;
    }
    const View3<const T> kb = block_view<const T>(buf[cur], n, hkv, dim);
    const View3<const T> vb = block_view<const T>(buf[cur] + n * row, n, hkv, dim);
    const double t0 = now_s();
    const KernelStats ks = attend_blocks<T>(st, q, qb, kb, vb, blocks[src], kc);
    const double t1 = now_s();
    m.compute_s += t1 - t0;
    add_span(m, "compute", s, t0, t1);
    m.tiles += ks.tiles;
    m.visible_pairs += ks.visible_pairs;
    m.step_tiles[s] = ks.tiles;
    if (!works.empty()) {
      add_span(m, "send", s, t_post, timed_wait(*works[0], m, s));
      add_span(m, "recv", s, t_post, timed_wait(*works[1], m, s));
    }
    cur ^= 1;
  }
}

template <class T>
void ring_backward(Communicator* ring, const std::vector<Block>& blocks, View3<const T> q,
                   View3<const T> k, View3<const T> v, View3<const T> dout, const float* lse,
                   const float* delta, const KernelConfig& kc, View3<float> dq, View3<float> dk,
                   View3<float> dv, CpMetrics& m, Workspace& ws) {
  const int R = ring ? ring->size() : 1;
  const int me = ring ? ring->rank() : 0;
  const Block& qb = blocks[me];
  const int64_t hkv = k.h, dim = k.d, row = hkv * dim;
  for (int64_t i = 0; i < dq.s; ++i)
    for (int64_t h = 0; h < dq.h; ++h) std::fill_n(dq.row(i, h), dq.d, 0.0f);
  if (R == 1) {
    for (int64_t i = 0; i < dk.s; ++i)
      for (int64_t h = 0; h < dk.h; ++h) {
        std::fill_n(dk.row(i, h), dk.d, 0.0f);
        std::fill_n(dv.row(i, h), dv.d, 0.0f);
      }
    const double t0 = now_s();
    const KernelStats s = attend_backward_blocks(q, qb, k, v, qb, dout, lse, delta, kc, dq, dk, dv);
    const double t1 = now_s();
    m.compute_s += t1 - t0;
    add_span(m, "compute", 0, t0, t1);
    m.tiles += s.tiles;
    return;
  }
  int64_t max_rows = 0;
  for (const Block& b : blocks) max_rows = std::max(max_rows, b.rows);
  const size_t cap = static_cast<size_t>(2 * max_rows * row);
  T* kv[2] = {ws.get<T>(0, cap), ws.get<T>(1, cap)};
  float* part = ws.get<float>(2, cap);
  float* acc_send[2] = {ws.get<float>(3, cap), ws.get<float>(4, cap)};
  float* acc_recv[2] = {ws.get<float>(5, cap), ws.get<float>(6, cap)};
  pack<T>(k, kv[0]);
  pack<T>(v, kv[0] + qb.rows * row);
  WorkPtr send_work[2], recv_work;
  double t_send[2] = {0, 0}, t_recv = 0;
  int cur = 0;
  const int next = (me + 1) % R, prev = (me - 1 + R) % R;
  for (int s = 0; s < R; ++s) {
    const int src = (me - s + R) % R;
    const int64_t n = blocks[src].rows;
    const int64_t n_next = blocks[(src - 1 + R) % R].rows;
    std::vector<WorkPtr> works;
    double t_post = 0;
    if (s < R - 1) {
      t_post = now_s();
      works = ring->batch_p2p(
          {P2POp{P2POp::send, kv[cur], sizeof(T) * 2 * n * row, next, kTagKvBackward},
           P2POp{P2POp::recv, kv[cur ^ 1], sizeof(T) * 2 * n_next * row, prev, kTagKvBackward}});
      m.comm_s += now_s() - t_post;
    }
    // This step's contribution to block src's dK, dV.
    std::fill_n(part, 2 * n * row, 0.0f);
    const View3<const T> kb = block_view<const T>(kv[cur], n, hkv, dim);
    const View3<const T> vb = block_view<const T>(kv[cur] + n * row, n, hkv, dim);
    double t0 = now_s();
    const KernelStats ks = attend_backward_blocks<T>(q, qb, kb, vb, blocks[src], dout, lse, delta,
                                                     kc, dq, block_view(part, n, hkv, dim),
                                                     block_view(part + n * row, n, hkv, dim));
    double t1 = now_s();
    m.compute_s += t1 - t0;
    add_span(m, "compute", s, t0, t1);
    m.tiles += ks.tiles;
    // Add the accumulator that travelled with this block (none at step 0: it starts here).
    const int par = s & 1;
    if (send_work[par])  // acc_send[par] free again
      add_span(m, "send", s, t_send[par], timed_wait(*send_work[par], m, s));
    float* acc = acc_send[par];
    if (s == 0) {
      std::copy_n(part, 2 * n * row, acc);
    } else {
      add_span(m, "recv", s, t_recv, timed_wait(*recv_work, m, s));
      const float* in = acc_recv[par ^ 1];
      t0 = now_s();
      for (int64_t i = 0; i < 2 * n * row; ++i) acc[i] = in[i] + part[i];
      m.compute_s += now_s() - t0;
    }
    t0 = now_s();
    send_work[par] = ring->isend(acc, sizeof(float) * 2 * n * row, next, kTagDkv);
    recv_work = ring->irecv(acc_recv[par], sizeof(float) * 2 * n_next * row, prev, kTagDkv);
    t_send[par] = t_recv = t0;
    m.comm_s += now_s() - t0;
    if (!works.empty()) {
      add_span(m, "send", s, t_post, timed_wait(*works[0], m, s));
      add_span(m, "recv", s, t_post, timed_wait(*works[1], m, s));
    }
    cur ^= 1;
  }
  // The accumulator of my own block, home after a full turn.
  add_span(m, "recv", R, t_recv, timed_wait(*recv_work, m, R));
  const float* home = acc_recv[(R - 1) & 1];
  unpack<float>(home, dk);
  unpack<float>(home + qb.rows * row, dv);
  for (int par = 0; par < 2; ++par)
    if (send_work[par]) add_span(m, "send", R, t_send[par], timed_wait(*send_work[par], m, R));
}

// Explicit instantiations: fp32 and bf16 storage.
#define LOOM_CP_INSTANTIATE(T)                                                                    \
  template void pack<T>(View3<const T>, T*);                                                      \
  template void unpack<T>(const T*, View3<T>);                                                    \
  template KernelStats attend_blocks<T>(StateView, View3<const T>, const Block&, View3<const T>,  \
                                        View3<const T>, const Block&, const KernelConfig&);       \
  template KernelStats attend_backward_blocks<T>(                                                 \
      View3<const T>, const Block&, View3<const T>, View3<const T>, const Block&, View3<const T>, \
      const float*, const float*, const KernelConfig&, View3<float>, View3<float>, View3<float>); \
  template void ring_forward<T>(Communicator*, const std::vector<Block>&, View3<const T>,         \
                                View3<const T>, View3<const T>, StateView, const KernelConfig&,   \
                                CpMetrics&, Workspace&);                                          \
  template void ring_backward<T>(Communicator*, const std::vector<Block>&, View3<const T>,        \
                                 View3<const T>, View3<const T>, View3<const T>, const float*,    \
                                 const float*, const KernelConfig&, View3<float>, View3<float>,   \
                                 View3<float>, CpMetrics&, Workspace&);
LOOM_CP_INSTANTIATE(float)
LOOM_CP_INSTANTIATE(bf16)
#undef LOOM_CP_INSTANTIATE

}  // namespace loom::cp_detail
