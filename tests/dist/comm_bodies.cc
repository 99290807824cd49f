// Communicator test bodies (see comm_bodies.h). Data are patterns of (source, destination,
// index), so a byte in the wrong place names where it came from; reduction inputs are small
// integers, exact in every dtype, so sums do not depend on the reduction order.
#include "dist/comm_bodies.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "loom/error.h"
#include "loom/timer.h"

namespace loom::test {
namespace {

using Bytes = std::vector<uint8_t>;

uint8_t pattern(int src, int dst, size_t i, int salt = 0) {
  return static_cast<uint8_t>(src * 131 + dst * 31 + i * 7 + salt * 17 + 1);
}

Bytes make_pattern(int src, int dst, size_t bytes, int salt = 0) {
  Bytes b(bytes);
  for (size_t i = 0; i < bytes; ++i) b[i] = pattern(src, dst, i, salt);
  return b;
}

// First index where `got` (at `at`) differs from the pattern, or -1.
long first_mismatch(const uint8_t* got, int src, int dst, size_t bytes, int salt = 0) {
  for (size_t i = 0; i < bytes; ++i) {
    if (got[i] != pattern(src, dst, i, salt)) return static_cast<long>(i);
  }
  return -1;
}

std::string where(const Communicator& c) {
  return c.backend() + " rank " + std::to_string(c.rank()) + " of " + std::to_string(c.size());
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// --- point to point ----------------------------------------------------------------------------

void p2p_sizes(Communicator& c) {
  const int n = c.size(), r = c.rank(), next = (r + 1) % n, prev = (r - 1 + n) % n;
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{7}, size_t{1001}, size_t{65537}}) {
    const Bytes out = make_pattern(r, next, bytes);
    Bytes in(bytes, 0xEE);
    WorkPtr recv = c.irecv(in.data(), bytes, prev, 1);
    WorkPtr send = c.isend(out.data(), bytes, next, 1);
    send->wait();
    recv->wait();
    EXPECT_TRUE(recv->test());
    EXPECT_EQ(first_mismatch(in.data(), prev, r, bytes), -1) << where(c) << " bytes " << bytes;
  }
  // A receive may be larger than its message; the bytes past the message stay untouched.
  const Bytes out = make_pattern(r, next, 5);
  Bytes in(8, 0xEE);
  WorkPtr recv = c.irecv(in.data(), in.size(), prev, 2);
  c.isend(out.data(), out.size(), next, 2)->wait();
  recv->wait();
  EXPECT_EQ(first_mismatch(in.data(), prev, r, 5), -1) << where(c);
  EXPECT_EQ(in[5], 0xEE);
  EXPECT_EQ(in[7], 0xEE);
  // To self.
  const Bytes self_out = make_pattern(r, r, 33);
  Bytes self_in(33);
  WorkPtr self_send = c.isend(self_out.data(), 33, r, 3);
  c.irecv(self_in.data(), 33, r, 3)->wait();
  self_send->wait();
  EXPECT_EQ(self_in, self_out) << where(c);
}

void p2p_order(Communicator& c) {
  const int n = c.size(), r = c.rank(), next = (r + 1) % n, prev = (r - 1 + n) % n;
  constexpr int kMessages = 6;
  // Messages of one (sender, receiver, tag) arrive in posting order; sizes differ on purpose.
  std::vector<Bytes> outs;
  std::vector<WorkPtr> sends;
  for (int i = 0; i < kMessages; ++i) outs.push_back(make_pattern(r, next, 10 + i, i));
  for (int i = 0; i < kMessages; ++i) sends.push_back(c.isend(outs[i].data(), 10 + i, next, 2));
  for (int i = 0; i < kMessages; ++i) {
    Bytes in(10 + kMessages, 0);
    c.irecv(in.data(), in.size(), prev, 2)->wait();
    EXPECT_EQ(first_mismatch(in.data(), prev, r, 10 + i, i), -1) << where(c) << " message " << i;
  }
  for (auto& s : sends) s->wait();
  // Tags are independent queues: receive tag 5 before tag 4 although 4 was sent first.
  const int64_t a = 1000 + r, b = 2000 + r;
  int64_t x = 0, y = 0;
  WorkPtr sa = c.isend(&a, sizeof a, next, 4);
  WorkPtr sb = c.isend(&b, sizeof b, next, 5);
  c.irecv(&y, sizeof y, prev, 5)->wait();
  c.irecv(&x, sizeof x, prev, 4)->wait();
  sa->wait();
  sb->wait();
  EXPECT_EQ(x, 1000 + prev) << where(c);
  EXPECT_EQ(y, 2000 + prev) << where(c);
}

void p2p_test_poll(Communicator& c) {
  const int n = c.size(), r = c.rank(), next = (r + 1) % n, prev = (r - 1 + n) % n;
  int64_t in = -1;
  const int64_t out = 7 * r + 1;
  WorkPtr recv = c.irecv(&in, sizeof in, prev, 11);
  // Nobody sends on tag 11 before the barrier.
  EXPECT_FALSE(recv->test()) << where(c);
  c.barrier();
  WorkPtr send = c.isend(&out, sizeof out, next, 11);
  const double deadline = now_s() + 10;
  while (!recv->test()) {
    ASSERT_LT(now_s(), deadline) << where(c) << ": test() never turned true";
    std::this_thread::yield();
  }
  send->wait();
  EXPECT_EQ(in, 7 * prev + 1) << where(c);
}

// After a Timeout or CommError every operation of the communicator and of its split tree throws
// CommError at once, naming the first error (a receive reused after a Timeout took the late
// peer's stale message and returned a wrong value without an error).
void expect_refused(Communicator& c, const std::string& first_error_part) {
  const double start = now_s();
  int64_t v = 0;
  std::vector<int64_t> all(static_cast<size_t>(c.size()));
  const std::vector<std::pair<const char*, std::function<void()>>> ops = {
      {"barrier", [&] { c.barrier(); }},
      {"all_gather", [&] { c.all_gather(&v, sizeof v, all.data()); }},
      {"all_reduce", [&] { c.all_reduce(&v, 1, DType::i64, ReduceOp::sum); }},
      {"isend", [&] { c.isend(&v, sizeof v, 0, 0); }},
      {"irecv", [&] { c.irecv(&v, sizeof v, 0, 0); }},
      {"split", [&] { c.split(0, 0); }}};
  for (const auto& [name, op] : ops) {
    try {
      op();
      ADD_FAILURE() << where(c) << ": " << name << " on a failed communicator did not throw";
    } catch (const Timeout& e) {
      ADD_FAILURE() << where(c) << ": " << name << " waited: " << e.what();
    } catch (const CommError& e) {
      EXPECT_TRUE(contains(e.what(), "failed earlier")) << e.what();
      EXPECT_TRUE(contains(e.what(), first_error_part)) << e.what();
      EXPECT_TRUE(contains(e.what(), "rank " + std::to_string(c.rank()))) << e.what();
    }
  }
  EXPECT_LT(now_s() - start, 1.0) << where(c) << ": refusing took time";
}

void p2p_errors(Communicator& c) {
  const int n = c.size(), r = c.rank(), next = (r + 1) % n, prev = (r - 1 + n) % n;
  // Bad arguments are refused at once, and leave the communicator usable.
  int64_t v = 0;
  EXPECT_THROW(c.isend(&v, sizeof v, n, 0), InvalidArgument);
  EXPECT_THROW(c.irecv(&v, sizeof v, -1, 0), InvalidArgument);
  EXPECT_THROW(c.isend(&v, sizeof v, next, -3), InvalidArgument);
  EXPECT_THROW(c.irecv(nullptr, 8, prev, 0), InvalidArgument);
  c.barrier();
  // A message longer than its receive fails on the receiver, naming both ranks. Every rank's
  // receive fails, so no rank uses the communicator after this but to see it refused.
  const Bytes out = make_pattern(r, next, 16);
  Bytes in(8);
  WorkPtr send = c.isend(out.data(), out.size(), next, 9);
  WorkPtr recv = c.irecv(in.data(), in.size(), prev, 9);
  try {
    recv->wait();
    ADD_FAILURE() << where(c) << ": a 16-byte message into an 8-byte receive did not fail";
  } catch (const CommError& e) {
    EXPECT_TRUE(contains(e.what(), "rank " + std::to_string(r))) << e.what();
    EXPECT_TRUE(contains(e.what(), "rank " + std::to_string(prev))) << e.what();
  }
  expect_refused(c, "rank " + std::to_string(prev));
}

void batch_ring(Communicator& c) {
  const int n = c.size(), r = c.rank(), next = (r + 1) % n, prev = (r - 1 + n) % n;
  constexpr size_t kBlock = 1003;
  // After step s a rank holds the block that started on rank r - s; after n steps its own.
  Bytes cur = make_pattern(r, 0, kBlock), nxt(kBlock);
  for (int step = 1; step <= n; ++step) {
    std::vector<P2POp> ops = {{P2POp::send, cur.data(), kBlock, next},
                              {P2POp::recv, nxt.data(), kBlock, prev}};
    for (auto& w : c.batch_p2p(ops)) w->wait();
    std::swap(cur, nxt);
    const int origin = ((r - step) % n + n) % n;
    EXPECT_EQ(first_mismatch(cur.data(), origin, 0, kBlock), -1) << where(c) << " step " << step;
  }
}

// --- collectives --------------------------------------------------------------------------------

void all_to_all_equal(Communicator& c) {
  const int n = c.size(), r = c.rank();
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{13}, size_t{4096}}) {
    Bytes send(n * bytes), recv(n * bytes, 0xEE);
    for (int p = 0; p < n; ++p) {
      for (size_t i = 0; i < bytes; ++i) send[p * bytes + i] = pattern(r, p, i);
    }
    c.all_to_all(send.data(), recv.data(), bytes);
    for (int p = 0; p < n; ++p) {
      EXPECT_EQ(first_mismatch(recv.data() + p * bytes, p, r, bytes), -1)
          << where(c) << " part from " << p << ", " << bytes << " bytes";
    }
  }
}

