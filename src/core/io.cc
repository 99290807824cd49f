// Safe file output, bounded input and memory estimates (see loom/io.h for the rules).
#include "loom/io.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <mutex>
#include <sstream>

#include "loom/error.h"
#include "loom/rng.h"

#ifndef STATX_ATTR_MOUNT_ROOT
#define STATX_ATTR_MOUNT_ROOT 0x00002000  // Linux 5.8; older headers lack it
#endif

namespace loom {

namespace fs = std::filesystem;

namespace {

std::string errno_text(int e) {
  return std::strerror(e);
}

std::atomic<int64_t> g_temp_counter{0};

// What a temporary's file name starts with, before ".tmp.<pid>-<n>" (at most 36 bytes): the
// target's own file name, or, where that suffix would take it past NAME_MAX (255 bytes), its
// first 200 bytes, '~' and the whole name's hash (a valid 250-byte --json name was refused:
// "cannot write into . (File name too long)").
std::string temp_stem(const std::string& filename) {
  constexpr size_t kSuffixMax = 36, kNameMax = 255;
  if (filename.size() + kSuffixMax <= kNameMax) return filename;
  char hash[17];
  std::snprintf(hash, sizeof hash, "%016llx",
                static_cast<unsigned long long>(fnv1a64(filename.data(), filename.size())));
  return filename.substr(0, 200) + "~" + hash;
}

std::string temp_name(const std::string& target) {
  const fs::path t(target);
  return (t.parent_path() / temp_stem(t.filename().string())).string() + ".tmp." +
         std::to_string(::getpid()) + "-" + std::to_string(g_temp_counter++);
}

// Decimal digits of s from i on, without a leading zero ("0" itself is one), at most 18: their
// value in v, i past them. False for anything else.
bool number_at(const std::string& s, size_t& i, int64_t& v) {
  const size_t start = i;
  v = 0;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') {
    if (i - start == 18) return false;
    v = v * 10 + (s[i++] - '0');
  }
  return i > start && (i - start == 1 || s[start] != '0');
}

// The kernel's pid_max: a running process's pid is below it.
int64_t pid_limit() {
  static const int64_t limit = [] {
    std::ifstream f("/proc/sys/kernel/pid_max");
    int64_t v = 0;
    return (f >> v) && v > 1 ? v : int64_t{4194304};  // PID_MAX_LIMIT
  }();
  return limit;
}

// The pid in `entry` when it is a temporary loom names "<prefix><pid>-<n>" (temp_name; prefix is
// "<stem>.tmp.") or "<prefix><pid>-s<n>" (the staged files of write_outputs before it used
// temp_name): both numbers in decimal digits without a leading zero, the pid one a process can
// have (1 to pid_max - 1). Anything else is -1, not loom's whatever it looks like: any digits,
// then anything after a '-', was taken for a dead run's, and a user's a.json.tmp.2024-06-01,
// a.json.tmp.2024-06-01.bak and a.json.tmp.99999999 were deleted.
long temp_pid(const std::string& entry, const std::string& prefix) {
  if (entry.size() <= prefix.size() || entry.compare(0, prefix.size(), prefix) != 0) return -1;
  size_t i = prefix.size();
  int64_t pid = 0, n = 0;
  if (!number_at(entry, i, pid) || pid < 1 || pid >= pid_limit()) return -1;
  if (i == entry.size() || entry[i++] != '-') return -1;
  if (i < entry.size() && entry[i] == 's') ++i;
  if (!number_at(entry, i, n) || i != entry.size()) return -1;
  return static_cast<long>(pid);
}

}  // namespace

long temporary_pid(const std::string& entry, const std::string& filename) {
  return temp_pid(entry, temp_stem(filename) + ".tmp.");
}

std::string seconds_text(double v) {
  std::string t = exact_text(v);
  const size_t e = t.find('e');
  if (e == std::string::npos) return t;
  size_t digits = e + 1;
  const bool negative = t[digits] == '-';
  if (t[digits] == '+' || negative) ++digits;
  while (digits + 1 < t.size() && t[digits] == '0') ++digits;
  return t.substr(0, e + 1) + (negative ? "-" : "") + t.substr(digits);
}

double env_seconds(const char* name, double fallback, double lo, double hi) {
  const char* text = std::getenv(name);
  if (!text || !*text) return fallback;
  // Decimal only, as the command line's numbers (strtod also took " 5" and hex "0x10"), and at
  // least a millisecond for LOOM_TIMEOUT_S (1e-9 was taken, and every wait then "timed out after
  // 0 s").
  bool decimal = true;
  for (const char* c = text; *c; ++c)
    decimal = decimal && (std::isdigit(static_cast<unsigned char>(*c)) || *c == '.' || *c == 'e' ||
                          *c == 'E' || *c == '+' || *c == '-');
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(text, &end);
  LOOM_CHECK(decimal && errno == 0 && end != text && *end == '\0' && v >= lo && v <= hi,
             InvalidArgument,
             name << " must be a decimal number of seconds from " << seconds_text(lo) << " to "
                  << seconds_text(hi) << ", got '" << text << "'");
  return v;
}

double output_timeout_s() {
  return env_seconds("LOOM_TIMEOUT_S", 60, 1e-3, 1e9);  // as the communicators' timeout
}

void write_nonblocking(int fd, const void* data, size_t bytes, const std::string& shown,
                       double timeout_s) {
  if (timeout_s < 0) timeout_s = output_timeout_s();
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0 && !(flags & O_NONBLOCK)) ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  using clock = std::chrono::steady_clock;
  const char* p = static_cast<const char*>(data);
  size_t done = 0;
  clock::time_point progress = clock::now();  // when the reader last took something
  while (done < bytes) {
    const ssize_t w = ::write(fd, p + done, bytes - done);
    if (w > 0) {
      done += static_cast<size_t>(w);
      progress = clock::now();
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w == 0) throw IoError(shown + ": write failed (no progress)");
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      throw IoError(shown + ": write failed (" + errno_text(errno) + ")");
    // Full: wait for the reader to take something, at most timeout_s since it last did.
    const double left = timeout_s - std::chrono::duration<double>(clock::now() - progress).count();
    if (left <= 0) {
      char secs[32];
      std::snprintf(secs, sizeof secs, "%g", timeout_s);
      throw IoError(shown + ": write timed out: its reader took nothing for " + secs +
                    " s (LOOM_TIMEOUT_S); " + std::to_string(done) + " of " +
                    std::to_string(bytes) + " bytes written. Read it as loom writes, or write " +
                    "to a regular file");
    }
    struct pollfd pfd = {fd, POLLOUT, 0};
    const int ms = static_cast<int>(std::min(std::ceil(left * 1e3), double(INT_MAX)));
    if (::poll(&pfd, 1, std::max(1, ms)) < 0 && errno != EINTR)
      throw IoError(shown + ": write failed (" + errno_text(errno) + ")");
    // Ready, timed out or an error (POLLERR, POLLHUP): the next write says which.
  }
}

