// The local backend: the ranks of a world are threads of one process.
//
// Each world keeps one inbox per receiving rank (a mutex, a condition variable and one channel
// per (source, tag) in use). A channel holds two FIFO queues: messages that arrived before their
// receive, and receives posted before their message. It exists only while it holds a message or
// a receive's Work refers to it; the last Work to go removes an empty channel (kept for ever, one
// per pair of ranks a collective touched, over 1 KB each, they made memory grow as P^2, and
// without bound over p2p tags). A send matches the oldest posted receive and copies straight
// into its buffer; otherwise it copies the bytes into a new message, so an isend is complete when
// it returns. A receive takes the oldest message, or queues itself and waits. Delayed messages
// (fault injection) carry a delivery time and are matched by the receiver once that time has
// passed; all sends of a delayed rank are delayed alike, so FIFO order per channel holds.
//
// Failure. All worlds made from one run_local call (the world and every split of it) share a
// Universe. When a rank's function throws, run_local poisons the universe and wakes every inbox
// of every world: waits then fail at once with CommError "rank R failed: <reason>". A wait also
// fails at once when its peer's thread has already returned without sending. Everything else is
// bounded by the wait's timeout. A rank that catches a Timeout or CommError and goes on finds its
// communicators failed (detail::Health, shared by the rank's world communicator and its splits):
// every later operation throws CommError at once, so no receive takes a stale message.
//
// Agreement. Every collective (barrier and split included) starts with an agreement over the
// world's shared memory, before it posts anything: each rank leaves what it called (the kind, the
// count, dtype and op of a reduction, all_gather's bytes, all_to_all's sizes per peer, and any
// fault of its own arguments, such as overlapping buffers) in the world's entry for its n-th
// collective, and waits until every rank has; the last to arrive compares them once, and every
// rank throws the same InvalidArgument when they differ (a reduction with another dtype of the
// same bytes, or sum against max, used to return different answers on different ranks without an
// error; barrier against all_gather, a timeout). Nothing has been posted then, so the
// communicator stays usable. The wait is bounded like any other (Timeout, or CommError at once
// when a rank failed or returned without calling it); collectives wait for every rank anyway.
// It sends no message: CommStats and fault injection's message counts are as before.
//
// Fault injection (FaultPlan): ops are counted per world rank over all its communicators (every
// isend, irecv, collective, barrier and split call is one op); sends are counted per world rank
// over all messages, those inside collectives included.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../collectives.h"
#include "../front.h"
#include "../split.h"
#include "loom/comm.h"
#include "loom/error.h"
#include "loom/timer.h"

namespace loom {
namespace {

// Per world rank; each entry is touched only by that rank's thread.
struct RankFaultState {
  int64_t ops = 0;
  int64_t sends = 0;
  bool killed = false;
};

struct PendingRecv {
  void* buf = nullptr;
  size_t capacity = 0;
  bool exact = false;
  bool done = false;
  bool bad_size = false;
  size_t received = 0;
};

struct Message {
  std::unique_ptr<char[]> data;
  size_t bytes = 0;
  size_t capacity = 0;    // of data
  double deliver_at = 0;  // now_s() time; 0: at once
};

// Message buffers for reuse: a fresh large allocation costs a page fault per 4 KiB, which is
// more than the copy itself. Small buffers come from malloc directly.
class BufferPool {
 public:
  std::unique_ptr<char[]> acquire(size_t bytes, size_t& capacity) {
    if (bytes >= kMinPooled) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.lower_bound(bytes);
      if (it != free_.end() && it->first <= 2 * bytes) {
        capacity = it->first;
        cached_ -= capacity;
        auto buf = std::move(it->second);
        free_.erase(it);
        return buf;
      }
    }
    capacity = std::max<size_t>(bytes, 1);
    return std::unique_ptr<char[]>(new char[capacity]);
  }

  void release(std::unique_ptr<char[]> buf, size_t capacity) {
    if (capacity < kMinPooled) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (cached_ + capacity > kMaxCached) return;
    cached_ += capacity;
    free_.emplace(capacity, std::move(buf));
  }

 private:
  static constexpr size_t kMinPooled = size_t{64} << 10;
  static constexpr size_t kMaxCached = size_t{512} << 20;
  std::mutex mu_;  // a leaf: taken under an inbox lock, never the other way round
  std::multimap<size_t, std::unique_ptr<char[]>> free_;
  size_t cached_ = 0;
};

// Channels alive now, in every world (detail::local_channels_alive, for the tests).
std::atomic<int64_t> g_channels_alive{0};

// Lists, not deques: an empty std::deque still allocates about 600 bytes, and a collective over
// P ranks has P * (P - 1) channels alive at once.
struct Channel {
  Channel() { g_channels_alive.fetch_add(1, std::memory_order_relaxed); }
  ~Channel() { g_channels_alive.fetch_sub(1, std::memory_order_relaxed); }
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  std::list<Message> messages;
  std::list<std::shared_ptr<PendingRecv>> recvs;
  int works = 0;  // live LocalRecvWorks that refer to this channel
};

struct Inbox {
  using Channels = std::map<std::pair<int, int>, Channel>;  // (source group rank, tag)
  std::mutex mu;
  std::condition_variable cv;
  Channels channels;  // map nodes never move: a Work keeps its channel's iterator

