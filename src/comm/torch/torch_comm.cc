// The torch backend (torch_comm.h): loom's Communicator over a c10d::ProcessGroup.
//
// A TorchComm is a view of one ProcessGroup: `members_` maps its ranks to ProcessGroup ranks and
// `group_id_` goes into the high bits of every wire tag, so that the communicators of one split
// tree never match each other's messages. The wire tag of (group g, tag t) is
//   g * 2^21 + t + kTagShift,
// where kTagShift lifts loom's negative collective tags (collectives.h) above zero. The root
// communicator is group 1; group 0 (wire tags below 2^21) stays free for the user's own
// send/recv on the same ProcessGroup. Split ids come from (parent id, split number, color):
// every member computes the same id without talking.
//
// A message is a send or recv of a 1-d uint8 tensor wrapping the caller's buffer (from_blob, no
// copy). A zero-byte message travels as one byte (some transports refuse empty tensors), so the
// matching of messages per (peer, tag) stays in posting order.
//
// Waits call c10d's Work::wait(timeout) with what is left of loom's deadline; any exception from
// the transport (a closed connection, a timeout) becomes CommError / Timeout naming this rank,
// the peer, the tag and the size.
#include "torch_comm.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <exception>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "../collectives.h"
#include "../front.h"
#include "../split.h"
#include "loom/error.h"
#include "loom/timer.h"

namespace loom {
namespace {

constexpr int kTagBits = 21;
constexpr int kTagShift = 8;  // collectives use tags -1 .. -6
constexpr int kMaxUserTag = (1 << kTagBits) - 1 - kTagShift;
constexpr int kMaxGroups = (INT_MAX >> kTagBits);  // group ids in [1, kMaxGroups]
// Group id 0 (wire tags below 2^21) is left to the user's own send/recv on the same group.
constexpr int kRootGroup = 1;

at::Tensor wrap(void* buf, size_t bytes, uint8_t* one_byte) {
  void* p = bytes == 0 ? one_byte : buf;
  const int64_t n = bytes == 0 ? 1 : static_cast<int64_t>(bytes);
  return at::from_blob(p, {n}, at::TensorOptions().dtype(at::kByte));
}

bool looks_like_timeout(const std::string& what) {
  return what.find("imed out") != std::string::npos || what.find("imeout") != std::string::npos;
}

class TorchComm;

// One posted send or receive.
class TorchWork final : public Work {
 public:
  TorchWork(TorchComm& comm, c10::intrusive_ptr<c10d::Work> work, bool is_send, int peer, int tag,
            size_t bytes, const char* op, std::unique_ptr<uint8_t> one_byte)
      : comm_(comm),
        work_(std::move(work)),
        is_send_(is_send),
        peer_(peer),
        tag_(tag),
        bytes_(bytes),
        op_(op),
        one_byte_(std::move(one_byte)) {}
  ~TorchWork() override;

  bool test() override;
  void wait(double timeout_s) override;

 private:
  std::string describe() const;
  void finish();
  bool test_once();
  void wait_for(double timeout);

  TorchComm& comm_;
  c10::intrusive_ptr<c10d::Work> work_;
  bool is_send_;
  int peer_, tag_;
  size_t bytes_;
  const char* op_;
  std::unique_ptr<uint8_t> one_byte_;  // the buffer of a zero-byte message
  bool done_ = false;
  bool failed_ = false;
};

class TorchComm final : public Communicator, public detail::Transport {
 public:
  // health: the tree's, for a split; none: a new tree (torch_communicator).
  TorchComm(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::vector<int> members, int rank,
            int group_id, double timeout_s, std::shared_ptr<detail::Health> health = nullptr)
      : Communicator(timeout_s),
        pg_(std::move(pg)),
        members_(std::move(members)),
        rank_(rank),
        group_id_(group_id),
        health_(health ? std::move(health)
                       : std::make_shared<detail::Health>("a new process group")) {
    root_ = group_id_ == kRootGroup;
  }

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  std::string backend() const override { return "torch"; }
  int transport_rank() const override { return rank_; }
  int transport_size() const override { return size(); }

