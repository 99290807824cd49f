// `loom verify`: check another implementation's attention outputs (out, lse, dq, dk, dv, global or
// per rank in a named sharding convention) against loom's fp64 reference, and localise what is
// wrong. Exit status: 0 pass, 1 fail, 2 unusable input. The library does the work
// (loom/verify.h); this file reads files, reorders layouts and prints.
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
#include "loom/verify.h"

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
void check_row_dims(const Tensor<double>& x, Dims dims, const std::string& what) {
  const int want = dims == Dims::bshd ? 4 : 3;
  const char* layout = dims == Dims::shd ? "SHD" : dims == Dims::bshd ? "BSHD" : "HSD";
  const char* shape = dims == Dims::shd    ? "[S, H, D]"
                      : dims == Dims::bshd ? "[B, S, H, D]"
                                           : "[H, S, D]";
  LOOM_CHECK(x.dim() == want, InvalidArgument,
             what << " has shape " << shape_str(x.shape()) << " but --layout-dims " << layout
                  << " needs " << shape);
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

// Batch element b (of `batches`) of an lse tensor on disk as [H, S].
Tensor<double> lse_to_hs(const Tensor<double>& x, Dims dims, int64_t b, int64_t batches,
                         const std::string& what) {
  if (dims == Dims::bshd) {
    LOOM_CHECK(x.dim() == 3, InvalidArgument,
               what << " has shape " << shape_str(x.shape()) << " but --layout-dims BSHD needs "
                    << "lse [B, H, S]");
    check_batches(x, batches, what);
    const int64_t H = x.size(1), S = x.size(2);
    Tensor<double> y({H, S});
    std::copy(x.data() + b * H * S, x.data() + (b + 1) * H * S, y.data());
    return y;
  }
  LOOM_CHECK(x.dim() == 2, InvalidArgument,
             what << " has shape " << shape_str(x.shape()) << " but lse must be [H, S]");
  return x;
}

int64_t batch_of(const Tensor<double>& q, Dims dims) {
  return dims == Dims::bshd && q.dim() == 4 ? q.size(0) : 1;
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

// A candidate tensor as files: global `name.npy` or per rank `name.rank{r}.npy`.
struct Files {
  bool present = false, per_rank = false;
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
Files read_candidate(const std::string& dir, const std::string& name, int ranks,
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
    f.global = read_npy_f64(g);
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
      f.ranks.push_back(read_npy_f64(dir + "/" + name + ".rank" + std::to_string(r) + ".npy"));
  }
  return f;
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
  std::vector<Tensor<double>> local;
  for (int r = 0; r < sh.ranks; ++r) {
    const std::string what = name + ".rank" + std::to_string(r) + ".npy";
    local.push_back(lse ? lse_to_hs(f.ranks[r], dims, b, batches, what)
                        : rows_to_shd(f.ranks[r], dims, b, batches, what));
  }
  return lse ? verify::unshard_cols(sh, local, name, want[0])
             : verify::unshard_rows(sh, local, name, want);
}

int run_verify(const VerifyOptions& o) {
  LOOM_CHECK(fs::is_directory(o.input), IoError, "--input " << o.input << " is not a directory");
  LOOM_CHECK(fs::is_directory(o.candidate), IoError,
             "--candidate " << o.candidate << " is not a directory");
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
  // Two outputs on one path, or an output onto an input file, are refused before any work.
  std::vector<std::pair<std::string, std::string>> paths;
  for (const char* name : {"q.npy", "k.npy", "v.npy", "dout.npy", "cu_seqlens.npy"})
    paths.emplace_back("--input's " + std::string(name), o.input + "/" + name);
  paths.emplace_back("--json", o.json);
  paths.emplace_back("--heatmap", o.heatmap);
  check_distinct_outputs(paths, 5);  // q.npy may be a link to k.npy: inputs are not compared
  // Nor into the candidate directory, whose names are read (--json CAND/out.npy replaced the
  // candidate's out with the report, --json CAND/dq.rank0.npy planted a file), nor onto a
  // candidate file elsewhere through a symlink.
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
    const std::string key = output_key(*path);
    for (const std::string& e : entries)
      LOOM_CHECK(output_key(o.candidate + "/" + e) != key, InvalidArgument,
                 option << " " << *path << " and the candidate's " << e
                        << " name the same file; give each output its own path");
  }
  check_output_writable(o.json, "--json");
  check_output_writable(o.heatmap, "--heatmap");
  const Dims dims = parse_dims(o.layout_dims);
  (void)verify::tolerance("out", o.dtype);
  const Tensor<double> q = read_npy_f64(o.input + "/q.npy");
  const Tensor<double> k = read_npy_f64(o.input + "/k.npy");
  const Tensor<double> v = read_npy_f64(o.input + "/v.npy");
  Tensor<double> dout;
  if (entry_present(o.input + "/dout.npy")) dout = read_npy_f64(o.input + "/dout.npy");
  // Shapes before any size is read (q.size(1) of a 0-d q threw std::out_of_range).
  check_row_dims(q, dims, "q.npy");
  check_row_dims(k, dims, "k.npy");
  check_row_dims(v, dims, "v.npy");
  if (dout.numel()) check_row_dims(dout, dims, "dout.npy");
  require_finite(q, "q.npy");
  require_finite(k, "k.npy");
  require_finite(v, "v.npy");
  require_finite(dout, "dout.npy");
  const int64_t B = batch_of(q, dims);
  LOOM_CHECK(B >= 1, InvalidArgument,
             "q.npy has shape " << shape_str(q.shape()) << ": no batch elements to check");
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
  const int64_t S = dims == Dims::hsd ? q.size(1) : (dims == Dims::bshd ? q.size(1) : q.size(0));
  // A q of no tokens was refused as "--ranks must be in [1, 0] ..., got 1".
  LOOM_CHECK(
      S >= 1, InvalidArgument,
      "q.npy has shape " << shape_str(q.shape()) << ": no tokens (S = 0), nothing to verify");
  // Every rank holds at least one token: --ranks 2147483647 ran out of memory building the
  // sharding ("an allocation outside loom's tensors failed", exit 1).
  LOOM_CHECK(o.ranks >= 1 && o.ranks <= S, InvalidArgument,
             "--ranks must be in [1, " << S << "] (at most the sequence length: every rank "
                                       << "holds at least one token), got " << o.ranks);
  (void)verify::make_sharding(o.convention, S, o.ranks, docs);

  // Candidate files, read once.
  const std::vector<std::string> names = {"out", "lse", "dq", "dk", "dv"};
  std::vector<Files> files;
  for (const auto& n : names) files.push_back(read_candidate(o.candidate, n, o.ranks, entries));

  // Batch row b as a problem, and the candidate for it assembled from the files in convention
  // conv (throws when conv cannot split the sequence or the files).
  auto problem_of = [&](int64_t b) {
    verify::Problem p;
    p.q = rows_to_shd(q, dims, b, B, "q.npy");
    p.k = rows_to_shd(k, dims, b, B, "k.npy");
    p.v = rows_to_shd(v, dims, b, B, "v.npy");
    if (dout.numel()) p.dout = rows_to_shd(dout, dims, b, B, "dout.npy");
    p.mask.causal = o.causal;
    p.mask.window = o.window;
    p.scale = o.scale_given ? o.scale : 0;  // 0: the library's default, 1/sqrt(D)
    p.doc_lengths = docs;
    return p;
  };
  auto candidate_of = [&](const verify::Problem& p, int64_t b, const std::string& conv) {
    const verify::Sharding sh = verify::make_sharding(conv, p.q.size(0), o.ranks, docs);
    verify::Candidate c;
    const std::vector<int64_t> hd = {p.q.size(1), p.q.size(2)}, kd = {p.k.size(1), p.k.size(2)};
    c.out = assemble(files[0], sh, dims, b, B, "out", false, hd);
    c.lse = assemble(files[1], sh, dims, b, B, "lse", true, {p.q.size(1)});
    c.dq = assemble(files[2], sh, dims, b, B, "dq", false, hd);
    c.dk = assemble(files[3], sh, dims, b, B, "dk", false, kd);
    c.dv = assemble(files[4], sh, dims, b, B, "dv", false, kd);
    return c;
  };

  verify::Options vo;
  vo.convention = o.convention;
  vo.ranks = o.ranks;
  vo.dtype = o.dtype;
  vo.full_check_max = o.full_check_max;
  bool passed = true;
  std::vector<verify::Report> reports;
  for (int64_t b = 0; b < B; ++b) {
    const verify::Problem p = problem_of(b);
    reports.push_back(verify::verify(p, candidate_of(p, b, o.convention), vo));
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
        for (int64_t b = 0; b < B && all_pass; ++b) {
          const verify::Problem p = problem_of(b);
          all_pass = verify::verify(p, candidate_of(p, b, conv), alt).passed;
        }
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
  c->add_option("--input", o->input, "DIR with q.npy, k.npy, v.npy [, dout.npy, cu_seqlens.npy]")
      ->required();
  c->add_option("--candidate", o->candidate,
                "DIR with any of out, lse, dq, dk, dv (.npy global or .rank{r}.npy per rank)")
      ->required();
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
                "sampled rows, and dk, dv only scanned for NaN and Inf (they need every row)")
      ->capture_default_str();
  c->add_flag("--quiet", o->quiet, "print nothing; only the exit status");
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
