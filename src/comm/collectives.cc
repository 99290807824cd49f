// Collectives over point-to-point messages (the local backend's algorithms).
//
// Every collective here is "direct": a rank posts all its receives, then all its sends, then
// waits. With P ranks that is P - 1 messages out and P - 1 in per phase, each of which the
// local backend delivers with one copy when the receive is already posted. Zero-length parts
// are still sent, so a size mismatch between two ranks becomes an error instead of a wait.
//
//   all_to_all      rank r sends part p to rank p, receives part p from rank p.
//   all_gather      rank r sends its block to everyone; block p lands at recv + p * bytes.
//   reduce_scatter  rank r sends block p to rank p, receives everyone's block r, and reduces
//                   them in rank order 0, 1, ..., P - 1 (the same order on every rank).
//   all_reduce      a reduce_scatter over P near-equal blocks of the buffer (rank r owns block
//                   r), then an all_gather of the reduced blocks. Each element is reduced on one
//                   rank only, so every rank ends with bitwise the same result.
//   barrier         dissemination: in round k (k = 1, 2, 4, ...) rank r signals rank r + k and
//                   waits for rank r - k; after ceil(log2 P) rounds everyone has heard from all.
//
// Every wait is bounded by the caller's absolute deadline.
#include "collectives.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "loom/error.h"
#include "loom/io.h"
#include "loom/timer.h"

