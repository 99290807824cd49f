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

#include "engine.h"

namespace loom::cp_detail {

Engine::Engine(const ShardPlan& p, const CpConfig& c, const CpShape& s, int64_t h, int64_t hkv,
               int64_t d, Communicator& cp_group, Communicator* inner_group,
               Communicator* outer_group, CpMetrics& metrics)
    : plan(p),
      cfg(c),
      shape(s),
      heads(h),
      kv_heads(hkv),
      dim(d),
      cp(cp_group),
      inner(inner_group),
      outer(outer_group),
      P(cp_group.size()),
      me(cp_group.rank()),
      rec(metrics, mem) {
  for (int r = 0; r < P; ++r) shards.push_back(make_block(plan, r, 1));
  rec.watch(&cp);
  rec.watch(inner);
  rec.watch(outer);
}

StateView Engine::fresh_state(int64_t rows, int64_t h) {
  if (!state_ || state_->rows() != rows || state_->acc.size(1) != h) {
    state_ = std::make_unique<SoftmaxState>(rows, h, dim);
  } else {
    state_->reset();
  }
  return state_->view();
}

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

}  // namespace

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

namespace {

// This member's KV block as one contiguous buffer (k rows, then v rows): the caller's when it is
// laid out so, else packed into slot 0.
template <class T>
const T* packed_kv(Engine& e, View3<const T> k, View3<const T> v, size_t cap) {
  const int64_t row = k.h * k.d;
  if (k.contiguous() && v.contiguous() && (k.s == 0 || v.data == k.data + k.s * row)) return k.data;
  T* own = e.mem.buffer<T>(0, cap);
  e.mem.pack<T>(k, own);
  e.mem.pack<T>(v, own + k.s * row);
  return own;
}

int64_t max_block_rows(const std::vector<Block>& blocks) {
  int64_t m = 0;
  for (const Block& b : blocks) m = std::max(m, b.rows);
  return m;
}

}  // namespace

TravellingSum::TravellingSum(Engine& e, Communicator* ring, size_t slot0, size_t cap, int tag)
    : e_(e), ring_(ring), tag_(tag) {
  const int R = ring->size(), me = ring->rank();
  next_ = (me + 1) % R;
  prev_ = (me - 1 + R) % R;
  for (size_t i = 0; i < 2; ++i) {
    send_[i] = e.mem.buffer<float>(slot0 + i, cap);
    recv_[i] = e.mem.buffer<float>(slot0 + 2 + i, cap);
  }
}

void TravellingSum::add_and_pass(int s, const float* part, size_t count, size_t count_next,
                                 int step) {
  const int par = s & 1;
  if (send_work_[par]) e_.rec.wait(*send_work_[par], SpanKind::send, step, t_send_[par]);
  float* acc = send_[par];  // free again
  if (s == 0) {
    e_.mem.copy(acc, part, count);
  } else {
    e_.rec.wait(*recv_work_, SpanKind::recv, step, t_recv_);
    const float* in = recv_[par ^ 1];
    e_.rec.local([&] { e_.mem.add(acc, in, part, count); });
  }
  e_.rec.post(t_send_[par], [&] {
    send_work_[par] = ring_->isend(acc, sizeof(float) * count, next_, tag_);
    recv_work_ = ring_->irecv(recv_[par], sizeof(float) * count_next, prev_, tag_);
    return 0;
  });
  t_recv_ = t_send_[par];
  last_ = par;
}

const float* TravellingSum::home(int step) {
  e_.rec.wait(*recv_work_, SpanKind::recv, step, t_recv_);
  for (int par = 0; par < 2; ++par)
    if (send_work_[par]) e_.rec.wait(*send_work_[par], SpanKind::send, step, t_send_[par]);
  return recv_[last_];
}

template <class T>
void ring_forward(Engine& e, Communicator* ring, const Block& qb, const std::vector<Block>& blocks,
                  View3<const T> q, View3<const T> k, View3<const T> v, StateView st, int step0) {
  const int R = ring ? ring->size() : 1;
  const int me = ring ? ring->rank() : 0;
  const Block& own = blocks[me];
  const KernelConfig& kc = e.cfg.kernel;
  if (R == 1) {
    e.rec.forward_step(step0, [&] { return attend_blocks<T>(st, q, qb, k, v, own, kc); });
    return;
  }
  const int64_t hkv = k.h, row = hkv * k.d;
  const size_t cap = static_cast<size_t>(2 * max_block_rows(blocks) * row);
  // Step s computes on cur; the block of step s + 1 arrives in slot (s + 1) & 1. Step 0's block
  // is this member's own (maybe the caller's buffer, never written).
  const T* cur = packed_kv<T>(e, k, v, cap);
  T* buf[2] = {e.mem.buffer<T>(0, cap), e.mem.buffer<T>(1, cap)};
  const int next = (me + 1) % R, prev = (me - 1 + R) % R;
  for (int s = 0; s < R; ++s) {
    const int src = (me - s + R) % R;
    const int64_t n = blocks[src].rows;
    T* incoming = buf[(s + 1) & 1];
    std::vector<WorkPtr> works;
    Memory::Event posted = 0;
    if (s < R - 1) {
      const int64_t n_next = blocks[(src - 1 + R) % R].rows;
      works = e.rec.post(posted, [&] {
        return ring->batch_p2p(
            {P2POp{P2POp::send, const_cast<T*>(cur), sizeof(T) * 2 * n * row, next, kTagKvForward},
             P2POp{P2POp::recv, incoming, sizeof(T) * 2 * n_next * row, prev, kTagKvForward}});
      });
    }
    const View3<const T> kb = e.rows_view<const T>(cur, n, hkv);
    const View3<const T> vb = e.rows_view<const T>(cur + n * row, n, hkv);
    e.rec.forward_step(step0 + s,
                       [&] { return attend_blocks<T>(st, q, qb, kb, vb, blocks[src], kc); });
    if (!works.empty()) {
      e.rec.wait(*works[0], SpanKind::send, step0 + s, posted);
      e.rec.wait(*works[1], SpanKind::recv, step0 + s, posted);
    }
    cur = incoming;
  }
}

