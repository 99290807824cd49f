// `loom verify`: check another implementation's attention outputs (out, lse, dq, dk, dv, global or
// per rank in a named sharding convention) against loom's fp64 reference, and localise what is
// wrong. Exit status: 0 pass, 1 fail, 2 unusable input. The library does the work
// (loom/verify.h); this file reads files, reorders layouts and prints.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "commands.h"
#include "loom/comm.h"
#include "loom/cp.h"
#include "loom/io.h"
#include "loom/npy.h"
#include "loom/timer.h"
#include "loom/verify.h"

extern "C" int omp_get_max_threads(void);

namespace loom::tools {

namespace {

namespace fs = std::filesystem;

struct VerifyOptions {
  std::string input, candidate, convention = "contiguous", layout_dims = "SHD", dtype = "fp32";
  int ranks = 1;
  bool causal = true;
  int64_t window = 0;
  std::string docs;
  double scale = 0;
  bool scale_given = false;  // set from the command line: 0 is refused, not "the default"
  std::string json, heatmap;
  bool quiet = false;
  int64_t full_check_max = verify::Options{}.full_check_max;
  std::string memory_limit;  // --memory-limit (empty: the machine's available memory)
};

// Layout of the tensors on disk: [S, H, D] (lse [H, S]), [B, S, H, D] (lse [B, H, S]) or
// [H, S, D] (lse [H, S]).
enum class Dims { shd, bshd, hsd };

Dims parse_dims(const std::string& s) {
  if (s == "SHD" || s == "shd" || s == "S,H,D") return Dims::shd;
  if (s == "BSHD" || s == "bshd" || s == "B,S,H,D") return Dims::bshd;
  if (s == "HSD" || s == "hsd" || s == "H,S,D") return Dims::hsd;
  throw InvalidArgument("unknown --layout-dims '" + s + "' (choose SHD, BSHD or HSD)");
}

// With BSHD every tensor must hold the B batch elements of q: a shorter one would be read past
// its end, a longer one's extra elements never checked.
void check_batches(const Tensor<double>& x, int64_t batches, const std::string& what) {
  LOOM_CHECK(x.size(0) == batches, InvalidArgument,
             what << " has shape " << shape_str(x.shape()) << ": " << x.size(0)
                  << " batch elements, but q.npy has " << batches);
}

// Refuses a row tensor whose number of dimensions is not the layout's: q.npy of shape [] or [8]
// was indexed as [S, H, D] and ended in a raw std::out_of_range (exit status 1, "a tensor
// failed").
// A shape from a .npy header is checked before the file's body is read.
void check_row_dims(const std::vector<int64_t>& x, Dims dims, const std::string& what) {
  const size_t want = dims == Dims::bshd ? 4 : 3;
  const char* layout = dims == Dims::shd ? "SHD" : dims == Dims::bshd ? "BSHD" : "HSD";
  const char* shape = dims == Dims::shd    ? "[S, H, D]"
                      : dims == Dims::bshd ? "[B, S, H, D]"
                                           : "[H, S, D]";
  LOOM_CHECK(x.size() == want, InvalidArgument,
             what << " has shape " << shape_str(x) << " but --layout-dims " << layout << " needs "
                  << shape);
}
void check_row_dims(const Tensor<double>& x, Dims dims, const std::string& what) {
  check_row_dims(x.shape(), dims, what);
}

// Batch element b (of `batches`, q's B) of a row tensor on disk as [S, H, D].
Tensor<double> rows_to_shd(const Tensor<double>& x, Dims dims, int64_t b, int64_t batches,
                           const std::string& what) {
  check_row_dims(x, dims, what);
  if (dims == Dims::shd) return x;
  if (dims == Dims::bshd) {
    check_batches(x, batches, what);
    const int64_t S = x.size(1), H = x.size(2), D = x.size(3);
    Tensor<double> y({S, H, D});
    std::copy(x.data() + b * S * H * D, x.data() + (b + 1) * S * H * D, y.data());
    return y;
  }
  const int64_t H = x.size(0), S = x.size(1), D = x.size(2);
  Tensor<double> y({S, H, D});
  for (int64_t h = 0; h < H; ++h)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t d = 0; d < D; ++d) y[(s * H + h) * D + d] = x[(h * S + s) * D + d];
  return y;
}

// Refuses an lse tensor whose number of dimensions is not the layout's.
void check_lse_dims(const Tensor<double>& x, Dims dims, const std::string& what) {
  if (dims == Dims::bshd) {
    LOOM_CHECK(x.dim() == 3, InvalidArgument,
               what << " has shape " << shape_str(x.shape()) << " but --layout-dims BSHD needs "
                    << "lse [B, H, S]");
    return;
  }
  LOOM_CHECK(x.dim() == 2, InvalidArgument,
             what << " has shape " << shape_str(x.shape()) << " but lse must be [H, S]");
}

// Batch element b (of `batches`) of an lse tensor on disk as [H, S].
Tensor<double> lse_to_hs(const Tensor<double>& x, Dims dims, int64_t b, int64_t batches,
                         const std::string& what) {
  check_lse_dims(x, dims, what);
  if (dims == Dims::bshd) {
    check_batches(x, batches, what);
    const int64_t H = x.size(1), S = x.size(2);
    Tensor<double> y({H, S});
    std::copy(x.data() + b * H * S, x.data() + (b + 1) * H * S, y.data());
    return y;
  }
  return x;
}

// rows_to_shd and lse_to_hs of the only batch element (B = 1), taking x: a body already [S, H, D]
// (lse [H, S]) is moved, not copied; one in another layout is reordered and then freed.
Tensor<double> take_rows(Tensor<double>&& x, Dims dims, const std::string& what) {
  Tensor<double> body = std::move(x);
  check_row_dims(body, dims, what);
  if (dims == Dims::shd) return body;
  return rows_to_shd(body, dims, 0, 1, what);
}
Tensor<double> take_lse(Tensor<double>&& x, Dims dims, const std::string& what) {
  Tensor<double> body = std::move(x);
  if (dims == Dims::bshd) return lse_to_hs(body, dims, 0, 1, what);
  check_lse_dims(body, dims, what);
  return body;
}

void require_finite(const Tensor<double>& t, const std::string& name) {
  for (int64_t i = 0; i < t.numel(); ++i)
    LOOM_CHECK(
        std::isfinite(t[i]), InvalidArgument,
        name << " contains a non-finite value at flat index " << i << "; inputs must be finite");
}

// Whether a directory entry named path exists. A dangling symlink counts (fs::exists follows
// links and said no, so `cu_seqlens.npy -> nowhere` was ignored and the run passed without the
// document mask): reading it then reports the file that cannot be opened.
bool entry_present(const std::string& path) {
  std::error_code ec;
  return fs::symlink_status(path, ec).type() != fs::file_type::not_found && !ec;
}

// A .npy file to read, and the shape its header gives (read_npy_shape: the body is read only once
// the memory estimate has passed).
struct NpyFile {
  std::string path;
  std::vector<int64_t> shape;
};

NpyFile npy_header(const std::string& path) {
  return NpyFile{path, read_npy_shape(path)};
}

double numel_of(const std::vector<int64_t>& shape) {
  double n = 1;
  for (int64_t d : shape) n *= static_cast<double>(d);
  return n;
}

// The body of f, as the header said: a file that changed shape since (rewritten while loom read
// it) is refused, not checked with sizes the memory estimate did not count.
Tensor<double> read_body(const NpyFile& f) {
  Tensor<double> t = read_npy_f64(f.path);
  LOOM_CHECK(t.shape() == f.shape, IoError,
             f.path << " has shape " << shape_str(t.shape()) << ", its header said "
                    << shape_str(f.shape) << " (it changed while loom read it)");
  return t;
}

// A candidate tensor as files: global `name.npy` or per rank `name.rank{r}.npy`. locate_candidate
// finds them and reads their headers; read_candidate then reads their bodies.
struct Files {
  bool present = false, per_rank = false;
  std::vector<NpyFile> files;  // the global file, or one per rank
  Tensor<double> global;
  std::vector<Tensor<double>> ranks;
};

// The per-rank index r of `entry` when it is `name`.rank{r}.npy, -1 when it is not such a name.
// A name that starts so but whose r is not a plain decimal (out.rank01.npy, out.rankX.npy) is
// refused: it would be silently ignored.
int64_t rank_of(const std::string& entry, const std::string& name) {
  const std::string prefix = name + ".rank", suffix = ".npy";
  if (entry.size() <= prefix.size() + suffix.size() || entry.rfind(prefix, 0) != 0 ||
      entry.compare(entry.size() - suffix.size(), suffix.size(), suffix) != 0)
    return -1;
  const std::string digits =
      entry.substr(prefix.size(), entry.size() - prefix.size() - suffix.size());
  const bool plain = digits.size() <= 10 && (digits == "0" || digits[0] != '0') &&
                     digits.find_first_not_of("0123456789") == std::string::npos;
  LOOM_CHECK(plain, InvalidArgument,
             "the candidate has " << entry << ", which is not a per-rank name (" << name
                                  << ".rank{r}.npy with r = 0, 1, ... written in plain decimal)");
  return std::stoll(digits);
}

// `entries`: the names in the candidate directory. Per-rank files must be a whole set,
// name.rank0.npy ... name.rank{ranks-1}.npy: a partial set (out.rank1.npy without out.rank0.npy
// was reported "absent: out") or a rank past --ranks is refused.
Files locate_candidate(const std::string& dir, const std::string& name, int ranks,
                       const std::vector<std::string>& entries) {
  Files f;
  const std::string g = dir + "/" + name + ".npy";
  const bool has_g = entry_present(g);
  std::set<int64_t> present;
  for (const std::string& e : entries) {
    const int64_t r = rank_of(e, name);
    if (r < 0) continue;
    LOOM_CHECK(r < ranks, InvalidArgument,
               "the candidate has " << dir << "/" << e << " but --ranks is " << ranks);
    present.insert(r);
  }
  LOOM_CHECK(!(has_g && !present.empty()), InvalidArgument,
             "the candidate has both " << name << ".npy and per-rank " << name
                                       << ".rank{r}.npy files; keep one of them");
  if (has_g) {
    f.present = true;
    f.files.push_back(npy_header(g));
  } else if (!present.empty()) {
    for (int r = 0; r < ranks; ++r)
      LOOM_CHECK(present.count(r), IoError,
                 "the candidate has " << name << ".rank" << *present.begin() << ".npy but not "
                                      << name << ".rank" << r << ".npy (--ranks " << ranks
                                      << ": per-rank files must be " << name << ".rank0.npy to "
                                      << name << ".rank" << ranks - 1 << ".npy)");
    f.present = true;
    f.per_rank = true;
    for (int r = 0; r < ranks; ++r)
      f.files.push_back(npy_header(dir + "/" + name + ".rank" + std::to_string(r) + ".npy"));
  }
  return f;
}

void read_candidate(Files& f) {
  if (!f.present) return;
  if (!f.per_rank) {
    f.global = read_body(f.files[0]);
    return;
  }
  for (const NpyFile& file : f.files) f.ranks.push_back(read_body(file));
}

// Batch element b of a candidate tensor, in global order: rows [S, A, B] or lse [H, S]. want:
// the [A, B] of every rank's rows (lse: [H]), from q or k, so that a wrong rank is named with
// the right shape (taken from rank 0, a wrong rank 0 was blamed on rank 1).
std::optional<Tensor<double>> assemble(const Files& f, const verify::Sharding& sh, Dims dims,
                                       int64_t b, int64_t batches, const std::string& name,
                                       bool lse, const std::vector<int64_t>& want) {
  if (!f.present) return std::nullopt;
  if (!f.per_rank)
    return lse ? lse_to_hs(f.global, dims, b, batches, name + ".npy")
               : rows_to_shd(f.global, dims, b, batches, name + ".npy");
  if (dims == Dims::shd) {  // the ranks' bodies are their [n_r, A, B] (lse [H, n_r]): no copies
    for (int r = 0; r < sh.ranks; ++r) {
      const std::string what = name + ".rank" + std::to_string(r) + ".npy";
      if (lse)
        check_lse_dims(f.ranks[r], dims, what);
      else
        check_row_dims(f.ranks[r], dims, what);
    }
    return lse ? verify::unshard_cols(sh, f.ranks, name, want[0])
               : verify::unshard_rows(sh, f.ranks, name, want);
  }
  std::vector<Tensor<double>> local;
  for (int r = 0; r < sh.ranks; ++r) {
    const std::string what = name + ".rank" + std::to_string(r) + ".npy";
    local.push_back(lse ? lse_to_hs(f.ranks[r], dims, b, batches, what)
                        : rows_to_shd(f.ranks[r], dims, b, batches, what));
  }
  return lse ? verify::unshard_cols(sh, local, name, want[0])
             : verify::unshard_rows(sh, local, name, want);
}

// The candidate's tensors, in the order run_verify reads them and the estimate counts them.
const std::vector<std::string> kCandidateNames = {"out", "lse", "dq", "dk", "dv"};

// As src/verify/verify.cc picks its rows (loom/verify.h): sampled check rows above
// --full-check-max, and at most kLocRows localisation rows and kLocBytes of their pair partials.
constexpr double kSampleRows = double(verify::kSampleRows);
constexpr double kLocRows = double(verify::kLocRows);
constexpr double kLocBytes = verify::kLocBytes;

// The problem's sizes, from the headers: per batch element, S tokens of H query and Hkv key
// heads of D; chunks: the convention's chunks (localisation's pairs grow with them).
struct VerifySizes {
  int64_t B = 1, S = 0, H = 0, Hkv = 0, D = 0;
  int chunks = 1;
  int64_t full_check_max = 0;
  bool shd = true;  // --layout-dims SHD: the bodies are [S, H, D] (lse [H, S]) already
};

// Peak bytes of a loom verify run, from the headers alone (nothing is read before it passes).
// Every tensor is held in double. In the order the run allocates them (run_verify, then
// verify::verify in src/verify/verify.cc):
//  1. the bodies: q, k, v, dout and every candidate file (all batch elements), held to the end;
//     each is read through its raw body (at most 8 bytes an element), freed once decoded;
//  2. the problem and the candidate in global [S, H, D] order. With one batch element (B = 1)
//     they are the bodies themselves (take_rows; a body in another layout is copied and then
//     freed, one at a time), and per-rank files are unsharded into a global tensor (SHD: from
//     the bodies; else copied rank by rank first, the copies freed after). With B > 1, per batch
//     element while it is checked: problem_of's copies of q, k, v and dout, and the candidate (a
//     global file's batch element copied; per-rank files as above);
//  3. inside verify(): its context (every token's position, document, chunk and rank, and the
//     sharding: about 64 bytes a token), then the largest of
//     a. the reference on the check rows (n: every row up to --full-check-max, else 256): out
//        and lse, with gradients dq and, where every row is checked, dk, dv of every key
//        ([S, Hkv, D]); sampled rows of q and dout are gathered (every row is read in place);
//     b. the reference's results, q's and dout's sampled rows gathered again for the tolerances
//        (check_limits), and for a problem outside the fixed tolerances' regime (which the
//        headers cannot tell) the bounds' own rows of keys and, with gradients where every row
//        is checked, four [S, Hkv, D] accumulators (sampled rows compare no dk, dv);
//     c. on a failure, localisation: the pair partials of the localisation rows and their lse,
//        the candidate and the reference on those rows, the heat map's directions, and with GQA
//        (1 < Hkv < H) gqa_model's q rows with permuted heads, its copy of the context and its
//        reference on those rows;
//     d. on a miss that rounding the exact values to float32 does not explain, before the
//        localisation: the reference's results and subnormal_reference's beside them (as a.);
//  4. the reports kept, a heat map of chunks^2 per batch element.
// The process as it stands is added, as loom attn adds it: its resident set in whole MiB, at
// least 12 MiB; and a margin for the allocator (below). Measured against the peak resident set in
// docs/verify.md ("Memory").
double estimate_verify_bytes(const std::vector<NpyFile>& inputs, const std::vector<Files>& files,
                             const VerifySizes& z) {
  const double e = 8;  // bytes of a double
  const double B = static_cast<double>(std::max<int64_t>(1, z.B)), S = static_cast<double>(z.S),
               H = static_cast<double>(z.H), Hkv = static_cast<double>(z.Hkv),
               D = static_cast<double>(z.D), nc = std::max(1, z.chunks);
  // 1. The bodies; 2. the problem and the candidate beside them (B = 1: the bodies, but for a
  // per-rank file's global tensor; B > 1: one batch element's copies). A body converted from
  // another layout with B = 1 is copied one at a time, at most `largest` beside the bodies.
  const bool single = z.B <= 1;
  double held = 0, largest = 0, batch_inputs = 0, batch_candidate = 0, unshard = 0;
  for (const NpyFile& f : inputs) {
    held += e * numel_of(f.shape);
    largest = std::max(largest, e * numel_of(f.shape));
    if (!single) batch_inputs += e * numel_of(f.shape) / B;
  }
  for (size_t i = 0; i < files.size(); ++i) {
    if (!files[i].present) continue;
    double pieces = 0;
    for (const NpyFile& f : files[i].files) {
      held += e * numel_of(f.shape);
      largest = std::max(largest, e * numel_of(f.shape));
      pieces += e * numel_of(f.shape) / B;
    }
    if (files[i].per_rank) {
      const std::string& name = kCandidateNames[i];
      const bool kv = name == "dk" || name == "dv";
      batch_candidate += e * (name == "lse" ? H * S : kv ? S * Hkv * D : S * H * D);
      if (!z.shd) unshard = std::max(unshard, pieces);
    } else if (!single) {
      batch_candidate += pieces;
    }
  }
  const bool out = files[0].present, dq = files[2].present;
  const bool grad = dq || files[3].present || files[4].present;
  // 3. Inside verify().
  const bool sampled = verify::checks_sampled_rows(z.S, z.full_check_max);
  const double n = sampled ? std::min(kSampleRows, S) : S;
  const double rows = e * n * H * D, rows_lse = e * n * H, keys = e * S * Hkv * D;
  // Sampled rows of q and dout are gathered; every row is read in place.
  const double gathered = sampled ? rows : 0, grad_keys = sampled ? 0 : 2 * keys;
  const double context = 64 * S + 64 * nc + e * n;
  const double a =
      gathered + rows + rows_lse + e * S + (grad ? gathered + rows + grad_keys + 3 * e * S : 0);
  const double ref = rows + rows_lse + (grad ? rows + grad_keys : 0);
  const double b =
      ref + gathered + 16 * e * S + (grad ? gathered + (sampled ? 0 : 4 * keys + e * S * Hkv) : 0);
  const double per_row = e * H * D * (2 * nc + 6);
  const double cap = std::max(16.0, std::min(kLocRows, std::floor(kLocBytes / per_row)));
  const double nl = std::ceil(n / std::ceil(n / cap));
  const double loc_rows = e * nl * H * D;
  double loc = 0;
  if (out) {  // pairs (nc + 7 rows of partials), their lse, observe, heat map, scale and GQA models
    loc = loc_rows * (nc + 7) + e * nl * H * (nc + 7) + 2 * loc_rows + e * S +
          e * (2 * nc + 1) * nl * D + 2 * e * std::min(64.0, nl) * H * D;
    // GQA: q's rows with permuted heads, the context's copy (positions, documents, sharding),
    // the reference's out and lse on them, the prediction.
    if (z.Hkv > 1 && z.Hkv < z.H) loc += 28 * S + 64 * nc + e * S + 3 * loc_rows + e * nl * H;
  }
  if (dq)  // pairs and dq shares (2 nc + 2 rows), their lse, observe, heat map
    loc = std::max(loc, loc_rows * (2 * nc + 2) + e * nl * H * (nc + 1) + 2 * loc_rows + e * S +
                            e * (nc + 1) * nl * D);
  // compute_pairs' threads (OpenMP's, localisation's only parallel loop) each score a chunk's
  // keys in a row of their own.
  if (out || dq) loc += std::max(1, omp_get_max_threads()) * e * S;
  // d.: q's and dout's sampled rows, out, dq (and dk, dv of every key where every row is
  // checked), a row of weights and of dp.
  const double model = gathered + rows + (grad ? gathered + rows + grad_keys : 0) + 2 * e * S;
  // The fp64 reference and the bounds read one kv head at a time from a contiguous copy of its k
  // and v rows (src/kernels/reference.cc, KvHead).
  const double kv_head = Hkv > 1 ? 2 * e * S * D : 0;
  const double inside = context + kv_head + std::max({a, b, ref + loc, ref + model});
  // 4. The reports.
  const double reports = 2 * e * B * nc * nc;
  const double run =
      std::max(largest, batch_inputs + batch_candidate + std::max(unshard, inside)) + reports;
  // The allocator's margin, 1/16 of the rest and at most 32 MiB: glibc serves blocks below its
  // mmap threshold (which it raises up to 32 MiB as larger blocks are freed) from its heap, whose
  // freed space stays resident while larger blocks are mapped beside it. (Without it the estimate
  // was within 1% of the peak in the GQA failure cases, all of the above live at once.)
  const double mib = 1024.0 * 1024.0;
  const double margin = std::min((held + run) / 16, 32 * mib);
  const double process = std::max(12 * mib, std::ceil(double(current_rss_bytes()) / mib) * mib);
  return process + held + run + margin;
}

// The address space a verify run maps beyond its estimate, for check_memory's mapped_bytes
// (threads_mapped_bytes, as loom attn counts its threads'): localisation's OpenMP workers
// (compute_pairs, in a failing run: omp_get_max_threads() - 1 of them), each a stack and a
// malloc arena, and the buffers OpenBLAS's own threads have still to map.
double verify_mapped_bytes(std::string* what) {
  const int threads = std::max(1, omp_get_max_threads());
  bool blas_missing = false;
  const double bytes = threads_mapped_bytes(0, 1, threads, true, &blas_missing);
  if (what)
    *what = "for the stacks and malloc arenas of its " + std::to_string(threads - 1) +
            " localisation thread" + (threads == 2 ? "" : "s") +
            (blas_missing ? " and OpenBLAS's buffers still to be mapped" : "") +
            "; a smaller OMP_NUM_THREADS maps less";
  return bytes;
}

int run_verify(const VerifyOptions& o) {
  for (const auto& [option, value] :
       {std::pair<const char*, const std::string*>{"--input", &o.input},
        {"--candidate", &o.candidate}})
    LOOM_CHECK(!value->empty(), InvalidArgument,
               option << " is required (loom verify --input DIR --candidate DIR)");
  require_directory(o.input, "--input");
  require_directory(o.candidate, "--candidate");
  LOOM_CHECK(o.window >= 0, InvalidArgument, "--window must be >= 0, got " << o.window);
  // Given, a scale is a positive finite number (0 meant "the default" and could pass).
  LOOM_CHECK(!o.scale_given || (std::isfinite(o.scale) && o.scale > 0), InvalidArgument,
             "--scale must be a positive finite number, got " << o.scale);
  // Taken in float32 (docs/verify.md): a scale that rounds to infinity there is refused as such
  // (1e39 went on to "out cannot be verified: ... bound ... not computable").
  // Both numbers in the fewest digits that read back as themselves (6 digits showed float32's
  // largest, 3.4028235e+38, as 3.40282e+38, below it).
  if (o.scale_given && std::isinf(static_cast<float>(o.scale))) {
    throw InvalidArgument("--scale " + exact_text(o.scale) + " overflows float32 (at most " +
                              exact_text(std::numeric_limits<float>::max()) +
                              "), in which the scale is taken",
                          __FILE__, __LINE__);
  }
  if (o.scale_given) check_scale_in_float32(o.scale);  // 5e-324 was refused as "got 0"
  LOOM_CHECK(o.full_check_max >= 1, InvalidArgument,
             "--full-check-max must be >= 1, got " << o.full_check_max);
  // Nor into the candidate directory, whose names are read (--json CAND/out.npy replaced the
  // candidate's out with the report, --json CAND/dq.rank0.npy planted a file), nor onto a
  // candidate file elsewhere through a symlink or a hard link (a hard link to an input was
  // refused, one to a candidate file was not).
  std::vector<std::string> entries;  // the candidate directory's names, listed once
  {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(o.candidate, ec))
      entries.push_back(e.path().filename().string());
    LOOM_CHECK(!ec, IoError,
               "--candidate " << o.candidate << ": cannot list (" << ec.message() << ")");
  }
  for (const auto& [option, path] :
       {std::pair<const char*, const std::string*>{"--json", &o.json}, {"--heatmap", &o.heatmap}}) {
    if (path->empty() || *path == "-") continue;
    check_output_outside(option, *path, "--candidate", o.candidate,
                         "whose files loom verify reads");
  }
  // Two outputs on one path, or an output onto an input or candidate file (a name, a symlink or
  // a hard link), are refused before any work; the files read are not compared among themselves
  // (q.npy may be a link to k.npy).
  std::vector<std::pair<std::string, std::string>> paths;
  for (const char* name : {"q.npy", "k.npy", "v.npy", "dout.npy", "cu_seqlens.npy"})
    paths.emplace_back("--input's " + std::string(name), o.input + "/" + name);
  for (const std::string& e : entries)
    paths.emplace_back("the candidate's " + e, o.candidate + "/" + e);
  const size_t read = paths.size();
  paths.emplace_back("--json", o.json);
  paths.emplace_back("--heatmap", o.heatmap);
  check_distinct_outputs(paths, read);
  check_output_writable(o.json, "--json");
  check_output_writable(o.heatmap, "--heatmap");
  const Dims dims = parse_dims(o.layout_dims);
  (void)verify::tolerance("out", o.dtype);
  const int64_t memory_limit =
      o.memory_limit.empty() ? -1 : parse_size(o.memory_limit, "--memory-limit");
  // The headers only: the bodies are read once the memory estimate has passed (a candidate of
  // 40 GiB in double was read piece by piece until the process was killed or ran out of memory).
  std::vector<NpyFile> inputs = {npy_header(o.input + "/q.npy"), npy_header(o.input + "/k.npy"),
                                 npy_header(o.input + "/v.npy")};
  // Shapes before any size is read (q.size(1) of a 0-d q threw std::out_of_range).
  check_row_dims(inputs[0].shape, dims, "q.npy");
  check_row_dims(inputs[1].shape, dims, "k.npy");
  check_row_dims(inputs[2].shape, dims, "v.npy");
  // A dout.npy of no elements counts as none.
  if (entry_present(o.input + "/dout.npy")) {
    NpyFile d = npy_header(o.input + "/dout.npy");
    if (numel_of(d.shape) > 0) {
      check_row_dims(d.shape, dims, "dout.npy");
      inputs.push_back(std::move(d));
    }
  }
  const std::vector<int64_t>& q_shape = inputs[0].shape;
  const int64_t B = dims == Dims::bshd ? q_shape[0] : 1;
  LOOM_CHECK(B >= 1, InvalidArgument,
             "q.npy has shape " << shape_str(q_shape) << ": no batch elements to check");
  std::vector<int64_t> docs;
  if (!o.docs.empty()) docs = parse_doc_lengths(o.docs);
  const std::string cu = o.input + "/cu_seqlens.npy";
  if (entry_present(cu)) {
    LOOM_CHECK(o.docs.empty(), InvalidArgument, "give documents either by --docs or by " << cu);
    const std::vector<int64_t> c = read_npy_index(cu);
    LOOM_CHECK(c.size() >= 2 && c[0] == 0, InvalidArgument,
               cu << " must be a 1-d array [0, L1, L1+L2, ...]");
    for (size_t i = 1; i < c.size(); ++i) {
      LOOM_CHECK(c[i] > c[i - 1], InvalidArgument,
                 cu << " must increase strictly (entry " << i << ")");
      docs.push_back(c[i] - c[i - 1]);
    }
  }