namespace {

void write_all_fd(int fd, const std::string& bytes, const std::string& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw IoError(path + ": write failed (" + errno_text(errno) + ")");
    }
    if (w == 0) throw IoError(path + ": write failed (no progress)");
    done += static_cast<size_t>(w);
  }
}

std::string dir_of(const std::string& p) {
  const fs::path parent = fs::path(p).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

void strip_trailing_slashes(std::string& p) {
  while (p.size() > 1 && p.back() == '/') p.pop_back();
}

// The mount points in /proc/self/mountinfo (its fifth field, with the kernel's octal escapes of
// space, tab, newline and backslash undone).
std::vector<std::string> mount_points() {
  std::vector<std::string> points;
  std::ifstream f("/proc/self/mountinfo");
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream fields(line);
    std::string id, parent, devno, root, point;
    if (!(fields >> id >> parent >> devno >> root >> point)) continue;
    std::string p;
    for (size_t i = 0; i < point.size(); ++i) {
      const auto digit = [&](size_t k) {
        return k < point.size() && point[k] >= '0' && point[k] <= '7';
      };
      if (point[i] == '\\' && digit(i + 1) && digit(i + 2) && digit(i + 3)) {
        p += static_cast<char>((point[i + 1] - '0') * 64 + (point[i + 2] - '0') * 8 +
                               (point[i + 3] - '0'));
        i += 3;
      } else {
        p += point[i];
      }
    }
    points.push_back(std::move(p));
  }
  return points;
}

// Whether `path` (its last component not followed: callers pass resolved targets) is a mount
// point, something mounted on it: a file system on a directory, a bind mount on a directory or a
// file. The kernel refuses to rename onto one (EBUSY). statx's STATX_ATTR_MOUNT_ROOT where the
// kernel reports it (Linux 5.8); else a device that differs from its directory's, or the path
// among /proc/self/mountinfo's mount points (a bind mount within one file system).
bool is_mount_point(const std::string& path) {
  struct statx sx;
  if (::statx(AT_FDCWD, path.c_str(), AT_SYMLINK_NOFOLLOW, STATX_BASIC_STATS, &sx) == 0 &&
      (sx.stx_attributes_mask & STATX_ATTR_MOUNT_ROOT))
    return (sx.stx_attributes & STATX_ATTR_MOUNT_ROOT) != 0;
  struct stat st, parent;
  if (::lstat(path.c_str(), &st) != 0) return false;
  if (::stat(dir_of(path).c_str(), &parent) == 0 && st.st_dev != parent.st_dev) return true;
  char* real = ::realpath(path.c_str(), nullptr);
  if (!real) return false;
  const std::string abs = real;
  std::free(real);
  const std::vector<std::string> points = mount_points();
  return std::find(points.begin(), points.end(), abs) != points.end();
}

// Refuses an existing output target that is a mount point: the output is renamed onto it, which
// the kernel refuses, and that was found only after the whole run, once the other outputs had
// been replaced (--output onto a mounted tmpfs: "cannot move the new files in (Device or resource
// busy)"; --trace onto a bind-mounted file: "write failed (Device or resource busy)", with --json
// already written). `given` is the path as the user gave it, `shown` names it in the message.
// An existing output marked immutable or append-only (chattr +i, +a; root too is refused): the
// rename over it (or the exchange with the new set) failed with EPERM at the end of the run,
// after the other outputs had been replaced. Where the file system keeps no such flags
// (ENOTTY), or the file cannot be opened to ask, there is nothing to refuse.
void refuse_immutable(const std::string& target, const std::string& shown) {
  const int fd = ::open(target.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return;
  int flags = 0;
  const bool got = ::ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0;
  ::close(fd);
  if (!got || !(flags & (FS_IMMUTABLE_FL | FS_APPEND_FL))) return;
  throw IoError(shown + ": is " +
                ((flags & FS_IMMUTABLE_FL) ? "immutable (chattr +i)" : "append-only (chattr +a)") +
                ", so loom cannot replace it; clear the flag (chattr -i -a) or write elsewhere");
}

void refuse_mount_point(const std::string& target, const std::string& given,
                        const std::string& shown, bool directory) {
  if (!is_mount_point(target)) return;
  std::string inside = given;
  strip_trailing_slashes(inside);
  throw IoError(shown + ": is a mount point (something is mounted on it), which loom cannot " +
                "replace: it renames " + (directory ? "the new set" : "the new file") +
                " onto it; " +
                (directory ? "name a directory inside it, e.g. " + inside + "/set"
                           : std::string("unmount it, or name another file")));
}

// Creates write_atomic's temporary `tmp` beside `target` (exclusively), with the permission bits
// of the file it will replace. Returns its descriptor; throws IoError.
int open_temp(const std::string& target, const std::string& tmp, const std::string& shown) {
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0) throw IoError(shown + ": cannot write (" + errno_text(errno) + ")");
  // A replaced file keeps its permission bits (a 0600 file became 0644, readable by all).
  // Best effort: a file system without modes (vfat) refuses fchmod and has none to keep.
  struct stat old;
  if (::stat(target.c_str(), &old) == 0 && S_ISREG(old.st_mode))
    (void)::fchmod(fd, old.st_mode & 07777);
  return fd;
}

// Makes a rename in `dir` durable: without an fsync of the directory, a crash after the rename
// could bring back the old file (or none) although the new one's bytes were synced. A directory
// that cannot be opened for reading (mode 0333: writable, not listable) cannot be synced: best
// effort, as the file's own fsync on a file system without it.
void sync_directory(const std::string& dir, const std::string& shown) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  const int r = ::fsync(fd);
  const int e = errno;
  ::close(fd);
  if (r != 0 && e != EINVAL && e != EROFS && e != ENOTSUP && e != ENOSYS)
    throw IoError(shown + ": write failed (syncing its directory: " + errno_text(e) + ")");
}