  // Removes the channel once nothing is queued on it and no Work refers to it (lock held). A
  // posted receive always has its Work, so works == 0 means no receive is queued either.
  void drop_if_idle(Channels::iterator it) {
    if (it->second.works == 0 && it->second.messages.empty()) channels.erase(it);
  }
};

class World;

// What one rank called, for the agreement at the start of a collective.
struct CallSig {
  const char* op = "";  // "all_gather", "barrier", ...
  int dtype = -1;       // reductions: DType
  int reduce = -1;      // reductions: ReduceOp
  uint64_t count = 0;   // all_gather: bytes; reduce_scatter, all_reduce: elements
  std::vector<size_t> send_bytes, recv_bytes;  // all_to_all: this rank's sizes per peer
  std::string problem;  // this rank's own arguments are wrong (overlapping buffers, ...)
};

// The calls of one collective (by its number on the communicator), until every rank has taken
// the verdict.
struct Agreement {
  // Under World::agree_mu_ until decided:
  std::vector<CallSig> calls;  // by group rank
  std::vector<char> arrived;
  int count = 0;  // ranks arrived
  // Written once, before `decided`; read without the lock after it.
  std::string verdict;  // empty: the calls agree
  std::atomic<bool> decided{false};
  std::atomic<int> left{0};  // ranks that have not taken the verdict yet
};

class Universe {
 public:
  Universe(int size, const FaultPlan& faults)
      : size_(size), faults_(faults), fault_state_(size), finished_(new std::atomic<bool>[size]) {
    for (int r = 0; r < size; ++r) finished_[r].store(false);
  }

  int size() const { return size_; }
  const FaultPlan& faults() const { return faults_; }
  RankFaultState& fault_state(int world_rank) { return fault_state_[world_rank]; }
  BufferPool& pool() { return pool_; }

  bool poisoned() const { return poisoned_.load(std::memory_order_acquire); }
  // Valid once poisoned() is true (written once, before the flag).
  int failed_rank() const { return failed_rank_; }
  const std::string& reason() const { return reason_; }

  // Marks the universe failed because of `world_rank`; the first call wins. Wakes every wait.
  void poison(int world_rank, const std::string& reason);
  void mark_finished(int world_rank);
  bool finished(int world_rank) const { return finished_[world_rank].load(); }
  // Fault injection: what was dropped, so that the timeouts it causes can say why.
  void note_drop(const std::string& what) {
    std::lock_guard<std::mutex> lock(drop_mu_);
    dropped_ = what;
  }
  std::string dropped() {
    std::lock_guard<std::mutex> lock(drop_mu_);
    return dropped_;
  }
  void add_world(const std::shared_ptr<World>& world);

 private:
  void wake_all_locked();

  std::mutex drop_mu_;
  std::string dropped_;
  const int size_;
  const FaultPlan faults_;
  std::vector<RankFaultState> fault_state_;
  BufferPool pool_;
  std::unique_ptr<std::atomic<bool>[]> finished_;
  std::atomic<bool> poisoned_{false};
  int failed_rank_ = -1;
  std::string reason_;
  std::mutex mu_;  // guards poisoning and worlds_
  std::vector<std::weak_ptr<World>> worlds_;
};

class World {
 public:
  World(std::shared_ptr<Universe> universe, std::vector<int> members)
      : universe_(std::move(universe)), members_(std::move(members)) {
    for (size_t i = 0; i < members_.size(); ++i) inboxes_.push_back(std::make_unique<Inbox>());
    is_root_ = true;
    for (size_t i = 0; i < members_.size(); ++i) is_root_ = is_root_ && members_[i] == int(i);
    is_root_ = is_root_ && int(members_.size()) == universe_->size();
  }

  Universe& universe() { return *universe_; }
  int size() const { return static_cast<int>(members_.size()); }
  int world_rank(int group_rank) const { return members_[group_rank]; }
  Inbox& inbox(int group_rank) { return *inboxes_[group_rank]; }

  // "rank 3", or "rank 3 (world rank 7)" in a split.
  std::string who(int group_rank) const {
    std::string s = "rank " + std::to_string(group_rank);
    if (!is_root_) s += " (world rank " + std::to_string(members_[group_rank]) + ")";
    return s;
  }

  void wake() {
    for (auto& box : inboxes_) {
      std::lock_guard<std::mutex> lock(box->mu);
      box->cv.notify_all();
    }
  }

  // Leaves `call`, this rank's collective number `seq`, and waits until every rank of this world
  // has left its own (or the deadline: Timeout; a failed or returned rank: CommError). Returns
  // "" when the calls agree, else what differs: the same text on every rank. `timeout` is for
  // the message.
  std::string agree(int rank, int64_t seq, CallSig call, double deadline, double timeout);

  // The sub-world of split number `seq` and `color`: the first member to arrive creates it,
  // the last one to take it removes the entry.
  std::shared_ptr<World> join_split(int64_t seq, int color, const std::vector<int>& members) {
    std::shared_ptr<World> world;
    {
      std::lock_guard<std::mutex> lock(split_mu_);
      SplitEntry& entry = splits_[{seq, color}];
      if (!entry.world) {
        entry.world = std::make_shared<World>(universe_, members);
        entry.remaining = static_cast<int>(members.size());
      }
      world = entry.world;
      if (--entry.remaining == 0) splits_.erase({seq, color});
    }
    universe_->add_world(world);
    return world;
  }

