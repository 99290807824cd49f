// loom/attention.h: attention on one rank. The fp64 reference, the blockwise fp32 forward on a
// running softmax state, the blockwise backward, and the merge of finished partial results.
//
// Shapes. q, out, dout, dq: [Sq, H, D]; k, v, dk, dv: [Sk, Hkv, D]; lse and delta: [H, Sq]
// (a head-major array with an explicit stride between heads, ml_stride >= Sq). GQA/MQA: query
// head h reads KV head h / (H / Hkv); H % Hkv == 0 is checked at every entry point.
//
// Masks. Rows carry global token positions (int64) and, optionally, document ids (int32; a null
// pointer means "all one document"). Query i may see key j iff
//     same document  and  (!causal or pos_j <= pos_i)  and  (window == 0 or |pos_i - pos_j| <
//     window).
// The rule never looks at local offsets, so contiguous, zigzag and stripe shards and packed
// documents are all the same code. Positions may be any int64 values (negative, gapped, up to
// INT64_MIN and INT64_MAX): every kernel and the reference evaluate the rule without overflow.
//
// Rows that see no key. A query row that sees no key at all (possible with windows, documents or
// arbitrary positions) has out = 0 and lse = -inf, never NaN, and with finite inputs contributes
// exactly nothing to dq/dk/dv (its dq is 0). Its weights are zeros inside the tiles it shares with
// keys, so a NaN or infinity there (in k or v of a key of the tile, or in the row's own dout) can
// still make its dq, and that tile's dk and dv, NaN by 0 x NaN in the backward's products: the
// entries that share a tile with a NaN, below.
//
// Non-finite inputs are carried through as the formula carries them: wherever a NaN or Inf in q,
// k or v makes the formula's out, lse, dq, dk or dv NaN or infinite (a NaN in k_j: every row that
// sees key j, and the gradients those rows reach), the kernels' value is NaN or infinite too, never
// a finite number. Entries that share a tile with a NaN may become NaN where the formula keeps them
// finite (0 x NaN in a product, as in a materialised softmax); other heads are untouched. A score
// of exactly -inf drops its key, as exp(-inf) = 0 does.
//
// Huge finite inputs (a precondition, not checked). The kernels form q.k in float32 and apply the
// scale after, so a pair whose unscaled q.k is past float32's range (|q.k| > FLT_MAX =
// 3.4028235e38, as with |q| and |k| near 1e19) scores +-inf even where scale q.k is finite: -inf
// drops the key (one key with q.k = -4e38 at scale 1e-3 gave out = 0, lse = -inf), +inf gives
// NaN. Keep |q_i.k_j| within FLT_MAX for the pairs the mask lets through: for such inputs multiply
// q by the scale and pass scale 1. (A check at the kernels' entry, one pass over q and k per call,
// cost 1.5-4 % of a 512 x 512 ring step's forward and was not kept; `loom attn --input` refuses
// files whose max ||q|| max ||k|| passes FLT_MAX before the run.)
//
// Precision. Storage fp32 (or bf16: the overloads at the end); every accumulation (scores, m, l,
// acc, lse, dq/dk/dv) is fp32.
//
// Threads. Each call uses up to `threads` OpenMP threads (0: the OpenMP default). Forward splits
// work over (head, q-tile); backward over (kv-head, k-tile) for dk/dv, with dq reduced without
// races. Calls on disjoint outputs may run concurrently from different threads.
#pragma once

#include <cstdint>
#include <limits>

#include "loom/bf16.h"
#include "loom/tensor.h"

