// model/gpt.h: a byte-level GPT decoder whose forward and backward run on one rank of a
// dp x tp x cp(ulysses x ring) mesh.
//
// Layer l (pre-norm):  h = RMSNorm(x);  q, k, v = h Wq, h Wk, h Wv;  rotary(q, k);
//                      x += CpAttention(q, k, v) Wo;  h = RMSNorm(x);  x += (silu(h W1) * h W3) W2
// then a final RMSNorm, the LM head [dim, 256] and the cross-entropy of next-byte targets.
//
// Parallelism of one sequence (S tokens):
//   cp  the ShardPlan (zigzag by default) gives this cp rank n tokens with their global
//       positions; attention over the whole sequence is CpAttention (ring, ulysses, hybrid or
//       allgather). Everything else is per token and needs no cp communication.
//   tp  Megatron tensor parallelism: Wq, Wk, Wv, W1, W3 are split by columns (heads / hidden
//       units), Wo and W2 by rows; this rank owns heads/tp query heads and kv_heads/tp KV heads.
//   sp  Megatron sequence parallelism inside the tp group (always on when tp > 1): the residual
//       stream, norms, embedding and LM head work on n_sp = ceil(n / tp) rows of the cp shard
//       (tp rank t owns rows [t n_sp, (t+1) n_sp), the last rank's tail padded with zero rows);
//       an all-gather brings the full n rows before a column-parallel GEMM and a reduce-scatter
//       replaces the all-reduce after a row-parallel one.
//   dp  different sequences per dp rank; the trainer sums gradients over dp.
// Embedding, norm gains and LM head are replicated over tp (their gradients are partial per tp
// rank and summed over the world); the tp-split matrices' gradients are summed over cp and dp.
//
// Parameters are fp32 master copies in one flat buffer (replicated ones first, then the
// tp-split ones), initialised from Philox by each element's GLOBAL (row, column), so every mesh
// starts from the same model. Precision::bf16 runs every GEMM on bf16 operands (bf16 copies of
// the weights made once per step, activations rounded when they enter a GEMM) with fp32
// accumulation (cblas_sbgemm, or exact widening + sgemm where OpenBLAS lacks it), attention on
// bf16-rounded q, k, v, and keeps the big saved activations in bf16 between forward and
// backward; norms, softmax, attention arithmetic, residuals and every reduction stay fp32.
//
// Thread-safety: one Gpt per rank, used by that rank's thread only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/bf16.h"
#include "loom/comm.h"
#include "loom/cp.h"
#include "loom/model/data.h"

namespace loom::model {

enum class Precision { fp32, bf16 };
Precision parse_precision(const std::string& name);  // "fp32" | "bf16", else InvalidArgument
std::string to_string(Precision p);

struct ModelConfig {
  int64_t vocab = 256;  // byte-level: must be 256 (validate)
  int64_t layers = 2;
  int64_t dim = 64;
  int64_t heads = 4;
  int64_t kv_heads = 2;
  int64_t ffn = 0;  // SwiGLU hidden units; 0: 4 * dim
  double rope_theta = 10000.0;
  float norm_eps = 1e-5f;
  int64_t ffn_dim() const { return ffn > 0 ? ffn : 4 * dim; }
  int64_t head_dim() const { return dim / heads; }
};

struct ParallelConfig {
  MeshShape mesh;
  // Must match the mesh's cp axes (validate): hybrid takes mesh.ulysses (> 1) as its ulysses
  // degree; ulysses runs over the whole cp group (ring == 1), and so does any other strategy
  // (ulysses == 1).
  Strategy strategy = Strategy::ring;
  int inner = 0;   // ring2d: ranks per inner ring (CpConfig::inner)
  int degree = 0;  // CpConfig::degree: the degree option of a registered strategy without a field
  Layout layout = Layout::zigzag;
  int threads = 1;  // OpenMP threads of the attention kernels on this rank
};

// Checks a model and mesh together; InvalidArgument naming the values (vocab == 256, norm_eps and
// rope_theta finite and > 0, heads % kv_heads, dim % heads, head_dim even, heads and kv_heads
// divisible by tp, ffn by tp, the strategy against the mesh's cp axes (hybrid: ulysses > 1;
// ulysses: ring == 1; any other: ulysses == 1), ulysses/hybrid head rules, mesh product == world
// when world > 0, ...).
void validate(const ModelConfig& m, const ParallelConfig& p, int world, int64_t seq);
// loom train's strategy when none is named: hybrid when ulysses and ring > 1, ulysses when only
// ulysses > 1, else ring.
Strategy default_strategy(const MeshShape& mesh);
// The CpConfig of the model's attention (strategy, its degrees, causal mask) on this mesh.
CpConfig cp_config(const ParallelConfig& p, int64_t head_dim);

// OpenBLAS threads used by every GEMM of this process (a process-wide setting).
void set_blas_threads(int threads);

// One parameter tensor: its full (unsplit) shape and how this rank holds it.
struct ParamSpec {
  std::string name;
  int64_t rows = 0, cols = 0;  // full shape; a vector is [1, cols]
  enum Split { none, by_cols, by_rows } split = none;
  int64_t local_rows = 0, local_cols = 0;  // this rank's piece
  int64_t offset = 0;                      // in the flat buffer
  bool decay = false;                      // AdamW weight decay applies
  int64_t local_size() const { return local_rows * local_cols; }
};

// Counters of one rank, accumulated until cleared.
struct ModelStats {
  double attention_s = 0;      // inside CpAttention forward/backward
  double total_s = 0;          // inside forward_backward / forward
  int64_t act_bytes_peak = 0;  // peak bytes of activations kept for backward
  int64_t act_bytes_live = 0;
};

class Gpt {
 public:
  // `mesh` must outlive the model. Parameters are initialised here (no communication);
  // CpAttention is built collectively over mesh.cp by the first forward_backward.
  Gpt(const ModelConfig& cfg, const ParallelConfig& par, Mesh& mesh, Precision precision,
      bool checkpoint_activations, uint64_t seed);
  ~Gpt();

  // Runs forward (and backward when `backward`) on this rank's part of `seq` (the cp shard of
  // the rows, the sp rows of that). Returns this rank's SUM of cross-entropy over its predicted
  // tokens. Gradients of (sum loss) * loss_scale are ADDED to grads(). Collective over the tp
  // and cp groups.
  double forward_backward(const Sequence& seq, double loss_scale, bool backward);

  // Flat parameter / gradient buffers of this rank: [replicated | tp-split].
  std::vector<float>& params() { return w_; }
  std::vector<float>& grads() { return g_; }
  int64_t replicated_size() const { return replicated_size_; }
  const std::vector<ParamSpec>& specs() const { return specs_; }
  const ParamSpec& spec(const std::string& name) const;
  void zero_grads();
  // Marks the bf16 weight copies stale (call after every update of params()).
  void params_changed() { bf16_fresh_ = false; }

  const ModelConfig& config() const { return cfg_; }
  ModelStats& stats() { return stats_; }

  struct Impl;

 private:
  ModelConfig cfg_;
  std::vector<ParamSpec> specs_;
  std::vector<float> w_, g_;
  std::vector<bf16> wb_;
  bool bf16_fresh_ = false;
  int64_t replicated_size_ = 0;
  ModelStats stats_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::model
