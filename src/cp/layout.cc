// Layouts: how a global sequence (optionally packed documents) is split over P ranks.
//
// Every layout is described by the same ShardPlan: for each rank, the global token index of each
// local row, its document, and the segments (chunks) of local rows. Chunk sizes follow one rule
// everywhere: a run of L tokens cut into c chunks gives the first L mod c chunks one more token.
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <iterator>
#include <sstream>

#include "loom/cp.h"

namespace loom {

Layout parse_layout(const std::string& name) {
  if (name == "contiguous") return Layout::contiguous;
  if (name == "zigzag") return Layout::zigzag;
  if (name == "stripe") return Layout::stripe;
  throw InvalidArgument("unknown layout '" + name + "' (choose contiguous, zigzag or stripe)");
}

std::string to_string(Layout l) {
  static const char* const names[] = {"contiguous", "zigzag", "stripe"};
  const size_t i = static_cast<size_t>(l);
  return i < std::size(names) ? names[i] : "?";
}

std::vector<int64_t> parse_doc_lengths(const std::string& text) {
  std::vector<int64_t> out;
  if (text.empty()) throw InvalidArgument("--docs is empty (expected lengths like 100,200,50)");
  size_t p = 0;
  while (p <= text.size()) {
    const size_t end = std::min(text.find(',', p), text.size());
    const std::string item = text.substr(p, end - p);
    bool digits = !item.empty();
    for (char c : item) digits = digits && std::isdigit(static_cast<unsigned char>(c));
    if (!digits)
      throw InvalidArgument("--docs: '" + item + "' in '" + text +
                            "' is not a positive integer (expected lengths like 100,200,50)");
    // A length past int64 is named as such (19 digits and more were "not a positive integer").
    errno = 0;
    const long long v = std::strtoll(item.c_str(), nullptr, 10);
    if (errno == ERANGE)
      throw InvalidArgument("--docs: the document length " + item +
                            " is past 2^63 - 1 (the sequence's tokens are int64)");
    if (v <= 0) throw InvalidArgument("--docs: document lengths must be positive, got " + item);
    out.push_back(v);
    if (end == text.size()) break;
    p = end + 1;
  }
  return out;
}

namespace {
// Start of chunk c when L tokens are cut into n chunks, the first L mod n one longer.
int64_t chunk_begin(int64_t len, int64_t n, int64_t c) {
  const int64_t base = len / n, extra = len % n;
  return c * base + std::min(c, extra);
}
}  // namespace

std::vector<int64_t> checked_doc_lengths(int64_t seq, const std::vector<int64_t>& doc_lengths) {
  std::vector<int64_t> docs = doc_lengths;
  if (docs.empty()) docs.push_back(seq);
  int64_t total = 0;
  for (int64_t l : docs) {
    LOOM_CHECK(l >= 1, InvalidArgument, "document lengths must be positive, got " << l);
    LOOM_CHECK(!__builtin_add_overflow(total, l, &total), InvalidArgument,
               "document lengths sum to more than 2^63 (the sequence has " << seq << " tokens)");
  }
  LOOM_CHECK(total == seq, InvalidArgument,
             "document lengths sum to " << total << " but the sequence has " << seq << " tokens");
  return docs;
}

ShardPlan ShardPlan::make(Layout layout, int64_t seq, int ranks,
                          const std::vector<int64_t>& doc_lengths) {
  LOOM_CHECK(seq >= 1, InvalidArgument, "sequence length must be >= 1, got " << seq);
  LOOM_CHECK(ranks >= 1, InvalidArgument, "ranks must be >= 1, got " << ranks);
  // A Layout outside the enumeration (a cast integer) matched no case below and gave a plan with
  // no tokens on any rank.
  LOOM_CHECK(
      layout == Layout::contiguous || layout == Layout::zigzag || layout == Layout::stripe,
      InvalidArgument,
      "layout must be contiguous, zigzag or stripe, got the value " << static_cast<int>(layout));
  ShardPlan p;
  p.layout = layout;
  p.seq = seq;
  p.ranks = ranks;
  p.doc_lengths = doc_lengths;
  const std::vector<int64_t> docs = checked_doc_lengths(seq, doc_lengths);
  const bool with_docs = !doc_lengths.empty();
  // The plan lists every token (8 bytes, 4 more with documents) and keeps three lists per rank
  // (and, while it is made, a count per rank): the per-rank lists allocated and each rank's rows
  // counted and reserved up front, so that a sequence or a rank count no memory holds is refused
  // at once as OutOfMemory naming its size (2^40 tokens, and 2^31 - 1 ranks, threw
  // std::bad_alloc).
  const auto out_of_memory = [&] {
    const double per_rank = 3.0 * sizeof(std::vector<int64_t>) + sizeof(int64_t);
    const double tokens_bytes = static_cast<double>(seq) * (with_docs ? 12.0 : 8.0);
    const double ranks_bytes = static_cast<double>(ranks) * per_rank;
    std::ostringstream os;
    os << "out of memory: a shard plan of " << seq << " tokens over " << ranks
       << " ranks lists every token and keeps lists per rank, "
       << (tokens_bytes + ranks_bytes) / (1 << 20) << " MiB: too "
       << (ranks_bytes > tokens_bytes ? "many ranks" : "long a sequence")
       << " for this machine's memory";
    return OutOfMemory(os.str(), __FILE__, __LINE__);
  };
  std::vector<int64_t> held;
  try {
    p.tokens.assign(ranks, {});
    p.docs.assign(ranks, {});
    p.segments.assign(ranks, {});
    held.assign(static_cast<size_t>(ranks), 0);
  } catch (const std::exception&) {  // std::bad_alloc, or std::length_error past max_size()
    throw out_of_memory();
  }
  {
    int64_t begin = 0;
    const int64_t P = ranks;
    const auto below = [P](int64_t n, int64_t r) { return n / P + (n % P > r ? 1 : 0); };
    for (const int64_t len : docs) {
      for (int64_t r = 0; r < P; ++r) {
        if (layout == Layout::contiguous)
          held[r] += chunk_begin(len, P, r + 1) - chunk_begin(len, P, r);
        else if (layout == Layout::zigzag)
          held[r] += chunk_begin(len, 2 * P, r + 1) - chunk_begin(len, 2 * P, r) +
                     chunk_begin(len, 2 * P, 2 * P - r) - chunk_begin(len, 2 * P, 2 * P - 1 - r);
        else  // stripe: the tokens g of [begin, begin + len) with g mod P = r
          held[r] += below(begin + len, r) - below(begin, r);
      }
      begin += len;
    }
  }
  try {
    for (int r = 0; r < ranks; ++r) {
      p.tokens[r].reserve(static_cast<size_t>(held[r]));
      if (with_docs) p.docs[r].reserve(static_cast<size_t>(held[r]));
    }
  } catch (const std::exception&) {  // std::bad_alloc, or std::length_error past max_size()
    throw out_of_memory();
  }
  auto add_run = [&](int r, int64_t first, int64_t count, int32_t doc) {
    if (count <= 0) return;
    auto& t = p.tokens[r];
    p.segments[r].push_back(Segment{static_cast<int64_t>(t.size()), count});
    for (int64_t i = 0; i < count; ++i) {
      t.push_back(first + i);
      if (with_docs) p.docs[r].push_back(doc);
    }
  };
  int64_t start = 0;
  for (size_t d = 0; d < docs.size(); ++d) {
    const int64_t len = docs[d];
    const int32_t doc = static_cast<int32_t>(d);
    switch (layout) {
      case Layout::contiguous:
        for (int r = 0; r < ranks; ++r) {
          const int64_t b = chunk_begin(len, ranks, r), e = chunk_begin(len, ranks, r + 1);
          add_run(r, start + b, e - b, doc);
        }
        break;
      case Layout::zigzag:
        for (int r = 0; r < ranks; ++r) {
          for (int64_t c : {static_cast<int64_t>(r), static_cast<int64_t>(2 * ranks - 1 - r)}) {
            const int64_t b = chunk_begin(len, 2 * ranks, c);
            const int64_t e = chunk_begin(len, 2 * ranks, c + 1);
            add_run(r, start + b, e - b, doc);
          }
        }
        break;
      case Layout::stripe:
        for (int r = 0; r < ranks; ++r) {
          // Token t of the document goes to rank (start + t) mod P; one segment per document.
          auto& t = p.tokens[r];
          const int64_t before = static_cast<int64_t>(t.size());
          for (int64_t g = start; g < start + len; ++g) {
            if (g % ranks == r) {
              t.push_back(g);
              if (with_docs) p.docs[r].push_back(doc);
            }
          }
          const int64_t n = static_cast<int64_t>(t.size()) - before;
          if (n > 0) p.segments[r].push_back(Segment{before, n});
        }
        break;
    }
    start += len;
  }
  return p;
}

void ShardPlan::check() const {
  LOOM_CHECK(ranks >= 1 && tokens.size() == static_cast<size_t>(ranks) &&
                 docs.size() == tokens.size() && segments.size() == tokens.size(),
             InvalidArgument,
             "shard plan: " << ranks << " ranks but tokens, docs and segments for " << tokens.size()
                            << ", " << docs.size() << " and " << segments.size());
  LOOM_CHECK(
      layout == Layout::contiguous || layout == Layout::zigzag || layout == Layout::stripe,
      InvalidArgument,
      "shard plan: layout must be contiguous, zigzag or stripe, got " << static_cast<int>(layout));
  LOOM_CHECK(seq >= 0, InvalidArgument, "shard plan: seq must be >= 0, got " << seq);
  // Document d spans [starts[d], starts[d + 1]).
  std::vector<int64_t> starts{0};
  for (int64_t l : checked_doc_lengths(seq, doc_lengths)) starts.push_back(starts.back() + l);
  const auto doc_of = [&](int64_t t) {
    return std::upper_bound(starts.begin(), starts.end(), t) - starts.begin() - 1;
  };
  // Every token once: as many rows as tokens (checked first, so that a plan claiming a huge seq
  // is refused before the table below is allocated), each token seen once.
  int64_t held = 0;
  for (const std::vector<int64_t>& t : tokens) held += static_cast<int64_t>(t.size());
  LOOM_CHECK(held == seq, InvalidArgument,
             "shard plan: the ranks hold " << held << " tokens of a sequence of " << seq);
  std::vector<bool> seen(static_cast<size_t>(seq), false);
  for (int r = 0; r < ranks; ++r) {
    const std::vector<int64_t>& t = tokens[r];
    const int64_t n = static_cast<int64_t>(t.size());
    LOOM_CHECK(doc_lengths.empty() ? docs[r].empty() : docs[r].size() == t.size(), InvalidArgument,
               "shard plan: rank " << r << " has " << docs[r].size() << " document indices for "
                                   << n << " rows (" << (doc_lengths.empty() ? "none" : "one each")
                                   << " expected)");
    for (int64_t i = 0; i < n; ++i) {
      check_token(r, i);
      LOOM_CHECK(!seen[static_cast<size_t>(t[i])], InvalidArgument,
                 "shard plan: token " << t[i] << " is held twice (again by rank " << r << " row "
                                      << i << ")");
      seen[static_cast<size_t>(t[i])] = true;
      LOOM_CHECK(docs[r].empty() || docs[r][i] == doc_of(t[i]), InvalidArgument,
                 "shard plan: rank " << r << " row " << i << " says token " << t[i]
                                     << " is in document " << docs[r][i] << ", but it is in "
                                     << doc_of(t[i]));
    }
    // Segments: consecutive runs of rows covering the shard in order, each of ascending tokens
    // of one document (the strategies find empty block pairs from a segment's first and last).
    int64_t next = 0;
    for (const Segment& g : segments[r]) {
      LOOM_CHECK(g.begin == next && g.count >= 1 && g.count <= n - g.begin, InvalidArgument,
                 "shard plan: rank " << r << "'s segment [" << g.begin << ", +" << g.count
                                     << ") does not continue its segments at row " << next
                                     << " within its " << n << " rows");
      for (int64_t i = g.begin + 1; i < g.begin + g.count; ++i)
        LOOM_CHECK(t[i] > t[i - 1] && doc_of(t[i]) == doc_of(t[g.begin]), InvalidArgument,
                   "shard plan: rank " << r << " row " << i << " (token " << t[i]
                                       << ") does not follow row " << i - 1 << " (token "
                                       << t[i - 1]
                                       << ") in ascending order within one document, as a "
                                          "segment must");
      next = g.begin + g.count;
    }
    LOOM_CHECK(
        next == n, InvalidArgument,
        "shard plan: rank " << r << "'s segments cover " << next << " of its " << n << " rows");
  }
}

int64_t ShardPlan::max_rows() const {
  int64_t m = 0;
  for (int r = 0; r < ranks; ++r) m = std::max(m, rows(r));
  return m;
}

void ShardPlan::check_token(int r, int64_t i) const {
  const int64_t t = tokens[r][static_cast<size_t>(i)];
  LOOM_CHECK(t >= 0 && t < seq, InvalidArgument,
             "shard plan: rank " << r << " row " << i << " holds token " << t
                                 << ", outside the sequence [0, " << seq << ")");
}

void ShardPlan::rank_error(int r, const char* what) const {
  std::ostringstream os;
  os << "ShardPlan::" << what << ": rank " << r << " is outside the plan's ranks [0, " << ranks
     << ")";
  throw InvalidArgument(os.str(), __FILE__, __LINE__);
}

Tokens ShardPlan::token_info(int r) const {
  check_rank(r, "token_info");
  return Tokens{tokens[r].data(), docs[r].empty() ? nullptr : docs[r].data(), rows(r)};
}

Tensor<float> ShardPlan::shard(const Tensor<float>& global, int r) const {
  check_rank(r, "shard");
  LOOM_CHECK(global.dim() == 3 && global.size(0) == seq, InvalidArgument,
             "shard: expected a [" << seq << ", H, D] tensor, got " << shape_str(global.shape()));
  const int64_t w = global.size(1) * global.size(2);
  Tensor<float> out({rows(r), global.size(1), global.size(2)});
  for (int64_t i = 0; i < rows(r); ++i) {
    check_token(r, i);
    std::copy_n(global.data() + tokens[r][i] * w, w, out.data() + i * w);
  }
  return out;
}

void ShardPlan::unshard(const Tensor<float>& local, int r, Tensor<float>& global) const {
  check_rank(r, "unshard");
  LOOM_CHECK(local.dim() == 3 && local.size(0) == rows(r) && global.dim() == 3 &&
                 global.size(0) == seq && global.size(1) == local.size(1) &&
                 global.size(2) == local.size(2),
             InvalidArgument,
             "unshard: local " << shape_str(local.shape()) << " does not fit global "
                               << shape_str(global.shape()) << " for rank " << r);
  const int64_t w = local.size(1) * local.size(2);
  for (int64_t i = 0; i < rows(r); ++i) {
    check_token(r, i);
    std::copy_n(local.data() + i * w, w, global.data() + tokens[r][i] * w);
  }
}

Tensor<float> ShardPlan::shard_lse(const Tensor<float>& global, int r) const {
  check_rank(r, "shard_lse");
  LOOM_CHECK(global.dim() == 2 && global.size(1) == seq, InvalidArgument,
             "shard_lse: expected an [H, " << seq << "] tensor, got " << shape_str(global.shape()));
  const int64_t H = global.size(0), n = rows(r);
  Tensor<float> out({H, n});
  for (int64_t i = 0; i < n; ++i) {
    check_token(r, i);
    for (int64_t h = 0; h < H; ++h) out[h * n + i] = global[h * seq + tokens[r][i]];
  }
  return out;
}

void ShardPlan::unshard_lse(const Tensor<float>& local, int r, Tensor<float>& global) const {
  check_rank(r, "unshard_lse");
  LOOM_CHECK(local.dim() == 2 && local.size(1) == rows(r) && global.dim() == 2 &&
                 global.size(1) == seq && global.size(0) == local.size(0),
             InvalidArgument,
             "unshard_lse: local " << shape_str(local.shape()) << " does not fit global "
                                   << shape_str(global.shape()) << " for rank " << r
                                   << " (lse is [H, rows], [H, seq])");
  const int64_t H = local.size(0), n = rows(r);
  for (int64_t i = 0; i < n; ++i) {
    check_token(r, i);
    for (int64_t h = 0; h < H; ++h) global[h * seq + tokens[r][i]] = local[h * n + i];
  }
}

}  // namespace loom
