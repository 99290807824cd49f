// Sharding conventions of other context-parallel implementations, as token lists per rank, and
// the chunks localisation speaks of. Each convention is written from that project's code (cited
// in loom/verify.h and docs/verify.md); loom's own three come from ShardPlan::make.
#include <algorithm>
#include <new>
#include <numeric>
#include <sstream>
#include <stdexcept>

#include "loom/cp.h"
#include "loom/verify.h"

namespace loom::verify {

std::vector<std::string> convention_names() {
  return {"contiguous", "zigzag", "stripe", "rfa-zigzag", "te-thd", "torch-headtail", "megatron"};
}

namespace {

std::string choices() {
  std::string s;
  const auto names = convention_names();
  for (size_t i = 0; i < names.size(); ++i) s += (i ? ", " : "") + names[i];
  return s;
}

// Adds the tokens [first, first + count) as one chunk owned by rank r.
void add_chunk(Sharding& sh, int r, int64_t first, int64_t count,
               std::vector<std::vector<int64_t>>& chunk_tokens, std::vector<int>& owner,
               int64_t chunk_id) {
  for (int64_t i = 0; i < count; ++i) sh.tokens[r].push_back(first + i);
  if (count <= 0) return;
  auto& c = chunk_tokens[static_cast<size_t>(chunk_id)];
  for (int64_t i = 0; i < count; ++i) c.push_back(first + i);
  owner[static_cast<size_t>(chunk_id)] = r;
}

// The dual-chunk ("head and tail") split shared by rfa-zigzag, te-thd, torch-headtail and
// megatron: every document is cut into 2P pieces of `piece(len, c)` tokens starting at
// `start(len, c)`, and rank r takes piece r then piece 2P - 1 - r of every document, document
// after document. Chunk c of the result is the union of piece c over the documents.
template <class Begin>
void dual_chunk(Sharding& sh, const std::vector<int64_t>& docs, Begin begin) {
  const int P = sh.ranks;
  // Reserved before the first token (rank r's two pieces of every document), so that a sequence
  // too long for memory fails at once, not after filling it.
  for (int r = 0; r < P; ++r) {
    int64_t n = 0;
    for (const int64_t len : docs)
      n += begin(len, r + 1) - begin(len, r) + begin(len, 2 * P - r) - begin(len, 2 * P - 1 - r);
    sh.tokens[r].reserve(static_cast<size_t>(n));
  }
  std::vector<std::vector<int64_t>> chunk_tokens(2 * P);
  std::vector<int> owner(2 * P, -1);
  int64_t start = 0;
  for (int64_t len : docs) {
    for (int r = 0; r < P; ++r) {
      for (int64_t c : {static_cast<int64_t>(r), static_cast<int64_t>(2 * P - 1 - r)}) {
        const int64_t b = begin(len, c), e = begin(len, c + 1);
        add_chunk(sh, r, start + b, e - b, chunk_tokens, owner, c);
      }
    }
    start += len;
  }
  for (int c = 0; c < 2 * P; ++c) {
    if (chunk_tokens[c].empty()) continue;
    std::sort(chunk_tokens[c].begin(), chunk_tokens[c].end());
    sh.chunks.push_back(chunk_tokens[c]);
    sh.chunk_rank.push_back(owner[c]);
  }
}

}  // namespace

namespace {

Sharding build_sharding(const std::string& convention, int64_t seq, int ranks,
                        const std::vector<int64_t>& doc_lengths) {
  const std::vector<int64_t> docs = checked_doc_lengths(seq, doc_lengths);
  Sharding sh;
  sh.convention = convention;
  sh.seq = seq;
  sh.ranks = ranks;
  sh.documents = static_cast<int64_t>(doc_lengths.size());
  sh.tokens.assign(ranks, {});
  const int64_t two_p = 2 * static_cast<int64_t>(ranks);

  if (convention == "contiguous" || convention == "zigzag" || convention == "stripe") {
    const ShardPlan plan = ShardPlan::make(parse_layout(convention), seq, ranks, doc_lengths);
    sh.tokens = plan.tokens;
    if (ranks == 1) {
      // One rank: cut the sequence into up to 8 contiguous chunks, only for localisation.
      const int64_t n = std::min<int64_t>(8, seq);
      for (int64_t c = 0; c < n; ++c) {
        const int64_t b = c * (seq / n) + std::min(c, seq % n);
        const int64_t e = (c + 1) * (seq / n) + std::min(c + 1, seq % n);
        std::vector<int64_t> t(static_cast<size_t>(e - b));
        std::iota(t.begin(), t.end(), b);
        sh.chunks.push_back(t);
        sh.chunk_rank.push_back(0);
      }
      return sh;
    }
    if (convention == "stripe") {
      // A stripe rank's tokens are one chunk (its KV block).
      for (int r = 0; r < ranks; ++r) {
        if (plan.tokens[r].empty()) continue;
        sh.chunks.push_back(plan.tokens[r]);
        sh.chunk_rank.push_back(r);
      }
      return sh;
    }
    // contiguous: P chunks; zigzag: 2P chunks; with documents, chunk c is the union of piece c
    // of every document. Pieces follow ShardPlan's rule: a run of L tokens cut into n pieces
    // gives the first L mod n pieces one more token.
    const int pieces = convention == "zigzag" ? 2 * ranks : ranks;
    std::vector<std::vector<int64_t>> ct(pieces);
    std::vector<int> owner(pieces, -1);
    int64_t start = 0;
    for (int64_t len : docs) {
      const int64_t base = len / pieces, extra = len % pieces, big = extra * (base + 1);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t c = t < big ? t / (base + 1) : extra + (t - big) / std::max<int64_t>(base, 1);
        ct[c].push_back(start + t);
        owner[c] = convention == "zigzag" && c >= ranks ? static_cast<int>(2 * ranks - 1 - c)
                                                        : static_cast<int>(c);
      }
      start += len;
    }
    for (int c = 0; c < pieces; ++c) {
      if (ct[c].empty()) continue;
      std::sort(ct[c].begin(), ct[c].end());
      sh.chunks.push_back(ct[c]);
      sh.chunk_rank.push_back(owner[c]);
    }
    return sh;
  }