// Bytes rank `src` sends to rank `dst` in the uneven test: 0, 9, 18 or 27.
size_t uneven_part(int src, int dst) {
  return static_cast<size_t>((src * 3 + dst * 5) % 4) * 9;
}

void all_to_all_uneven(Communicator& c) {
  const int n = c.size(), r = c.rank();
  // Send parts laid out in reverse rank order with 3-byte gaps, receive parts in rank order with
  // 1-byte gaps: offsets, not packing, decide where bytes go, and gaps stay untouched.
  std::vector<size_t> sb(n), so(n), rb(n), ro(n);
  size_t send_total = 0, recv_total = 0;
  for (int p = n - 1; p >= 0; --p) {
    sb[p] = uneven_part(r, p);
    so[p] = send_total;
    send_total += sb[p] + 3;
  }
  for (int p = 0; p < n; ++p) {
    rb[p] = uneven_part(p, r);
    ro[p] = recv_total;
    recv_total += rb[p] + 1;
  }
  Bytes send(send_total, 0), recv(recv_total, 0xEE);
  for (int p = 0; p < n; ++p) {
    for (size_t i = 0; i < sb[p]; ++i) send[so[p] + i] = pattern(r, p, i);
  }
  c.all_to_all(send.data(), sb.data(), so.data(), recv.data(), rb.data(), ro.data());
  for (int p = 0; p < n; ++p) {
    EXPECT_EQ(first_mismatch(recv.data() + ro[p], p, r, rb[p]), -1)
        << where(c) << " part from " << p << ", " << rb[p] << " bytes";
    EXPECT_EQ(recv[ro[p] + rb[p]], 0xEE) << where(c) << " gap after part " << p;
  }
}