namespace loom::detail {
namespace {

void wait_by(Work& work, Deadline deadline) {
  try {
    work.wait(std::max(0.0, deadline.at - now_s()));
  } catch (const Timeout& e) {
    std::ostringstream os;
    os << e.what() << ", the rest of the collective's limit of " << seconds_text(deadline.limit_s)
       << " s";
    throw Timeout(os.str());
  }
}

void wait_all(std::vector<WorkPtr>& works, Deadline deadline) {
  for (auto& w : works) wait_by(*w, deadline);
}

template <typename T>
void reduce_typed(T* dst, const T* src, size_t count, ReduceOp op) {
  if (op == ReduceOp::sum) {
    for (size_t i = 0; i < count; ++i) dst[i] += src[i];
  } else {
    for (size_t i = 0; i < count; ++i) dst[i] = max_of(dst[i], src[i]);
  }
}

// out[i] = block_0[i] op block_1[i] op ... op block_{P-1}[i], in rank order. `out` may be one
// of the blocks: element i is read from all blocks before it is written.
template <typename T>
void reduce_blocks_typed(T* out, const std::vector<const void*>& blocks, size_t count,
                         ReduceOp op) {
  for (size_t i = 0; i < count; ++i) {
    T acc = static_cast<const T*>(blocks[0])[i];
    for (size_t p = 1; p < blocks.size(); ++p) {
      const T v = static_cast<const T*>(blocks[p])[i];
      acc = op == ReduceOp::sum ? acc + v : max_of(acc, v);
    }
    out[i] = acc;
  }
}

void reduce_blocks(void* out, const std::vector<const void*>& blocks, size_t count, DType dtype,
                   ReduceOp op) {
  switch (dtype) {
    case DType::f32:
      reduce_blocks_typed(static_cast<float*>(out), blocks, count, op);
      break;
    case DType::f64:
      reduce_blocks_typed(static_cast<double*>(out), blocks, count, op);
      break;
    case DType::i64:
      reduce_blocks_typed(static_cast<int64_t*>(out), blocks, count, op);
      break;
  }
}

const char* as_bytes(const void* p, size_t offset) {
  return static_cast<const char*>(p) + offset;
}
char* as_bytes(void* p, size_t offset) {
  return static_cast<char*>(p) + offset;
}

// a * b, or false when it passes size_t.
bool product(size_t a, size_t b, size_t& out) {
  return !__builtin_mul_overflow(a, b, &out);
}

// Whether [a, a + an) and [b, b + bn) share a byte (empty ranges share none).
bool overlaps(const void* a, size_t an, const void* b, size_t bn) {
  if (an == 0 || bn == 0) return false;
  const uintptr_t x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x < y ? y - x < an : x - y < bn;
}

std::string too_large(const char* what, size_t a, size_t b, size_t c = 1) {
  std::ostringstream os;
  os << what << " of " << a << " x " << b;
  if (c != 1) os << " x " << c;
  os << " bytes is more than size_t holds: no buffer is that large";
  return os.str();
}

}  // namespace

void throw_scratch_alloc(const char* op, size_t bytes) {
  std::ostringstream os;
  os << op << ": could not allocate " << bytes << " bytes for the blocks received from the other "
     << "ranks (out of memory); reduce fewer elements per call";
  throw OutOfMemory(os.str(), __FILE__, __LINE__);
}

std::string all_gather_overlap(int size, int rank, const void* send, size_t bytes,
                               const void* recv) {
  size_t total = 0;
  if (!product(bytes, static_cast<size_t>(size), total))
    return too_large("all_gather's receive buffer (bytes x ranks)", bytes,
                     static_cast<size_t>(size));
  if (send == as_bytes(recv, static_cast<size_t>(rank) * bytes)) return "";  // in place
  if (!overlaps(send, bytes, recv, total)) return "";
  std::ostringstream os;
  os << "all_gather's send buffer (" << bytes << " bytes) overlaps its receive buffer (" << total
     << " bytes) other than as this rank's own block (in place: send = recv + rank x bytes), so "
     << "blocks from other ranks would overwrite it before it is sent; use separate buffers";
  return os.str();
}

std::string reduce_scatter_overlap(int size, const void* send, const void* recv, size_t count,
                                   DType dtype) {
  size_t block = 0, total = 0;
  if (!product(count, dtype_size(dtype), block) ||
      !product(block, static_cast<size_t>(size), total))
    return too_large("reduce_scatter's send buffer (count x element size x ranks)", count,
                     dtype_size(dtype), static_cast<size_t>(size));
  if (!overlaps(send, total, recv, block)) return "";
  std::ostringstream os;
  os << "reduce_scatter's receive buffer (" << block << " bytes) overlaps its send buffer ("
     << total << " bytes); use separate buffers";
  return os.str();
}

std::string all_reduce_size_problem(size_t count, DType dtype) {
  size_t bytes = 0;
  if (!product(count, dtype_size(dtype), bytes))
    return too_large("all_reduce's buffer (count x element size)", count, dtype_size(dtype));
  return "";
}

std::string all_to_all_overlap(int size, const void* send, const size_t* send_bytes,
                               const size_t* send_offsets, const void* recv,
                               const size_t* recv_bytes, const size_t* recv_offsets) {
  struct Part {
    uintptr_t begin;
    size_t bytes;
    bool recv;
    int peer;
  };
  std::vector<Part> parts;
  for (int p = 0; p < size; ++p) {
    for (const bool r : {false, true}) {
      const size_t bytes = r ? recv_bytes[p] : send_bytes[p];
      const size_t offset = r ? recv_offsets[p] : send_offsets[p];
      const uintptr_t base = reinterpret_cast<uintptr_t>(r ? recv : send);
      if (bytes == 0) continue;
      if (offset > UINTPTR_MAX - base || bytes > UINTPTR_MAX - base - offset) {
        std::ostringstream os;
        os << "all_to_all's " << (r ? "receive" : "send") << " part for rank " << p << " (offset "
           << offset << ", " << bytes << " bytes) runs past the end of memory";
        return os.str();
      }
      parts.push_back({base + offset, bytes, r, p});
    }
  }
  // By address: a part overlaps an earlier one iff it starts before the furthest end so far (of
  // the kind it must not meet: receives meet nothing, sends no receive).
  std::sort(parts.begin(), parts.end(),
            [](const Part& a, const Part& b) { return a.begin < b.begin; });
  const Part* far_send = nullptr;
  const Part* far_recv = nullptr;
  const auto end = [](const Part* x) { return x->begin + x->bytes; };
  for (const Part& x : parts) {
    const Part* hit = nullptr;
    if (far_recv && x.begin < end(far_recv)) hit = far_recv;
    if (!hit && x.recv && far_send && x.begin < end(far_send)) hit = far_send;
    if (hit) {
      std::ostringstream os;
      os << "all_to_all's " << (hit->recv ? "receive" : "send") << " part for rank " << hit->peer
         << " overlaps its " << (x.recv ? "receive" : "send") << " part for rank " << x.peer
         << " (receive parts may overlap nothing, send parts may overlap each other); use "
         << "separate buffers";
      return os.str();
    }
    const Part*& far = x.recv ? far_recv : far_send;
    if (!far || end(&x) > end(far)) far = &x;
  }
  return "";
}

size_t block_begin(size_t count, int parts, int p) {
  const size_t base = count / parts, extra = count % parts;
  const size_t up = static_cast<size_t>(p);
  return up * base + std::min(up, extra);
}

void reduce_into(void* dst, const void* src, size_t count, DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::f32:
      reduce_typed(static_cast<float*>(dst), static_cast<const float*>(src), count, op);
      break;
    case DType::f64:
      reduce_typed(static_cast<double*>(dst), static_cast<const double*>(src), count, op);
      break;
    case DType::i64:
      reduce_typed(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), count, op);
      break;
  }
}