  // The convention must be able to split this sequence before any candidate file is read.
  const int64_t S = dims == Dims::shd ? q_shape[0] : q_shape[1];
  // A q of no tokens was refused as "--ranks must be in [1, 0] ..., got 1".
  LOOM_CHECK(S >= 1, InvalidArgument,
             "q.npy has shape " << shape_str(q_shape) << ": no tokens (S = 0), nothing to verify");
  // Every rank holds at least one token: --ranks 2147483647 ran out of memory building the
  // sharding ("an allocation outside loom's tensors failed", exit 1).
  LOOM_CHECK(o.ranks >= 1 && o.ranks <= S, InvalidArgument,
             "--ranks must be in [1, " << S << "] (at most the sequence length: every rank "
                                       << "holds at least one token), got " << o.ranks);
  VerifySizes sizes;
  sizes.chunks =
      static_cast<int>(verify::make_sharding(o.convention, S, o.ranks, docs).chunks.size());

  // The candidate's files, found and their headers read.
  std::vector<Files> files;
  for (const auto& n : kCandidateNames)
    files.push_back(locate_candidate(o.candidate, n, o.ranks, entries));

  // Memory: the whole run's peak, refused before any body is read.
  {
    const std::vector<int64_t>& k_shape = inputs[1].shape;
    sizes.B = B;
    sizes.S = S;
    sizes.H = dims == Dims::hsd ? q_shape[0] : q_shape[dims == Dims::bshd ? 2 : 1];
    sizes.D = q_shape.back();
    sizes.Hkv = dims == Dims::hsd ? k_shape[0] : k_shape[dims == Dims::bshd ? 2 : 1];
    sizes.full_check_max = o.full_check_max;
    sizes.shd = dims == Dims::shd;
    const double estimate = estimate_verify_bytes(inputs, files, sizes);
    std::string mapped_what;
    const double mapped = verify_mapped_bytes(&mapped_what);
    check_memory(estimate, memory_limit, "loom verify", "--memory-limit", mapped, mapped_what);
  }