  // "rank 3", or "rank 3 (torch rank 7)" in a split.
  std::string who(int r) const {
    std::string s = "rank " + std::to_string(r);
    if (!root_) s += " (torch rank " + std::to_string(members_[r]) + ")";
    return s;
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    alive("split");
    const detail::Deadline until = deadline(-1);
    const detail::SplitGroup g =
        health_->guard([&] { return detail::split_group(*this, color, key, until); });
    const int64_t seq = split_seq_++;
    if (color < 0) return nullptr;
    std::vector<int> members;  // torch ranks
    for (int p : g.members) members.push_back(members_[p]);
    // Children of one split have disjoint members, so they may share an id; children of
    // different splits (or parents) must not. The mix below is the same on every member.
    const uint64_t h =
        (static_cast<uint64_t>(group_id_) * 1000003u + static_cast<uint64_t>(seq) * 7919u +
         static_cast<uint64_t>(color) * 31u + 1u);
    const int id = 2 + static_cast<int>(h % static_cast<uint64_t>(kMaxGroups - 1));
    return std::make_unique<TorchComm>(pg_, std::move(members), g.new_rank, id, timeout_s_,
                                       health_);
  }

  WorkPtr isend(const void* buf, size_t bytes, int peer, int tag) override {
    alive("isend");
    detail::check_p2p("isend", who(rank_), size(), buf, bytes, peer, tag, kMaxUserTag);
    return health_->guard([&] { return post_send(buf, bytes, peer, tag, nullptr); });
  }

  WorkPtr irecv(void* buf, size_t bytes, int peer, int tag) override {
    alive("irecv");
    detail::check_p2p("irecv", who(rank_), size(), buf, bytes, peer, tag, kMaxUserTag);
    return health_->guard([&] { return post_recv(buf, bytes, peer, tag, nullptr, false); });
  }

  WorkPtr post_send(const void* buf, size_t bytes, int peer, int tag, const char* op) override {
    return post(true, const_cast<void*>(buf), bytes, peer, tag, op);
  }

  WorkPtr post_recv(void* buf, size_t bytes, int peer, int tag, const char* op, bool) override {
    return post(false, buf, bytes, peer, tag, op);
  }

  void all_to_all(const void* send, const size_t* send_bytes, const size_t* send_offsets,
                  void* recv, const size_t* recv_bytes, const size_t* recv_offsets,
                  double timeout_s) override {
    alive("all_to_all");
    detail::check_all_to_all(rank_, send_bytes, send_offsets, recv_bytes, recv_offsets);
    const detail::Deadline until = deadline(timeout_s);
    ScopedTimer timer(stats_.wait_s);
    health_->guard([&] {
      detail::all_to_all(*this, send, send_bytes, send_offsets, recv, recv_bytes, recv_offsets,
                         until);
    });
  }

  void all_gather(const void* send, size_t bytes, void* recv, double timeout_s) override {
    alive("all_gather");
    detail::check_buffers("all_gather", send, recv, bytes, "bytes");
    const detail::Deadline until = deadline(timeout_s);
    ScopedTimer timer(stats_.wait_s);
    health_->guard([&] { detail::all_gather(*this, send, bytes, recv, until); });
  }

  void reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                      double timeout_s) override {
    alive("reduce_scatter");
    detail::check_buffers("reduce_scatter", send, recv, count, "elements");
    detail::check_reduction("reduce_scatter", dtype, op);
    const detail::Deadline until = deadline(timeout_s);
    ScopedTimer timer(stats_.wait_s);
    health_->guard([&] { detail::reduce_scatter(*this, send, recv, count, dtype, op, until); });
  }

  void all_reduce(void* buf, size_t count, DType dtype, ReduceOp op, double timeout_s) override {
    alive("all_reduce");
    detail::check_buffers("all_reduce", buf, buf, count, "elements");
    detail::check_reduction("all_reduce", dtype, op);
    const detail::Deadline until = deadline(timeout_s);
    ScopedTimer timer(stats_.wait_s);
    health_->guard([&] { detail::all_reduce(*this, buf, count, dtype, op, until); });
  }

  void barrier(double timeout_s) override {
    alive("barrier");
    const detail::Deadline until = deadline(timeout_s);
    ScopedTimer timer(stats_.wait_s);
    health_->guard([&] { detail::barrier(*this, until); });
  }

  double timeout_for(double t) const { return resolve_timeout(t); }
  detail::Health& health() { return *health_; }
  // CommError at once when this communicator's tree failed earlier (detail::Health).
  void alive(const char* op) const {
    if (health_->failed()) health_->refuse(who(rank_), op);
  }
  std::string group_text() const {
    return "the torch group of " + std::to_string(size()) + " ranks";
  }

 private:
  detail::Deadline deadline(double timeout_s) const {
    const double limit = resolve_timeout(timeout_s);
    return {now_s() + limit, limit};
  }
  int wire_tag(int tag) const { return (group_id_ << kTagBits) + tag + kTagShift; }