namespace loom {

struct Mask {
  bool causal = true;
  int64_t window = 0;  // 0: unlimited; else keys with |pos_i - pos_j| < window
};

// Token metadata of a block of rows: global position of each row and, optionally, its document.
struct Tokens {
  const int64_t* pos = nullptr;  // n entries, required
  const int32_t* doc = nullptr;  // n entries, or nullptr for a single document
  int64_t n = 0;
  Tokens sub(int64_t begin, int64_t count) const {
    return Tokens{pos + begin, doc ? doc + begin : nullptr, count};
  }
};

// The mask rule for one (query, key) pair. Exact for any two int64 positions: the distance
// |pos_i - pos_j| (up to 2^64 - 1) is formed in uint64_t, never as an overflowing int64.
inline bool visible(const Mask& m, int64_t qpos, int32_t qdoc, int64_t kpos, int32_t kdoc) {
  if (qdoc != kdoc) return false;
  const bool key_before = kpos <= qpos;
  if (m.causal && !key_before) return false;
  if (m.window > 0) {
    const uint64_t dist = key_before ? static_cast<uint64_t>(qpos) - static_cast<uint64_t>(kpos)
                                     : static_cast<uint64_t>(kpos) - static_cast<uint64_t>(qpos);
    if (dist >= static_cast<uint64_t>(m.window)) return false;
  }
  return true;
}

// Options of the blockwise kernels.
// The largest head dimension D the kernels take (src/kernels/checks.h enforces it).
inline constexpr int64_t kMaxHeadDim = 256;
// The largest block_q and block_k the kernels take (as the planner's device profiles): a
// kMaxBlock x kMaxBlock tile of fp32 scores is already 64 MiB per thread.
inline constexpr int64_t kMaxBlock = 4096;
// The most OpenMP threads one kernel call (or CpAttention) takes, as the loom command's
// --threads: more is a typo, not a machine.
inline constexpr int kMaxKernelThreads = 1024;

// Every kernel entry point checks these (InvalidArgument naming the value).
struct KernelConfig {
  Mask mask;
  // Softmax scale; must be set (usually 1/sqrt(D)): FLT_MIN = 1.1754944e-38 <= scale <=
  // 2.3586574e38 (the largest float32 at most FLT_MAX / log2 e). Accuracy depends on the scores,
  // not only the scale: the fixed fp32 tolerance holds while |scale| max||q|| max||k|| <= 128
  // (loom/tolerance.h, kFp32FixedTolMaxScore) and each row's weights spread over at least two
  // effective keys (kFp32FixedTolMinEffectiveKeys); past the score bound the errors grow with the
  // scores (fp32_error_bounds gives the bound of one problem), and once scores reach about 1e6
  // float32 cannot resolve exp(score - lse) from the fp32 lse: the backward, which recomputes its
  // weights that way (as FlashAttention does), then has gradients dominated by rounding (finite, or
  // NaN: dv off by 5.5e-2 at scores up to 1e7, 1.6 at 9e7), while the forward keeps its accuracy.
  // An implementation that keeps p from the forward (PyTorch's materialised softmax-then-matmul)
  // has no such term (dv within 4e-8 on the same inputs).
  float scale = 0.0f;
  int threads = 0;  // OpenMP threads for this call, in [0, kMaxKernelThreads]; 0: OpenMP default
  int64_t block_q = 64;  // tile rows (queries), in [1, kMaxBlock]
  int64_t block_k = 64;  // tile columns (keys), in [1, kMaxBlock]
};

// The checks every kernel entry point makes of cfg (mask window >= 0, scale, threads, blocks),
// for callers that hold a config before any call (CpAttention's constructor). InvalidArgument
// naming the value.
void check_kernel_config(const KernelConfig& cfg);

// What one kernel call did. A tile is a block_q x block_k block of (query, key) pairs for one
// query head; it is empty (skipped), full (no mask work) or partial.
struct KernelStats {
  int64_t tiles = 0;          // tiles computed (full + partial)
  int64_t tiles_skipped = 0;  // empty tiles
  int64_t visible_pairs = 0;  // (query, key, head) triples the mask allows, for useful FLOPs
  KernelStats& operator+=(const KernelStats& o) {
    tiles += o.tiles;
    tiles_skipped += o.tiles_skipped;
    visible_pairs += o.visible_pairs;
    return *this;
  }
};

// ---------------------------------------------------------------------------------------------
// fp64 reference: plain loops, any mask, GQA. Small and obviously right; never optimised.

// out [Sq,H,D], lse [H,Sq] (lse[h*Sq + i]).
void reference_forward(View3<const double> q, View3<const double> k, View3<const double> v,
                       Tokens qt, Tokens kt, const Mask& mask, double scale, View3<double> out,
                       double* lse);

// Gradients of sum(out * dout) with respect to q, k, v. dq [Sq,H,D], dk, dv [Sk,Hkv,D] are
// overwritten (not accumulated). dk or dv may be an empty view, View3<double>{} (data nullptr and
// every size 0): that gradient is not computed (loom verify checks dq alone on sampled query rows
// and needs no [Sk,Hkv,D] buffer for them); dq and the other gradient are the same, bitwise.
void reference_backward(View3<const double> q, View3<const double> k, View3<const double> v,
                        View3<const double> dout, Tokens qt, Tokens kt, const Mask& mask,
                        double scale, View3<double> dq, View3<double> dk, View3<double> dv);

// reference_forward's out and reference_backward's gradients as float32 arithmetic gets them
// where values fall below float32's normal range (2^-126): the same loops, with every weight p_ij,
// partial sum of out_i, of dp_ij = dout_i . v_j, of delta_i = dout_i . out_i, every ds_ij and
// partial sum of dq, dk and dv that lies under 2^-126 in magnitude rounded to float32 (a multiple
// of 2^-149), as a float32 fused multiply-add chain rounds it. Values in the normal range are
// kept exact, so where nothing falls below it the results are reference_forward's and
// reference_backward's, bitwise. Their distance from the exact ones is what subnormal arithmetic
// alone errs, which no float32 implementation avoids (Float32Floor, loom/tolerance.h): v of 1e-39
// makes dp and ds subnormal and a correct dq err 4e-5, while dq itself rounds to float32 within
// 3e-6. Arguments as reference_backward (dk or dv empty: not computed), out as
// reference_forward's (without lse); dout.data == nullptr: out only (dq, dk, dv not touched).
void subnormal_reference(View3<const double> q, View3<const double> k, View3<const double> v,
                         View3<const double> dout, Tokens qt, Tokens kt, const Mask& mask,
                         double scale, View3<double> out, View3<double> dq, View3<double> dk,
                         View3<double> dv);

// The most subnormal_reference can move one element of each result from the exact one's
// arithmetic (reference_forward's, reference_backward's), whatever the mask: each of its roundings
// errs at most 2^-150, carried through the sums by the inputs' largest magnitudes (the derivation
// is in src/kernels/reference.cc). It costs one pass over the inputs, where the model costs a
// reference, so a check runs the model only where this bound says it can matter
// (subnormal_model_may_block, loom/tolerance.h): without the screen a dq that missed at S = 4096
// took `loom verify` 53 s instead of 30. dout.data == nullptr: out only (dq, dk, dv 0).
struct SubnormalShift {
  double out = 0, dq = 0, dk = 0, dv = 0;
};
SubnormalShift subnormal_reference_shift(View3<const double> q, View3<const double> k,
                                         View3<const double> v, View3<const double> dout,
                                         double scale);

// Number of (query, key, head) triples the mask allows: useful-FLOP accounting
// (forward = 4 * D * pairs, backward = 2.5x that).
int64_t count_visible_pairs(Tokens qt, Tokens kt, const Mask& mask, int64_t heads);

// ---------------------------------------------------------------------------------------------
// Blockwise forward on a running softmax state.

// A view of a running softmax state for `rows` query rows:
//   acc [rows, heads, dim] fp32 (row stride acc_ss, head stride dim),
//   m, l [heads, rows] fp32 with stride ml_stride between heads.
// m is the running row max of the scaled scores in base-2 units, score * log2(e) (-inf before
// any key), l the running sum of exp(score - m ln 2) = 2^(score log2(e) - m); acc the running sum
// of the same weights times v. (The forward computes its scores in base 2 so that its exp is a
// cheaper 2^x; finish() converts, and lse is in natural units everywhere.)
struct StateView {
  float* acc = nullptr;
  float* m = nullptr;
  float* l = nullptr;
  int64_t rows = 0, heads = 0, dim = 0;
  int64_t acc_ss = 0;     // row stride of acc (>= heads * dim)
  int64_t ml_stride = 0;  // head stride of m and l (>= rows)
  StateView sub_rows(int64_t begin, int64_t count) const {
    return StateView{
        acc + begin * acc_ss, m + begin, l + begin, count, heads, dim, acc_ss, ml_stride};
  }
};

// Owning softmax state, initialised empty (m = -inf, l = 0, acc = 0).
class SoftmaxState {
 public:
  SoftmaxState() = default;
  SoftmaxState(int64_t rows, int64_t heads, int64_t dim);
  void reset();  // back to empty
  StateView view();
  int64_t rows() const { return rows_; }

