// loom/cp.h: context-parallel attention. A global sequence of S tokens is split over the P ranks
// of a context-parallel group (a layout); every rank holds the rows of its shard of q, k, v and
// computes exact attention for its queries over all keys, with one of the strategies of the
// registry (strategies() below lists them with what each is for; src/cp/strategies/ holds one
// file per strategy).
//
// Shapes on one rank (n = the shard's token count): q, out, dout, dq [n, H, D]; k, v, dk, dv
// [n, Hkv, D]; lse [H, n] (head stride n). All fp32; every accumulation is fp32.
//
// Every shard carries the GLOBAL position of each of its tokens (and its document id with packed
// documents); masks are evaluated on those, so the result is the one-rank result for every
// layout. This header uses only the Communicator interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "loom/attention.h"
#include "loom/comm.h"
#include "loom/tensor.h"

namespace loom {

enum class Layout { contiguous, zigzag, stripe };

// A strategy of the registry, named by its registered name (src/cp/strategies/registry.cc lists
// the built-ins; register_strategy in the internal strategies/strategy.h adds more). A new
// strategy needs no edit here: Strategy{"name"} names it. Compared by name; a value type to copy
// freely. Strategy::ring, ulysses, hybrid, allgather and ring2d name the built-ins.
//
// The headers need C++17; loom itself is built as C++20. Under C++20 the constructor is
// consteval, so a name that is not a constant (a char buffer) does not compile; under C++17 it is
// constexpr, and the rule is the caller's: the name must be a string literal, which outlives
// every copy.
#if defined(__cpp_consteval) && __cpp_consteval >= 201811L
#define LOOM_STRATEGY_CTOR consteval
#else
#define LOOM_STRATEGY_CTOR constexpr
#endif
class Strategy {
 public:
  constexpr Strategy() : name_("ring") {}
  // The name must be a string literal (it outlives every copy).
  template <size_t N>
  explicit LOOM_STRATEGY_CTOR Strategy(const char (&name)[N]) : name_(name, N - 1) {}
  constexpr std::string_view name() const { return name_; }
  friend constexpr bool operator==(Strategy a, Strategy b) { return a.name_ == b.name_; }
  friend constexpr bool operator!=(Strategy a, Strategy b) { return !(a == b); }

  static const Strategy ring, ulysses, hybrid, allgather, ring2d;

 private:
  std::string_view name_;
};
inline constexpr Strategy Strategy::ring{"ring"};
inline constexpr Strategy Strategy::ulysses{"ulysses"};
inline constexpr Strategy Strategy::hybrid{"hybrid"};
inline constexpr Strategy Strategy::allgather{"allgather"};
inline constexpr Strategy Strategy::ring2d{"ring2d"};
#undef LOOM_STRATEGY_CTOR

Layout parse_layout(const std::string& name);      // InvalidArgument listing the choices
Strategy parse_strategy(const std::string& name);  // InvalidArgument listing the choices
std::string to_string(Layout l);
std::string to_string(Strategy s);

// What the registry says about one strategy, for help texts, docs and reports.
struct StrategyInfo {
  Strategy id;
  std::string name;
  std::string summary;      // one line: what it is for
  std::string option;       // the degree option it takes ("--ulysses", "--inner") or empty
  std::string option_help;  // what the option's N is (for --help), or empty
};
// Every registered strategy, in registration order (the built-ins first).
const std::vector<StrategyInfo>& strategies();
// The registry's description of s (InvalidArgument listing the choices when s is not registered).
const StrategyInfo& strategy_info(Strategy s);
// "ring, ulysses, hybrid, allgather or ring2d" (and any registered later).
std::string strategy_choices();

// A run of local rows whose tokens form one chunk of the layout (consecutive in the sequence
// for contiguous and zigzag; the whole shard for stripe). Kernel tiles never straddle segments,
// so a chunk's tile count does not depend on its neighbours.
struct Segment {
  int64_t begin = 0;  // first local row
  int64_t count = 0;
};

// How a global sequence is split over P ranks.
//
// contiguous  rank r holds tokens [r S/P, (r+1) S/P) (the first S mod P ranks one more).
// zigzag      the sequence is cut into 2P chunks (the first S mod 2P chunks one token longer);
//             rank r holds chunks r and 2P-1-r. With S divisible by 2P every rank does equal
//             causal work at every ring step.
// stripe      token t is on rank t mod P.
// Packed documents (doc_lengths non-empty, summing to S): each document is split on its own by
// the same rule (per-document zigzag: a document of length L is cut into 2P chunks, the first
// L mod 2P one token longer, and rank r takes chunks r and 2P-1-r of every document), so every
// document is balanced by itself. Shards may differ in size by a few tokens; nothing is padded,
// so nothing padded can change a result.
struct ShardPlan {
  Layout layout = Layout::zigzag;
  int64_t seq = 0;
  int ranks = 1;
  std::vector<int64_t> doc_lengths;            // empty: one document
  std::vector<std::vector<int64_t>> tokens;    // [rank] -> global token index of each local row
  std::vector<std::vector<int32_t>> docs;      // [rank] -> document of each local row (empty
                                               // when there is one document)
  std::vector<std::vector<Segment>> segments;  // [rank] -> segments of local rows