  // The bodies.
  Tensor<double> q = read_body(inputs[0]);
  Tensor<double> k = read_body(inputs[1]);
  Tensor<double> v = read_body(inputs[2]);
  Tensor<double> dout = inputs.size() > 3 ? read_body(inputs[3]) : Tensor<double>();
  require_finite(q, "q.npy");
  require_finite(k, "k.npy");
  require_finite(v, "v.npy");
  require_finite(dout, "dout.npy");
  for (Files& f : files) read_candidate(f);

  // Batch element b as a problem, and the candidate for it assembled from the files in
  // convention conv (throws when conv cannot split the sequence or the files). With one batch
  // element (B = 1) both are built once from the bodies themselves (take_rows: an [S, H, D] body
  // is moved, not copied), and the convention retry below reassembles only the per-rank tensors;
  // with B > 1 each batch element's are copied out of the bodies while it is checked.
  auto bare_problem = [&] {
    verify::Problem p;
    p.mask.causal = o.causal;
    p.mask.window = o.window;
    p.scale = o.scale_given ? o.scale : 0;  // 0: the library's default, 1/sqrt(D)
    p.doc_lengths = docs;
    return p;
  };
  auto problem_of = [&](int64_t b) {
    verify::Problem p = bare_problem();
    p.q = rows_to_shd(q, dims, b, B, "q.npy");
    p.k = rows_to_shd(k, dims, b, B, "k.npy");
    p.v = rows_to_shd(v, dims, b, B, "v.npy");
    if (dout.numel()) p.dout = rows_to_shd(dout, dims, b, B, "dout.npy");
    return p;
  };
  verify::Problem single;  // B = 1: the problem, holding the bodies
  if (B == 1) {
    single = bare_problem();
    single.q = take_rows(std::move(q), dims, "q.npy");
    single.k = take_rows(std::move(k), dims, "k.npy");
    single.v = take_rows(std::move(v), dims, "v.npy");
    if (dout.numel()) single.dout = take_rows(std::move(dout), dims, "dout.npy");
  }
  // The candidate's tensors into c, in convention conv. A global file of the only batch element
  // is taken once (it does not depend on the convention); per-rank files are assembled again,
  // the previous assembly freed first.
  auto fill_candidate = [&](verify::Candidate& c, const verify::Problem& p, int64_t b,
                            const std::string& conv) {
    const verify::Sharding sh = verify::make_sharding(conv, p.q.size(0), o.ranks, docs);
    const std::vector<int64_t> hd = {p.q.size(1), p.q.size(2)}, kd = {p.k.size(1), p.k.size(2)};
    std::optional<Tensor<double>>* fields[] = {&c.out, &c.lse, &c.dq, &c.dk, &c.dv};
    for (size_t i = 0; i < kCandidateNames.size(); ++i) {
      const std::string& name = kCandidateNames[i];
      const bool lse = name == "lse";
      const std::vector<int64_t> want =
          lse ? std::vector<int64_t>{p.q.size(1)} : (name == "dk" || name == "dv" ? kd : hd);
      Files& f = files[i];
      if (B == 1 && f.present && !f.per_rank) {
        if (!*fields[i])
          *fields[i] = lse ? take_lse(std::move(f.global), dims, name + ".npy")
                           : take_rows(std::move(f.global), dims, name + ".npy");
        continue;
      }
      fields[i]->reset();
      *fields[i] = assemble(f, sh, dims, b, B, name, lse, want);
    }
  };
  verify::Candidate single_candidate;  // B = 1: the candidate, holding the global bodies
  // Batch element b checked with options vo (convention vo.convention).
  auto check = [&](int64_t b, const verify::Options& vo) {
    if (B == 1) {
      fill_candidate(single_candidate, single, 0, vo.convention);
      return verify::verify(single, single_candidate, vo);
    }
    const verify::Problem p = problem_of(b);
    verify::Candidate c;
    fill_candidate(c, p, b, vo.convention);
    return verify::verify(p, c, vo);
  };