  if (convention == "rfa-zigzag") {
    // torch.chunk(n): chunks of ceil(L / n) tokens; fewer than n chunks when L is too short.
    for (int64_t len : docs) {
      const int64_t size = (len + two_p - 1) / two_p;
      const int64_t count = (len + size - 1) / size;
      LOOM_CHECK(count == two_p, InvalidArgument,
                 "rfa-zigzag: torch.chunk(" << two_p << ") of a sequence of " << len
                                            << " tokens gives only " << count
                                            << " chunks, so ring-flash-attention's extract_local "
                                               "cannot index chunk "
                                            << two_p - 1);
    }
    dual_chunk(sh, docs, [&](int64_t len, int64_t c) {
      const int64_t size = (len + two_p - 1) / two_p;
      return std::min(len, c * size);
    });
    return sh;
  }

  if (convention == "te-thd" || convention == "torch-headtail" || convention == "megatron") {
    for (size_t d = 0; d < docs.size(); ++d)
      LOOM_CHECK(
          docs[d] % two_p == 0, InvalidArgument,
          convention << " needs every " << (doc_lengths.empty() ? "sequence" : "document")
                     << " length divisible by 2 * ranks = " << two_p << "; "
                     << (doc_lengths.empty() ? "the sequence" : "document " + std::to_string(d))
                     << " has " << docs[d] << " tokens");
    dual_chunk(sh, docs, [&](int64_t len, int64_t c) { return c * (len / two_p); });
    return sh;
  }
  throw InvalidArgument("unknown convention '" + convention + "' (choose " + choices() + ")");
}

}  // namespace

Sharding make_sharding(const std::string& convention, int64_t seq, int ranks,
                       const std::vector<int64_t>& doc_lengths) {
  LOOM_CHECK(seq >= 1, InvalidArgument, "sequence length must be >= 1, got " << seq);
  LOOM_CHECK(ranks >= 1, InvalidArgument, "--ranks must be >= 1, got " << ranks);
  // Every token is listed twice (its rank's rows, its chunk), 16 bytes each, and every rank has
  // a token list and up to two chunks: a sequence or a rank count no memory holds is the
  // library's OutOfMemory naming its size (2^62 tokens threw std::bad_alloc; 2^31 - 1 ranks
  // failed on 48 GiB of per-rank lists and the message named the 10 tokens' 0.001 MiB). loom's
  // three conventions fail up front in ShardPlan::make; the others reserve first.
  try {
    return build_sharding(convention, seq, ranks, doc_lengths);
  } catch (const std::bad_alloc&) {
  } catch (const std::length_error&) {
  }
  // Per rank: its token list, and up to two chunks (a list and an owner each).
  const double per_rank = 3.0 * sizeof(std::vector<int64_t>) + 2.0 * sizeof(int);
  const double bytes = static_cast<double>(seq) * 16.0 + static_cast<double>(ranks) * per_rank;
  std::ostringstream os;
  os << "out of memory: the " << convention << " sharding of " << seq << " tokens over " << ranks
     << " ranks lists every token twice and keeps lists per rank, " << bytes / (1 << 20)
     << " MiB: too "
     << (static_cast<double>(ranks) * per_rank > static_cast<double>(seq) * 16.0
             ? "many ranks"
             : "long a sequence")
     << " for this machine's memory";
  throw OutOfMemory(os.str(), __FILE__, __LINE__);
}