 private:
  struct SplitEntry {
    std::shared_ptr<World> world;
    int remaining = 0;
  };
  // What differs among the calls (every rank's); "" when they agree.
  std::string disagreement(const std::vector<CallSig>& calls) const;
  std::string describe(const CallSig& c) const;

  std::shared_ptr<Universe> universe_;
  std::vector<int> members_;  // world rank of each group rank
  std::vector<std::unique_ptr<Inbox>> inboxes_;
  bool is_root_ = false;
  std::mutex split_mu_;
  std::map<std::pair<int64_t, int>, SplitEntry> splits_;
  // Guards agreements_ and an undecided entry; taken alone or after an inbox's lock, never
  // before one. A rank waits for the verdict on its own inbox's lock and condition variable,
  // which the deciding rank, poisoning and a rank's return notify.
  std::mutex agree_mu_;
  std::map<int64_t, Agreement> agreements_;  // by collective number; nodes never move
};

std::string World::describe(const CallSig& c) const {
  static const char* const kDtypes[] = {"f32", "f64", "i64"};
  std::ostringstream os;
  os << c.op;
  if (c.dtype >= 0) {
    os << " of " << c.count << " " << kDtypes[c.dtype] << " elements"
       << (std::strcmp(c.op, "reduce_scatter") == 0 ? " per rank" : "") << " ("
       << (c.reduce == static_cast<int>(ReduceOp::sum) ? "sum" : "max") << ")";
  } else if (std::strcmp(c.op, "all_gather") == 0) {
    os << " of " << c.count << " bytes";
  }
  return os.str();
}

std::string World::disagreement(const std::vector<CallSig>& calls) const {
  const int n = size();
  for (int p = 0; p < n; ++p) {
    if (!calls[p].problem.empty()) return "on " + who(p) + ", " + calls[p].problem;
  }
  const CallSig& first = calls[0];
  for (int p = 1; p < n; ++p) {
    const CallSig& c = calls[p];
    if (std::strcmp(c.op, first.op) != 0 || c.dtype != first.dtype || c.reduce != first.reduce ||
        c.count != first.count) {
      return who(0) + " called " + describe(first) + " but " + who(p) + " " + describe(c) +
             "; every rank of a communicator must make the same collective calls in the same "
             "order, with the same count, dtype and op (loom/comm.h)";
    }
  }
  if (std::strcmp(first.op, "all_to_all") == 0) {
    for (int r = 0; r < n; ++r) {
      for (int p = 0; p < n; ++p) {
        const size_t sent = calls[r].send_bytes[p], expected = calls[p].recv_bytes[r];
        if (sent == expected) continue;
        std::ostringstream os;
        os << who(r) << " sends " << sent << " bytes to " << who(p) << ", which expects "
           << expected << " from it; send_bytes[p] on rank r must equal "
           << "recv_bytes[r] on rank p (loom/comm.h)";
        return os.str();
      }
    }
  }
  return "";
}

std::string World::agree(int rank, int64_t seq, CallSig call, double deadline, double timeout) {
  const char* op = call.op;
  Agreement* a = nullptr;
  bool last = false;
  {
    std::lock_guard<std::mutex> lock(agree_mu_);
    a = &agreements_[seq];
    if (a->calls.empty() && a->count == 0) {
      a->calls.resize(members_.size());
      a->arrived.assign(members_.size(), 0);
      a->left.store(size());
    }
    a->calls[rank] = std::move(call);
    a->arrived[rank] = 1;
    if (++a->count == size()) {
      a->verdict = disagreement(a->calls);
      a->calls = {};  // the sizes per peer of all_to_all: P^2 of them
      a->decided.store(true, std::memory_order_release);
      last = true;
    }
  }
  if (last) {
    // Each rank waits on its own inbox (one lock per rank: 3000 ranks woken through one lock
    // took twice as long as their barrier).
    for (auto& box : inboxes_) {
      std::lock_guard<std::mutex> lock(box->mu);
      box->cv.notify_all();
    }
  } else {
    Inbox& box = inbox(rank);
    std::unique_lock<std::mutex> lock(box.mu);
    while (!a->decided.load(std::memory_order_acquire)) {
      // Every exit below leaves this rank's call behind and the entry stays: the communicator
      // fails with the Timeout or CommError (detail::Health), so no later call meets it.
      if (universe_->poisoned()) {
        throw CommError(who(rank) + ": " + op + " aborted: rank " +
                            std::to_string(universe_->failed_rank()) +
                            " failed: " + universe_->reason(),
                        __FILE__, __LINE__);
      }
      std::string missing;
      int missing_count = 0, returned = -1;
      {
        std::lock_guard<std::mutex> agree_lock(agree_mu_);  // after box.mu, as nowhere else
        for (int p = 0; p < size() && returned < 0; ++p) {
          if (a->arrived[p]) continue;
          if (universe_->finished(members_[p])) returned = p;
          if (++missing_count <= 8) missing += (missing.empty() ? "" : ", ") + who(p);
        }
      }
      // A message lost by fault injection shows up here too (its receiver never gets to this
      // collective): named as the receives name it.
      const std::string dropped = universe_->dropped();
      const std::string note = dropped.empty() ? "" : " (" + dropped + ")";
      if (returned >= 0) {
        throw CommError(who(rank) + ": " + op + " can never complete: " + who(returned) +
                            " has returned without calling it" + note,
                        __FILE__, __LINE__);
      }
      const double now = now_s();
      if (now >= deadline) {
        std::ostringstream os;
        os << who(rank) << ": " << op << " timed out after " << timeout << " s waiting for "
           << missing << (missing_count > 8 ? " and others" : "") << " to call it" << note;
        throw Timeout(os.str(), __FILE__, __LINE__);
      }
      box.cv.wait_for(lock, std::chrono::duration<double>(deadline - now));
    }
  }
  std::string verdict = a->verdict;
  if (a->left.fetch_sub(1) == 1) {
    std::lock_guard<std::mutex> lock(agree_mu_);
    agreements_.erase(seq);
  }
  return verdict;
}

void Universe::poison(int world_rank, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  if (poisoned_.load()) return;
  failed_rank_ = world_rank;
  reason_ = reason;
  poisoned_.store(true, std::memory_order_release);
  wake_all_locked();
}

void Universe::mark_finished(int world_rank) {
  finished_[world_rank].store(true);
  std::lock_guard<std::mutex> lock(mu_);
  wake_all_locked();
}

void Universe::add_world(const std::shared_ptr<World>& world) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& w : worlds_) {
    if (w.lock() == world) return;
  }
  std::erase_if(worlds_, [](const std::weak_ptr<World>& w) { return w.expired(); });
  worlds_.push_back(world);
}

