// NumPy .npy reading and writing.
//
// The format: magic "\x93NUMPY", major and minor version bytes, a little-endian header length
// (2 bytes in version 1, 4 bytes in versions 2 and 3), then an ASCII Python dict literal
//   {'descr': '<f4', 'fortran_order': False, 'shape': (4, 8, 64), }
// padded with spaces to a multiple of 64 bytes and ending in '\n', then the raw data. We accept
// only little-endian f4/f8 in C order and refuse anything else with one line naming the file.
#include "loom/npy.h"

#include "loom/io.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>

namespace loom {

namespace {

// numpy writes headers of a few hundred bytes; anything far longer is not a real .npy file.
constexpr size_t kMaxHeaderBytes = size_t{1} << 20;

struct Header {
  std::string descr;
  bool fortran = false;
  std::vector<int64_t> shape;
  size_t data_offset = 0;
};

[[noreturn]] void fail(const std::string& what, const std::string& why) {
  // Bytes from the file's header are shown escaped: a NUL in the descr cut the printed message
  // short ("dtype <f4", which reads as supported), a control character garbled the line.
  std::string shown;
  for (unsigned char c : why) {
    if (c < 0x20 || c == 0x7f) {
      char esc[8];
      std::snprintf(esc, sizeof esc, "\\x%02x", c);
      shown += esc;
    } else {
      shown += static_cast<char>(c);
    }
  }
  throw IoError(what + ": " + shown);
}

// The header's dict literal, read strictly: '{', then entries 'key': value separated by commas
// (a trailing comma allowed), '}', then only spaces and the final newline. Keys are quoted
// strings, each of 'descr', 'fortran_order' and 'shape' exactly once and nothing else; a value is
// a quoted string (returned without its quotes), a parenthesised tuple (returned with them) or a
// bare word (True, False). numpy refuses the rest too; a search for each key took the first of
// two 'fortran_order' entries where numpy takes the last (a Fortran-order array read as C order)
// and accepted unknown keys and text after the '}'.
struct DictEntry {
  std::string key, value;
  bool quoted = false;
};
std::vector<DictEntry> parse_dict(const std::string& dict, const std::string& what) {
  size_t p = 0;
  auto skip = [&] {
    while (p < dict.size() && std::isspace(static_cast<unsigned char>(dict[p]))) ++p;
  };
  auto malformed = [&](const std::string& why) -> void {
    fail(what, "malformed npy header (" + why + ")");
  };
  // A quoted string at p (' or "), without escapes (numpy's keys and dtypes have none).
  auto quoted = [&]() -> std::string {
    const char q = dict[p];
    const size_t close = dict.find(q, p + 1);
    if (close == std::string::npos) malformed("an unterminated string");
    std::string v = dict.substr(p + 1, close - p - 1);
    p = close + 1;
    return v;
  };
  skip();
  if (p >= dict.size() || dict[p] != '{') malformed("no dict");
  ++p;
  std::vector<DictEntry> entries;
  for (;;) {
    skip();
    if (p < dict.size() && dict[p] == '}') break;
    if (p >= dict.size() || (dict[p] != '\'' && dict[p] != '"')) malformed("a key is not a string");
    DictEntry e;
    e.key = quoted();
    skip();
    if (p >= dict.size() || dict[p] != ':') malformed("no ':' after '" + e.key + "'");
    ++p;
    skip();
    if (p >= dict.size()) malformed("no value for '" + e.key + "'");
    if (dict[p] == '\'' || dict[p] == '"') {
      e.value = quoted();
      e.quoted = true;
    } else if (dict[p] == '(') {
      const size_t close = dict.find(')', p);
      if (close == std::string::npos) malformed("an unterminated tuple");
      e.value = dict.substr(p, close - p + 1);
      p = close + 1;
    } else {
      const size_t b = p;
      while (p < dict.size() && std::isalnum(static_cast<unsigned char>(dict[p]))) ++p;
      e.value = dict.substr(b, p - b);
      if (e.value.empty()) malformed("the value of '" + e.key + "'");
    }
    for (const DictEntry& seen : entries)
      if (seen.key == e.key) malformed("'" + e.key + "' given twice");
    if (e.key != "descr" && e.key != "fortran_order" && e.key != "shape")
      malformed("an unknown key '" + e.key + "'");
    entries.push_back(e);
    skip();
    if (p < dict.size() && dict[p] == ',') {
      ++p;
      continue;
    }
    skip();
    if (p >= dict.size() || dict[p] != '}')
      malformed("no ',' or '}' after '" + entries.back().key + "'");
    break;
  }
  ++p;
  skip();
  if (p != dict.size()) malformed("text after the dict");
  for (const char* key : {"descr", "fortran_order", "shape"}) {
    bool found = false;
    for (const DictEntry& e : entries) found = found || e.key == key;
    if (!found) fail(what, std::string("npy header has no '") + key + "' entry");
  }
  return entries;
}

std::vector<int64_t> parse_shape(const std::string& text, const std::string& what) {
  // A Python tuple of non-negative integers, as numpy writes it and reads it back (ast's
  // literal_eval, then a tuple of ints required): "()", "(n,)" or "(a, b, ...)", a trailing
  // comma allowed after two or more. "(2)" is the integer 2 and "(2 3)" no Python at all: numpy
  // refuses both, and they were read as [2] and [2, 3].
  const auto bad = [&] {
    fail(what, "malformed shape " + text +
                   " in npy header (a Python tuple such as (2, 3), (2,) or () is required)");
  };
  if (text.size() < 2 || text.front() != '(' || text.back() != ')') bad();
  const size_t end = text.size() - 1;  // the ')'
  size_t p = 1;
  const auto skip = [&] {
    while (p < end && std::isspace(static_cast<unsigned char>(text[p]))) ++p;
  };
  std::vector<int64_t> shape;
  bool trailing_comma = false;
  skip();
  while (p < end) {
    if (!std::isdigit(static_cast<unsigned char>(text[p]))) bad();
    int64_t v = 0;
    while (p < end && std::isdigit(static_cast<unsigned char>(text[p]))) {
      if (v > (std::numeric_limits<int64_t>::max() - 9) / 10)
        fail(what, "shape " + text + " is too large");
      v = v * 10 + (text[p] - '0');
      ++p;
    }
    if (p < end && text[p] == 'L') ++p;  // Python 2 long suffix
    shape.push_back(v);
    // loom's tensors have at most 4 dimensions (loom/tensor.h).
    if (shape.size() > 4) fail(what, "shape " + text + " has more than 4 dimensions");
    skip();
    trailing_comma = false;
    if (p == end) break;
    if (text[p] != ',') bad();  // "(2 3)", "(2;3)"
    ++p;
    trailing_comma = true;
    skip();
  }
  if (shape.size() == 1 && !trailing_comma) bad();  // "(2)": an int, not a tuple
  return shape;
}

Header parse_header(const uint8_t* bytes, size_t size, const std::string& what) {
  static const char kMagic[] = "\x93NUMPY";
  if (size < 10 || std::memcmp(bytes, kMagic, 6) != 0) fail(what, "not a .npy file (bad magic)");
  const int major = bytes[6];
  size_t hlen = 0, start = 0;
  if (major == 1) {
    hlen = bytes[8] | (static_cast<size_t>(bytes[9]) << 8);
    start = 10;
  } else if (major == 2 || major == 3) {
    if (size < 12) fail(what, "truncated npy header");
    hlen = bytes[8] | (static_cast<size_t>(bytes[9]) << 8) |
           (static_cast<size_t>(bytes[10]) << 16) | (static_cast<size_t>(bytes[11]) << 24);
    start = 12;
  } else {
    fail(what, "unsupported npy format version " + std::to_string(major));
  }
  if (hlen > size - start) fail(what, "truncated npy header");
  Header h;
  const std::string dict(reinterpret_cast<const char*>(bytes + start), hlen);
  for (const DictEntry& e : parse_dict(dict, what)) {
    if (e.key == "descr") {
      if (!e.quoted) fail(what, "malformed descr '" + e.value + "' in npy header");
      h.descr = e.value;
    } else if (e.key == "fortran_order") {
      if (e.quoted || (e.value != "True" && e.value != "False"))
        fail(what, "malformed fortran_order '" + e.value + "' in npy header");
      h.fortran = e.value == "True";
    } else {
      if (e.value.size() < 2 || e.value.front() != '(') fail(what, "malformed shape in npy header");
      h.shape = parse_shape(e.value, what);
    }
  }
  h.data_offset = start + hlen;
  return h;
}

}  // namespace

namespace {
// Element size of a header's dtype (4 or 8) and the bytes of data it declares; refuses what we
// cannot read, and sizes that overflow. `integers`: also accept '<i4' and '<i8' (index arrays
// such as cu_seqlens); `is_int` says which kind was found.
size_t body_bytes(const Header& h, const std::string& what, size_t& esize, size_t& count,
                  bool integers = false, bool* is_int = nullptr) {
  if (h.fortran) fail(what, "Fortran-order arrays are not supported (save with C order)");
  if (is_int) *is_int = false;
  if (h.descr == "<f4") {
    esize = 4;
  } else if (h.descr == "<f8") {
    esize = 8;
  } else if (integers && (h.descr == "<i4" || h.descr == "<i8")) {
    esize = h.descr == "<i4" ? 4 : 8;
    if (is_int) *is_int = true;
  } else if (h.descr == ">f4" || h.descr == ">f8" || h.descr == ">i4" || h.descr == ">i8") {
    fail(what, "big-endian arrays are not supported (dtype " + h.descr + ")");
  } else if (integers) {
    fail(what, "dtype " + h.descr +
                   " is not supported (need int32 '<i4', int64 '<i8', float32 '<f4' or float64 "
                   "'<f8')");
  } else {
    fail(what, "dtype " + h.descr + " is not supported (need float32 '<f4' or float64 '<f8')");
  }
  size_t n = 1;
  for (int64_t d : h.shape) {
    if (d != 0 && n > std::numeric_limits<size_t>::max() / 16 / static_cast<size_t>(d))
      fail(what, "shape " + shape_str(h.shape) + " is too large");
    n *= static_cast<size_t>(d);
  }
  count = n;
  return n * esize;
}

void check_body_size(const Header& h, size_t want, size_t have, const std::string& what) {
  if (have < want)
    fail(what, "truncated: header says shape " + shape_str(h.shape) + " (" + std::to_string(want) +
                   " bytes of data) but the file has " + std::to_string(have));
  if (have > want)
    fail(what, "header says shape " + shape_str(h.shape) + " (" + std::to_string(want) +
                   " bytes of data) but the file has " + std::to_string(have));
}

Tensor<double> decode(const Header& h, const uint8_t* src, size_t esize, size_t n) {
  Tensor<double> t(h.shape);
  if (esize == 4) {
    for (size_t i = 0; i < n; ++i) {
      float f;
      std::memcpy(&f, src + 4 * i, 4);
      t[static_cast<int64_t>(i)] = f;
    }
  } else if (n > 0) {  // memcpy with a null pointer is undefined even for 0 bytes
    std::memcpy(t.data(), src, n * 8);
  }
  return t;
}
}  // namespace

Tensor<double> parse_npy(const uint8_t* bytes, size_t size, const std::string& what) {
  const Header h = parse_header(bytes, size, what);
  size_t esize = 0, n = 0;
  const size_t want = body_bytes(h, what, esize, n);
  check_body_size(h, want, size - h.data_offset, what);
  return decode(h, bytes + h.data_offset, esize, n);
}

namespace {
std::string header_for(const std::vector<int64_t>& shape, const char* descr) {
  std::ostringstream d;
  d << "{'descr': '" << descr << "', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < shape.size(); ++i)
    d << shape[i] << (shape.size() == 1 ? "," : (i + 1 < shape.size() ? ", " : ""));
  d << "), }";
  std::string dict = d.str();
  const size_t total = 10 + dict.size() + 1;
  dict.append((64 - total % 64) % 64, ' ');
  dict.push_back('\n');
  std::string out("\x93NUMPY\x01\x00", 8);
  out.push_back(static_cast<char>(dict.size() & 0xff));
  out.push_back(static_cast<char>(dict.size() >> 8));
  return out + dict;
}

template <class T>
void write_npy_impl(const std::string& path, const Tensor<T>& x, const char* descr) {
  // The header's shape must describe the body, or neither loom nor numpy reads the file back: a
  // default-constructed Tensor has shape [] (a scalar, one element) but no data, and was written
  // as a header alone, with no error.
  int64_t want = 1;
  for (int64_t d : x.shape()) want *= d;  // the Tensor's constructor checked it fits int64
  LOOM_CHECK(want == x.numel(), InvalidArgument,
             "write_npy " << path << ": the tensor has shape " << shape_str(x.shape()) << " ("
                          << want << " elements) but holds " << x.numel()
                          << (x.shape().empty() && x.numel() == 0
                                  ? " (a default-constructed Tensor has no shape: give it one, "
                                    "e.g. Tensor<float>({0}) for an empty array)"
                                  : "")
                          << "; nothing was written");
  std::string bytes = header_for(x.shape(), descr);
  if (x.numel() > 0)
    bytes.append(reinterpret_cast<const char*>(x.data()),
                 sizeof(T) * static_cast<size_t>(x.numel()));
  write_file_atomic(path, bytes);
}
}  // namespace

namespace {
// Reads path's header and body: the magic, the version and the dict are checked, and the data
// size they declare is compared with the file's size, before any of the body is read.
std::vector<uint8_t> read_checked(const std::string& path, Header& h, size_t& esize, size_t& n,
                                  bool integers = false, bool* is_int = nullptr,
                                  bool header_only = false) {
  InputFile f(path, path);
  const size_t fsize = static_cast<size_t>(f.size());
  std::vector<uint8_t> head(std::min<size_t>(fsize, 12));
  f.read_exact(head.data(), head.size());
  static const char kMagic[] = "\x93NUMPY";
  if (head.size() < 6 || std::memcmp(head.data(), kMagic, 6) != 0)
    fail(path, "not a .npy file (bad magic)");
  if (head.size() < 10) fail(path, "truncated npy header (the file ends after its magic)");
  const size_t start = head[6] == 1 ? 10 : 12;
  size_t hlen = head[8] | (static_cast<size_t>(head[9]) << 8);
  if (head[6] != 1 && head.size() >= 12)
    hlen |= (static_cast<size_t>(head[10]) << 16) | (static_cast<size_t>(head[11]) << 24);
  if (head[6] >= 1 && head[6] <= 3) {
    if (fsize < start || hlen > fsize - start) fail(path, "truncated npy header");
    if (hlen > kMaxHeaderBytes)
      fail(path, "npy header of " + std::to_string(hlen) + " bytes is too long (at most " +
                     std::to_string(kMaxHeaderBytes) + ")");
    head.resize(start + hlen);
    if (head.size() > 12) f.read_exact(head.data() + 12, head.size() - 12);
  }
  h = parse_header(head.data(), head.size(), path);
  const size_t want = body_bytes(h, path, esize, n, integers, is_int);
  check_body_size(h, want, fsize - h.data_offset, path);
  if (header_only) return {};
  std::vector<uint8_t> body(want);
  f.read_exact(body.data(), want);
  return body;
}
}  // namespace

Tensor<double> read_npy_f64(const std::string& path) {
  Header h;
  size_t esize = 0, n = 0;
  const std::vector<uint8_t> body = read_checked(path, h, esize, n);
  return decode(h, body.data(), esize, n);
}

std::vector<int64_t> read_npy_index(const std::string& path) {
  Header h;
  size_t esize = 0, n = 0;
  bool is_int = false;
  const std::vector<uint8_t> body = read_checked(path, h, esize, n, true, &is_int);
  if (h.shape.size() != 1)
    fail(path, "has shape " + shape_str(h.shape) + " but must be a 1-d array");
  std::vector<int64_t> v(n);
  for (size_t i = 0; i < n; ++i) {
    if (is_int && esize == 4) {
      int32_t x;
      std::memcpy(&x, body.data() + 4 * i, 4);
      v[i] = x;
    } else if (is_int) {
      std::memcpy(&v[i], body.data() + 8 * i, 8);
    } else {
      double x;
      if (esize == 4) {
        float f;
        std::memcpy(&f, body.data() + 4 * i, 4);
        x = f;
      } else {
        std::memcpy(&x, body.data() + 8 * i, 8);
      }
      // Whole numbers that fit int64 (2^63 itself does not); NaN fails both tests.
      if (!(x == std::floor(x) && std::fabs(x) < 9223372036854775808.0))
        fail(path, "entry " + std::to_string(i) + " is not a whole number that fits 64 bits");
      v[i] = static_cast<int64_t>(x);
    }
  }
  return v;
}

std::vector<int64_t> read_npy_shape(const std::string& path) {
  Header h;
  size_t esize = 0, n = 0;
  read_checked(path, h, esize, n, false, nullptr, true);
  return h.shape;
}

Tensor<float> read_npy_f32(const std::string& path) {
  Header h;
  size_t esize = 0, n = 0;
  const std::vector<uint8_t> body = read_checked(path, h, esize, n);
  // Decoded straight to float: through a double tensor the read held 16 bytes an element (the
  // body, the doubles and the floats) where a 4-byte file needs 8.
  Tensor<float> t(h.shape);
  if (esize == 4) {
    if (n > 0) std::memcpy(t.data(), body.data(), n * 4);
    return t;
  }
  for (size_t i = 0; i < n; ++i) {
    double d;
    std::memcpy(&d, body.data() + 8 * i, 8);
    // A finite f8 value beyond float32's range became Inf here and was then reported as "a
    // non-finite value": name it for what it is.
    if (std::isfinite(d) && std::fabs(d) > double(std::numeric_limits<float>::max())) {
      std::ostringstream os;
      os << "holds " << d << " at flat index " << i
         << ", which is finite but does not fit float32 (magnitude at most "
         << std::numeric_limits<float>::max() << ")";
      fail(path, os.str());
    }
    t[static_cast<int64_t>(i)] = static_cast<float>(d);
  }
  return t;
}

std::vector<int64_t> read_npy_role_shape(const std::string& path, const std::string& role,
                                         int expect_rank) {
  std::vector<int64_t> shape = read_npy_shape(path);
  if (static_cast<int>(shape.size()) != expect_rank) {
    const char* want = expect_rank == 3 ? "[S, H, D]" : expect_rank == 2 ? "[H, S]" : "";
    throw IoError(path + ": has shape " + shape_str(shape) + " but " + role + " must be " +
                  (want[0] ? want : std::to_string(expect_rank) + "-dimensional"));
  }
  return shape;
}

void write_npy(const std::string& path, const Tensor<float>& x) {
  write_npy_impl(path, x, "<f4");
}
void write_npy(const std::string& path, const Tensor<double>& x) {
  write_npy_impl(path, x, "<f8");
}

void write_file_atomic(const std::string& path, const std::string& bytes) {
  write_output(path, bytes);
}

}  // namespace loom