void Sharding::check() const {
  LOOM_CHECK(seq >= 1, InvalidArgument, "Sharding: seq must be >= 1, got " << seq);
  LOOM_CHECK(ranks >= 1 && tokens.size() == static_cast<size_t>(ranks), InvalidArgument,
             "Sharding: ranks is " << ranks << " but tokens holds the lists of " << tokens.size()
                                   << " ranks (one per rank, ranks >= 1)");
  // Counted first, so that a sharding claiming a huge seq is refused before the table below.
  size_t total = 0;
  for (const auto& t : tokens) total += t.size();
  LOOM_CHECK(total == static_cast<uint64_t>(seq), InvalidArgument,
             "Sharding: the ranks' tokens list " << total << " tokens but seq is " << seq
                                                 << " (every token of [0, seq) on exactly one "
                                                    "rank)");
  std::vector<int> owner(static_cast<size_t>(seq), -1);
  for (int r = 0; r < ranks; ++r) {
    for (size_t i = 0; i < tokens[r].size(); ++i) {
      const int64_t t = tokens[r][i];
      LOOM_CHECK(
          t >= 0 && t < seq, InvalidArgument,
          "Sharding: tokens[" << r << "][" << i << "] = " << t << " is outside [0, " << seq << ")");
      LOOM_CHECK(owner[t] < 0, InvalidArgument,
                 "Sharding: token " << t << " is listed twice (by rank " << owner[t]
                                    << " and as tokens[" << r << "][" << i
                                    << "]): every token must be on exactly one rank");
      owner[t] = r;
    }
  }
  LOOM_CHECK(chunk_rank.size() == chunks.size(), InvalidArgument,
             "Sharding: " << chunks.size() << " chunks but chunk_rank names the ranks of "
                          << chunk_rank.size());
  total = 0;
  for (const auto& c : chunks) total += c.size();
  LOOM_CHECK(total == static_cast<uint64_t>(seq), InvalidArgument,
             "Sharding: the chunks list " << total << " tokens but seq is " << seq
                                          << " (every token in exactly one chunk)");
  std::vector<bool> seen(static_cast<size_t>(seq), false);
  for (size_t c = 0; c < chunks.size(); ++c) {
    const int r = chunk_rank[c];
    LOOM_CHECK(r >= 0 && r < ranks, InvalidArgument,
               "Sharding: chunk_rank[" << c << "] = " << r << " is outside [0, " << ranks << ")");
    for (size_t i = 0; i < chunks[c].size(); ++i) {
      const int64_t t = chunks[c][i];
      LOOM_CHECK(
          t >= 0 && t < seq, InvalidArgument,
          "Sharding: chunks[" << c << "][" << i << "] = " << t << " is outside [0, " << seq << ")");
      LOOM_CHECK(i == 0 || t > chunks[c][i - 1], InvalidArgument,
                 "Sharding: chunks[" << c << "] is not ascending at " << i << " (" << t << " after "
                                     << chunks[c][i - 1] << ")");
      LOOM_CHECK(!seen[t], InvalidArgument,
                 "Sharding: token " << t << " is in two chunks (again in chunks[" << c << "])");
      LOOM_CHECK(owner[t] == r, InvalidArgument,
                 "Sharding: chunks[" << c << "] belongs to rank " << r << " (chunk_rank) but its "
                                     << "token " << t << " is on rank " << owner[t]);
      seen[t] = true;
    }
  }
}

namespace {

// What both unshard functions check first: one tensor per rank, and, where the caller gives no
// expected shape (they are read from rank 0), rank 0 of `dims` dimensions (`expected` says
// which, for the message).
void check_locals(const Sharding& sh, const std::vector<Tensor<double>>& local,
                  const std::string& what, int64_t dims, const char* expected, bool given) {
  LOOM_CHECK(static_cast<int>(local.size()) == sh.ranks, InvalidArgument,
             what << ": expected " << sh.ranks << " per-rank tensors, got " << local.size());
  LOOM_CHECK(
      given || local[0].dim() == dims, InvalidArgument,
      what << ".rank0 has shape " << shape_str(local[0].shape()) << ", expected " << expected);
}

// "<what>.rank<r> has shape [..] but <convention> with <P> ranks gives rank <r> ": the start of
// a per-rank shape error; the caller adds the shape the convention gives, then hint().
std::string rank_mismatch(const Sharding& sh, const std::string& what, int r,
                          const Tensor<double>& t) {
  std::ostringstream os;
  os << what << ".rank" << r << " has shape " << shape_str(t.shape()) << " but " << sh.convention
     << " with " << sh.ranks << " ranks gives rank " << r << " ";
  return os.str();
}

// The end of a per-rank shape error: with packed documents, contiguous is per document (as
// ShardPlan::make cuts it), not the sequence cut in P runs, which files written that way miss.
std::string hint(const Sharding& sh) {
  if (sh.convention != "contiguous" || sh.documents < 2 || sh.ranks < 2) return "";
  std::ostringstream os;
  os << " (with " << sh.documents << " documents, contiguous cuts each document into " << sh.ranks
     << " pieces and rank r holds piece r of every document; a contiguous split of the packed "
        "sequence is not a convention loom verify knows: give global files, name.npy, instead)";
  return os.str();
}

}  // namespace

