// The byte corpus: documents, the validation split, and the sequences of a step.
#include "loom/model/data.h"

#include <algorithm>
#include <cctype>

#include "loom/error.h"
#include "loom/io.h"
#include "loom/rng.h"

namespace loom::model {

namespace {

// True when the line at `p` starts with a KJV reference "<book>1:1 " (a book's first verse).
bool is_book_start(const std::string& t, size_t p) {
  size_t i = p;
  while (i < t.size() && std::isdigit(static_cast<unsigned char>(t[i]))) ++i;  // "1Sm"
  const size_t letters = i;
  while (i < t.size() && std::isalpha(static_cast<unsigned char>(t[i]))) ++i;
  if (i == letters) return false;
  return t.compare(i, 4, "1:1 ") == 0;
}

std::vector<size_t> find_documents(const std::string& t) {
  std::vector<size_t> kjv;
  for (size_t p = 0; p < t.size();) {
    if (is_book_start(t, p)) kjv.push_back(p);
    const size_t nl = t.find('\n', p);
    if (nl == std::string::npos) break;
    p = nl + 1;
  }
  if (kjv.size() >= 2) {
    kjv[0] = 0;  // anything before Genesis belongs to the first book
    return kjv;
  }
  // Blank lines separate documents: "\n\n", or "\r\n\r\n" in CRLF text (whose blank lines were
  // not seen: a CRLF file was one document). A document starts after the last blank line.
  auto line_end = [&](size_t p) {  // length of the line end "\n" or "\r\n" at p, or 0
    if (p < t.size() && t[p] == '\n') return size_t{1};
    return p + 1 < t.size() && t[p] == '\r' && t[p + 1] == '\n' ? size_t{2} : size_t{0};
  };
  std::vector<size_t> starts{0};
  for (size_t p = t.find('\n'); p != std::string::npos; p = t.find('\n', p + 1)) {
    size_t s = p + 1;
    if (line_end(s) == 0) continue;  // not followed by a blank line
    while (const size_t n = line_end(s)) s += n;
    if (s < t.size() && s > starts.back()) starts.push_back(s);
    p = s - 1;
  }
  return starts;
}

void append(Split& s, const std::string& t, size_t begin, size_t end) {
  if (end <= begin) return;
  s.doc_starts.push_back(s.size());
  s.bytes.insert(s.bytes.end(), t.begin() + static_cast<std::ptrdiff_t>(begin),
                 t.begin() + static_cast<std::ptrdiff_t>(end));
}

}  // namespace

Corpus make_corpus(const std::string& text, const std::string& source) {
  LOOM_CHECK(!text.empty(), IoError, "--data " << source << " is empty");
  Corpus c;
  c.source = source;
  std::vector<size_t> starts = find_documents(text);
  c.documents = static_cast<int64_t>(starts.size());
  starts.push_back(text.size());
  for (size_t d = 0; d + 1 < starts.size(); ++d) {
    const size_t b = starts[d], e = starts[d + 1], len = e - b;
    const size_t tail = static_cast<size_t>(static_cast<double>(len) * kValFraction);
    size_t cut = e - tail;
    // Move the cut back to the start of its line when that at most doubles the held-out tail.
    const size_t nl = cut > b ? text.rfind('\n', cut - 1) : std::string::npos;
    if (nl != std::string::npos && nl >= b && cut - (nl + 1) <= tail) cut = nl + 1;
    append(c.train, text, b, cut);
    append(c.val, text, cut, e);
  }
  return c;
}

Corpus load_corpus(const std::string& path) {
  // Regular files only (a FIFO or /dev/zero would block or grow without bound), at most 1 GiB;
  // `loom train --data-limit` reads with its own limit and calls make_corpus.
  constexpr size_t kLimit = size_t{1} << 30;
  std::string text;
  try {
    InputFile f(path, "--data");
    text = f.read_rest(kLimit, "--data-limit");
  } catch (const IoError& e) {
    throw IoError(std::string("cannot read ") + e.what(), __FILE__, __LINE__);
  }
  return make_corpus(text, path);
}

int64_t Sequence::predicted() const {
  return std::count_if(target.begin(), target.end(), [](int32_t t) { return t >= 0; });
}

Sequence make_sequence(const Split& split, int64_t offset, int64_t seq, bool pack_documents) {
  // The window [offset, offset + seq + 1) must lie in the split (written without overflow: a
  // window past the end read beyond the bytes, seq -1 ended in std::length_error).
  LOOM_CHECK(seq >= 1, InvalidArgument, "sequence length must be >= 1, got " << seq);
  LOOM_CHECK(
      offset >= 0 && offset < split.size() && seq <= split.size() - 1 - offset, InvalidArgument,
      "window of " << seq << " + 1 bytes at offset " << offset << " does not fit the split of "
                   << split.size()
                   << " bytes (need offset >= 0 and offset + seq + 1 <= " << split.size() << ")");
  Sequence s;
  s.input.resize(static_cast<size_t>(seq));
  s.target.resize(static_cast<size_t>(seq));
  s.rope_pos.resize(static_cast<size_t>(seq));
  // Document of each of the seq + 1 window bytes (all 0 without packing).
  std::vector<int64_t> doc(static_cast<size_t>(seq + 1), 0);
  std::vector<int64_t> doc_begin(static_cast<size_t>(seq + 1), offset);
  if (pack_documents) {
    auto it = std::upper_bound(split.doc_starts.begin(), split.doc_starts.end(), offset);
    int64_t d = static_cast<int64_t>(it - split.doc_starts.begin()) - 1;
    for (int64_t t = 0; t <= seq; ++t) {
      while (d + 1 < static_cast<int64_t>(split.doc_starts.size()) &&
             split.doc_starts[d + 1] <= offset + t)
        ++d;
      doc[t] = d;
      doc_begin[t] = std::max(split.doc_starts[d], offset);
    }
  }
  for (int64_t t = 0; t < seq; ++t) {
    s.input[t] = split.bytes[offset + t];
    s.target[t] = doc[t + 1] == doc[t] ? split.bytes[offset + t + 1] : -1;
    s.rope_pos[t] = offset + t - doc_begin[t];
  }
  if (pack_documents) {
    int64_t run = 1;
    for (int64_t t = 1; t < seq; ++t) {
      if (doc[t] != doc[t - 1]) {
        s.doc_lengths.push_back(run);
        run = 0;
      }
      ++run;
    }
    s.doc_lengths.push_back(run);
    if (s.doc_lengths.size() == 1) s.doc_lengths.clear();
  }
  return s;
}

int64_t train_offset(const Split& split, int64_t seq, uint64_t seed, int64_t step, int64_t index) {
  // At least one window of seq + 1 bytes (seq == size divided by zero, seq > size gave a
  // negative offset).
  LOOM_CHECK(seq >= 1 && seq < split.size(), InvalidArgument,
             "sequence length " << seq << " does not fit the split of " << split.size()
                                << " bytes (need 1 <= seq <= " << split.size() - 1 << ")");
  const uint64_t starts = static_cast<uint64_t>(split.size() - seq);  // offsets 0 .. size-seq-1
  const auto w = philox4x32({static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32),
                             static_cast<uint32_t>(index), 0x7a17u},
                            rng_key(seed, "train-data"));
  const uint64_t r = (static_cast<uint64_t>(w[0]) << 32) | w[1];
  return static_cast<int64_t>(r % starts);
}

std::vector<int64_t> val_offsets(const Split& split, int64_t seq, int64_t count) {
  LOOM_CHECK(seq >= 1, InvalidArgument, "sequence length must be >= 1, got " << seq);
  std::vector<int64_t> out;
  const int64_t last = split.size() - seq - 1;
  if (last < 0 || count <= 0) return out;
  // There are last + 1 distinct windows: more than that are spaced at most 1 apart, so they are
  // every offset 0 .. last, which count = last + 1 gives (i itself) without first pushing
  // `count` offsets (--eval-batches 99999999999 grew past 7.9 GB before the de-duplication).
  count = std::min(count, last + 1);
  out.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    // last x i in 128 bits: it overflowed int64 past 3e9 windows of a large split.
    const __int128 x = count == 1 ? 0 : static_cast<__int128>(last) * i / (count - 1);
    out.push_back(static_cast<int64_t>(x));
  }
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace loom::model