void all_gather(Communicator& c) {
  const int n = c.size(), r = c.rank();
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{13}, size_t{10000}}) {
    const Bytes send = make_pattern(r, 0, bytes);
    Bytes recv(n * bytes, 0xEE);
    c.all_gather(send.data(), bytes, recv.data());
    for (int p = 0; p < n; ++p) {
      EXPECT_EQ(first_mismatch(recv.data() + p * bytes, p, 0, bytes), -1)
          << where(c) << " block " << p << ", " << bytes << " bytes";
    }
    // In place: the own block already sits in the receive buffer.
    Bytes inplace(n * bytes, 0xEE);
    std::copy(send.begin(), send.end(), inplace.begin() + r * bytes);
    c.all_gather(inplace.data() + r * bytes, bytes, inplace.data());
    EXPECT_EQ(inplace, recv) << where(c) << " in place, " << bytes << " bytes";
  }
}

// A small integer, exact in f32/f64/i64, for element i of block `block` on rank `rank`.
int64_t value(int rank, int block, size_t i) {
  return static_cast<int64_t>(((rank + 1) * (i + 3) + block * 7) % 1000) - 300;
}

template <typename T>
DType dtype_of();
template <>
DType dtype_of<float>() {
  return DType::f32;
}
template <>
DType dtype_of<double>() {
  return DType::f64;
}
template <>
DType dtype_of<int64_t>() {
  return DType::i64;
}