  // Posts one send (or recv) of buf on the ProcessGroup: CommError naming both ranks when torch
  // refuses it; a send is booked in the stats when posted.
  WorkPtr post(bool send, void* buf, size_t bytes, int peer, int tag, const char* op) {
    auto one = std::make_unique<uint8_t>(0);
    std::vector<at::Tensor> t{wrap(buf, bytes, one.get())};
    c10::intrusive_ptr<c10d::Work> w;
    try {
      w = send ? pg_->send(t, members_[peer], wire_tag(tag))
               : pg_->recv(t, members_[peer], wire_tag(tag));
    } catch (const std::exception& e) {
      throw CommError(who(rank_) + ": posting " + (send ? "send to " : "recv from ") + who(peer) +
                          " failed: " + e.what(),
                      __FILE__, __LINE__);
    }
    if (send) {
      stats_.bytes_sent += static_cast<int64_t>(bytes);
      stats_.messages_sent += 1;
    }
    return std::make_unique<TorchWork>(*this, std::move(w), send, peer, tag, bytes, op,
                                       std::move(one));
  }

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::vector<int> members_;  // [group rank] -> ProcessGroup rank
  int rank_;
  int group_id_;
  std::shared_ptr<detail::Health> health_;  // shared with the splits of this communicator
  bool root_ = true;
  int64_t split_seq_ = 0;
};

std::string TorchWork::describe() const {
  std::ostringstream os;
  os << comm_.who(comm_.rank()) << ": ";
  if (op_) os << op_ << ": ";
  os << (is_send_ ? "send to " : "recv from ") << comm_.who(peer_);
  if (!op_) os << " (tag " << tag_ << ", " << bytes_ << " bytes)";
  return os.str();
}

void TorchWork::finish() {
  done_ = true;
  if (!is_send_) comm_.stats().bytes_recv += static_cast<int64_t>(bytes_);
}

bool TorchWork::test() {
  comm_.alive("test of a request");
  if (done_) return true;
  return comm_.health().guard([&] { return test_once(); });
}

bool TorchWork::test_once() {
  LOOM_CHECK(!failed_, CommError, describe() << " failed earlier");
  bool completed = false;
  try {
    completed = work_->isCompleted();
    if (completed && !work_->isSuccess()) work_->wait();  // rethrows the transport's error
  } catch (const std::exception& e) {
    failed_ = true;
    throw CommError(describe() + " failed: " + e.what(), __FILE__, __LINE__);
  }
  if (completed) finish();
  return completed;
}

void TorchWork::wait(double timeout_s) {
  comm_.alive("wait of a request");
  if (done_) return;
  const double timeout = comm_.timeout_for(timeout_s);
  comm_.health().guard([&] { wait_for(timeout); });
}

void TorchWork::wait_for(double timeout) {
  LOOM_CHECK(!failed_, CommError, describe() << " failed earlier");
  ScopedTimer timer(comm_.stats().wait_s);
  // c10d reads a zero timeout as "no timeout": wait at least 1 ms.
  const auto ms =
      std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(timeout * 1e3)));
  try {
    work_->wait(ms);
  } catch (const std::exception& e) {
    failed_ = true;
    const std::string what = e.what();
    std::ostringstream os;
    if (looks_like_timeout(what)) {
      os << describe() << " timed out after " << timeout << " s (" << comm_.group_text() << ")";
      throw Timeout(os.str(), __FILE__, __LINE__);
    }
    os << describe() << " failed (" << comm_.who(peer_) << " may have died): " << what;
    throw CommError(os.str(), __FILE__, __LINE__);
  }
  finish();
}

TorchWork::~TorchWork() {
  if (done_ || failed_) return;
  // The transport still owns the buffer: wait (bounded), and stop it where it can be stopped.
  try {
    wait(-1);
  } catch (...) {
    try {
      work_->abort();
    } catch (...) {
    }
  }
}

}  // namespace

std::unique_ptr<Communicator> torch_communicator(c10::intrusive_ptr<c10d::ProcessGroup> pg,
                                                 double timeout_s) {
  LOOM_CHECK(pg, InvalidArgument, "torch_communicator: the process group is null");
  const int n = pg->getSize();
  std::vector<int> members(n);
  for (int r = 0; r < n; ++r) members[r] = r;
  const int rank = pg->getRank();
  auto comm =
      std::make_unique<TorchComm>(std::move(pg), std::move(members), rank, kRootGroup,
                                  timeout_s < 0 ? Communicator::default_timeout_s() : timeout_s);
  return comm;
}

}  // namespace loom