  // InvalidArgument for a bad layout, seq < 1, ranks < 1 or document lengths that do not sum to
  // seq; OutOfMemory naming the size when the plan's lists (every token, three per rank) do not
  // fit, before any is filled (ranks may exceed seq: the extra ranks hold no rows).
  static ShardPlan make(Layout layout, int64_t seq, int ranks,
                        const std::vector<int64_t>& doc_lengths = {});
  // The fields are public; a plan built by hand must hold what make() guarantees, and check()
  // throws InvalidArgument naming the first thing that breaks it: every token of [0, seq) on
  // exactly one rank; docs[r] empty without doc_lengths, else each row's document; segments
  // that cover each rank's rows in order, each of ascending tokens of one document (the
  // strategies find empty block pairs from a segment's first and last token). CpAttention's
  // constructor and gather_rows call it (a token past seq overflowed the heap; tokens out of
  // order gave wrong attention; a plan without segments gave zeros).
  void check() const;
  // rows, token_info, shard, unshard and their lse forms take a rank r in [0, ranks) and throw
  // InvalidArgument naming r and ranks otherwise (rows: one comparison; no accessor is on a
  // per-element path).
  int64_t rows(int r) const {
    check_rank(r, "rows");
    return static_cast<int64_t>(tokens[static_cast<size_t>(r)].size());
  }
  int64_t max_rows() const;
  // Token metadata of rank r's rows (positions = global token indices).
  Tokens token_info(int r) const;
  // Copies rank r's rows out of a global [S, *, *] tensor (InvalidArgument for a row whose token
  // is outside [0, seq)).
  Tensor<float> shard(const Tensor<float>& global, int r) const;
  // Writes rank r's rows of `local` into their places in `global` (the same check).
  void unshard(const Tensor<float>& local, int r, Tensor<float>& global) const;
  // The same for lse, whose layout is [H, n] (head stride n, CpAttention::forward), against a
  // global [H, seq]: shard_lse copies rank r's columns out, unshard_lse writes them back.
  Tensor<float> shard_lse(const Tensor<float>& global, int r) const;
  void unshard_lse(const Tensor<float>& local, int r, Tensor<float>& global) const;