template <typename T>
void reduce_scatter_typed(Communicator& c, ReduceOp op) {
  const int n = c.size(), r = c.rank();
  for (size_t count : {size_t{0}, size_t{1}, size_t{5}, size_t{1000}}) {
    std::vector<T> send(n * count), recv(count + 1, T(-77));
    for (int p = 0; p < n; ++p) {
      for (size_t i = 0; i < count; ++i) send[p * count + i] = T(value(r, p, i));
    }
    c.reduce_scatter(send.data(), recv.data(), count, dtype_of<T>(), op);
    for (size_t i = 0; i < count; ++i) {
      T want = T(value(0, r, i));
      for (int s = 1; s < n; ++s) {
        want =
            op == ReduceOp::sum ? T(want + T(value(s, r, i))) : std::max(want, T(value(s, r, i)));
      }
      if (recv[i] != want) {
        ADD_FAILURE() << where(c) << " count " << count << " element " << i << ": got " << recv[i]
                      << ", want " << want;
        break;
      }
    }
    EXPECT_EQ(recv[count], T(-77)) << where(c) << ": wrote past the block";
  }
}

void reduce_scatter(Communicator& c) {
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
    reduce_scatter_typed<float>(c, op);
    reduce_scatter_typed<double>(c, op);
    reduce_scatter_typed<int64_t>(c, op);
  }
}

template <typename T>
void all_reduce_typed(Communicator& c, ReduceOp op) {
  const int n = c.size(), r = c.rank();
  for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}, size_t{4099}}) {
    std::vector<T> buf(count);
    for (size_t i = 0; i < count; ++i) buf[i] = T(value(r, 0, i));
    c.all_reduce(buf.data(), count, dtype_of<T>(), op);
    for (size_t i = 0; i < count; ++i) {
      T want = T(value(0, 0, i));
      for (int s = 1; s < n; ++s) {
        want =
            op == ReduceOp::sum ? T(want + T(value(s, 0, i))) : std::max(want, T(value(s, 0, i)));
      }
      if (buf[i] != want) {
        ADD_FAILURE() << where(c) << " count " << count << " element " << i << ": got " << buf[i]
                      << ", want " << want;
        break;
      }
    }
  }
}

// A NaN on any one rank makes a max NaN on every rank, as a sum carries it: std::max(acc, NaN)
// kept acc on the local backend, and MPI_MAX leaves NaN unspecified, so the answer hung on which
// rank held the NaN. Each rank in turn holds it, in all_reduce and in reduce_scatter's blocks.
template <typename T>
void max_carries_nan_typed(Communicator& c) {
  const int n = c.size(), r = c.rank();
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (int holder = 0; holder < n; ++holder) {
    // Element 0 has no NaN (its max is n); element 1 is NaN on `holder`; element 2 is NaN on
    // `holder` and +inf on another rank.
    T buf[3] = {
        T(1 + r), r == holder ? nan : T(1),
        r == holder ? nan : (r == (holder + 1) % n ? std::numeric_limits<T>::infinity() : T(-1))};
    c.all_reduce(buf, 3, dtype_of<T>(), ReduceOp::max);
    EXPECT_EQ(buf[0], T(n)) << where(c) << ": holder " << holder;
    EXPECT_TRUE(std::isnan(buf[1]))
        << where(c) << ": all_reduce max lost rank " << holder << "'s NaN (got " << buf[1] << ")";
    EXPECT_TRUE(std::isnan(buf[2])) << where(c) << ": all_reduce max lost rank " << holder
                                    << "'s NaN beside an inf (got " << buf[2] << ")";
    std::vector<T> send(static_cast<size_t>(n) * 2), recv(2);
    for (int p = 0; p < n; ++p) {
      send[2 * p] = T(r);
      send[2 * p + 1] = r == holder ? nan : T(r);
    }
    c.reduce_scatter(send.data(), recv.data(), 2, dtype_of<T>(), ReduceOp::max);
    EXPECT_EQ(recv[0], T(n - 1)) << where(c) << ": holder " << holder;
    EXPECT_TRUE(std::isnan(recv[1])) << where(c) << ": reduce_scatter max lost rank " << holder
                                     << "'s NaN (got " << recv[1] << ")";
  }
}