void Universe::wake_all_locked() {
  for (const auto& w : worlds_) {
    if (auto world = w.lock()) world->wake();
  }
}

// Copies a message into a posted receive (inbox lock held).
void deliver(PendingRecv& recv, const char* data, size_t bytes) {
  recv.received = bytes;
  if (bytes > recv.capacity || (recv.exact && bytes != recv.capacity)) {
    recv.bad_size = true;
  } else if (bytes > 0) {
    std::memcpy(recv.buf, data, bytes);
  }
  recv.done = true;
}

// Matches queued messages whose time has come with posted receives (inbox lock held).
void progress(Channel& ch, double now, BufferPool& pool) {
  while (!ch.recvs.empty() && !ch.messages.empty() && ch.messages.front().deliver_at <= now) {
    Message& m = ch.messages.front();
    deliver(*ch.recvs.front(), m.data.get(), m.bytes);
    pool.release(std::move(m.data), m.capacity);
    ch.recvs.pop_front();
    ch.messages.pop_front();
  }
}

class DoneWork final : public Work {
 public:
  bool test() override { return true; }
  void wait(double) override {}
};

class LocalComm;

class LocalRecvWork final : public Work {
 public:
  // Counts itself in the channel's works (inbox lock held).
  LocalRecvWork(LocalComm& comm, std::shared_ptr<World> world, Inbox::Channels::iterator channel,
                int peer, int tag, const char* op, std::shared_ptr<PendingRecv> recv);
  ~LocalRecvWork() override;
  bool test() override;
  void wait(double timeout_s) override;

 private:
  // Throws when the receive can never complete (inbox lock held, receive not done).
  void check_alive(const Channel& ch) const;
  std::string dropped_note() const;
  // Books the received bytes once; throws if the message did not fit.
  void finish();
  bool test_once();
  void wait_until(double timeout);
  std::string describe() const;

  LocalComm& comm_;
  std::shared_ptr<World> world_;
  Inbox& inbox_;
  Inbox::Channels::iterator it_;
  Channel& channel_;
  int peer_, tag_;
  const char* op_;
  std::shared_ptr<PendingRecv> recv_;
  bool booked_ = false;
};

class LocalComm final : public Communicator, public detail::Transport {
 public:
  // health: the tree's, for a split; none: a new tree (a world communicator).
  LocalComm(std::shared_ptr<World> world, int rank, double timeout_s,
            std::shared_ptr<detail::Health> health = nullptr)
      : Communicator(timeout_s),
        world_(std::move(world)),
        rank_(rank),
        health_(health ? std::move(health) : std::make_shared<detail::Health>("a new run_local")) {}

  int rank() const override { return rank_; }
  int size() const override { return world_->size(); }
  std::string backend() const override { return "local"; }
  int transport_rank() const override { return rank_; }
  int transport_size() const override { return world_->size(); }

  std::unique_ptr<Communicator> split(int color, int key) override {
    alive("split");
    const detail::Deadline until = deadline(-1);
    return health_->guard([&]() -> std::unique_ptr<Communicator> {
      tick("split");
      CallSig call;
      call.op = "split";
      agree(std::move(call), until.at, -1);
      const detail::SplitGroup g = detail::split_group(*this, color, key, until);
      const int64_t seq = split_seq_++;
      if (color < 0) return nullptr;
      std::vector<int> members;  // world ranks
      for (int p : g.members) members.push_back(world_->world_rank(p));
      auto sub = world_->join_split(seq, color, members);
      return std::make_unique<LocalComm>(std::move(sub), g.new_rank, timeout_s_, health_);
    });
  }

