// loom/error.h: the error hierarchy and the check macros.
//
// Library code throws; only tools/ catches, prints one line and exits non-zero.
//   loom::Error -> InvalidArgument, NotSupported, CommError, Timeout, IoError, OutOfMemory
// Arguments are checked once at public entry points with LOOM_CHECK*; internal invariants use
// assert. Never check in hot loops.
#pragma once

#include <charconv>
#include <sstream>
#include <stdexcept>
#include <string>

namespace loom {

class Error : public std::runtime_error {
 public:
  Error(const std::string& message, const char* file = "", int line = 0)
      : std::runtime_error(message), file_(file), line_(line) {}
  // Where the check fired (for debugging; tools print only what()).
  const char* file() const { return file_; }
  int line() const { return line_; }

 private:
  const char* file_;
  int line_;
};

#define LOOM_DEFINE_ERROR(Name) \
  class Name : public Error {   \
   public:                      \
    using Error::Error;         \
  };
LOOM_DEFINE_ERROR(InvalidArgument)  // bad shapes, sizes, options, values
LOOM_DEFINE_ERROR(NotSupported)     // a valid request this build or backend cannot do
LOOM_DEFINE_ERROR(CommError)        // a peer failed, a message was malformed, a backend error
LOOM_DEFINE_ERROR(IoError)          // unreadable, malformed or unwritable files
LOOM_DEFINE_ERROR(OutOfMemory)      // an allocation failed; the message names what was allocated
#undef LOOM_DEFINE_ERROR

// A blocking wait ran past its deadline. Derives from CommError: callers that handle
// communication failures handle timeouts too.
class Timeout : public CommError {
 public:
  using CommError::CommError;
};

// x in the fewest digits that read back as x (std::to_chars: "2.3586574e+38", "1e-12", "nan"),
// for messages that name a limit or a refused value: a stream's 6 digits printed float32's
// largest softmax scale above itself, and "--lr 10.000001" as "10".
inline std::string exact_text(double x) {
  char buf[32];
  return std::string(buf, std::to_chars(buf, buf + sizeof buf, x).ptr);
}
inline std::string exact_text(float x) {
  char buf[32];
  return std::string(buf, std::to_chars(buf, buf + sizeof buf, x).ptr);
}

}  // namespace loom

// LOOM_CHECK(cond, Kind, message-stream): throws loom::Kind(message) when cond is false.
//   LOOM_CHECK(s > 0, InvalidArgument, "--seq must be positive, got " << s);
#define LOOM_CHECK(cond, Kind, msg)                                 \
  do {                                                              \
    if (!(cond)) {                                                  \
      std::ostringstream loom_check_os_;                            \
      loom_check_os_ << msg;                                        \
      throw ::loom::Kind(loom_check_os_.str(), __FILE__, __LINE__); \
    }                                                               \
  } while (0)

// LOOM_CHECK_OP(a, op, b, Kind, message): as LOOM_CHECK, and appends both values:
//   LOOM_CHECK_OP(h % hkv, ==, 0, InvalidArgument, "heads must be a multiple of kv-heads");
//   -> "heads must be a multiple of kv-heads (h % hkv = 2, 0 = 0)"
#define LOOM_CHECK_OP(a, op, b, Kind, msg)                                                  \
  do {                                                                                      \
    const auto& loom_a_ = (a);                                                              \
    const auto& loom_b_ = (b);                                                              \
    if (!(loom_a_ op loom_b_)) {                                                            \
      std::ostringstream loom_check_os_;                                                    \
      loom_check_os_ << msg << " (" #a " = " << loom_a_ << ", " #b " = " << loom_b_ << ")"; \
      throw ::loom::Kind(loom_check_os_.str(), __FILE__, __LINE__);                         \
    }                                                                                       \
  } while (0)
#define LOOM_CHECK_EQ(a, b, Kind, msg) LOOM_CHECK_OP(a, ==, b, Kind, msg)
#define LOOM_CHECK_GT(a, b, Kind, msg) LOOM_CHECK_OP(a, >, b, Kind, msg)
#define LOOM_CHECK_GE(a, b, Kind, msg) LOOM_CHECK_OP(a, >=, b, Kind, msg)
#define LOOM_CHECK_LE(a, b, Kind, msg) LOOM_CHECK_OP(a, <=, b, Kind, msg)