// Flushes the temporary `tmp` (open as fd) to disk, closes it, renames it over `target` and syncs
// the directory. Any failure removes the temporary and throws IoError; fd is closed either way.
void commit_temp(int fd, const std::string& tmp, const std::string& target,
                 const std::string& shown) {
  if (::fsync(fd) != 0 && errno != EINVAL && errno != EROFS) {
    const int e = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    throw IoError(shown + ": write failed (" + errno_text(e) + ")");
  }
  if (::close(fd) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    throw IoError(shown + ": write failed (" + errno_text(e) + ")");
  }
  if (std::rename(tmp.c_str(), target.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    throw IoError(shown + ": write failed (" + errno_text(e) + ")");
  }
  sync_directory(dir_of(target), shown);
}

// Writes bytes to a new file `tmp` (created exclusively) and renames it over `target`.
void write_atomic(const std::string& target, const std::string& bytes, const std::string& shown) {
  const std::string tmp = temp_name(target);
  const int fd = open_temp(target, tmp, shown);
  try {
    write_all_fd(fd, bytes, shown);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  commit_temp(fd, tmp, target, shown);
}

// Writes into an existing device, FIFO or socket path without replacing it.
void write_direct(const std::string& target, const std::string& bytes, const std::string& shown,
                  bool fifo) {
  const int fd = ::open(target.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (fifo && errno == ENXIO)
      throw IoError(shown + ": is a FIFO that nobody reads; start the reader first");
    throw IoError(shown + ": cannot write (" + errno_text(errno) + ")");
  }
  // Kept non-blocking: a reader that opened the FIFO and then stopped reading held a blocking
  // write for ever (LOOM_TIMEOUT_S did not apply); write_nonblocking waits for it with a timeout.
  try {
    write_nonblocking(fd, bytes.data(), bytes.size(), shown);
  } catch (...) {
    ::close(fd);
    throw;
  }
  if (::close(fd) != 0) throw IoError(shown + ": write failed (" + errno_text(errno) + ")");
}

bool pid_alive(long pid) {
  if (pid <= 0) return true;  // not ours to judge
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH;
}

}  // namespace

namespace {

// resolve_output_path; with `directory` the path and every link target lose their trailing '/'
// first. lstat("link/") follows the link, so "link/" was taken for a plain directory, and once
// the '/' was stripped later, an output set was renamed onto the link itself ("Not a
// directory") after the whole run.
std::string resolve(const std::string& path, bool directory) {
  if (path == "-") return path;
  std::string p = path;
  if (directory) strip_trailing_slashes(p);
  for (int hops = 0; hops < 40; ++hops) {
    struct stat st;
    if (::lstat(p.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return p;
    std::error_code ec;
    const fs::path link = fs::read_symlink(p, ec);
    if (ec) throw IoError(path + ": cannot read the symlink (" + ec.message() + ")");
    p = link.is_absolute() ? link.string() : (fs::path(dir_of(p)) / link).string();
    if (directory) strip_trailing_slashes(p);
  }
  throw IoError(path + ": too many levels of symbolic links");
}

// Refuses a directory output that no directory can be renamed onto: "-" (standard output), "/",
// or a path ending in "." or ".." (given, or reached through a symlink). --output - and
// --output . were refused only after the whole run, when the set was swapped in.
void check_replaceable(const std::string& given, const std::string& target,
                       const std::string& shown) {
  const std::string last = fs::path(target).filename().string();
  LOOM_CHECK(given != "-" && target != "/" && last != "." && last != "..", InvalidArgument,
             shown << ": is not a directory loom can replace ('-', '/', '.' and '..' cannot be "
                      "renamed onto); name the directory, e.g. results/set");
}

}  // namespace

namespace {

// The descriptor N when `name` is a descriptor number (at most 9 digits), else -1.
int fd_number(const std::string& name) {
  if (name.empty() || name.size() > 9) return -1;
  int fd = 0;
  for (const char c : name) {
    if (c < '0' || c > '9') return -1;
    fd = fd * 10 + (c - '0');
  }
  return fd;
}

// The descriptor that `path` itself names, without following its last component: /dev/stdout,
// /dev/stderr, /dev/fd/N, /proc/self/fd/N as spelled, or any path whose directory is /dev (for
// stdout and stderr) or this process's fd directory (/proc/<pid>/fd, where /dev/fd and
// /proc/self/fd lead): "../../dev/stdout", `cd /dev` and "stdout". Else -1.
int stream_fd_named(const std::string& path) {
  if (path == "/dev/stdout") return STDOUT_FILENO;
  if (path == "/dev/stderr") return STDERR_FILENO;
  for (const char* prefix : {"/dev/fd/", "/proc/self/fd/"}) {
    const size_t n = std::strlen(prefix);
    if (path.compare(0, n, prefix) == 0) return fd_number(path.substr(n));
  }
  const fs::path p(path);
  const std::string name = p.filename().string();
  if (name != "stdout" && name != "stderr" && fd_number(name) < 0) return -1;
  char* real = ::realpath(dir_of(path).c_str(), nullptr);
  if (!real) return -1;
  const std::string dir = real;
  std::free(real);
  if (dir == "/dev" && name == "stdout") return STDOUT_FILENO;
  if (dir == "/dev" && name == "stderr") return STDERR_FILENO;
  if (dir == "/proc/" + std::to_string(::getpid()) + "/fd") return fd_number(name);
  return -1;
}

}  // namespace

int own_stream_fd(const std::string& path) {
  if (path.empty() || path == "-") return -1;
  // The symlink chain, one link at a time: a link to /dev/stdout was followed through
  // /proc/self/fd/1 to the file standard output was redirected to, and replaced it (`>> log.txt`
  // lost its lines), or to a pipe's "pipe:[N]" ("cannot write into /proc/self/fd"). The last
  // link, /proc/self/fd/N itself, is never followed.
  std::string p = path;
  for (int hops = 0; hops < 40; ++hops) {
    if (const int fd = stream_fd_named(p); fd >= 0) return fd;
    struct stat st;
    if (::lstat(p.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return -1;
    std::error_code ec;
    const fs::path link = fs::read_symlink(p, ec);
    if (ec) return -1;
    p = link.is_absolute() ? link.string() : (fs::path(dir_of(p)) / link).string();
  }
  return -1;
}

std::string resolve_output_path(const std::string& path) {
  return resolve(path, false);
}

namespace {

// The staging directories of the OutputSets alive, each with the set as its user named it
// ("--output set"): a file written there is named in messages as the user's DIR/name, not by the
// temporary directory (a full disk said "set.tmp.5170-1/out.npy: write failed").
std::mutex g_staging_mutex;
std::vector<std::pair<std::string, std::string>> g_staging;  // {staging directory, shown}

// How messages name the output `path`: as given, or, inside an OutputSet's staging directory,
// as the set's file ("--output set/out.npy").
std::string shown_output(const std::string& path) {
  const std::string dir = dir_of(path);
  std::lock_guard<std::mutex> lock(g_staging_mutex);
  for (const auto& [staging, shown] : g_staging)
    if (dir == staging) return shown + "/" + fs::path(path).filename().string();
  return path;
}

}  // namespace

void write_output(const std::string& path, const std::string& bytes) {
  LOOM_CHECK(!path.empty(), InvalidArgument, "an output path is empty");
  if (path == "-") {
    std::fflush(stdout);
    write_all_fd(STDOUT_FILENO, bytes, "standard output");
    return;
  }
  // The process's own stream: written to its descriptor, as "-" is (/dev/stdout was followed to
  // the file stdout was redirected to, which was then replaced: `>> log.txt` lost its lines; to a
  // pipe it was "cannot write into /proc/self/fd").
  if (const int fd = own_stream_fd(path); fd >= 0) {
    std::fflush(stdout);
    std::fflush(stderr);
    write_all_fd(fd, bytes, path);
    return;
  }
  const std::string shown = shown_output(path);
  const std::string target = resolve_output_path(path);
  clean_stale_temps(target);
  struct stat st;
  if (::stat(target.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) throw IoError(shown + ": is a directory (a file was expected)");
    if (!S_ISREG(st.st_mode)) {
      write_direct(target, bytes, shown, S_ISFIFO(st.st_mode));
      return;
    }
    refuse_mount_point(target, path, shown, false);
  } else if (errno != ENOENT) {
    throw IoError(shown + ": cannot write (" + errno_text(errno) + ")");
  }
  write_atomic(target, bytes, shown);
}

std::string stage_output(const std::string& path, const std::string& bytes) {
  LOOM_CHECK(!path.empty(), InvalidArgument, "an output path is empty");
  const std::string target = resolve_output_path(path);
  refuse_mount_point(target, path, path, false);
  const std::string tmp = temp_name(target);
  const int fd = open_temp(target, tmp, path);
  try {
    write_all_fd(fd, bytes, path);
    if (::fsync(fd) != 0 && errno != EINVAL && errno != EROFS)
      throw IoError(path + ": write failed (" + errno_text(errno) + ")");
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    throw IoError(path + ": write failed (" + errno_text(e) + ")");
  }
  return tmp;
}

void commit_staged(const std::string& staged, const std::string& path) {
  const std::string target = resolve_output_path(path);
  if (std::rename(staged.c_str(), target.c_str()) != 0) {
    const int e = errno;
    ::unlink(staged.c_str());
    throw IoError(path + ": write failed (" + errno_text(e) + ")");
  }
  sync_directory(dir_of(target), path);
}

AtomicFileWriter::AtomicFileWriter(const std::string& path) : shown_(path) {
  LOOM_CHECK(!path.empty(), InvalidArgument, "an output path is empty");
  target_ = resolve_output_path(path);
  clean_stale_temps(target_);
  struct stat st;
  if (::stat(target_.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) throw IoError(path + ": is a directory (a file was expected)");
    if (!S_ISREG(st.st_mode))
      throw IoError(path + ": is not a regular file (a FIFO, device or socket); loom writes " +
                    "this file only as a regular file, never into one of those");
    refuse_mount_point(target_, path, path, false);
  } else if (errno != ENOENT) {
    throw IoError(path + ": cannot write (" + errno_text(errno) + ")");
  }
  tmp_ = temp_name(target_);
  fd_ = open_temp(target_, tmp_, shown_);
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ < 0) return;
  ::close(fd_);
  ::unlink(tmp_.c_str());
}

void AtomicFileWriter::write(const void* data, size_t bytes) {
  LOOM_CHECK(fd_ >= 0, InvalidArgument, shown_ << ": written after commit()");
  size_t done = 0;
  const char* p = static_cast<const char*>(data);
  while (done < bytes) {
    const ssize_t w = ::write(fd_, p + done, bytes - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0)
      throw IoError(shown_ + ": write failed (" +
                    (w < 0 ? errno_text(errno) : std::string("no progress")) + ")");
    done += static_cast<size_t>(w);
  }
}

void AtomicFileWriter::commit() {
  LOOM_CHECK(fd_ >= 0, InvalidArgument, shown_ << ": committed twice");
  const int fd = fd_;
  fd_ = -1;  // commit_temp closes it, and removes the temporary on failure
  commit_temp(fd, tmp_, target_, shown_);
}

namespace {

// Whether `entry` is `name` or a write_atomic temporary of it ("<name>.tmp.<pid>-<n>").
bool is_file_or_its_temp(const std::string& entry, const std::string& name) {
  return entry == name || temp_pid(entry, temp_stem(name) + ".tmp.") > 0;
}

// Removes dir if every entry in it is a regular file named in names, or a temporary of one (an
// output set's staging directory, or the old set swapped out of it; a kill while a file of the
// set was being written left that file's temporary there, and the directory was then kept for
// ever): those files, then the directory. Anything else (a subdirectory, a link, a FIFO,
// another name: not loom's) leaves dir and all of it in place. Returns "" once dir is gone, else
// why it is not (OutputSet::commit reports it). Never throws.
std::string remove_set_directory(const std::string& dir, const std::vector<std::string>& names) {
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0) return errno_text(errno);
  if (!S_ISDIR(st.st_mode)) return "not a directory";
  // The old set of a read-only DIR (0555, whose bits the new set keeps) is this user's own: it
  // is made writable (and listable) to empty it, and given its bits back if it stays.
  const mode_t mode = st.st_mode & 07777;
  const bool relaxed = st.st_uid == ::geteuid() && (mode & S_IRWXU) != S_IRWXU &&
                       ::chmod(dir.c_str(), mode | S_IRWXU) == 0;
  const auto kept = [&](const std::string& why) {
    if (relaxed) ::chmod(dir.c_str(), mode);
    return why;
  };
  std::error_code ec;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string entry = e.path().filename().string();
    const bool ours = std::any_of(names.begin(), names.end(), [&](const std::string& n) {
      return is_file_or_its_temp(entry, n);
    });
    if (!ours || e.symlink_status(ec).type() != fs::file_type::regular)
      return kept("it holds '" + entry + "', which is not a file loom wrote there");
    files.push_back(e.path());
  }
  if (ec) return kept(ec.message());
  for (const fs::path& f : files)
    if (!fs::remove(f, ec) && ec) return kept(ec.message());
  if (::rmdir(dir.c_str()) != 0) return kept(errno_text(errno));
  return "";
}

}  // namespace

void clean_stale_temps(const std::string& path, const std::vector<std::string>& names) {
  if (path.empty() || path == "-" || own_stream_fd(path) >= 0) return;
  std::error_code ec;
  const std::string target = resolve_output_path(path);
  const std::string dir = dir_of(target);
  const std::string prefix = temp_stem(fs::path(target).filename().string()) + ".tmp.";
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;
  std::vector<std::string> stale;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    const long pid = temp_pid(name, prefix);
    if (pid > 0 && !pid_alive(pid)) stale.push_back((fs::path(dir) / name).string());
  }
  ::closedir(d);
  // A write_output temporary is a regular file; an OutputSet's staging directory holds regular
  // files of its names only. Anything else under such a name was not left by loom.
  for (const std::string& s : stale) {
    struct stat st;
    if (::lstat(s.c_str(), &st) != 0) continue;
    if (S_ISREG(st.st_mode)) {
      ::unlink(s.c_str());
    } else if (S_ISDIR(st.st_mode) && !names.empty()) {
      remove_set_directory(s, names);
    }
  }
}

std::string output_key(const std::string& path) {
  // "-" is descriptor 1, as /dev/stdout, /dev/fd/1 and /proc/self/fd/1 are: keyed as that link's
  // target (a file stdout is redirected to, a pipe's "pipe:[N]", a tty; /proc/PID/fd/1 itself
  // when stdout is closed), so `--json - --trace /dev/stdout` is two outputs on one stream, as
  // `--json /dev/stdout --trace /dev/fd/1` was (it kept "-" and wrote both, unparseable, exit 0).
  // A path that leads to one of the process's own streams (a symlink to /dev/stdout) is keyed
  // as that stream is.
  const int fd = path == "-" ? STDOUT_FILENO : own_stream_fd(path);
  std::string key = resolve_output_path(fd >= 0 ? "/proc/self/fd/" + std::to_string(fd) : path);
  std::error_code ec;
  const fs::path abs = fs::weakly_canonical(fs::absolute(key, ec), ec);
  if (!ec) key = abs.string();
  return key;
}

void check_output_outside(const std::string& option, const std::string& path,
                          const std::string& dir_option, const std::string& dir,
                          const std::string& why) {
  if (path.empty() || path == "-" || dir.empty()) return;
  // Compared component by component: /a/bc is not inside /a/b.
  const fs::path file = fs::path(output_key(path)).lexically_normal();
  const fs::path parent = fs::path(output_key(dir)).lexically_normal();
  auto f = file.begin();
  for (auto d = parent.begin(); d != parent.end(); ++d, ++f) {
    if (d->empty() && std::next(d) == parent.end()) break;  // a trailing '/'
    if (f == file.end() || *f != *d) return;
  }
  LOOM_CHECK(false, InvalidArgument,
             option << " " << path << " is inside " << dir_option << " " << dir << ", " << why
                    << "; write it outside that directory");
}

void check_distinct_outputs(const std::vector<std::pair<std::string, std::string>>& outputs,
                            size_t inputs) {
  struct Seen {
    std::string key, option;  // option: "--json", "--json - (standard output, /x/r.json)"
    dev_t dev = 0;
    ino_t ino = 0;  // 0: not an existing regular file
  };
  std::vector<Seen> seen;
  size_t seen_inputs = 0;  // the leading entries of `seen` that are inputs
  for (size_t i = 0; i < outputs.size(); ++i) {
    const auto& [option, path] = outputs[i];
    if (path.empty()) continue;
    // "-" is named as standard output and what it is: "--trace o.json and --json name the same
    // file" was all a user of --json - > o.json was told.
    const std::string key = output_key(path);
    const std::string stdout_is = path == "-" ? " - (standard output, " + key + ")" : "";
    const std::string named = option + (stdout_is.empty() ? " " + path : stdout_is);
    Seen me{key, option + stdout_is};
    struct stat st;
    if ((path == "-" ? ::fstat(STDOUT_FILENO, &st) : ::stat(path.c_str(), &st)) == 0 &&
        S_ISREG(st.st_mode)) {
      me.dev = st.st_dev;
      me.ino = st.st_ino;
    }
    for (size_t j = i < inputs ? seen_inputs : 0; j < seen.size(); ++j) {
      const Seen& o = seen[j];
      LOOM_CHECK(
          o.key != me.key, InvalidArgument,
          named << " and " << o.option << " name the same file; give each output its own path");
      // Hard links are one file under two names: a --log linked to --data truncated the corpus.
      LOOM_CHECK(me.ino == 0 || o.ino != me.ino || o.dev != me.dev, InvalidArgument,
                 named << " and " << o.option
                       << " name the same file (hard links to one file); give each output its "
                          "own path");
    }
    seen_inputs += i < inputs;
    seen.push_back(std::move(me));
  }
}

namespace {

// Whether this process may rename over another user's file in a sticky directory: it has
// CAP_FOWNER (bit 3 of CapEff in /proc/self/status; root without that file).
bool has_cap_fowner() {
  std::ifstream f("/proc/self/status");
  std::string key, value;
  while (f >> key >> value) {
    if (key != "CapEff:") continue;
    const unsigned long long caps = std::strtoull(value.c_str(), nullptr, 16);
    return (caps >> 3) & 1;
  }
  return ::geteuid() == 0;
}

}  // namespace

void check_output_writable(const std::string& path, const std::string& option, bool directory,
                           bool replaced) {
  if (path.empty() || ((path == "-" || own_stream_fd(path) >= 0) && !directory)) return;
  const std::string shown = option + " " + path;
  const std::string target = resolve(path, directory);
  if (directory) check_replaceable(path, target, shown);
  struct stat st;
  const bool exists = ::stat(target.c_str(), &st) == 0;
  if (exists) {
    if (directory && !S_ISDIR(st.st_mode)) throw IoError(shown + ": exists and is not a directory");
    if (!directory && S_ISDIR(st.st_mode))
      throw IoError(shown + ": is a directory (a file was expected)");
    if (!directory && !S_ISREG(st.st_mode)) return;  // a device or FIFO: written directly
    if (replaced) {
      refuse_mount_point(target, path, shown, directory);
      refuse_immutable(target, shown);
    }
  } else if (errno != ENOENT) {
    throw IoError(shown + ": cannot write (" + errno_text(errno) + ")");
  }
  const std::string dir = dir_of(target);
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    throw IoError(shown + ": cannot write into " + dir + " (" + errno_text(errno) + ")");
  // In a sticky directory (/tmp, mode 1777) only the owner of a file (or of the directory) may
  // rename over it: another user's file there passed, and the run failed at its very end with
  // "write failed (Operation not permitted)".
  struct stat ds;
  if (exists && replaced && ::stat(dir.c_str(), &ds) == 0 && (ds.st_mode & S_ISVTX) &&
      st.st_uid != ::geteuid() && ds.st_uid != ::geteuid() && !has_cap_fowner())
    throw IoError(shown + ": belongs to another user (uid " + std::to_string(st.st_uid) +
                  ") in the sticky directory " + dir +
                  ", where only its owner may replace it; remove it or write elsewhere");
  // access() says yes to root on a read-only or pseudo file system (/proc, /sys): create the
  // temporary the write will need, for real, and remove it at once.
  const std::string probe = temp_name(target);
  if (directory) {
    if (::mkdir(probe.c_str(), 0700) != 0)
      throw IoError(shown + ": cannot write into " + dir + " (" + errno_text(errno) + ")");
    ::rmdir(probe.c_str());
  } else {
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0)
      throw IoError(shown + ": cannot write into " + dir + " (" + errno_text(errno) + ")");
    ::close(fd);
    ::unlink(probe.c_str());
  }
}