  Tensor<float> acc;   // [rows, heads, dim]
  Tensor<float> m, l;  // [heads, rows]

 private:
  int64_t rows_ = 0;
};

// Every function below comes in two overloads: fp32 storage and bf16 storage. With bf16, q, k,
// v (and out, dout) are stored in bf16 and every accumulation is fp32: the softmax state (acc,
// m, l), lse, delta and the dq, dk, dv accumulators are the same fp32 objects, with the same
// shapes and contracts. So a context-parallel ring can keep and send its KV blocks in bf16 (half
// the bytes) while its state and the dk/dv partials travelling with a block stay fp32, and a
// state filled by bf16 attends can be finished to fp32 or bf16 (or mixed with fp32 attends).
//
// bf16 precision: the scores q k^T and (on CPUs with AVX512-BF16) the product p v are formed from
// bf16 operands with fp32 sums; p is rounded to bf16 for p v only (l sums the unrounded p, so lse
// has fp32 accuracy); on CPUs without AVX512-BF16 p is not rounded and attend() computes bitwise
// what the fp32 overload computes on the widened inputs. finish() to bf16 rounds out (relative
// u = 2^-8 per element);
// compute_delta on that out carries its rounding into dq and dk. The backward's five products
// are, on CPUs with AVX512-BF16, formed from bf16 operands with fp32 sums too: p is rounded to
// bf16 for dv = p^T dout and ds for dk and dq (each relative u; dv then has bf16 accuracy),
// while p, ds and every accumulator stay fp32; on CPUs without it the backward is fp32 on the
// exact bf16 inputs (dv has fp32 accuracy). The bf16 dot products take subnormal operands as zero
// and flush products and partial sums below FLT_MIN (whatever MXCSR says); the kernels multiply q,
// k, v, dout and ds by powers of two where they are small (exactly, and taken back out in fp32),
// so that what is flushed stays far below fp32's rounding (src/kernels/blockwise.cc, "lifting"):
// small inputs (v of 1e-36, dout of 1e-37) keep the accuracy above. Memory: with AVX512-BF16 the
// backward also keeps q and dout transposed, 2 Sq H D bf16 (one of at most 16 MiB kept with the
// calling thread, as attend's packed copy). The error bounds against the fp64 reference on the
// same bf16 inputs are derived in loom/tolerance.h (bf16_error_bounds computes them for one
// problem).

// Folds the KV block (k, v with tokens kt) into the state of the query rows q (tokens qt).
// q: [st.rows, H, D] with H == st.heads, D == st.dim; k, v: [Sk, Hkv, D]. D <= 256.
// Memory: besides small per-thread tiles, a packed copy of k and v for a chunk of kv heads at a
// time (attend_kv_chunk_heads: about 2 Sk D elements of fp32, or of bf16 for bf16 storage, per kv
// head, as many kv heads as fit in 4 MiB, at least one). One of at most 16 MiB stays with the
// calling thread for its next call (a ring of equal blocks then reuses warm pages), until the
// thread exits; a larger one is freed on return.
KernelStats attend(StateView st, View3<const float> q, View3<const float> k, View3<const float> v,
                   Tokens qt, Tokens kt, const KernelConfig& cfg);
KernelStats attend(StateView st, View3<const bf16> q, View3<const bf16> k, View3<const bf16> v,
                   Tokens qt, Tokens kt, const KernelConfig& cfg);

// out[i, h, :] = acc / l, lse[h * lse_stride + i] = m ln 2 + log(l) (natural log); rows with
// l == 0 give out = 0 and lse = -inf. bf16: out rounded to bf16 (nearest even); lse fp32.
void finish(StateView st, View3<float> out, float* lse, int64_t lse_stride);
void finish(StateView st, View3<bf16> out, float* lse, int64_t lse_stride);

// ---------------------------------------------------------------------------------------------
// Blockwise backward. Uses the FINAL lse of each query row, so partial gradients from different
// KV blocks (ring steps) simply add.

// delta[h * stride + i] = sum_d dout[i,h,d] * out[i,h,d] (bf16: exact products, fp32 sums, in
// the order of the backward's dp GEMM on the path LOOM_KERNEL selects).
void compute_delta(View3<const float> out, View3<const float> dout, float* delta, int64_t stride);
void compute_delta(View3<const bf16> out, View3<const bf16> dout, float* delta, int64_t stride);

// Accumulates (+=) into dq [Sq,H,D], dk, dv [Sk,Hkv,D] (fp32 for either storage) the gradient
// contributions of the pairs (q rows, this KV block):
//   S = scale q k^T, P = exp(S - lse), dv += P^T dout, dP = dout v^T, dS = P (dP - delta),
//   dq += scale dS k, dk += scale dS^T q.
// Rows with lse = -inf contribute nothing.
// Memory: besides small per-thread tiles, head-major copies of q and dout and one fp32 dq buffer
// per thread for a chunk of kv heads' query heads at a time (attend_backward_chunk_heads: about
// (2 sizeof(T) + 4 threads) Sq D bytes per query head, and with bf16 dot products (the avx512bf16
// and amx paths) 4 Sq D more for q and dout transposed; kv heads in chunks of 8 MiB, at least one).
// A buffer of at most 16 MiB stays with the calling thread for its next call, as attend()'s.
KernelStats attend_backward(View3<const float> q, View3<const float> k, View3<const float> v,
                            View3<const float> dout, const float* lse, const float* delta,
                            int64_t ml_stride, Tokens qt, Tokens kt, const KernelConfig& cfg,
                            View3<float> dq, View3<float> dk, View3<float> dv);
KernelStats attend_backward(View3<const bf16> q, View3<const bf16> k, View3<const bf16> v,
                            View3<const bf16> dout, const float* lse, const float* delta,
                            int64_t ml_stride, Tokens qt, Tokens kt, const KernelConfig& cfg,
                            View3<float> dq, View3<float> dk, View3<float> dv);

// ---------------------------------------------------------------------------------------------
// Merge of finished partial results (overflow-free): for each row and head,
//   lse = max(lse_a, lse_b) + log1p(exp(-|lse_a - lse_b|)),
//   out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse).
// Writes the result into (out_a, lse_a). Both -inf: out_a = 0, lse_a = -inf.
void merge(View3<float> out_a, float* lse_a, View3<const float> out_b, const float* lse_b,
           int64_t lse_stride);

// The instruction-set path the kernels take in this process now, e.g. "avx2", "avx512",
// "avx512bf16", "amx", "sse4", "neon", "scalar" (chosen per call from the CPU and the LOOM_KERNEL
// environment variable = auto | portable | a compiled target's name; see src/kernels/tile_ops.h).
// Throws InvalidArgument / NotSupported when LOOM_KERNEL names no target / one this process
// cannot run.
const char* kernel_path();

// Whether the path kernel_path() names computes bf16 storage with bf16 dot products (avx512bf16:
// vdpbf16ps; amx: AMX tiles): the weights p and ds are then rounded to bf16 for their products,
// and the results are held to bf16_error_bounds(..., bf16_dots = true) (loom/tolerance.h); the
// other paths widen bf16 to fp32. Throws as kernel_path().
bool kernel_path_bf16_dots();

// One side of the work tiles the kernels compute on (src/kernels/blockwise.cc): over n rows cut
// into blocks of `block` rows, the block times the smallest factor whose product reaches `want`
// rows, never more blocks than the n rows have (so at least `block`, and `block` when want <= 0
// or n <= block). Preconditions: block >= 1, n >= 0. The planner's simulation (src/plan/sim.cc)
// uses it to charge the same work tiles; `want` is the path's minimum work-tile side (128 on
// every CPU path, plan Profile::work_tile).
int64_t work_tile_side(int64_t block, int64_t n, int64_t want);

// How many kv heads attend() packs and computes at a time when its packed copy of k and v takes
// `bytes_per_kv_head` bytes per kv head: as many as fit in 4 MiB (kAttendChunkBytes), at least 1,
// at most kv_heads. Each chunk's copy is written just before its tasks read it, so it is read
// from the caches rather than from memory (src/kernels/blockwise.cc). Preconditions:
// kv_heads >= 1, bytes_per_kv_head >= 1.
constexpr int64_t kAttendChunkBytes = int64_t{4} << 20;
int64_t attend_kv_chunk_heads(int64_t kv_heads, int64_t bytes_per_kv_head);

// How many kv heads attend_backward() computes at a time when its head-major copies of the query
// heads' rows take `bytes_per_kv_head` bytes per kv head (q and dout in their storage type, one
// fp32 dq buffer per thread, and with bf16 dot products q and dout transposed, for the group of
// query heads that read the kv head): as many as fit in 8 MiB (kBackwardChunkBytes), but at least
// enough for two of its (kv head, k-tile) tasks per thread over k_tiles tiles per kv head, at
// least 1 and at most kv_heads. Preconditions: every argument >= 1.
constexpr int64_t kBackwardChunkBytes = int64_t{8} << 20;
int64_t attend_backward_chunk_heads(int64_t kv_heads, int64_t bytes_per_kv_head, int64_t k_tiles,
                                    int threads);

// An upper bound of the heap bytes that attend() calls (and, with `backward`, attend_backward()
// calls too) hold at once on one calling thread, for q of sq rows of `heads` heads against k, v
// of sk rows of `kv_heads` heads of dimension `dim`, in bf16 storage or fp32, with cfg's tile
// sizes and threads (its mask and scale are not read): the per-thread tiles, the tile plans and
// the packed or head-major copies (the chunk functions above), the one the thread keeps between
// calls included, on the path the process runs (with bf16 dot products or not:
// kernel_path_bf16_dots()). It also bounds any sequence of smaller calls of the same proportions
// (a call on n <= sq rows with at least n sk / sq - 1 keys, as the segment pairs of a context-
// parallel step are), whatever the mask; a thread whose earlier calls were larger keeps up to
// 16 MiB from them besides. strategy_working_bytes (loom/cp.h) counts it for each strategy.
// InvalidArgument for sq, sk < 0, heads or kv_heads < 1, heads % kv_heads != 0, dim outside
// [1, kMaxHeadDim], or cfg's threads or tile sizes out of range.
int64_t attend_workspace_bytes(int64_t sq, int64_t sk, int64_t heads, int64_t kv_heads, int64_t dim,
                               bool bf16, bool backward, const KernelConfig& cfg);

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

}  // namespace loom