  verify::Options vo;
  vo.convention = o.convention;
  vo.ranks = o.ranks;
  vo.dtype = o.dtype;
  vo.full_check_max = o.full_check_max;
  bool passed = true;
  std::vector<verify::Report> reports;
  for (int64_t b = 0; b < B; ++b) {
    reports.push_back(check(b, vo));
    passed = passed && reports.back().passed;
  }

  // Per-rank files that fail: are they in another convention's order? (A common mistake: the
  // files were written in one convention and described as another.)
  bool any_per_rank = false;
  for (const auto& f : files) any_per_rank = any_per_rank || f.per_rank;
  if (!passed && any_per_rank && o.ranks > 1) {
    for (const auto& conv : verify::convention_names()) {
      if (conv == o.convention) continue;
      bool all_pass = true;
      try {
        verify::Options alt = vo;
        alt.convention = conv;
        alt.localise = false;
        for (int64_t b = 0; b < B && all_pass; ++b) all_pass = check(b, alt).passed;
      } catch (const Error&) {
        all_pass = false;  // this convention cannot split the sequence or the files
      }
      if (!all_pass) continue;
      verify::Diagnosis d;
      d.kind = "row_order";
      d.residual = 0;
      d.text = "rows are in the wrong order: the per-rank files are in " + conv + " order, not " +
               o.convention + " (with --convention " + conv +
               " every tensor passes; the errors above and the heat map read them in " +
               o.convention + " order)";
      // It replaces the diagnoses: they were fitted to rows read in the wrong order, and one
      // printed after it as "or no known defect explains the out error" contradicted it.
      for (auto& r : reports)
        if (!r.passed) r.diagnoses = {d};
      break;
    }
  }

