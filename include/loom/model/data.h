// model/data.h: the byte-level corpus of the trainer and the sequences drawn from it.
//
// A corpus is a text file read as bytes (tokens 0..255), cut into documents:
//   * the King James Bible as `bible -f gen1:1-rev22:21` prints it: one verse per line, each
//     line starting with "<book><chapter>:<verse> " ("Ge1:1 ", "1Sm1:1 "); a book (a document)
//     starts at every verse 1:1, so the Bible gives its 66 books;
//   * any other text: documents are separated by blank lines ("\n\n", or "\r\n\r\n" in CRLF
//     text; a run of blank lines is one separator);
//   * no separator found: the whole file is one document.
// The held-out validation split is the last kValFraction of every document (moved back to the
// start of its line when that at most doubles the tail), so training and validation see the same
// books but never the same bytes. Both splits are kept as one stream with document starts.
//
// A training sequence of S tokens is the window stream[o, o + S + 1): inputs are its first S
// bytes and the target of input t is byte t + 1 (so every input predicts a token, and the
// global token t's target is known to every rank: all ranks hold the whole window). The window
// start o depends only on (seed, step, sequence index) through Philox, so a resumed run draws
// exactly the sequences of an uninterrupted one. With packed documents, the window's document
// boundaries become the attention's document mask, a target in another document than its input
// is not predicted (-1), and rotary positions restart at every document; without, the window
// is one document and the rotary position is the global token index.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace loom::model {

constexpr double kValFraction = 0.05;

struct Split {
  std::vector<uint8_t> bytes;
  std::vector<int64_t> doc_starts;  // ascending, doc_starts[0] == 0 (when bytes is non-empty)
  int64_t size() const { return static_cast<int64_t>(bytes.size()); }
};

struct Corpus {
  std::string source;  // the file name
  Split train, val;
  int64_t documents = 0;
};

// Reads and splits a text file. IoError when it cannot be read or is empty.
Corpus load_corpus(const std::string& path);
// The same from bytes in memory (tests).
Corpus make_corpus(const std::string& text, const std::string& source);

struct Sequence {
  std::vector<int32_t> input;        // [S] byte values
  std::vector<int32_t> target;       // [S] next byte, or -1 (not predicted)
  std::vector<int64_t> doc_lengths;  // packed documents (sum S), or empty (one document)
  std::vector<int64_t> rope_pos;     // [S] rotary position of each token
  int64_t predicted() const;         // targets >= 0
};

// The window of `seq` + 1 bytes at `offset` of the split. Requires seq >= 1, offset >= 0 and
// offset + seq + 1 <= split.size(); InvalidArgument naming the values otherwise.
Sequence make_sequence(const Split& split, int64_t offset, int64_t seq, bool pack_documents);

// Offset of training sequence `index` of step `step` (uniform over the valid starts). Requires
// 1 <= seq <= split.size() - 1 (at least one window); InvalidArgument otherwise.
int64_t train_offset(const Split& split, int64_t seq, uint64_t seed, int64_t step, int64_t index);
// Offsets of the `count` validation windows: evenly spaced over the split, fixed for a run,
// without repeats; at most the split's size - seq distinct windows (a larger count gives them
// all, each once; none when seq >= the split's size or count <= 0). Requires seq >= 1
// (InvalidArgument).
std::vector<int64_t> val_offsets(const Split& split, int64_t seq, int64_t count);

}  // namespace loom::model