Tensor<double> unshard_rows(const Sharding& sh, const std::vector<Tensor<double>>& local,
                            const std::string& what, const std::vector<int64_t>& row_shape) {
  LOOM_CHECK(row_shape.empty() || row_shape.size() == 2, InvalidArgument,
             "unshard_rows: row_shape must be empty or [A, B], got " << shape_str(row_shape));
  sh.check();
  check_locals(sh, local, what, 3, "3 dims", !row_shape.empty());
  // The sizes every rank must have: the caller's (q's or k's), else rank 0's. Read from rank 0,
  // a wrong rank 0 was blamed on rank 1, with rank 0's wrong sizes as the expected ones.
  const int64_t a = row_shape.empty() ? local[0].size(1) : row_shape[0];
  const int64_t b = row_shape.empty() ? local[0].size(2) : row_shape[1];
  Tensor<double> g({sh.seq, a, b});
  for (int r = 0; r < sh.ranks; ++r) {
    const auto& t = local[r];
    const int64_t n = static_cast<int64_t>(sh.tokens[r].size());
    LOOM_CHECK(t.dim() == 3 && t.size(0) == n && t.size(1) == a && t.size(2) == b, InvalidArgument,
               rank_mismatch(sh, what, r, t) << n << " rows of [" << a << ", " << b << "]"
                                             << (t.dim() == 3 && t.size(0) != n ? hint(sh) : ""));
    for (int64_t i = 0; i < n; ++i)
      std::copy(t.data() + i * a * b, t.data() + (i + 1) * a * b,
                g.data() + sh.tokens[r][i] * a * b);
  }
  return g;
}

Tensor<double> unshard_cols(const Sharding& sh, const std::vector<Tensor<double>>& local,
                            const std::string& what, int64_t rows) {
  LOOM_CHECK(rows >= -1, InvalidArgument,
             "unshard_cols: rows must be -1 (rank 0's) or a size, got " << rows);
  sh.check();
  check_locals(sh, local, what, 2, "[H, n]", rows >= 0);
  const int64_t a = rows >= 0 ? rows : local[0].size(0);
  Tensor<double> g({a, sh.seq});
  for (int r = 0; r < sh.ranks; ++r) {
    const auto& t = local[r];
    const int64_t n = static_cast<int64_t>(sh.tokens[r].size());
    LOOM_CHECK(t.dim() == 2 && t.size(0) == a && t.size(1) == n, InvalidArgument,
               rank_mismatch(sh, what, r, t) << "[" << a << ", " << n << "]"
                                             << (t.dim() == 2 && t.size(0) == a ? hint(sh) : ""));
    for (int64_t h = 0; h < a; ++h)
      for (int64_t i = 0; i < n; ++i) g[h * sh.seq + sh.tokens[r][i]] = t[h * n + i];
  }
  return g;
}

template <class T>
Tensor<T> gather_rows(const Tensor<T>& x, const std::vector<int64_t>& rows) {
  LOOM_CHECK(x.dim() == 3, InvalidArgument,
             "gather_rows needs a 3-d tensor, got shape " << shape_str(x.shape()));
  const int64_t w = x.size(1) * x.size(2);
  Tensor<T> y({static_cast<int64_t>(rows.size()), x.size(1), x.size(2)});
  for (size_t r = 0; r < rows.size(); ++r) {
    LOOM_CHECK(rows[r] >= 0 && rows[r] < x.size(0), InvalidArgument,
               "gather_rows: row " << rows[r] << " is outside [0, " << x.size(0) << ")");
    std::copy(x.data() + rows[r] * w, x.data() + (rows[r] + 1) * w, y.data() + r * w);
  }
  return y;
}

template Tensor<float> gather_rows(const Tensor<float>&, const std::vector<int64_t>&);
template Tensor<double> gather_rows(const Tensor<double>&, const std::vector<int64_t>&);

}  // namespace loom::verify
