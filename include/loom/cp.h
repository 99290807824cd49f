// loom/cp.h: context-parallel attention. A global sequence of S tokens is split over the P ranks
// of a context-parallel group (a layout); every rank holds the rows of its shard of q, k, v and
// computes exact attention for its queries over all keys, with one of four strategies.
//
//   ring       K,V blocks travel around the ring; one attend per step into the softmax state.
//   ulysses    all-to-all "my tokens, all heads" -> "all tokens, my heads", attend, all-to-all
//   back. hybrid     ulysses inside groups of U consecutive cp ranks, ring across the P/U groups.
//   allgather  all-gather K,V, attend, reduce-scatter dK,dV.
//
// Shapes on one rank (n = the shard's token count): q, out, dout, dq [n, H, D]; k, v, dk, dv
// [n, Hkv, D]; lse [H, n] (head stride n). All fp32; every accumulation is fp32.
//
// Every shard carries the GLOBAL position of each of its tokens (and its document id with packed
// documents); masks are evaluated on those, so the result is the one-rank result for every
// layout. This header uses only the Communicator interface.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loom/attention.h"
#include "loom/comm.h"
#include "loom/tensor.h"

namespace loom {

enum class Layout { contiguous, zigzag, stripe };
enum class Strategy { ring, ulysses, hybrid, allgather };

Layout parse_layout(const std::string& name);      // InvalidArgument listing the choices
Strategy parse_strategy(const std::string& name);  // InvalidArgument listing the choices
std::string to_string(Layout l);
std::string to_string(Strategy s);

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

  static ShardPlan make(Layout layout, int64_t seq, int ranks,
                        const std::vector<int64_t>& doc_lengths = {});
  int64_t rows(int r) const { return static_cast<int64_t>(tokens[r].size()); }
  int64_t max_rows() const;
  // Token metadata of rank r's rows (positions = global token indices).
  Tokens token_info(int r) const;
  // Copies rank r's rows out of a global [S, *, *] tensor.
  Tensor<float> shard(const Tensor<float>& global, int r) const;
  // Writes rank r's rows of `local` into their places in `global`.
  void unshard(const Tensor<float>& local, int r, Tensor<float>& global) const;
};

// Parses "L1,L2,..." (positive integers). InvalidArgument naming the bad text.
std::vector<int64_t> parse_doc_lengths(const std::string& text);

struct CpConfig {
  Strategy strategy = Strategy::ring;
  int ulysses = 1;      // hybrid: ulysses degree U (P % U == 0); ulysses: P; ring/allgather: 1
  KernelConfig kernel;  // mask, scale, threads, tile sizes
};

// What one rank did. Times in seconds; bytes from the communicator's counters.
struct CpMetrics {
  double compute_s = 0;  // inside attention kernels
  double comm_s = 0;     // inside communication calls (posting, copying, waiting, collectives):
                         // time this rank's thread spent on communication instead of compute
  double wait_s = 0;     // blocked in waits and blocking collectives (part of comm_s)
  int64_t bytes_sent = 0;
  int64_t bytes_recv = 0;
  int64_t tiles = 0;                // kernel tiles computed (forward and backward)
  int64_t visible_pairs = 0;        // (query, key, head) triples the mask allows, forward only
  std::vector<int64_t> step_tiles;  // tiles computed at each step of the last forward (ring:
                                    // per ring step; allgather: per KV block)
  // A span of this rank's time line (t0, t1 from now_s()). Kinds:
  //   "compute"                      a kernel call (step = ring step or KV block)
  //   "send", "recv"                 an asynchronous transfer, from posting until its wait
  //                                  returned (an upper bound of its flight time)
  //   "wait"                         blocked in a wait
  //   "a2a", "allgather", "reduce_scatter"   a blocking collective (step = -1)
  struct Span {
    std::string kind;
    int step;
    double t0, t1;
  };
  std::vector<Span> spans;
  bool record_spans = true;
  void clear_counters();
  // Length of the union of the communication spans (send, recv and collectives): the time during
  // which some communication of this rank was under way.
  double comm_window_s() const;
};

// Context-parallel attention over the ranks of `cp` (P = cp.size(); this rank is cp.rank() and
// holds plan.tokens[cp.rank()]). Construction is collective over cp (hybrid splits it into
// ulysses and ring groups). Checks every constraint once, naming the values:
//   H % Hkv == 0; hybrid: P % U == 0; ulysses/hybrid: H % U == 0 and (Hkv % U == 0 or
//   U % Hkv == 0); plan.ranks == P.
class CpAttention {
 public:
  CpAttention(Communicator& cp, const ShardPlan& plan, const CpConfig& cfg, int64_t heads,
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
// global [S, H, D] tensor, on every rank (padded all-gather). Collective over cp.
Tensor<float> gather_rows(Communicator& cp, const ShardPlan& plan, const Tensor<float>& local);

}  // namespace loom