  // Output: text, then files.
  const verify::Report* shown = &reports[0];
  for (const auto& r : reports)
    if (!r.passed) {
      shown = &r;
      break;
    }
  // With an output on standard output ("-"), the text report stays off it (as in loom attn):
  // mixed in, it made the JSON unparseable.
  if (!o.quiet && o.json != "-" && o.heatmap != "-") {
    for (size_t b = 0; b < reports.size(); ++b) {
      if (B > 1) std::printf("batch %zu\n", b);
      std::fputs(reports[b].summary().c_str(), stdout);
    }
  }
  // Both outputs' bytes first, then written as a unit (write_outputs): one after another,
  // --json a.json --heatmap /dev/full left a new a.json behind a run that exited 2.
  std::vector<std::pair<std::string, std::string>> outputs;
  if (!o.json.empty()) {
    std::string j;
    if (B == 1) {
      j = reports[0].to_json();
    } else {
      j = "{\n\"passed\": " + std::string(passed ? "true" : "false") + ",\n\"batches\": [\n";
      for (size_t b = 0; b < reports.size(); ++b) j += (b ? ",\n" : "") + reports[b].to_json();
      j += "]\n}\n";
    }
    outputs.emplace_back(o.json, std::move(j));
  }
  if (!o.heatmap.empty()) outputs.emplace_back(o.heatmap, shown->heatmap_svg());
  write_outputs(outputs);
  return passed ? 0 : 1;
}