  WorkPtr isend(const void* buf, size_t bytes, int peer, int tag) override {
    alive("isend");
    check_p2p("isend", buf, bytes, peer, tag);
    return health_->guard([&] {
      tick("isend");
      return post_send(buf, bytes, peer, tag, nullptr);
    });
  }

  WorkPtr irecv(void* buf, size_t bytes, int peer, int tag) override {
    alive("irecv");
    check_p2p("irecv", buf, bytes, peer, tag);
    return health_->guard([&] {
      tick("irecv");
      return post_recv(buf, bytes, peer, tag, nullptr, false);
    });
  }

  // Receives first: a send that finds its receive posted copies once, straight into it.
  std::vector<WorkPtr> batch_p2p(const std::vector<P2POp>& ops) override {
    // Every kind checked before anything is posted: another value left its slot null, and the
    // caller's wait crashed on it.
    detail::check_p2p_kinds(ops);
    std::vector<WorkPtr> works(ops.size());
    for (P2POp::Kind pass : {P2POp::recv, P2POp::send}) {
      for (size_t i = 0; i < ops.size(); ++i) {
        const P2POp& op = ops[i];
        if (op.kind != pass) continue;
        works[i] = pass == P2POp::recv ? irecv(op.buf, op.bytes, op.peer, op.tag)
                                       : isend(op.buf, op.bytes, op.peer, op.tag);
      }
    }
    return works;
  }

  WorkPtr post_send(const void* buf, size_t bytes, int peer, int tag, const char* op) override {
    Universe& u = world_->universe();
    const int me = world_->world_rank(rank_);
    const FaultPlan& f = u.faults();
    const int64_t index = u.fault_state(me).sends++;
    stats_.bytes_sent += static_cast<int64_t>(bytes);
    stats_.messages_sent += 1;
    if (f.drop_rank == me && index == f.drop_at_op) {
      u.note_drop("fault injection dropped a message from world rank " + std::to_string(me) +
                  " to world rank " + std::to_string(world_->world_rank(peer)));
      return std::make_unique<DoneWork>();
    }
    const double deliver_at = f.delay_rank == me ? now_s() + f.delay_ms * 1e-3 : 0.0;

    Inbox& box = world_->inbox(peer);
    const char* data = static_cast<const char*>(buf);
    {
      std::lock_guard<std::mutex> lock(box.mu);
      // No channel, no receive posted: find, not [], which would leave an empty one behind.
      const auto it = box.channels.find({rank_, tag});
      Channel* ch = it == box.channels.end() ? nullptr : &it->second;
      if (ch && deliver_at == 0 && ch->messages.empty() && !ch->recvs.empty()) {
        // Straight into the posted receive; its Work still refers to the channel, which stays.
        deliver(*ch->recvs.front(), data, bytes);
        ch->recvs.pop_front();
        box.cv.notify_all();
        return std::make_unique<DoneWork>();
      }
    }
    // No receive waiting: copy outside the lock, then queue (or match one posted meanwhile).
    Message m;
    m.bytes = bytes;
    m.deliver_at = deliver_at;
    try {
      m.data = u.pool().acquire(bytes, m.capacity);
    } catch (const std::bad_alloc&) {  // std::bad_array_new_length included
      std::ostringstream os;
      os << world_->who(rank_) << ": " << (op ? op : "isend") << ": send to " << world_->who(peer)
         << ": could not allocate " << bytes << " bytes to hold the message until its receive is "
         << "posted (out of memory); post the receive first or send less";
      throw OutOfMemory(os.str(), __FILE__, __LINE__);
    }
    if (bytes > 0) std::memcpy(m.data.get(), data, bytes);
    {
      std::lock_guard<std::mutex> lock(box.mu);
      Channel& ch = box.channels[{rank_, tag}];
      ch.messages.push_back(std::move(m));
      progress(ch, now_s(), u.pool());
      box.cv.notify_all();
    }
    return std::make_unique<DoneWork>();
  }

  WorkPtr post_recv(void* buf, size_t bytes, int peer, int tag, const char* op,
                    bool exact) override {
    auto recv = std::make_shared<PendingRecv>();
    recv->buf = buf;
    recv->capacity = bytes;
    recv->exact = exact;
    Inbox& box = world_->inbox(rank_);
    std::lock_guard<std::mutex> lock(box.mu);
    const auto it = box.channels.try_emplace({peer, tag}).first;
    WorkPtr work;
    try {
      work = std::make_unique<LocalRecvWork>(*this, world_, it, peer, tag, op, recv);
    } catch (...) {
      box.drop_if_idle(it);
      throw;
    }
    // The Work exists first, so the receive is never queued without one to cancel it.
    it->second.recvs.push_back(std::move(recv));
    progress(it->second, now_s(), world_->universe().pool());
    return work;
  }

  void all_to_all(const void* send, const size_t* send_bytes, const size_t* send_offsets,
                  void* recv, const size_t* recv_bytes, const size_t* recv_offsets,
                  double timeout_s) override {
    alive("all_to_all");
    detail::check_all_to_all(rank_, send_bytes, send_offsets, recv_bytes, recv_offsets);
    const detail::Deadline until = deadline(timeout_s);
    health_->guard([&] {
      tick("all_to_all");
      CallSig call;
      call.op = "all_to_all";
      call.send_bytes.assign(send_bytes, send_bytes + size());
      call.recv_bytes.assign(recv_bytes, recv_bytes + size());
      call.problem = detail::all_to_all_overlap(size(), send, send_bytes, send_offsets, recv,
                                                recv_bytes, recv_offsets);
      agree(std::move(call), until.at, timeout_s);
      detail::all_to_all(*this, send, send_bytes, send_offsets, recv, recv_bytes, recv_offsets,
                         until);
    });
  }