void max_carries_nan(Communicator& c) {
  max_carries_nan_typed<float>(c);
  max_carries_nan_typed<double>(c);
}

// Inexact sums must still come out bitwise equal on every rank.
template <typename T>
void all_reduce_identical(Communicator& c) {
  const int n = c.size(), r = c.rank();
  constexpr size_t kCount = 777;
  std::vector<T> buf(kCount);
  for (size_t i = 0; i < kCount; ++i) buf[i] = T(std::sin(r * 1000.0 + i) * 1e3 + 1.0 / (i + 3));
  c.all_reduce(buf.data(), kCount, dtype_of<T>(), ReduceOp::sum);
  std::vector<T> all(n * kCount);
  c.all_gather(buf.data(), kCount * sizeof(T), all.data());
  for (int p = 0; p < n; ++p) {
    EXPECT_EQ(std::memcmp(all.data() + p * kCount, buf.data(), kCount * sizeof(T)), 0)
        << where(c) << ": all_reduce result differs from rank " << p;
  }
}

void all_reduce(Communicator& c) {
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
    all_reduce_typed<float>(c, op);
    all_reduce_typed<double>(c, op);
    all_reduce_typed<int64_t>(c, op);
  }
  all_reduce_identical<float>(c);
  all_reduce_identical<double>(c);
  // A ReduceOp or DType that does not exist (a cast integer) is refused on every rank before any
  // message: an unknown op acted as max.
  double x[1] = {1}, y[1] = {0};
  const ReduceOp bad_op = static_cast<ReduceOp>(7);
  const DType bad_type = static_cast<DType>(9);
  EXPECT_THROW(c.all_reduce(x, 1, DType::f64, bad_op), InvalidArgument);
  EXPECT_THROW(c.all_reduce(x, 1, bad_type, ReduceOp::sum), InvalidArgument);
  std::vector<double> send(static_cast<size_t>(c.size()), 1.0);
  EXPECT_THROW(c.reduce_scatter(send.data(), y, 1, DType::f64, bad_op), InvalidArgument);
  EXPECT_THROW(c.reduce_scatter(send.data(), y, 1, bad_type, ReduceOp::max), InvalidArgument);
  EXPECT_EQ(x[0], 1);
  c.barrier();  // nothing was posted: the group is usable
}

void barrier(Communicator& c) {
  // Rank 0 enters the second barrier late; nobody may leave it before rank 0 entered. Times come
  // from the monotonic clock, which all processes of one machine share.
  c.barrier();
  double entered = 0;
  if (c.rank() == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    entered = now_s();
  }
  c.barrier();
  const double left = now_s();
  std::vector<double> entered_all(c.size());
  c.all_gather(&entered, sizeof entered, entered_all.data());
  EXPECT_GE(left, entered_all[0]) << where(c) << " left the barrier before rank 0 entered it";
  for (int i = 0; i < 3; ++i) c.barrier();  // back to back
}

// --- split --------------------------------------------------------------------------------------

// The group's members as parent ranks, gathered through the group itself.
std::vector<int64_t> members_of(Communicator& group, int64_t parent_rank) {
  std::vector<int64_t> all(group.size());
  group.all_gather(&parent_rank, sizeof parent_rank, all.data());
  return all;
}