void all_to_all(Transport& t, const void* send, const size_t* send_bytes,
                const size_t* send_offsets, void* recv, const size_t* recv_bytes,
                const size_t* recv_offsets, Deadline deadline) {
  const int size = t.transport_size(), rank = t.transport_rank();
  LOOM_CHECK_EQ(send_bytes[rank], recv_bytes[rank], InvalidArgument,
                "all_to_all on rank " << rank << ": the part a rank sends to itself must equal "
                                      << "the part it receives from itself");
  std::vector<WorkPtr> recvs, sends;
  recvs.reserve(size);
  sends.reserve(size);
  for (int step = 1; step < size; ++step) {
    const int from = (rank - step + size) % size;
    recvs.push_back(t.post_recv(as_bytes(recv, recv_offsets[from]), recv_bytes[from], from,
                                kTagAllToAll, "all_to_all", true));
  }
  for (int step = 1; step < size; ++step) {
    const int to = (rank + step) % size;
    sends.push_back(t.post_send(as_bytes(send, send_offsets[to]), send_bytes[to], to, kTagAllToAll,
                                "all_to_all"));
  }
  if (send_bytes[rank] > 0) {
    std::memmove(as_bytes(recv, recv_offsets[rank]), as_bytes(send, send_offsets[rank]),
                 send_bytes[rank]);
  }
  wait_all(sends, deadline);
  wait_all(recvs, deadline);
}

void all_gather(Transport& t, const void* send, size_t bytes, void* recv, Deadline deadline) {
  const int size = t.transport_size(), rank = t.transport_rank();
  size_t total = 0;
  LOOM_CHECK(product(bytes, static_cast<size_t>(size), total), InvalidArgument,
             too_large("all_gather's receive buffer (bytes x ranks)", bytes, size));
  std::vector<WorkPtr> recvs, sends;
  for (int step = 1; step < size; ++step) {
    const int from = (rank - step + size) % size;
    recvs.push_back(
        t.post_recv(as_bytes(recv, from * bytes), bytes, from, kTagAllGather, "all_gather", true));
  }
  for (int step = 1; step < size; ++step) {
    sends.push_back(t.post_send(send, bytes, (rank + step) % size, kTagAllGather, "all_gather"));
  }
  if (bytes > 0) std::memmove(as_bytes(recv, rank * bytes), send, bytes);
  wait_all(sends, deadline);
  wait_all(recvs, deadline);
}

void reduce_scatter(Transport& t, const void* send, void* recv, size_t count, DType dtype,
                    ReduceOp op, Deadline deadline) {
  const int size = t.transport_size(), rank = t.transport_rank();
  size_t block_bytes = 0, total = 0;
  LOOM_CHECK(product(count, dtype_size(dtype), block_bytes) &&
                 product(block_bytes, static_cast<size_t>(size), total),
             InvalidArgument,
             too_large("reduce_scatter's send buffer (count x element size x ranks)", count,
                       dtype_size(dtype), size));
  // incoming[p]: rank p's copy of block `rank` (p != rank).
  char* incoming = t.scratch(block_bytes * size, "reduce_scatter");
  std::vector<WorkPtr> recvs, sends;
  for (int step = 1; step < size; ++step) {
    const int from = (rank - step + size) % size;
    recvs.push_back(t.post_recv(incoming + from * block_bytes, block_bytes, from, kTagReduceScatter,
                                "reduce_scatter", true));
  }
  for (int step = 1; step < size; ++step) {
    const int to = (rank + step) % size;
    sends.push_back(t.post_send(as_bytes(send, to * block_bytes), block_bytes, to,
                                kTagReduceScatter, "reduce_scatter"));
  }
  wait_all(sends, deadline);
  wait_all(recvs, deadline);
  std::vector<const void*> blocks(size);
  for (int p = 0; p < size; ++p) {
    blocks[p] = p == rank ? as_bytes(send, rank * block_bytes) : incoming + p * block_bytes;
  }
  reduce_blocks(recv, blocks, count, dtype, op);
}