  void all_gather(const void* send, size_t bytes, void* recv, double timeout_s) override {
    alive("all_gather");
    detail::check_buffers("all_gather", send, recv, bytes, "bytes");
    const detail::Deadline until = deadline(timeout_s);
    health_->guard([&] {
      tick("all_gather");
      CallSig call;
      call.op = "all_gather";
      call.count = bytes;
      call.problem = detail::all_gather_overlap(size(), rank_, send, bytes, recv);
      agree(std::move(call), until.at, timeout_s);
      detail::all_gather(*this, send, bytes, recv, until);
    });
  }

  void reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                      double timeout_s) override {
    alive("reduce_scatter");
    detail::check_buffers("reduce_scatter", send, recv, count, "elements");
    detail::check_reduction("reduce_scatter", dtype, op);
    const detail::Deadline until = deadline(timeout_s);
    health_->guard([&] {
      tick("reduce_scatter");
      agree(reduction("reduce_scatter", count, dtype, op,
                      detail::reduce_scatter_overlap(size(), send, recv, count, dtype)),
            until.at, timeout_s);
      detail::reduce_scatter(*this, send, recv, count, dtype, op, until);
    });
  }

  void all_reduce(void* buf, size_t count, DType dtype, ReduceOp op, double timeout_s) override {
    alive("all_reduce");
    detail::check_buffers("all_reduce", buf, buf, count, "elements");
    detail::check_reduction("all_reduce", dtype, op);
    const detail::Deadline until = deadline(timeout_s);
    health_->guard([&] {
      tick("all_reduce");
      agree(
          reduction("all_reduce", count, dtype, op, detail::all_reduce_size_problem(count, dtype)),
          until.at, timeout_s);
      detail::all_reduce(*this, buf, count, dtype, op, until);
    });
  }

  void barrier(double timeout_s) override {
    alive("barrier");
    const detail::Deadline until = deadline(timeout_s);
    health_->guard([&] {
      tick("barrier");
      CallSig call;
      call.op = "barrier";
      agree(std::move(call), until.at, timeout_s);
      detail::barrier(*this, until);
    });
  }

  double timeout_for(double t) const { return resolve_timeout(t); }
  detail::Health& health() { return *health_; }
  // CommError at once when this communicator's tree failed earlier (detail::Health).
  void alive(const char* op) const {
    if (health_->failed()) health_->refuse(world_->who(rank_), op);
  }

 private:
  detail::Deadline deadline(double timeout_s) const {
    const double limit = resolve_timeout(timeout_s);
    return {now_s() + limit, limit};
  }

  static CallSig reduction(const char* op, size_t count, DType dtype, ReduceOp reduce,
                           std::string problem) {
    CallSig call;
    call.op = op;
    call.count = count;
    call.dtype = static_cast<int>(dtype);
    call.reduce = static_cast<int>(reduce);
    call.problem = std::move(problem);
    return call;
  }

  // The agreement every collective starts with (World::agree): InvalidArgument on every rank
  // when the ranks' calls differ or one rank's arguments are wrong. Its wait counts in wait_s.
  void agree(CallSig call, double until, double timeout_s) {
    const int64_t seq = coll_seq_++;
    const char* op = call.op;
    std::string verdict;
    if (size() == 1) {
      verdict = call.problem.empty() ? "" : "on " + world_->who(0) + ", " + call.problem;
    } else {
      ScopedTimer timer(stats_.wait_s);
      verdict = world_->agree(rank_, seq, std::move(call), until, resolve_timeout(timeout_s));
    }
    if (!verdict.empty()) {
      throw InvalidArgument(world_->who(rank_) + ": " + op + ": " + verdict, __FILE__, __LINE__);
    }
  }

  void check_p2p(const char* what, const void* buf, size_t bytes, int peer, int tag) const {
    detail::check_p2p(what, world_->who(rank_), size(), buf, bytes, peer, tag, INT_MAX);
  }

  // Counts one communication op of this rank; a kill fault fires here.
  void tick(const char* what) {
    Universe& u = world_->universe();
    const int me = world_->world_rank(rank_);
    RankFaultState& fs = u.fault_state(me);
    if (u.faults().kill_rank != me) return;
    const std::string killed = "rank " + std::to_string(me) + " was killed (fault injection)";
    if (fs.killed) throw CommError(killed + ", then called " + what, __FILE__, __LINE__);
    if (fs.ops++ == u.faults().kill_at_op) {
      fs.killed = true;
      u.poison(me, killed);
      throw CommError(killed, __FILE__, __LINE__);
    }
  }

  std::shared_ptr<World> world_;
  int rank_;
  std::shared_ptr<detail::Health> health_;  // shared with the splits of this communicator
  int64_t split_seq_ = 0;
  int64_t coll_seq_ = 0;  // collectives called, split included: the agreement's number
};