 private:
  // r in [0, ranks) (and within tokens), else rank_error.
  void check_rank(int r, const char* what) const {
    if (r < 0 || r >= ranks || static_cast<size_t>(r) >= tokens.size()) rank_error(r, what);
  }
  [[noreturn]] void rank_error(int r, const char* what) const;
  void check_token(int r, int64_t i) const;  // tokens[r][i] in [0, seq), else InvalidArgument
};

// The document lengths of a sequence of `seq` tokens, checked (each >= 1, an int64 sum without
// overflow, equal to seq); empty doc_lengths give {seq}. InvalidArgument naming the values.
std::vector<int64_t> checked_doc_lengths(int64_t seq, const std::vector<int64_t>& doc_lengths);

// Parses "L1,L2,..." (positive integers). InvalidArgument naming the bad text.
std::vector<int64_t> parse_doc_lengths(const std::string& text);

// How error messages name a strategy's degree option: as the command line's flag ("hybrid:
// --ulysses 3 must divide ...") or as the Python op's keyword argument ("hybrid: ulysses=3 must
// divide ...").
enum class OptionSpelling { flag, keyword };

struct CpConfig {
  Strategy strategy = Strategy::ring;
  int ulysses = 1;      // hybrid: ulysses degree U (P % U == 0); ulysses: P; ring/allgather: 1
  int inner = 0;        // ring2d: ranks per inner ring (P % inner == 0); others: unused
  int degree = 0;       // the degree of a registered strategy whose option has no field above
  KernelConfig kernel;  // mask, scale, threads, tile sizes
  OptionSpelling option_spelling = OptionSpelling::flag;  // how errors name the degree option
};

// Sets the value cfg.strategy's degree option sets (its StrategyInfo::option: cfg.ulysses for
// hybrid's --ulysses, cfg.inner for ring2d's --inner, ...). InvalidArgument when the strategy
// takes no degree option.
void set_degree(CpConfig& cfg, int value);

// How a strategy lays the P ranks of a cp group out: `inner` consecutive cp ranks form an inner
// group (the mesh's ulysses axis: a ulysses group, or ring2d's inner ring), and the P / inner
// inner groups form the outer axis (the mesh's ring axis). ring: 1 x P; ulysses: P x 1.
struct CpShape {
  int inner = 1, outer = 1;
  bool replicate_kv = false;  // the inner axis splits heads and U % Hkv == 0 (KV replicated)
};
// The one place of the head and group constraints, called by CpAttention, the trainer and the
// CLI: checks cfg for a cp group of `ranks` ranks holding `heads` query and `kv_heads` KV heads
// (per tp rank in the trainer) and returns the layout. InvalidArgument naming the values:
//   heads, kv_heads >= 1 and heads % kv_heads == 0; a strategy's degree option N >= 1 and
//   P % N == 0 (hybrid's --ulysses, ring2d's --inner, a registered strategy's own; named as
//   cfg.option_spelling says); ulysses, hybrid: H % U == 0 and (Hkv % U == 0 or U % Hkv == 0);
//   then the strategy's own rules (StrategyEntry::inner_degree).
CpShape check_cp_config(const CpConfig& cfg, int ranks, int64_t heads, int64_t kv_heads);

// A problem as the memory estimates see it: `rows` is the most rows a rank holds; forward and
// (with `backward`) backward calls, repeated, in storage of dtype_bytes (4: fp32, 2: bf16), with
// `threads` kernel threads and the kernels' tile sizes.
struct CpProblem {
  int64_t seq = 0, rows = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int ranks = 1;
  bool backward = false;
  int dtype_bytes = 4;                 // 4 (fp32) or 2 (bf16)
  int threads = 1;                     // KernelConfig::threads as the calls run (>= 1)
  int64_t block_q = 64, block_k = 64;  // KernelConfig's tile sizes
  // The local backend copies a message whose receive is not posted yet, and keeps the released
  // copies for reuse: true counts them (a rank's messages of a step or a collective in flight).
  bool local_backend = false;
  CpShape shape{};  // the strategy's layout of the ranks: strategy_working_bytes sets it from cfg
};
// The bytes of cfg.strategy's own working set on one rank, an upper bound, from the strategy's
// registry entry: everything the strategy allocates beyond the caller's inputs and outputs (its
// Memory slots: blocks in flight, gradient partials and accumulators, delta; the softmax state;
// re-sharded copies and their send and receive buffers), the kernels' workspace for the calls it
// makes (attend_workspace_bytes, loom/attention.h), and with local_backend the local backend's
// message copies and a collective's scratch. `loom attn --memory-limit` adds the rest.
// Throws InvalidArgument for a negative size, ranks or threads < 1, dtype_bytes other than 2 or
// 4, tile sizes outside [1, kMaxBlock], and what check_cp_config refuses.
double strategy_working_bytes(const CpConfig& cfg, const CpProblem& p);

// Kinds of a time-line span.
//   compute                          a kernel call (step = ring step or KV block)
//   send, recv                       an asynchronous transfer, from posting until its wait
//                                    returned (an upper bound of its flight time)
//   wait                             blocked in a wait
//   a2a, allgather, reduce_scatter   a blocking collective (step = -1)
enum class SpanKind : uint8_t { compute, send, recv, wait, a2a, allgather, reduce_scatter };
constexpr int kSpanKinds = 7;
const char* to_string(SpanKind k);
// Communication spans: everything but compute and wait.
inline bool is_comm(SpanKind k) {
  return k != SpanKind::compute && k != SpanKind::wait;
}

// What one rank did. Times in seconds; bytes from the communicator's counters. Counters add up
// over calls until clear_counters(); nothing in here grows with the number of calls: spans are
// kept only while record_spans is set (a trace or timeline was asked for), and then at most
// span_limit of them (later ones are counted in spans_dropped).
struct CpMetrics {
  double compute_s = 0;  // inside attention kernels
  double comm_s = 0;     // inside communication calls (posting, copying, waiting, collectives):
                         // time this rank's thread spent on communication instead of compute
  double wait_s = 0;     // blocked in waits and blocking collectives (part of comm_s)
  int64_t bytes_sent = 0;
  int64_t bytes_recv = 0;
  int64_t tiles = 0;                // kernel tiles computed (forward and backward)
  int64_t visible_pairs = 0;        // (query, key, head) triples the mask allows, forward only
  int64_t peak_buffer_bytes = 0;    // the strategy's reused buffers (memory seam slots) at
                                    // their peak; not a counter (clear_counters keeps it)
  std::vector<int64_t> step_tiles;  // tiles computed at each step of the last forward (ring:
                                    // per ring step; allgather: per KV block; ring2d: per
                                    // (outer, inner) step)
  // Length of the union of the communication spans (send, recv and collectives) of every call:
  // the time during which some communication of this rank was under way. Kept whether or not
  // spans are recorded.
  double window_s = 0;
  // A span of this rank's time line (t0, t1 from now_s()).
  struct Span {
    SpanKind kind;
    int step;
    double t0, t1;
  };
  std::vector<Span> spans;    // only while record_spans; at most span_limit
  bool record_spans = false;  // set it for a trace or timeline
  size_t span_limit = size_t{1} << 16;
  int64_t spans_dropped = 0;  // spans not kept because span_limit was reached
  void clear_counters();      // zeroes the counters and empties spans (keeps record_spans)
  double comm_window_s() const { return window_s; }
};

// The groups a CpAttention runs on, from the mesh (build_mesh): the cp group, and optionally its
// inner (mesh ulysses) and outer (mesh ring) axes. With I = CpShape::inner and cp rank
// r = o I + i, the inner group of r holds cp ranks o I .. o I + I - 1 and r is its rank i; the
// outer group holds cp ranks i, I + i, 2 I + i, ... and r is its rank o (build_mesh's ulysses and
// ring groups, or splits of cp with color r / I, resp. r % I, and key r). An axis's given groups
// are used when every rank gives one of the axis's size, and the constructor then checks that
// they are the axis (above: each rank's place, and, one all-gather over each group, its members,
// all of this cp group) and throws InvalidArgument on every rank naming the first wrong one;
// when no rank gives one of that size (none, or other sizes) the axis is split from cp by
// build_mesh; when some ranks do and others do not, InvalidArgument on every rank. An axis that
// spans cp (ulysses, ring) runs on cp itself, whatever is given.
struct CpGroups {
  Communicator* cp = nullptr;
  Communicator* inner = nullptr;  // consecutive cp ranks (Mesh::ulysses)
  Communicator* outer = nullptr;  // across inner groups (Mesh::ring)
};

// Context-parallel attention over the ranks of `cp` (P = cp.size(); this rank is cp.rank() and
// holds plan.tokens[cp.rank()]). Construction is collective over cp (a two-axis strategy, hybrid
// or ring2d, gets its inner and outer groups from the mesh; given ones are checked, CpGroups
// above). Checks every constraint once
// (check_cp_config, plan.ranks == P, and cfg.kernel: scale, window, threads in
// [0, kMaxKernelThreads], block_q and block_k in [1, kMaxBlock]), naming the values; then checks
// (one all-gather over cp) that every rank passed the same plan (layout, seq, document lengths,
// the tokens of each rank), strategy, degree, mask, scale, heads, kv heads and head dim, and
// throws InvalidArgument on every rank naming the first difference ("rank 1 has stripe, rank 0
// zigzag"); kernel threads and tile sizes may differ. forward and backward check every view's
// sizes, data and strides (head stride >= D when H > 1, row stride >= H * D when n > 1), then
// check (an all-gather of 8 bytes per rank over cp) that every rank is in the same call, forward
// or backward, fp32 or bf16, and throw InvalidArgument on every rank otherwise. `cp` (and the
// groups) must outlive the object. Groups it splits from cp wait cp's timeout as of each forward
// and backward (cp.set_timeout_s after construction applies); groups the caller gives keep their
// own. After a forward or backward threw Timeout or CommError, cp and its groups are unusable
// (loom/comm.h): every later call throws CommError at once; build a new communicator and
// CpAttention.
class CpAttention {
 public:
  CpAttention(Communicator& cp, const ShardPlan& plan, const CpConfig& cfg, int64_t heads,
              int64_t kv_heads, int64_t head_dim);
  CpAttention(const CpGroups& groups, const ShardPlan& plan, const CpConfig& cfg, int64_t heads,
              int64_t kv_heads, int64_t head_dim);
  ~CpAttention();
  CpAttention(const CpAttention&) = delete;
  CpAttention& operator=(const CpAttention&) = delete;