void require_directory(const std::string& path, const std::string& option) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) throw IoError(option + " " + path + ": " + errno_text(errno));
  if (!S_ISDIR(st.st_mode)) throw IoError(option + " " + path + " is not a directory");
}

void check_output_set(const std::string& dir, const std::vector<std::string>& names) {
  if (dir.empty()) return;
  const std::string target = resolve(dir, true);
  check_replaceable(dir, target, dir);
  struct stat st;
  if (::stat(target.c_str(), &st) != 0) {
    if (errno == ENOENT) return;
    throw IoError(dir + ": cannot use as an output directory (" + errno_text(errno) + ")");
  }
  if (!S_ISDIR(st.st_mode)) throw IoError(dir + ": exists and is not a directory");
  refuse_mount_point(target, dir, dir, true);
  refuse_immutable(target, dir);
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(target, ec)) {
    const std::string name = e.path().filename().string();
    if (std::find(names.begin(), names.end(), name) == names.end())
      throw IoError(dir + " holds '" + name +
                    "', which loom does not write there; loom replaces the directory as a "
                    "whole, so give a new or empty directory");
    // loom writes regular files: a directory, link or FIFO of one of its names is not its own
    // (a directory dq.npy was deleted with everything in it when the old set was removed).
    std::error_code type_ec;
    if (e.symlink_status(type_ec).type() != fs::file_type::regular)
      throw IoError(dir + " holds '" + name +
                    "', which is not a regular file (loom writes only regular files there); "
                    "loom replaces the directory as a whole, so give a new or empty directory");
    // A file mounted over (a bind mount) cannot be removed with the old set.
    if (is_mount_point(e.path().string()))
      throw IoError(dir + " holds '" + name +
                    "', which is a mount point (a file is mounted over it), so the old set "
                    "cannot be removed; unmount it, or give a new or empty directory");
  }
  if (ec) throw IoError(dir + ": cannot list (" + ec.message() + ")");
}