void split(Communicator& c) {
  const int n = c.size(), r = c.rank();
  // Two colors by parity, keys reverse the order, and the last rank (of 3 or more) opts out.
  auto color_of = [&](int p) { return (n > 2 && p == n - 1) ? -1 : p % 2; };
  auto sub = c.split(color_of(r), -r);
  // Point to point in the parent, posted now and finished after the group's own exchange on the
  // same tag: the two must not mix.
  const int64_t in_parent = 200000 + r;
  int64_t got_parent = -1;
  WorkPtr rp = c.irecv(&got_parent, sizeof got_parent, (r - 1 + n) % n, 0);
  WorkPtr sp = c.isend(&in_parent, sizeof in_parent, (r + 1) % n, 0);
  if (color_of(r) < 0) {
    EXPECT_EQ(sub, nullptr) << where(c);
  } else {
    ASSERT_NE(sub, nullptr) << where(c);
    std::vector<int64_t> want;
    for (int p = n - 1; p >= 0; --p) {
      if (color_of(p) == color_of(r)) want.push_back(p);
    }
    EXPECT_EQ(sub->size(), static_cast<int>(want.size())) << where(c);
    EXPECT_EQ(sub->backend(), c.backend());
    EXPECT_EQ(want[sub->rank()], r) << where(c);
    EXPECT_EQ(members_of(*sub, r), want) << where(c);
    int64_t sum = r;
    sub->all_reduce(&sum, 1, DType::i64, ReduceOp::sum);
    int64_t want_sum = 0;
    for (int64_t p : want) want_sum += p;
    EXPECT_EQ(sum, want_sum) << where(c);

    const int sn = sub->size(), sr = sub->rank();
    const int64_t in_sub = 100000 + r;
    int64_t got_sub = -1;
    WorkPtr rs = sub->irecv(&got_sub, sizeof got_sub, (sr - 1 + sn) % sn, 0);
    sub->isend(&in_sub, sizeof in_sub, (sr + 1) % sn, 0)->wait();
    rs->wait();
    EXPECT_EQ(got_sub, 100000 + want[(sr - 1 + sn) % sn]) << where(c);

    // Nested split: pairs by sub rank / 2; ties in key keep the parent order.
    auto pair = sub->split(sr / 2, 0);
    ASSERT_NE(pair, nullptr);
    std::vector<int64_t> want_pair;
    for (int q = (sr / 2) * 2; q < std::min(sn, (sr / 2) * 2 + 2); ++q)
      want_pair.push_back(want[q]);
    EXPECT_EQ(members_of(*pair, r), want_pair) << where(c);
  }
  sp->wait();
  rp->wait();
  EXPECT_EQ(got_parent, 200000 + (r - 1 + n) % n) << where(c);
  // Everyone in one group, keyed by rank: a copy of the parent.
  auto all = c.split(7, r);
  ASSERT_NE(all, nullptr);
  EXPECT_EQ(all->size(), n);
  EXPECT_EQ(all->rank(), r);
  all->barrier();
}

// --- timeouts and stats -------------------------------------------------------------------------

