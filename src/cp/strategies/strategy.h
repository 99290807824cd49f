// Internal to src/cp: the strategy interface and the registry.
//
// A strategy is one file in this folder: a class implementing forward and backward over the
// engine (engine.h), and one StrategyEntry that declares its name, what it is for, the degree
// option it takes, its constraints (with their messages) and its defaults. registry.cc lists the
// entries; nothing else in the tree names strategies one by one.
#pragma once

#include <memory>
#include <vector>

#include "../engine.h"

namespace loom::cp_detail {

template <class T>
struct ForwardArgs {
  View3<const T> q, k, v;  // this rank's rows: q [n, H, D], k, v [n, Hkv, D]
  View3<T> out;            // [n, H, D], overwritten
  float* lse;              // [H, n], overwritten
};

template <class T>
struct BackwardArgs {
  View3<const T> q, k, v, out, dout;
  const float* lse;         // [H, n] from forward
  View3<float> dq, dk, dv;  // overwritten
};

class CpStrategy {
 public:
  virtual ~CpStrategy() = default;
  virtual void forward(const ForwardArgs<float>& a) = 0;
  virtual void forward(const ForwardArgs<bf16>& a) = 0;
  virtual void backward(const BackwardArgs<float>& a) = 0;
  virtual void backward(const BackwardArgs<bf16>& a) = 0;
};

// Implements the four virtuals with the derived class's templates fwd<T>() and bwd<T>().
template <class Derived>
class CpStrategyOf : public CpStrategy {
 public:
  void forward(const ForwardArgs<float>& a) override { self().template fwd<float>(a); }
  void forward(const ForwardArgs<bf16>& a) override { self().template fwd<bf16>(a); }
  void backward(const BackwardArgs<float>& a) override { self().template bwd<float>(a); }
  void backward(const BackwardArgs<bf16>& a) override { self().template bwd<bf16>(a); }

 private:
  Derived& self() { return static_cast<Derived&>(*this); }
};

// The degree option a strategy takes, declared by its entry: the command line (loom attn, loom
// train) and the python binding build their options from these.
struct DegreeOption {
  const char* flag = "";           // "--inner"; "" when the strategy takes none
  const char* help = "";           // what N is, for --help
  int CpConfig::*value = nullptr;  // the CpConfig value it sets (CpConfig::degree for a
                                   // strategy whose option has no field of its own)
};

struct StrategyEntry {
  Strategy id;                // Strategy{"name"}: its name
  const char* summary;        // one line: what it is for (help texts, docs)
  DegreeOption degree = {};   // the degree option it reads from CpConfig, if any
  bool splits_heads = false;  // its inner axis splits heads (ulysses all-to-all)
  // The inner degree for P ranks (CpShape::inner); throws InvalidArgument naming the values
  // when cfg does not fit P.
  int (*inner_degree)(int P, const CpConfig& cfg);
  std::unique_ptr<CpStrategy> (*make)(Engine& e);
  // Estimated bytes of its working set on one rank (strategy_working_bytes in loom/cp.h).
  double (*working_bytes)(const CpProblem& p);
};

// Adds a strategy defined outside registry.cc (a test, a plug-in) after the built-ins; call it
// before any CpAttention is built (not thread-safe against concurrent use of the registry).
// InvalidArgument when the name is taken or the entry lacks inner_degree, make or working_bytes.
void register_strategy(const StrategyEntry& e);

// e's degree option set to n, as cfg.option_spelling names it: "--ulysses 3" (the command line)
// or "ulysses=3" (the Python op). e must take a degree option (register_strategy checked its
// flag's form).
std::string degree_text(const StrategyEntry& e, const CpConfig& cfg, int64_t n);

// The fp32 bytes of one rank's rows of q ([rows, H, D]), of K or V ([rows, Hkv, D]) and of a
// softmax statistic ([H, rows]): the units of the working-set estimates.
struct RowBytes {
  double q, kv, stat;
  explicit RowBytes(const CpProblem& p)
      : q(4.0 * double(p.rows) * double(p.heads) * double(p.head_dim)),
        kv(4.0 * double(p.rows) * double(p.kv_heads) * double(p.head_dim)),
        stat(4.0 * double(p.rows) * double(p.heads)) {}
};

// Memory slots: the ring pass uses 0-6 (engine.h); every strategy may use kSlotDelta for its
// delta [H, rows] and the slots from kSlotOwn on for its own buffers.
constexpr size_t kSlotDelta = 7;
constexpr size_t kSlotOwn = 8;

// Pieces of the working-set bounds (registry.cc), in bytes, for p's storage, threads and tile
// sizes.
//   state_bytes      the engine's SoftmaxState for `rows` query rows of `heads` heads (acc, m, l)
//   kernel_bytes     the kernels' workspace (attend_workspace_bytes) for q blocks of at most sq
//                    rows of `heads` heads against KV blocks of at most sk rows of kv_heads heads
//   ring_pass_bytes  the ring pass's slots 0-6 (ring_pass.cc) over R members whose KV blocks have
//                    at most `rows` rows of kv_heads heads: the KV double buffer in storage, and in
//                    backward the dK,dV partial and TravellingSum's four accumulators in fp32;
//                    none for R = 1. With p.local_backend also the messages of one step in flight
//                    per member (a KV block; in backward also an accumulator): each member waits
//                    for the block it receives at every step, which kept the members within a
//                    step of each other in every run measured (one further ahead copies more).
//   local_messages   the local backend's copies of one collective's messages over R ranks, on
//                    one rank: a message whose receive is not posted is copied, and every rank
//                    posts its receives before its sends, so of each pair of ranks at most one
//                    message is copied, (R - 1) / 2 a rank; the copies go back to a pool that
//                    keeps them for later messages, so each message size (bytes; 0: none) counts
//                    once, for all the collectives that send it.
double state_bytes(const CpProblem& p, int64_t rows, int64_t heads);
double local_messages(int R, std::vector<double> sizes);
double kernel_bytes(const CpProblem& p, int64_t sq, int64_t sk, int64_t heads, int64_t kv_heads);
double ring_pass_bytes(const CpProblem& p, int R, int64_t rows, int64_t kv_heads);

// Registry helpers: the factory of a strategy class, and the inner degree of strategies whose
// ranks form one axis (ring, allgather).
template <class S>
std::unique_ptr<CpStrategy> make_strategy(Engine& e) {
  return std::make_unique<S>(e);
}
inline int no_inner_axis(int, const CpConfig&) {
  return 1;
}
// The entry of a strategy whose ranks form one axis (ring, allgather): no degree option, heads
// not split, inner degree 1.
template <class S>
constexpr StrategyEntry one_axis_entry(Strategy id, const char* summary,
                                       double (*working_bytes)(const CpProblem&)) {
  return StrategyEntry{.id = id,
                       .summary = summary,
                       .inner_degree = no_inner_axis,
                       .make = make_strategy<S>,
                       .working_bytes = working_bytes};
}

// hybrid's implementation and working set, which ulysses (one group) shares.
std::unique_ptr<CpStrategy> make_hybrid(Engine& e);
double hybrid_working_bytes(const CpProblem& p);

// Every registered strategy (registry.cc), and the one for an id (InvalidArgument listing the
// choices when it is not registered).
const std::vector<StrategyEntry>& registry();
const StrategyEntry& entry(Strategy s);

}  // namespace loom::cp_detail
