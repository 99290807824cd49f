// loom/verify.h: check another context-parallel attention implementation against the exact
// (fp64) answer, and localise what is wrong.
//
// The candidate is any implementation (GPU, another library, a user's own ring loop) that was run
// on the same q, k, v (and dout) as this check. It hands over any subset of out, lse, dq, dk, dv,
// either in global token order or per rank in a named sharding convention (`Sharding`); verify()
// undoes the sharding, compares each present tensor with the fp64 reference under the dtype's
// written tolerance, and, when something fails, fits the error to the (query chunk, KV chunk)
// pairs of the convention's ring schedule and to a library of known defects, and says in words
// which one it is (a dropped or doubled ring step, a mask with the wrong chunk offset, a causal
// mask one token off or missing on the diagonal step, rows in the wrong order, bf16 rounding
// between steps, a sum with no log-sum-exp merge, stale KV in the forward or the backward, a
// wrong softmax scale).
//
// Shapes (global order). q, out, dout, dq: [S, H, D]; k, v, dk, dv: [S, Hkv, D]; lse: [H, S]
// (natural log, as loom and flash-attention define it). Masks follow loom/attention.h: positions
// are global token indices, documents are packed (doc_lengths), the same rule for every layout.
//
// Ring schedule assumed for localisation: at step s, rank r holds the KV block (shard) of rank
// (r - s) mod P (KV travels from r to r + 1), as in loom's ring and ring-flash-attention.
//
// Threads: verify() is a pure function of its arguments; calls may run concurrently.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "loom/attention.h"
#include "loom/cp.h"
#include "loom/tensor.h"

namespace loom::verify {

// ---------------------------------------------------------------------------------------------
// Sharding conventions. Each maps a global sequence of S tokens (optionally packed documents) to
// the ranks' local rows, and cuts it into chunks (the units of localisation).
//
//   contiguous, zigzag, stripe   as loom defines them (loom/cp.h, ShardPlan::make).
//   rfa-zigzag       ring-flash-attention: value.chunk(2 * world, dim=seq); rank r takes chunks
//                    r and 2 * world - 1 - r (test/test_zigzag_ring_flash_attn_func.py,
//                    extract_local; per sequence of cu_seqlens in the varlen test). torch.chunk
//                    semantics: chunks of ceil(L / 2W) tokens, the last ones shorter; refused when
//                    torch.chunk would return fewer than 2W chunks.
//   te-thd           TransformerEngine THD (packed sequences): every sequence (document) of length
//                    L, L % (2 cp) == 0, is cut into 2 cp chunks and rank r takes chunks r and
//                    2 cp - 1 - r of every sequence, sequence after sequence
//                    (transformer_engine/common/fused_attn/context_parallel.cu,
//                    thd_partition_indices_kernel behind tex.thd_get_partitioned_indices).
//   torch-headtail   PyTorch context_parallel's _HeadTailLoadBalancer (S % 2W == 0; rank r: chunk
//                    r then chunk 2W - 1 - r) and, with documents, _PerDocumentHeadTailLoadBalancer
//                    (the same per document, rank-major)
//                    (torch/distributed/tensor/experimental/_context_parallel/_load_balancer.py).
//   megatron         Megatron-LM get_batch_on_this_cp_rank (megatron/core/utils.py): view the
//                    sequence as [2 cp, S / (2 cp)] and index_select [r, 2 cp - 1 - r]
//                    (S % 2cp == 0); with packed sequences (cu_seqlens) it calls TE's
//                    thd_get_partitioned_indices, i.e. te-thd.
struct Sharding {
  std::string convention;
  int64_t seq = 0;
  int ranks = 1;
  int64_t documents = 0;  // packed documents the sequence was given as (0: none given)
  std::vector<std::vector<int64_t>> tokens;  // [rank] -> global token of each local row
  // Chunks in position order of their first token: chunk c holds the global tokens chunks[c]
  // (ascending) and belongs to rank chunk_rank[c]. A rank's KV block is the union of its chunks.
  std::vector<std::vector<int64_t>> chunks;
  std::vector<int> chunk_rank;