void all_reduce(Transport& t, void* buf, size_t count, DType dtype, ReduceOp op,
                Deadline deadline) {
  const int size = t.transport_size(), rank = t.transport_rank();
  size_t bytes = 0;
  LOOM_CHECK(product(count, dtype_size(dtype), bytes), InvalidArgument,
             too_large("all_reduce's buffer (count x element size)", count, dtype_size(dtype)));
  if (size == 1) return;
  const size_t elem = dtype_size(dtype);
  auto begin = [&](int p) { return block_begin(count, size, p) * elem; };
  auto length = [&](int p) { return begin(p + 1) - begin(p); };
  const size_t own_bytes = length(rank);

  // Phase 1 (reduce_scatter): block p goes to rank p; rank p's copies of our block come back.
  char* incoming = t.scratch(own_bytes * size, "all_reduce");
  {
    std::vector<WorkPtr> recvs, sends;
    for (int step = 1; step < size; ++step) {
      const int from = (rank - step + size) % size;
      recvs.push_back(t.post_recv(incoming + from * own_bytes, own_bytes, from,
                                  kTagAllReduceScatter, "all_reduce", true));
    }
    for (int step = 1; step < size; ++step) {
      const int to = (rank + step) % size;
      sends.push_back(t.post_send(as_bytes(buf, begin(to)), length(to), to, kTagAllReduceScatter,
                                  "all_reduce"));
    }
    wait_all(sends, deadline);  // blocks p != rank are free to overwrite from here on
    wait_all(recvs, deadline);
    std::vector<const void*> blocks(size);
    for (int p = 0; p < size; ++p) {
      blocks[p] = p == rank ? as_bytes(buf, begin(rank)) : incoming + p * own_bytes;
    }
    reduce_blocks(as_bytes(buf, begin(rank)), blocks, own_bytes / elem, dtype, op);
  }
  // Phase 2 (all_gather): the reduced block r goes to everyone.
  std::vector<WorkPtr> recvs, sends;
  for (int step = 1; step < size; ++step) {
    const int from = (rank - step + size) % size;
    recvs.push_back(t.post_recv(as_bytes(buf, begin(from)), length(from), from, kTagAllReduceGather,
                                "all_reduce", true));
  }
  for (int step = 1; step < size; ++step) {
    sends.push_back(t.post_send(as_bytes(buf, begin(rank)), own_bytes, (rank + step) % size,
                                kTagAllReduceGather, "all_reduce"));
  }
  wait_all(sends, deadline);
  wait_all(recvs, deadline);
}

void barrier(Transport& t, Deadline deadline) {
  const int size = t.transport_size(), rank = t.transport_rank();
  for (int k = 1; k < size; k *= 2) {
    WorkPtr r = t.post_recv(nullptr, 0, (rank - k + size) % size, kTagBarrier, "barrier", true);
    WorkPtr s = t.post_send(nullptr, 0, (rank + k) % size, kTagBarrier, "barrier");
    wait_by(*s, deadline);
    wait_by(*r, deadline);
  }
}

Traffic traffic_all_to_all(int rank, int size, const size_t* send_bytes, const size_t* recv_bytes) {
  Traffic t;
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    t.bytes_sent += static_cast<int64_t>(send_bytes[p]);
    t.bytes_recv += static_cast<int64_t>(recv_bytes[p]);
    t.messages_sent += 1;
  }
  return t;
}

Traffic traffic_all_gather(int size, size_t bytes) {
  const int64_t others = size - 1;
  return {others * static_cast<int64_t>(bytes), others * static_cast<int64_t>(bytes), others};
}

Traffic traffic_reduce_scatter(int size, size_t count, DType dtype) {
  return traffic_all_gather(size, count * dtype_size(dtype));
}

Traffic traffic_all_reduce(int rank, int size, size_t count, DType dtype) {
  if (size == 1) return {};
  const int64_t elem = static_cast<int64_t>(dtype_size(dtype));
  const int64_t own =
      static_cast<int64_t>(block_begin(count, size, rank + 1) - block_begin(count, size, rank)) *
      elem;
  const int64_t rest = static_cast<int64_t>(count) * elem - own;
  const int64_t bytes = rest + (size - 1) * own;
  return {bytes, bytes, 2 * static_cast<int64_t>(size - 1)};
}

Traffic traffic_barrier(int size) {
  Traffic t;
  for (int k = 1; k < size; k *= 2) t.messages_sent += 1;
  return t;
}

void add_traffic(CommStats& stats, const Traffic& traffic) {
  stats.bytes_sent += traffic.bytes_sent;
  stats.bytes_recv += traffic.bytes_recv;
  stats.messages_sent += traffic.messages_sent;
}

}  // namespace loom::detail