// ---------------------------------------------------------------------------------------------

OutputSet::OutputSet(const std::string& dir, std::vector<std::string> names,
                     const std::string& option)
    : names_(std::move(names)) {
  LOOM_CHECK(!dir.empty() && dir != "-", InvalidArgument,
             "an output directory must be a directory path, got '" << dir << "'");
  // A name is a plain file name of the set: "../escape.npy" wrote outside DIR.
  for (const std::string& n : names_)
    LOOM_CHECK(!n.empty() && n != "." && n != ".." && n.find('/') == std::string::npos &&
                   n.find('\0') == std::string::npos,
               InvalidArgument,
               "OutputSet: '" << n << "' is not a plain file name (no '/', '.' or '..')");
  dir_ = resolve(dir, true);
  check_output_set(dir, names_);
  clean_stale_temps(dir_, names_);
  staging_ = temp_name(dir_);
  if (::mkdir(staging_.c_str(), 0777) != 0)
    throw IoError(dir + ": cannot create the staging directory " + staging_ + " (" +
                  errno_text(errno) + ")");
  // DIR's permission bits go onto the set in commit(), once its files are written: given to the
  // staging directory here, a read-only DIR (0555) made it read-only too, and a run as its owner
  // failed after all its work ("--output s/out.npy: cannot write (Permission denied)").
  std::string shown = dir;
  strip_trailing_slashes(shown);
  shown_ = option.empty() ? shown : option + " " + shown;
  std::lock_guard<std::mutex> lock(g_staging_mutex);
  g_staging.emplace_back(staging_, shown_);
}