void timeout(Communicator& c) {
  const int n = c.size(), r = c.rank();
  if (r == 0) {
    const double saved = c.timeout_s();
    // Timeouts outside 0.001..1e9 s are refused, and the default stays: an infinite one made the
    // local backend's waits return at once and spin (the sender then hung), a NaN one waited
    // with no timeout at all, a negative one timed out every wait "after 0 s".
    const double inf = std::numeric_limits<double>::infinity();
    for (double bad : {inf, std::nan(""), -5.0, 0.0, 1e-4, 2e9}) {
      EXPECT_THROW(c.set_timeout_s(bad), InvalidArgument) << bad;
      EXPECT_EQ(c.timeout_s(), saved);
    }
    // The message gives the value that reads back as the one refused (it said "1e+09").
    try {
      c.set_timeout_s(1e9 * (1 + 1e-15));
      ADD_FAILURE() << "a timeout just above 1e9 s was taken";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(contains(e.what(), "from 0.001 to 1e9 seconds, got 1000000000.000001"))
          << e.what();
    }
  }
  if (n > 1 && r <= 1) {
    // A wait given NaN or inf is refused before it blocks; the largest timeout waits normally.
    int64_t v = 5;
    if (r == 0) {
      WorkPtr recv = c.irecv(&v, sizeof v, 1, 79);
      EXPECT_THROW(recv->wait(std::numeric_limits<double>::infinity()), InvalidArgument);
      EXPECT_THROW(recv->wait(std::nan("")), InvalidArgument);
      recv->wait(1e9);
      EXPECT_EQ(v, 42);
    } else {
      v = 42;
      c.isend(&v, sizeof v, 0, 79)->wait(1e9);
    }
  }
  c.barrier();  // refused timeouts leave the group usable
  int64_t x = r;
  c.all_reduce(&x, 1, DType::i64, ReduceOp::max);
  EXPECT_EQ(x, n - 1);
  // A receive nobody sends to times out after the communicator's default (wait() without an
  // argument), naming both ranks; then the communicator refuses everything, at once. The peer
  // stays alive meanwhile: the local backend fails a wait at once when its peer has returned, so
  // there rank 1 waits for rank 0 to return (a CommError saying so).
  const int peer = n > 1 ? 1 : 0;  // never sends on tag 77
  if (r == 0) {
    int64_t in = 0;
    c.set_timeout_s(0.3);
    WorkPtr recv = c.irecv(&in, sizeof in, peer, 77);
    const double start = now_s();
    try {
      recv->wait();
      ADD_FAILURE() << where(c) << ": a receive nobody sends to did not time out";
    } catch (const Timeout& e) {
      const double waited = now_s() - start;
      EXPECT_GE(waited, 0.29) << e.what();
      EXPECT_LT(waited, 5.0) << e.what();
      EXPECT_TRUE(contains(e.what(), "rank 0")) << e.what();
      EXPECT_TRUE(contains(e.what(), "rank " + std::to_string(peer))) << e.what();
    }
    EXPECT_THROW(recv->wait(), CommError);
    expect_refused(c, "timed out");
  } else if (r == 1 && c.backend() == "local") {
    int64_t in = 0;
    EXPECT_THROW(c.irecv(&in, sizeof in, 0, 80)->wait(), CommError);
  }
}

void stats(Communicator& c) {
  const int n = c.size(), r = c.rank(), next = (r + 1) % n, prev = (r - 1 + n) % n;
  CommStats& s = c.stats();
  auto check = [&](const CommStats& before, int64_t sent, int64_t recv, int64_t messages,
                   const char* what) {
    EXPECT_EQ(s.bytes_sent - before.bytes_sent, sent) << where(c) << " " << what;
    EXPECT_EQ(s.bytes_recv - before.bytes_recv, recv) << where(c) << " " << what;
    EXPECT_EQ(s.messages_sent - before.messages_sent, messages) << where(c) << " " << what;
    EXPECT_GE(s.wait_s, before.wait_s) << where(c) << " " << what;
  };
  CommStats before = s;
  Bytes out(100, 1), in(100);
  WorkPtr recv = c.irecv(in.data(), 100, prev, 21);
  c.isend(out.data(), 100, next, 21)->wait();
  recv->wait();
  check(before, 100, 100, 1, "p2p");

  before = s;
  Bytes gathered(n * 10);
  c.all_gather(out.data(), 10, gathered.data());
  check(before, (n - 1) * 10, (n - 1) * 10, n - 1, "all_gather");

  before = s;
  std::vector<size_t> sb(n), so(n), rb(n), ro(n);
  int64_t sent = 0, received = 0;
  for (int p = 0; p < n; ++p) {
    sb[p] = uneven_part(r, p);
    rb[p] = uneven_part(p, r);
    so[p] = p * 27;
    ro[p] = p * 27;
    if (p != r) {
      sent += sb[p];
      received += rb[p];
    }
  }
  Bytes a2a_send(n * 27), a2a_recv(n * 27);
  c.all_to_all(a2a_send.data(), sb.data(), so.data(), a2a_recv.data(), rb.data(), ro.data());
  check(before, sent, received, n - 1, "all_to_all");

  before = s;
  std::vector<float> rs_send(n * 3, 1.0f), rs_recv(3);
  c.reduce_scatter(rs_send.data(), rs_recv.data(), 3, DType::f32, ReduceOp::sum);
  check(before, (n - 1) * 12, (n - 1) * 12, n - 1, "reduce_scatter");

  before = s;
  std::vector<double> ar(10, 1.0);
  c.all_reduce(ar.data(), 10, DType::f64, ReduceOp::sum);
  const int64_t own = (10 / n + (r < 10 % n ? 1 : 0)) * 8;
  const int64_t ar_bytes = n == 1 ? 0 : (80 - own) + (n - 1) * own;
  check(before, ar_bytes, ar_bytes, 2 * (n - 1), "all_reduce");

  before = s;
  c.barrier();
  int64_t rounds = 0;
  for (int k = 1; k < n; k *= 2) ++rounds;
  check(before, 0, 0, rounds, "barrier");
}

}  // namespace