template <class T>
void ring_backward(Engine& e, Communicator* ring, const Block& qb, const std::vector<Block>& blocks,
                   View3<const T> q, View3<const T> k, View3<const T> v, View3<const T> dout,
                   const float* lse, const float* delta, View3<float> dq, View3<float> dk,
                   View3<float> dv, int step0) {
  const int R = ring ? ring->size() : 1;
  const int me = ring ? ring->rank() : 0;
  const Block& own = blocks[me];
  const KernelConfig& kc = e.cfg.kernel;
  const int64_t hkv = k.h, row = hkv * k.d;
  if (R == 1) {
    e.mem.zero(dk);
    e.mem.zero(dv);
    e.rec.backward_step(step0, [&] {
      return attend_backward_blocks<T>(q, qb, k, v, own, dout, lse, delta, kc, dq, dk, dv);
    });
    return;
  }
  const size_t cap = static_cast<size_t>(2 * max_block_rows(blocks) * row);
  const T* cur = packed_kv<T>(e, k, v, cap);
  T* kv[2] = {e.mem.buffer<T>(0, cap), e.mem.buffer<T>(1, cap)};
  float* part = e.mem.buffer<float>(2, cap);
  TravellingSum sum(e, ring, 3, cap, kTagDkv);
  const int next = (me + 1) % R, prev = (me - 1 + R) % R;
  for (int s = 0; s < R; ++s) {
    const int step = step0 + s;
    const int src = (me - s + R) % R;
    const int64_t n = blocks[src].rows;
    const int64_t n_next = blocks[(src - 1 + R) % R].rows;
    T* incoming = kv[(s + 1) & 1];
    std::vector<WorkPtr> works;
    Memory::Event posted = 0;
    if (s < R - 1) {
      works = e.rec.post(posted, [&] {
        return ring->batch_p2p(
            {P2POp{P2POp::send, const_cast<T*>(cur), sizeof(T) * 2 * n * row, next, kTagKvBackward},
             P2POp{P2POp::recv, incoming, sizeof(T) * 2 * n_next * row, prev, kTagKvBackward}});
      });
    }
    // This step's contribution to block src's dK, dV.
    e.mem.zero(part, static_cast<size_t>(2 * n * row));
    const View3<const T> kb = e.rows_view<const T>(cur, n, hkv);
    const View3<const T> vb = e.rows_view<const T>(cur + n * row, n, hkv);
    e.rec.backward_step(step, [&] {
      return attend_backward_blocks<T>(q, qb, kb, vb, blocks[src], dout, lse, delta, kc, dq,
                                       e.rows_view<float>(part, n, hkv),
                                       e.rows_view<float>(part + n * row, n, hkv));
    });
    sum.add_and_pass(s, part, static_cast<size_t>(2 * n * row),
                     static_cast<size_t>(2 * n_next * row), step);
    if (!works.empty()) {
      e.rec.wait(*works[0], SpanKind::send, step, posted);
      e.rec.wait(*works[1], SpanKind::recv, step, posted);
    }
    cur = incoming;
  }
  // The accumulator of my own block, home after a full turn.
  const float* home = sum.home(step0 + R);
  e.mem.unpack<float>(home, dk);
  e.mem.unpack<float>(home + own.rows * row, dv);
}

// Explicit instantiations: fp32 and bf16 storage.
#define LOOM_CP_INSTANTIATE(T)                                                                    \
  template KernelStats attend_blocks<T>(StateView, View3<const T>, const Block&, View3<const T>,  \
                                        View3<const T>, const Block&, const KernelConfig&);       \
  template KernelStats attend_backward_blocks<T>(                                                 \
      View3<const T>, const Block&, View3<const T>, View3<const T>, const Block&, View3<const T>, \
      const float*, const float*, const KernelConfig&, View3<float>, View3<float>, View3<float>); \
  template void ring_forward<T>(Engine&, Communicator*, const Block&, const std::vector<Block>&,  \
                                View3<const T>, View3<const T>, View3<const T>, StateView, int);  \
  template void ring_backward<T>(Engine&, Communicator*, const Block&, const std::vector<Block>&, \
                                 View3<const T>, View3<const T>, View3<const T>, View3<const T>,  \
                                 const float*, const float*, View3<float>, View3<float>,          \
                                 View3<float>, int);
LOOM_CP_INSTANTIATE(float)
LOOM_CP_INSTANTIATE(bf16)
#undef LOOM_CP_INSTANTIATE

}  // namespace loom::cp_detail