  // The fields are public; a sharding built by hand must hold what make_sharding guarantees, and
  // check() throws InvalidArgument naming the first field that breaks it: seq >= 1, ranks >= 1,
  // tokens for `ranks` ranks listing every token of [0, seq) exactly once, and chunks (as many
  // as chunk_rank, each owned by a rank in [0, ranks) that holds its tokens) listing every token
  // once, ascending within a chunk. unshard_rows and unshard_cols call it (a token past seq or
  // fewer token lists than ranks wrote out of bounds; a token listed twice left a row zero and
  // made the comparison wrong).
  void check() const;
};

// Names accepted by make_sharding, in the order listed above.
std::vector<std::string> convention_names();
// Builds a convention. InvalidArgument naming the convention and the violated rule (e.g.
// "te-thd needs every document length divisible by 2 * ranks = 8; document 1 has 30 tokens");
// OutOfMemory naming the size where the token lists (every token twice, lists per rank) do not
// fit in memory, before they are filled.
Sharding make_sharding(const std::string& convention, int64_t seq, int ranks,
                       const std::vector<int64_t>& doc_lengths = {});

// Puts per-rank row tensors ([n_r, A, B], rows = local tokens) into a global [S, A, B] tensor.
// row_shape: the [A, B] every rank must have (q's [H, D] for out and dq, k's [Hkv, D] for dk
// and dv); empty: rank 0's. InvalidArgument naming the first rank whose shape differs from
// [n_r, A, B] and the shape the convention gives it (with packed documents and contiguous, also
// that contiguous is per document), and sh.check()'s.
Tensor<double> unshard_rows(const Sharding& sh, const std::vector<Tensor<double>>& local,
                            const std::string& what, const std::vector<int64_t>& row_shape = {});
// The same for lse ([A, n_r] per rank, tokens along the last axis) -> [A, S]; rows: the A every
// rank must have (q's H), -1: rank 0's. The same checks.
Tensor<double> unshard_cols(const Sharding& sh, const std::vector<Tensor<double>>& local,
                            const std::string& what, int64_t rows = -1);
// The reverse of unshard_rows for one rank (rows = sh.tokens[r]), or any rows: rows `rows` of a
// [S, A, B] tensor, in that order, as [rows.size(), A, B]. T is float or double. InvalidArgument
// for a tensor that is not 3-d or a row outside [0, S).
template <class T>
Tensor<T> gather_rows(const Tensor<T>& x, const std::vector<int64_t>& rows);

// ---------------------------------------------------------------------------------------------
// The check.

struct Problem {
  Tensor<double> q, k, v;  // [S, H, D], [S, Hkv, D], [S, Hkv, D]
  Tensor<double> dout;     // [S, H, D]; empty when no gradient is checked
  Mask mask;
  double scale = 0;                  // 0: 1/sqrt(D); else finite and > 0 (InvalidArgument)
  std::vector<int64_t> doc_lengths;  // empty: one document
};

// The candidate's tensors in global order (unshard_rows/unshard_cols first); any may be absent.
struct Candidate {
  std::optional<Tensor<double>> out, lse, dq, dk, dv;
};

// Rows compared above Options::full_check_max, and localisation's bounds: at most kLocRows of
// the compared rows, fewer when their pair partials would pass kLocBytes (loom verify's memory
// estimate counts them).
constexpr int64_t kSampleRows = 256;
constexpr int64_t kLocRows = 1024;
constexpr double kLocBytes = 512.0 * 1024 * 1024;

// Whether a sequence of S tokens is checked on kSampleRows sampled rows (out, lse, dq; dk and dv
// then only scanned for NaN and Inf) rather than on every row: S above full_check_max and above
// kSampleRows (a "sample" of every row is every row, and then dk and dv are compared too).
inline bool checks_sampled_rows(int64_t S, int64_t full_check_max) {
  return S > full_check_max && S > kSampleRows;
}

struct Options {
  // Which convention and world size the candidate used: the chunks and ring steps that
  // localisation speaks of. With ranks == 1 the sequence is cut into up to 8 contiguous chunks
  // and no ranks or steps are named.
  std::string convention = "contiguous";
  int ranks = 1;
  // Storage precision of the candidate: "fp32" or "bf16" (selects the tolerances below).
  std::string dtype = "fp32";
  bool localise = true;
  // Above this many tokens out, lse and dq are compared on 256 evenly spaced query rows and dk,
  // dv are not compared (they need every query row); every element of every present tensor is
  // still scanned for NaN and Inf (a failure: the exact values are finite), and a candidate of
  // which nothing can be compared is an InvalidArgument, not a pass. Localisation uses at most
  // 1024 of the compared rows (fewer when the pair partials would pass 512 MiB).
  int64_t full_check_max = 4096;  // kSampleRows, kLocRows, kLocBytes: below
  // How errors name full_check_max: "--full-check-max" (loom verify) or "full_check_max="
  // (loom.torch.verify's keyword), as CpConfig::option_spelling.
  OptionSpelling option_spelling = OptionSpelling::flag;
};

// Written tolerances (loom/tolerance.h): normwise relative error ||x - ref|| / ||ref|| per tensor;
// lse = -inf must agree exactly. fp32 storage and accumulation: 1e-5 for every tensor
// (kFp32RelTol). bf16 storage (u = 2^-8): out, dq, dk 2u (u for rounding out to bf16, u for the
// bf16 probabilities in p v; dq and dk see out's rounding through delta); dv 2u (u for rounding
// the fp32 result to bf16 storage on top of its fp32 accuracy); lse 1e-5 (lse is fp32 in every
// bf16 implementation we know: flash-attention, TE, loom). Those bf16 tolerances hold from
// kBf16FixedTolMinEffectiveKeys effective keys per query row (effective_keys)
// and a head dim of kBf16FixedTolMinHeadDim; below, verify() holds out to the problem's bound of
// the bf16-dot path (bf16_error_bounds, dots) and dq, dk, dv to theirs plus u (a gradient may be
// stored in bf16), and says so (Report::per_problem_bounds). Both dtypes' fixed tolerances need
// the scores in fp32's regime (|scale| max||q|| max||k|| <= kFp32FixedTolMaxScore) and fp32's
// also kFp32FixedTolMinEffectiveKeys effective keys, and keys and values sharing no component
// above the common_key_ratio / common_value_ratio thresholds (fixed_tolerance_exclusion with v);
// outside,
// every tensor, lse included, is held to the problem's bound for any implementation
// (fp32_error_bounds, or the bf16 bounds with their fp32 terms; loom_kernels false).
// InvalidArgument for a tensor other than out, lse, dq, dk, dv or a dtype other than fp32, bf16.
double tolerance(const std::string& tensor, const std::string& dtype);

struct TensorCheck {
  std::string name;  // out, lse, dq, dk, dv
  bool present = false;
  bool compared = false;  // present and comparable (dk/dv above full_check_max: false)
  bool passed = false;
  // tolerance: +inf where not computable, and for dk, dv above full_check_max under per-problem
  // bounds (their bounds, like their exact values, need every query row and are not computed).
  double rel_err = 0, max_abs_err = 0, tolerance = 0;
  bool sampled = false;  // compared on sampled query rows
  // dk, dv above full_check_max: only scanned for NaN / Inf (compared, and failed, only when
  // that found some; rel_err is then +inf and max_abs_err means nothing).
  bool scanned_only = false;
  int64_t non_finite = 0;    // NaN / Inf entries in the candidate
  int64_t inf_mismatch = 0;  // lse: -inf where the reference is finite, or the reverse
  // Normwise relative error per rank, per chunk and per head (empty when not compared).
  std::vector<double> per_rank, per_chunk, per_head;
};

struct Diagnosis {
  // dropped_step, doubled_step, mask_offset, mask_off_by_one, diagonal_unmasked, row_order,
  // bf16_between_steps, bf16_storage, gqa_mapping, no_lse_merge, stale_kv_forward,
  // stale_kv_backward, wrong_scale, non_finite, unexplained, not_localised
  std::string kind;
  std::string text;     // one sentence in words
  double residual = 1;  // ||candidate - model|| / ||candidate - reference|| (0: fully explained)
  std::vector<int> ranks, steps, q_chunks, kv_chunks;  // what it names (empty: all / none)
  // wrong_scale: the scale the candidate used; mask_offset: the offset (chunks); mask_off_by_one:
  // the causal mask's offset in tokens (1: key j <= i + 1 visible, -1: j < i)
  double value = 0;
};

struct Report {
  bool passed = false;
  std::string convention;
  int ranks = 1;
  int64_t seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
  std::vector<TensorCheck> tensors;  // out, lse, dq, dk, dv in that order
  std::vector<std::string> absent;   // names of tensors the candidate did not hand over
  std::vector<Diagnosis> diagnoses;  // best first; empty when passed
  // Heat map: share of the error energy of `heat_tensor` that each (query chunk, KV chunk)
  // pair explains, [chunks][chunks], in [0, 1]; empty when nothing failed.
  std::string heat_tensor;
  std::vector<std::vector<double>> heat;
  std::vector<int> chunk_rank;  // owner rank of each chunk (for labels and steps)
  // Outside the fixed tolerances' regime (loom/tolerance.h, check_limits: scores past
  // kFp32FixedTolMaxScore; under kFp32FixedTolMinEffectiveKeys, bf16
  // kBf16FixedTolMinEffectiveKeys, effective keys per query row; keys or values sharing a large
  // component; bf16 also a head dim under kBf16FixedTolMinHeadDim): each tensor is held to the
  // problem's own bound (lse too, but never under kFp32RelTol). why: the reason, as the summary
  // prints it.
  bool per_problem_bounds = false;
  std::string per_problem_why;
  // What would let a bound of 1 or more be checked (loom/tolerance.h check_limits_hint).
  std::string per_problem_hint;

  std::string to_json() const;      // the report as one JSON object
  std::string heatmap_svg() const;  // a self-contained SVG of `heat`
  std::string summary() const;      // the human-readable report, several lines
};

// Checks the candidate. InvalidArgument for unusable input (shapes that do not match the
// problem, an unknown convention or dtype, a convention that cannot split this sequence).
Report verify(const Problem& problem, const Candidate& candidate, const Options& options);

}  // namespace loom::verify