const std::vector<CommBody>& comm_bodies() {
  static const std::vector<CommBody> bodies = {
      {"p2p_sizes", p2p_sizes},
      {"p2p_order", p2p_order},
      {"p2p_test_poll", p2p_test_poll},
      {"p2p_errors", p2p_errors},
      {"batch_p2p_ring", batch_ring},
      {"all_to_all_equal", all_to_all_equal},
      {"all_to_all_uneven", all_to_all_uneven},
      {"all_gather", all_gather},
      {"reduce_scatter", reduce_scatter},
      {"all_reduce", all_reduce},
      {"max_carries_nan", max_carries_nan},
      {"barrier", barrier},
      {"split", split},
      {"timeout", timeout},
      {"stats", stats},
  };
  return bodies;
}

std::vector<MeshShape> mesh_factorisations(int world) {
  std::vector<MeshShape> shapes;
  for (int dp = 1; dp <= world; ++dp) {
    for (int tp = 1; dp * tp <= world; ++tp) {
      for (int uly = 1; dp * tp * uly <= world; ++uly) {
        if (world % (dp * tp * uly) == 0) shapes.push_back({dp, tp, uly, world / (dp * tp * uly)});
      }
    }
  }
  return shapes;
}

void check_mesh(Communicator& world, const MeshShape& shape) {
  const int w = world.rank();
  const int T = shape.tp, U = shape.ulysses, R = shape.ring;
  const int t = w % T, u = (w / T) % U, q = (w / (T * U)) % R, d = w / (T * U * R);
  Mesh mesh = build_mesh(world, shape);
  const std::string at = where(world) + " mesh dp=" + std::to_string(shape.dp) +
                         " tp=" + std::to_string(T) + " ulysses=" + std::to_string(U) +
                         " ring=" + std::to_string(R);
  EXPECT_EQ(mesh.tp_rank, t) << at;
  EXPECT_EQ(mesh.uly_rank, u) << at;
  EXPECT_EQ(mesh.ring_rank, q) << at;
  EXPECT_EQ(mesh.dp_rank, d) << at;
  EXPECT_EQ(mesh.cp_rank(), q * U + u) << at;
  auto rank_of = [&](int dd, int qq, int uu, int tt) { return ((dd * R + qq) * U + uu) * T + tt; };
  struct Group {
    const char* name;
    Communicator* comm;
    int rank;
    std::vector<int64_t> members;
  };
  std::vector<Group> groups = {{"tp", mesh.tp.get(), t, {}},
                               {"ulysses", mesh.ulysses.get(), u, {}},
                               {"ring", mesh.ring.get(), q, {}},
                               {"cp", mesh.cp.get(), q * U + u, {}},
                               {"dp", mesh.dp.get(), d, {}}};
  for (int i = 0; i < T; ++i) groups[0].members.push_back(rank_of(d, q, u, i));
  for (int i = 0; i < U; ++i) groups[1].members.push_back(rank_of(d, q, i, t));
  for (int i = 0; i < R; ++i) groups[2].members.push_back(rank_of(d, i, u, t));
  for (int j = 0; j < R * U; ++j) groups[3].members.push_back(rank_of(d, j / U, j % U, t));
  for (int i = 0; i < shape.dp; ++i) groups[4].members.push_back(rank_of(i, q, u, t));
  for (Group& g : groups) {
    ASSERT_NE(g.comm, nullptr) << at << " group " << g.name;
    EXPECT_EQ(g.comm->size(), static_cast<int>(g.members.size())) << at << " group " << g.name;
    EXPECT_EQ(g.comm->rank(), g.rank) << at << " group " << g.name;
    EXPECT_EQ(members_of(*g.comm, w), g.members) << at << " group " << g.name;
  }
}

}  // namespace loom::test