LocalRecvWork::LocalRecvWork(LocalComm& comm, std::shared_ptr<World> world,
                             Inbox::Channels::iterator channel, int peer, int tag, const char* op,
                             std::shared_ptr<PendingRecv> recv)
    : comm_(comm),
      world_(std::move(world)),
      inbox_(world_->inbox(comm.rank())),
      it_(channel),
      channel_(channel->second),
      peer_(peer),
      tag_(tag),
      op_(op),
      recv_(std::move(recv)) {
  ++channel_.works;
}

LocalRecvWork::~LocalRecvWork() {
  std::lock_guard<std::mutex> lock(inbox_.mu);
  if (!recv_->done) std::erase(channel_.recvs, recv_);  // cancel: no sender touches buf now
  --channel_.works;
  inbox_.drop_if_idle(it_);
}

std::string LocalRecvWork::describe() const {
  std::ostringstream os;
  os << world_->who(comm_.rank()) << ": ";
  if (op_) os << op_ << ": ";
  os << "recv from " << world_->who(peer_);
  if (!op_) os << " (tag " << tag_ << ", " << recv_->capacity << " bytes)";
  return os.str();
}

void LocalRecvWork::check_alive(const Channel& ch) const {
  Universe& u = world_->universe();
  if (u.poisoned()) {
    throw CommError(
        describe() + " aborted: rank " + std::to_string(u.failed_rank()) + " failed: " + u.reason(),
        __FILE__, __LINE__);
  }
  if (ch.messages.empty() && u.finished(world_->world_rank(peer_))) {
    throw CommError(describe() + " can never complete: " + world_->who(peer_) +
                        " has returned without sending it" + dropped_note(),
                    __FILE__, __LINE__);
  }
}

// " (fault injection: ... dropped)" once a drop fault fired: a lost message shows up as a peer
// that returned without sending, or as the next message arriving in its place, not only as a
// timeout (those messages blamed the peer or the sizes).
std::string LocalRecvWork::dropped_note() const {
  const std::string dropped = world_->universe().dropped();
  return dropped.empty() ? std::string() : " (" + dropped + ")";
}

void LocalRecvWork::finish() {
  if (!booked_) {
    booked_ = true;
    comm_.stats().bytes_recv += static_cast<int64_t>(recv_->received);
  }
  if (recv_->bad_size) {
    std::ostringstream os;
    os << describe() << ": the message has " << recv_->received << " bytes, "
       << (recv_->exact ? "expected exactly " : "more than the receive's ") << recv_->capacity
       << dropped_note();
    throw CommError(os.str(), __FILE__, __LINE__);
  }
}

bool LocalRecvWork::test() {
  comm_.alive("test of a receive");
  return comm_.health().guard([&] { return test_once(); });
}

bool LocalRecvWork::test_once() {
  {
    std::lock_guard<std::mutex> lock(inbox_.mu);
    progress(channel_, now_s(), world_->universe().pool());
    if (!recv_->done) {
      check_alive(channel_);
      return false;
    }
  }
  finish();
  return true;
}

void LocalRecvWork::wait(double timeout_s) {
  comm_.alive("wait of a receive");
  const double timeout = comm_.timeout_for(timeout_s);
  comm_.health().guard([&] { wait_until(timeout); });
}

void LocalRecvWork::wait_until(double timeout) {
  ScopedTimer timer(comm_.stats().wait_s);
  const double deadline = now_s() + timeout;
  {
    std::unique_lock<std::mutex> lock(inbox_.mu);
    for (;;) {
      const double now = now_s();
      progress(channel_, now, world_->universe().pool());
      if (recv_->done) break;
      check_alive(channel_);
      if (now >= deadline) {
        std::ostringstream os;
        os << describe() << " timed out after " << timeout << " s" << dropped_note();
        throw Timeout(os.str(), __FILE__, __LINE__);
      }
      double wake = deadline;
      if (!channel_.messages.empty()) wake = std::min(wake, channel_.messages.front().deliver_at);
      inbox_.cv.wait_for(lock, std::chrono::duration<double>(std::max(0.0, wake - now)));
    }
  }
  finish();
}

std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "unknown exception";
  }
}

// A non-negative integer at most `max` (a rank or milliseconds must fit an int: kill:4294967297
// was rank 1, kill:2147483648 a negative rank, that is no fault at all).
int64_t parse_int(const char* name, const std::string& field, const std::string& whole,
                  int64_t max = std::numeric_limits<int64_t>::max()) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(field, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  LOOM_CHECK(used > 0 && used == field.size() && v >= 0, InvalidArgument,
             "fault '" << whole << "': '" << field << "' is not a non-negative " << name);
  LOOM_CHECK(v <= max, InvalidArgument,
             "fault '" << whole << "': " << name << " " << field << " is above " << max);
  return v;
}

}  // namespace

namespace detail {
// For the tests (tests/dist/test_comm_local.cc declares it): the local backend's channels alive
// now, over every world of the process. Not in a public header.
int64_t local_channels_alive() {
  return g_channels_alive.load(std::memory_order_relaxed);
}
}  // namespace detail