void declare_verify(CLI::App* c, VerifyOptions& opts) {
  VerifyOptions* o = &opts;
  // Required, but checked in run_verify rather than by CLI11, which checks required options
  // before unexpected arguments: `loom verify --bogus` said "--input is required".
  c->add_option("--input", o->input,
                "DIR with q.npy, k.npy, v.npy [, dout.npy, cu_seqlens.npy] (required)");
  c->add_option("--candidate", o->candidate,
                "DIR with any of out, lse, dq, dk, dv (.npy global or .rank{r}.npy per rank) "
                "(required)");
  c->add_option("--convention", o->convention,
                "sharding: contiguous, zigzag, stripe, rfa-zigzag, te-thd, torch-headtail, "
                "megatron")
      ->capture_default_str();
  c->add_option("--ranks", o->ranks, "context-parallel world size of the candidate")
      ->capture_default_str();
  add_mask_options(c, o->causal, o->window, o->docs);
  c->add_option("--scale", o->scale, "softmax scale (default 1/sqrt(D))");
  c->add_option("--dtype", o->dtype, "candidate storage: fp32 or bf16 (selects the tolerances)")
      ->capture_default_str();
  c->add_option("--layout-dims", o->layout_dims, "tensor layout on disk: SHD, BSHD or HSD")
      ->capture_default_str();
  c->add_option("--json", o->json, "write the report as JSON to FILE");
  c->add_option("--heatmap", o->heatmap, "write the (query chunk x KV chunk) heat map SVG to FILE");
  c->add_option("--full-check-max", o->full_check_max,
                "compare every row up to this many tokens; above it out, lse and dq on 256 "
                "sampled rows, and dk, dv only scanned for NaN and Inf (they need every row); "
                "at most 256 tokens are always compared whole")
      ->capture_default_str();
  c->add_flag("--quiet", o->quiet, "print nothing; only the exit status");
  add_memory_limit_option(c, o->memory_limit);
}

}  // namespace

void add_verify_command(CLI::App& app) {
  add_command<VerifyOptions>(
      app, "verify",
      "check another implementation's outputs against the exact answer, localise errors",
      declare_verify, [](const CLI::App* c, VerifyOptions& o) {
        o.scale_given = c->count("--scale") > 0;
        // loom verify uses no other rank: under mpirun every rank ran the whole check, printed
        // the report and rewrote --json and --heatmap. Rank 0 runs it; the others end at once.
        if (launched_by_mpirun() && launcher_rank() > 0) return 0;
        try {
          return run_verify(o);
        } catch (const Error& e) {
          // Unusable input: one line, exit status 2 (a failed check is 1).
          std::fprintf(stderr, "loom: error: %s\n", e.what());
          return 2;
        } catch (const std::bad_alloc&) {
          std::fprintf(stderr,
                       "loom: error: out of memory (an allocation outside loom's tensors "
                       "failed); check smaller inputs\n");
          return 2;
        } catch (const std::exception& e) {
          // Anything else is unusable input too, never "a tensor failed" (exit status 1).
          std::fprintf(stderr, "loom: error: %s\n", e.what());
          return 2;
        }
      });
}

}  // namespace loom::tools