  // out [n, H, D] and lse [H, n] are overwritten.
  void forward(View3<const float> q, View3<const float> k, View3<const float> v, View3<float> out,
               float* lse);
  // dq [n, H, D], dk, dv [n, Hkv, D] are overwritten. out and lse from forward.
  void backward(View3<const float> q, View3<const float> k, View3<const float> v,
                View3<const float> out, View3<const float> dout, const float* lse, View3<float> dq,
                View3<float> dk, View3<float> dv);

  // bf16 storage: q, k, v, out, dout in bf16 (KV blocks travel in bf16, half the bytes); the
  // softmax state, lse and every gradient accumulator stay fp32 (dK, dV partials travel in
  // fp32), and dq, dk, dv are returned in fp32.
  void forward(View3<const bf16> q, View3<const bf16> k, View3<const bf16> v, View3<bf16> out,
               float* lse);
  void backward(View3<const bf16> q, View3<const bf16> k, View3<const bf16> v,
                View3<const bf16> out, View3<const bf16> dout, const float* lse, View3<float> dq,
                View3<float> dk, View3<float> dv);

  CpMetrics& metrics();

  struct Impl;  // opaque

 private:
  Impl* impl_;
};

// Gathers every rank's rows of a [n_r, W] row tensor (given as a [n_r, H, D] tensor) into the
// global [S, H, D] tensor, on every rank (padded all-gather). Collective over cp; plan.ranks must
// be cp.size() (InvalidArgument naming both).
Tensor<float> gather_rows(Communicator& cp, const ShardPlan& plan, const Tensor<float>& local);

}  // namespace loom