OutputSet::~OutputSet() {
  {
    std::lock_guard<std::mutex> lock(g_staging_mutex);
    for (auto it = g_staging.begin(); it != g_staging.end(); ++it)
      if (it->first == staging_) {
        g_staging.erase(it);
        break;
      }
  }
  if (committed_) return;
  std::error_code ec;
  fs::remove_all(staging_, ec);
}

std::string OutputSet::path(const std::string& name) const {
  LOOM_CHECK(std::find(names_.begin(), names_.end(), name) != names_.end(), InvalidArgument,
             "OutputSet: '" << name << "' is not one of the set's names");
  return (fs::path(staging_) / name).string();
}

namespace {

// What OutputSet::commit returns when the old set, swapped out to `old`, could not be removed.
std::string leftover(const std::string& shown, const std::string& old,
                     const std::vector<std::string>& names) {
  const std::string why = remove_set_directory(old, names);
  if (why.empty()) return "";
  return shown + ": the new set is in place, but the old one could not be removed (" + why +
         ") and is left in " + old + "; remove it yourself";
}

}  // namespace

std::string OutputSet::commit() {
  LOOM_CHECK(!committed_, InvalidArgument, "OutputSet::commit called twice");
  // Each file keeps the permission bits of the file of its name in the set it replaces, as
  // write_output keeps a replaced file's (a 0600 out.npy became 0644).
  for (const std::string& name : names_) {
    struct stat old_st, new_st;
    const std::string now = (fs::path(staging_) / name).string();
    if (::stat((fs::path(dir_) / name).c_str(), &old_st) == 0 && S_ISREG(old_st.st_mode) &&
        ::stat(now.c_str(), &new_st) == 0 && S_ISREG(new_st.st_mode))
      ::chmod(now.c_str(), old_st.st_mode & 07777);
  }
  // The set replaces DIR: it keeps DIR's permission bits (a private 0700 directory became 0755),
  // given now that its files are written. A rename within one directory needs no write
  // permission on the directory renamed, so a read-only set is still swapped in.
  struct stat dir_st;
  if (::stat(dir_.c_str(), &dir_st) == 0 && S_ISDIR(dir_st.st_mode))
    ::chmod(staging_.c_str(), dir_st.st_mode & 07777);
  if (::rename(staging_.c_str(), dir_.c_str()) == 0) {  // dir did not exist (or was empty)
    committed_ = true;
    return "";
  }
  if (errno != EEXIST && errno != ENOTEMPTY)
    throw IoError(dir_ + ": cannot move the new files in (" + errno_text(errno) + ")");
  // dir exists and holds files: exchange it with the staging directory in one step.
  if (::renameat2(AT_FDCWD, staging_.c_str(), AT_FDCWD, dir_.c_str(), RENAME_EXCHANGE) == 0) {
    committed_ = true;
    return leftover(shown_, staging_, names_);  // staging_ now holds the old set
  }
  if (errno != EINVAL && errno != ENOSYS)
    throw IoError(dir_ + ": cannot swap the new files in (" + errno_text(errno) + ")");
  // No RENAME_EXCHANGE on this file system: move the old set aside, then the new one in.
  const std::string old = temp_name(dir_);
  if (::rename(dir_.c_str(), old.c_str()) != 0 || ::rename(staging_.c_str(), dir_.c_str()) != 0)
    throw IoError(dir_ + ": cannot swap the new files in (" + errno_text(errno) + ")");
  committed_ = true;
  return leftover(shown_, old, names_);
}