FaultPlan parse_fault(const std::string& text) {
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  const std::string usage = "expected kill:R, drop:R, delay:R:MS, optionally ,at=K for kill/drop";
  FaultPlan plan;
  std::string spec = text, at;
  if (const size_t comma = text.find(','); comma != std::string::npos) {
    spec = text.substr(0, comma);
    const std::string rest = text.substr(comma + 1);
    LOOM_CHECK(rest.rfind("at=", 0) == 0, InvalidArgument,
               "fault '" << text << "': unknown option '" << rest << "'; " << usage);
    at = rest.substr(3);
    LOOM_CHECK(!at.empty(), InvalidArgument, "fault '" << text << "': empty at=; " << usage);
  }
  std::vector<std::string> parts;
  for (size_t start = 0;;) {
    const size_t colon = spec.find(':', start);
    parts.push_back(spec.substr(start, colon - start));
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  const std::string& kind = parts[0];
  if (kind == "kill" || kind == "drop") {
    LOOM_CHECK(parts.size() == 2, InvalidArgument, "fault '" << text << "': " << usage);
    const int rank = static_cast<int>(parse_int("rank", parts[1], text, kIntMax));
    // Default: the rank's second op / second send, so the fault strikes mid-run.
    const int64_t when = at.empty() ? 1 : parse_int("at", at, text);
    if (kind == "kill") {
      plan.kill_rank = rank;
      plan.kill_at_op = when;
    } else {
      plan.drop_rank = rank;
      plan.drop_at_op = when;
    }
  } else if (kind == "delay") {
    LOOM_CHECK(parts.size() == 3 && at.empty(), InvalidArgument,
               "fault '" << text << "': " << usage);
    plan.delay_rank = static_cast<int>(parse_int("rank", parts[1], text, kIntMax));
    plan.delay_ms = static_cast<int>(parse_int("milliseconds", parts[2], text, kIntMax));
  } else {
    throw InvalidArgument("fault '" + text + "': unknown kind '" + kind + "'; " + usage, __FILE__,
                          __LINE__);
  }
  return plan;
}

void run_local(int ranks, const std::function<void(Communicator&)>& fn, const FaultPlan& faults,
               double timeout_s) {
  LOOM_CHECK_GE(ranks, 1, InvalidArgument, "run_local needs at least one rank");
  for (const auto& [what, rank] : {std::pair<const char*, int>{"kill", faults.kill_rank},
                                   {"drop", faults.drop_rank},
                                   {"delay", faults.delay_rank}}) {
    LOOM_CHECK(
        rank < ranks, InvalidArgument,
        "fault " << what << " names rank " << rank << " but the world has " << ranks << " ranks");
  }
  LOOM_CHECK(faults.delay_ms >= 0, InvalidArgument,
             "fault delay must be non-negative, got " << faults.delay_ms << " ms");
  const double timeout = timeout_s < 0 ? Communicator::default_timeout_s()
                                       : Communicator::checked_timeout_s(timeout_s);
  // Each rank is a thread, and Linux numbers threads below PID_MAX_LIMIT (2^22) system-wide: a
  // larger world can never start. run_local(INT_MAX) allocated its per-rank state first and
  // threw std::bad_alloc (or exhausted the memory).
  LOOM_CHECK(static_cast<bool>(fn), InvalidArgument, "run_local: the rank function is empty");
  constexpr int kMaxRanks = 1 << 22;
  LOOM_CHECK(ranks <= kMaxRanks, InvalidArgument,
             "run_local: " << ranks << " ranks, but each rank is a thread and Linux runs at most "
                           << kMaxRanks << " threads (PID_MAX_LIMIT); run fewer ranks");

  std::shared_ptr<Universe> universe;
  std::shared_ptr<World> world;
  std::vector<std::exception_ptr> errors;
  std::vector<std::thread> threads;
  try {
    universe = std::make_shared<Universe>(ranks, faults);
    std::vector<int> members(ranks);
    for (int r = 0; r < ranks; ++r) members[r] = r;
    world = std::make_shared<World>(universe, members);
    universe->add_world(world);
    errors.resize(ranks);
    threads.reserve(ranks);
  } catch (const std::bad_alloc&) {
    throw OutOfMemory("run_local: could not allocate the state of " + std::to_string(ranks) +
                          " ranks (their inboxes and bookkeeping, a few hundred bytes each, out "
                          "of memory); run fewer ranks",
                      __FILE__, __LINE__);
  }
  auto body = [&](int r) {
    try {
      LocalComm comm(world, r, timeout);
      fn(comm);
    } catch (...) {
      errors[r] = std::current_exception();
      universe->poison(r, what_of(errors[r]));
    }
    universe->mark_finished(r);
  };

  std::string start_error;  // why a rank's thread could not start
  for (int r = 0; r < ranks && start_error.empty(); ++r) {
    try {
      threads.emplace_back(body, r);
    } catch (...) {
      start_error = "could not start the thread of rank " + std::to_string(r) + " of " +
                    std::to_string(ranks) + ": " + what_of(std::current_exception()) +
                    " (the limit on processes and threads, ulimit -u, or memory); run fewer "
                    "ranks or threads";
      universe->poison(r, start_error);
    }
  }
  for (auto& t : threads) t.join();
  // Thrown with its context: the bare system_error said only "Resource temporarily unavailable".
  if (!start_error.empty()) throw CommError(start_error, __FILE__, __LINE__);
  if (!universe->poisoned()) return;
  const int failed = universe->failed_rank();
  if (failed >= 0 && errors[failed]) std::rethrow_exception(errors[failed]);
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace loom