// ---------------------------------------------------------------------------------------------

void lock_or_refuse(int fd, const std::string& path, const std::string& option) {
  int r;
  do {
    r = ::flock(fd, LOCK_EX | LOCK_NB);
  } while (r != 0 && errno == EINTR);
  LOOM_CHECK(r == 0 || errno != EWOULDBLOCK, IoError,
             option << " " << path
                    << " is in use by another running loom process (it holds the lock); wait for "
                       "that run to end, or give another path");
}

DirectoryLock::DirectoryLock(const std::string& dir, const std::string& option) {
  fd_ = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  // A missing directory holds nothing to protect (whoever writes it reports it missing). Any
  // other failure locked nothing either: a directory one may write but not list (mode 0333) let
  // a second run in, and its listing (a fresh run's guard) saw nothing to protect.
  LOOM_CHECK(fd_ >= 0 || errno == ENOENT, IoError,
             option << " " << dir << " cannot be opened (" << errno_text(errno)
                    << "); it must be a directory this user can list and write");
  try {
    lock_or_refuse(fd_, dir, option);
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) ::close(fd_);
}

InputFile::InputFile(const std::string& path, const std::string& what) : path_(path), what_(what) {
  const std::string shown = what == path ? path : what + " " + path;
  if (path == "-") {
    fd_ = STDIN_FILENO;
    return;
  }
  // O_NONBLOCK: opening a FIFO must not wait for a writer.
  fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd_ < 0) throw IoError(shown + ": cannot open (" + errno_text(errno) + ")");
  own_ = true;
  struct stat st;
  if (::fstat(fd_, &st) != 0) {
    const int e = errno;
    ::close(fd_);
    throw IoError(shown + ": cannot open (" + errno_text(e) + ")");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    if (S_ISDIR(st.st_mode)) throw IoError(shown + ": is a directory (a file was expected)");
    throw IoError(shown + ": is not a regular file (a FIFO, device or socket); loom reads only " +
                  "regular files" + (what == "--data" ? " or '-' for standard input" : ""));
  }
  const int flags = ::fcntl(fd_, F_GETFL);
  if (flags >= 0) ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK);
  size_ = static_cast<int64_t>(st.st_size);
}

InputFile::~InputFile() {
  if (own_ && fd_ >= 0) ::close(fd_);
}

size_t InputFile::read_some(void* buf, size_t n) {
  for (;;) {
    const ssize_t r = ::read(fd_, buf, n);
    if (r >= 0) return static_cast<size_t>(r);
    if (errno == EINTR) continue;
    throw IoError((what_ == path_ ? path_ : what_ + " " + path_) + ": read error (" +
                  errno_text(errno) + ")");
  }
}

void InputFile::read_exact(void* buf, size_t n) {
  size_t done = 0;
  while (done < n) {
    const size_t r = read_some(static_cast<char*>(buf) + done, n - done);
    if (r == 0)
      throw IoError((what_ == path_ ? path_ : what_ + " " + path_) + ": truncated (expected " +
                    std::to_string(n) + " more bytes, got " + std::to_string(done) + ")");
    done += r;
  }
}

std::string InputFile::read_rest(size_t max_bytes, const std::string& limit_option) {
  const std::string shown = what_ == path_ ? path_ : what_ + " " + path_;
  auto too_big = [&]() {
    throw IoError(shown + ": larger than the limit of " + human_bytes(double(max_bytes)) +
                  (limit_option.empty() ? std::string() : " (raise it with " + limit_option + ")"));
  };
  std::string out;
  if (regular()) {
    if (static_cast<uint64_t>(size_) > max_bytes) too_big();
    out.reserve(static_cast<size_t>(size_));
  }
  char buf[1 << 16];
  for (;;) {
    const size_t r = read_some(buf, sizeof buf);
    if (r == 0) break;
    if (out.size() + r > max_bytes) too_big();
    out.append(buf, r);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------

namespace {
int64_t meminfo_kib(const char* key) {
  std::ifstream f("/proc/meminfo");
  std::string k;
  int64_t v = -1;
  std::string unit;
  while (f >> k >> v) {
    std::getline(f, unit);
    if (k == key) return v;
  }
  return -1;
}

int64_t read_int_file(const char* path) {
  std::ifstream f(path);
  std::string s;
  if (!(f >> s) || s == "max") return -1;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  return (end && *end == '\0' && v >= 0) ? v : -1;
}

// /proc/self/status's `key` ("VmSize:", "VmData:") in bytes; -1 when it cannot be read.
int64_t status_bytes(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string k, rest;
  while (f >> k) {
    if (k == key) {
      int64_t kib = -1;
      return (f >> kib) && kib >= 0 ? kib * 1024 : -1;
    }
    std::getline(f, rest);
  }
  return -1;
}

// MemAvailable, lowered to the cgroup's headroom; -1 when neither is known.
int64_t machine_memory_bytes() {
  const int64_t kib = meminfo_kib("MemAvailable:");
  int64_t avail = kib >= 0 ? kib * 1024 : -1;
  const int64_t max = read_int_file("/sys/fs/cgroup/memory.max");
  if (max >= 0) {
    const int64_t cur = std::max<int64_t>(0, read_int_file("/sys/fs/cgroup/memory.current"));
    const int64_t room = std::max<int64_t>(0, max - cur);
    avail = avail < 0 ? room : std::min(avail, room);
  }
  return avail;
}
}  // namespace

int64_t address_space_room(std::string* limit) {
  struct Limit {
    int resource;
    const char *used, *name;
  };
  // RLIMIT_DATA counts the private writable mappings (VmData) since Linux 4.7.
  const Limit limits[] = {{RLIMIT_AS, "VmSize:", "the address-space limit (ulimit -v)"},
                          {RLIMIT_DATA, "VmData:", "the data-size limit (ulimit -d)"}};
  int64_t room = -1;
  for (const Limit& l : limits) {
    struct rlimit rl;
    if (::getrlimit(l.resource, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) continue;
    const int64_t used = status_bytes(l.used);
    if (used < 0) continue;
    const int64_t max = rl.rlim_cur > uint64_t(std::numeric_limits<int64_t>::max())
                            ? std::numeric_limits<int64_t>::max()
                            : static_cast<int64_t>(rl.rlim_cur);
    const int64_t left = std::max<int64_t>(0, max - used);
    if (room >= 0 && left >= room) continue;
    room = left;
    if (limit)
      *limit = std::string(l.name) + " of " + human_bytes(double(max)) + ", of which " +
               human_bytes(double(used)) + " is mapped already";
  }
  return room;
}

int64_t openblas_buffers_mapped() {
  std::FILE* f = std::fopen("/proc/self/maps", "re");
  if (!f) return -1;
  int64_t buffers = 0;
  char line[4096];
  while (std::fgets(line, sizeof line, f)) {
    unsigned long long start = 0, end = 0, inode = 0;
    char perms[8] = {};
    int path_at = 0;
    if (std::sscanf(line, "%llx-%llx %7s %*s %*s %llu %n", &start, &end, perms, &inode, &path_at) <
        4)
      continue;
    const bool anonymous = inode == 0 && (line[path_at] == '\0' || line[path_at] == '\n');
    if (anonymous && std::strcmp(perms, "rw-p") == 0)
      buffers += static_cast<int64_t>((end - start) >> 27);  // 128 MiB blocks
  }
  std::fclose(f);
  return buffers;
}

int64_t available_memory_bytes() {
  const int64_t avail = machine_memory_bytes();
  const int64_t room = address_space_room();
  if (room < 0) return avail;
  return avail < 0 ? room : std::min(avail, room);
}

std::string human_bytes(double b) {
  char buf[48];
  if (!(b < 1e30)) return "an unbounded amount";
  if (b >= double(1ull << 40))
    std::snprintf(buf, sizeof buf, "%.2f TiB", b / double(1ull << 40));
  else if (b >= double(1 << 30))
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / double(1 << 30));
  else if (b >= double(1 << 20))
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / double(1 << 20));
  else if (b >= 1024)
    std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024);
  else
    std::snprintf(buf, sizeof buf, "%.0f B", b);
  return buf;
}

int64_t parse_size(const std::string& text, const std::string& option) {
  const std::string usage = " (expected bytes with an optional K, M, G or T suffix, e.g. 8G)";
  LOOM_CHECK(!text.empty(), InvalidArgument, option << " is empty" << usage);
  // Decimal digits only: std::stod took "0x10", "1e3", "+5" and " 5" as numbers.
  size_t used = 0;
  while (used < text.size() && text[used] >= '0' && text[used] <= '9') ++used;
  LOOM_CHECK(used > 0, InvalidArgument, option << " '" << text << "' is not a size" << usage);
  std::string suffix = text.substr(used);
  // Suffixes: none or B (bytes); K, M, G, T (any case), alone or followed by B, b or iB.
  int shift = -1;
  if (suffix.empty() || suffix == "B") {
    shift = 0;
  } else if (const size_t k = std::string("kKmMgGtT").find(suffix[0]);
             k != std::string::npos && (suffix.size() == 1 || suffix.substr(1) == "B" ||
                                        suffix.substr(1) == "b" || suffix.substr(1) == "iB")) {
    shift = 10 * static_cast<int>(k / 2 + 1);
  }
  // A fraction ("1.5G", or "21.69GiB" as loom's own messages print sizes) is refused as such.
  LOOM_CHECK(suffix.empty() || suffix[0] != '.', InvalidArgument,
             option << " '" << text
                    << "' is a fraction: give a whole number of bytes, K, M, G or T (1536M for "
                       "1.5G)");
  LOOM_CHECK(shift >= 0, InvalidArgument,
             option << " '" << text << "' has an unknown suffix '" << suffix << "'" << usage);
  // The value, times 2^shift, must be in [1, 2^63 - 1] (computed exactly: 8388607T, below
  // 8 EiB, was refused by a floating-point bound).
  const int64_t max = std::numeric_limits<int64_t>::max() >> shift;
  int64_t v = 0;
  bool fits = true;
  for (size_t i = 0; i < used && fits; ++i) {
    const int d = text[i] - '0';
    fits = v <= (max - d) / 10;
    if (fits) v = v * 10 + d;
  }
  LOOM_CHECK(fits && v >= 1, InvalidArgument,
             option << " must be a positive size below 8 EiB, got '" << text << "'");
  return v << shift;
}

void check_memory(double estimate_bytes, int64_t limit_bytes, const std::string& what,
                  const std::string& option, double mapped_bytes, const std::string& mapped_what) {
  // An estimate whose byte counts overflowed (NaN, negative, infinite) is refused whatever the
  // limit, known or not: a negative one passed every limit and the run allocated.
  LOOM_CHECK(std::isfinite(estimate_bytes) && estimate_bytes >= 0, InvalidArgument,
             what << " is too large to estimate its memory (the byte counts overflow: "
                  << estimate_bytes << "); make the problem smaller");
  // An address-space limit bounds the run whatever --memory-limit says, and counts what is only
  // mapped too (OpenBLAS's buffers): past it an allocation fails, and OpenBLAS retries its own
  // for ever (a run under `ulimit -v` hung).
  std::string which;
  const int64_t room = address_space_room(&which);
  const double mapped = estimate_bytes + std::max(0.0, mapped_bytes);
  if (room >= 0 && mapped > double(room)) {
    std::ostringstream os;
    os << what << " needs about " << human_bytes(mapped) << " of address space (estimate) but "
       << which << ", leaves " << human_bytes(double(room))
       << (mapped_bytes > 0
               ? " (the estimate counts " + human_bytes(mapped_bytes) + " " + mapped_what + ")"
               : "")
       << "; make the problem smaller or raise the limit";
    throw InvalidArgument(os.str(), __FILE__, __LINE__);
  }
  const bool from_machine = limit_bytes < 0;
  const double limit = from_machine ? double(machine_memory_bytes()) : double(limit_bytes);
  if (limit < 0) return;  // unknown: nothing to compare with
  if (!(estimate_bytes > limit)) return;
  std::ostringstream os;
  os << what << " needs about " << human_bytes(estimate_bytes)
     << " (estimate) but the memory limit is " << human_bytes(limit)
     << (from_machine ? " (available memory)" : " (" + option + ")")
     << "; make the problem smaller or " << (from_machine ? "set " : "raise ") << option;
  throw InvalidArgument(os.str(), __FILE__, __LINE__);
}

}  // namespace loom
