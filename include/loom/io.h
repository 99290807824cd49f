// loom/io.h: safe file output, bounded file input and memory estimates.
//
// Output. write_output(path, bytes) never replaces something that is not a regular file:
//   * "-" is standard output, written directly, as are the process's other own streams
//     (own_stream_fd: /dev/stdout, /dev/stderr, /dev/fd/N, and symlinks that lead to them);
//   * a symlink is followed (to its final target), and the target is written as below;
//   * an existing device, FIFO or socket is opened and written directly, never replaced (a FIFO
//     without a reader is refused at once instead of blocking, and a reader that stops reading
//     fails the write after LOOM_TIMEOUT_S: write_nonblocking);
//   * a regular file or a missing path is written atomically: the bytes go to
//     "<target>.tmp.<pid>-<n>" in the same directory, are flushed to disk, and the temporary
//     file is renamed over the target only when complete, the directory then synced (so the
//     rename survives a crash). A failed write removes it. A replaced file's permission bits
//     are kept (a new one gets 0666 & ~umask).
//   * a directory is refused, as is a mount point (a file system or a bind mount on the target),
//     which no rename can replace.
// Every write is checked (a full disk is an IoError naming the path, never a silent loss).
// clean_stale_temps removes the temporaries a killed run left next to a path (those whose pid
// is no longer running), so they do not pile up.
//
// OutputSet writes a set of files as a unit (`loom attn --output DIR`): the files go into a
// fresh sibling directory "<DIR>.tmp.<pid>-<n>", and commit() swaps it in with one atomic
// renameat2(RENAME_EXCHANGE) (or a rename when DIR does not exist yet); the old set is then
// removed (where it cannot be, commit() says where it is left). A run that fails or is killed never
// changes DIR, and two concurrent runs leave one complete set. DIR may hold only files the set may
// write (loom's own names): anything else in it is refused with an IoError before anything is
// written, so loom never deletes a user's file.
//
// Input. InputFile opens a file for reading without blocking: directories, FIFOs, devices and
// sockets are refused with one line naming the path (only "-", standard input, is read as a
// stream), and reads are bounded by the caller's limit.
//
// Memory. available_memory_bytes() is /proc/meminfo's MemAvailable, lowered to the cgroup
// limit's headroom and to what an address-space limit (ulimit -v, -d) leaves, when set;
// check_memory() refuses an estimate above a limit in one line that names the estimate, the
// limit and the option that changes it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace loom {

// ---- output ----

// Writes bytes to path as described above. Throws IoError.
void write_output(const std::string& path, const std::string& bytes);
// The path that write_output writes: symlinks followed; "-" stays "-".
std::string resolve_output_path(const std::string& path);
// The descriptor that /dev/stdout, /dev/stderr, /dev/fd/N or /proc/self/fd/N names (the
// process's own open streams, which write_output writes directly, as "-"), else -1; also for a
// path that leads there through symlinks (followed one link at a time, never through the last,
// /proc/self/fd/N, to the file or pipe behind it) or through its directory ("../dev/stdout").
int own_stream_fd(const std::string& path);
// Temporaries are named "<target>.tmp.<pid>-<n>"; a target name too long for that suffix within
// NAME_MAX (more than 219 bytes) gives its first 200 bytes, '~' and a hash of the whole name in
// place of <target>.
// Removes the temporaries next to path's target whose process is gone: exactly
// "<target>.tmp.<pid>-<n>" (and "<target>.tmp.<pid>-s<n>", the staged files of earlier
// versions), both numbers in decimal digits without a leading zero and the pid below pid_max;
// regular files (write_output's), and, given the names of an OutputSet, directories that hold
// only regular files of those names (its staging directories). Anything else (a user's
// a.json.tmp.2024-06-01) is left alone, as is a temporary that cannot be removed. Never throws.
// Whether a pid is gone is judged on this node, in this PID namespace: a temporary that a running
// process on another node (or in another namespace) writes looks stale here and is removed, so
// jobs on different nodes must not write one path at the same time, and under an MPI launcher
// only the rank that writes a path should call this for it (loom's tools: rank 0).
void clean_stale_temps(const std::string& path, const std::vector<std::string>& names = {});
// The pid in `entry` when it is such a temporary of a file named `filename` (in the same
// directory), else -1: the one rule of what loom's own temporaries are called (loom train sweeps
// its checkpoint directory with it).
long temporary_pid(const std::string& entry, const std::string& filename);
// One file of several written as a unit (the tools' write_outputs): stage_output writes bytes
// into a new temporary beside path's target (symlinks followed), named as write_output's, flushed
// to disk and with the permission bits of the file it will replace, and returns its path;
// commit_staged renames it over the target and syncs the directory. A failure of either removes
// the temporary; the caller removes the staged files it does not commit. Both throw IoError
// naming `path`.
std::string stage_output(const std::string& path, const std::string& bytes);
void commit_staged(const std::string& staged, const std::string& path);
// Writes one file in pieces, with write_output's guarantees for a regular file or a missing
// path: the pieces go to the temporary "<target>.tmp.<pid>-<n>" beside the target (symlinks
// followed), and commit() flushes it to disk, renames it over the target and syncs the
// directory. Destroyed before commit() (a failed piece, an exception between pieces), it
// removes the temporary and the target is as it was. The constructor removes stale temporaries
// of the target as write_output does, and refuses (IoError) a target that is a directory, a
// device, a FIFO or a socket: a file written in pieces is only ever a regular file. (loom train
// streams its checkpoints through it: they are larger than the memory a copy could take.)
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(const std::string& path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  void write(const void* data, size_t bytes);  // throws IoError naming the path
  void commit();                               // throws IoError; the temporary is then gone

 private:
  std::string shown_, target_, tmp_;
  int fd_ = -1;
};
// Seconds a write to a FIFO, pipe, socket or device may wait for its reader without progress:
// LOOM_TIMEOUT_S (as the communicators' waits: a decimal number of seconds from 0.001 to 1e9, else
// InvalidArgument naming it), or 60 when unset.
double output_timeout_s();
// Writes all `bytes` at data to fd, a FIFO, pipe, socket or device that the caller opened (it is
// made non-blocking: never pass a descriptor shared with others, such as standard output), waiting
// in poll() while it is full: when its reader takes nothing for timeout_s seconds (< 0:
// output_timeout_s()), an IoError "<shown>: write timed out: its reader took nothing for 60 s
// (LOOM_TIMEOUT_S); ..." (a reader that opened a FIFO and never read held loom for ever). Other
// failures are "<shown>: write failed (...)".
void write_nonblocking(int fd, const void* data, size_t bytes, const std::string& shown,
                       double timeout_s = -1);
// Refuses (InvalidArgument) two outputs that resolve to the same file, e.g.
//   {{"--json", "r.json"}, {"--trace", "r.json"}}, or to one existing regular file under two
// names (hard links: same device and inode). Empty paths are ignored. The first `inputs` entries
// are files read, not written: each is compared with every output, not with the other inputs
// (q.npy may be a link to k.npy: reading one file twice is harmless).
void check_distinct_outputs(const std::vector<std::pair<std::string, std::string>>& outputs,
                            size_t inputs = 0);
// The absolute path write_output(path) writes, symlinks followed (of the path's directories
// too, where they exist): what check_distinct_outputs compares. "-" (standard output) is keyed
// as /proc/self/fd/1 is, i.e. as /dev/stdout and /dev/fd/1: the target of descriptor 1 (the file
// standard output is redirected to, its pipe or tty; /proc/PID/fd/1 when it is closed).
std::string output_key(const std::string& path);
// Refuses (InvalidArgument) an output file `path` (given as `option`) that lies inside the
// directory `dir` (given as `dir_option`), at any depth, symlinks followed: `loom attn --output
// DIR` replaces DIR as a whole, `loom verify` reads the names in its --candidate directory.
// `why` ends the message ("which loom replaces as a whole"). Empty paths and "-" pass.
void check_output_outside(const std::string& option, const std::string& path,
                          const std::string& dir_option, const std::string& dir,
                          const std::string& why);
// Refuses (IoError naming `option` and the path), before any work, an output that write_output
// (or, with `directory`, an OutputSet) could not write: a directory where a file is expected (a
// file where a directory is), or a directory to hold it in which no file (with `directory`, no
// directory) can be created: the temporary and the rename need it. It is tried for real (a
// temporary is created and removed at once), so a read-only or pseudo file system (/proc, /sys)
// fails here even for root, for whom access() says yes. "-", devices and FIFOs pass (they are
// checked when written). Empty paths are ignored. With `directory`, a trailing '/' is dropped
// before symlinks are followed ("link/" names link's target), and "-", "/" and a path ending in
// "." or ".." (given or reached through a link) are refused (InvalidArgument): no directory can be
// renamed onto them. With `replaced` (the output is renamed over an existing target, as
// write_output and OutputSet do), an existing target that belongs to another user in a sticky
// directory (/tmp, mode 1777) is refused as well: only its owner may replace it there; and so is
// an existing target that is a mount point (a tmpfs mounted on the directory, a file bind-mounted
// over the file: the kernel refuses a rename onto it), with what to name instead. A file written
// in place (loom train's --log) passes replaced = false.
void check_output_writable(const std::string& path, const std::string& option,
                           bool directory = false, bool replaced = true);
// Refuses (IoError), before any work, what the OutputSet(dir, names) constructor refuses: dir
// exists and is not a directory, is a mount point, or holds a name the set does not write (or a
// file of its names that is mounted over); and (InvalidArgument)
// a dir no directory can be renamed onto, as check_output_writable does.
void check_output_set(const std::string& dir, const std::vector<std::string>& names);
// Refuses (IoError) an input directory that is missing, unreadable or not a directory, naming
// the option and the reason: "--input in: No such file or directory", "--input in: Too many
// levels of symbolic links", "--input in is not a directory".
void require_directory(const std::string& path, const std::string& option);

class OutputSet {
 public:
  // dir: the directory the set replaces (a trailing '/' dropped, symlinks followed); names: every
  // file name the set may hold, each a plain name (InvalidArgument for '/', '.' or '..'). Throws
  // IoError when dir exists and is not a directory, is a mount point, holds other files, or the
  // staging directory cannot be made. DIR's permission bits go onto the set in commit(), so a
  // read-only DIR (0555) of this user is replaced too, as a read-only file is. `option` names the
  // set in the messages of the files written to path(name): "--output set/out.npy: write failed
  // (...)", not the staging directory.
  OutputSet(const std::string& dir, std::vector<std::string> names,
            const std::string& option = "--output");
  ~OutputSet();  // removes the staging directory unless committed
  OutputSet(const OutputSet&) = delete;
  OutputSet& operator=(const OutputSet&) = delete;

  // Where to write file `name` (one of the names) before commit().
  std::string path(const std::string& name) const;
  // Swaps the staged files in as the new contents of dir (with dir's permission bits), then
  // removes the old set. Throws IoError when the new set cannot be swapped in. Returns "" or,
  // when the new set is in place but the old one could not be removed (its files belong to
  // another user, who alone may delete them), one line for the caller to print: "--output out:
  // the new set is in place, but the old one could not be removed (Permission denied) and is left
  // in out.tmp.4242-1; remove it yourself".
  std::string commit();

 private:
  std::string dir_, staging_, shown_;
  std::vector<std::string> names_;
  bool committed_ = false;
};

// ---- locks ----

// Takes an exclusive advisory lock (flock) on fd, an open descriptor of `path` (a file or a
// directory); it lasts while that open descriptor does. Another process holding the lock (a
// second run writing the same checkpoints or log) is an IoError naming `option` and `path`. A
// file system without flock (EOPNOTSUPP, ENOLCK: some network mounts) locks nothing, silently.
void lock_or_refuse(int fd, const std::string& path, const std::string& option);

// Opens the existing directory `dir` and holds its lock_or_refuse lock until destroyed. A dir
// that exists but cannot be opened for reading (not a directory, or not listable by this user:
// mode 0333) is an IoError naming `option` and `dir`: it could be neither locked nor listed. A
// missing dir locks nothing (whoever writes it reports that).
class DirectoryLock {
 public:
  DirectoryLock(const std::string& dir, const std::string& option);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int fd_ = -1;
};

// ---- input ----

class InputFile {
 public:
  // Opens path ("-": standard input) for reading. `what` names the file in messages
  // ("--data", "q.npy"...). Throws IoError for a missing, unreadable or non-regular file.
  InputFile(const std::string& path, const std::string& what);
  ~InputFile();
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  bool regular() const { return size_ >= 0; }
  int64_t size() const { return size_; }  // bytes of a regular file, -1 for a stream
  // Reads up to n bytes; returns how many (0: end of file). Throws IoError.
  size_t read_some(void* buf, size_t n);
  // Reads exactly n bytes or throws IoError ("truncated").
  void read_exact(void* buf, size_t n);
  // Reads the rest of the file; throws IoError when it holds more than max_bytes (naming
  // `limit_option`, the option that raises the limit, when given).
  std::string read_rest(size_t max_bytes, const std::string& limit_option = "");
  const std::string& path() const { return path_; }

 private:
  std::string path_, what_;
  int fd_ = -1;
  bool own_ = false;
  int64_t size_ = -1;
};

// ---- memory ----

// Bytes this process may still allocate: MemAvailable, and the cgroup's memory.max minus its
// memory.current, and address_space_room(), whichever is lowest. -1 when none is known.
int64_t available_memory_bytes();
// Bytes this process may still map under its soft address-space limit (RLIMIT_AS, `ulimit -v`,
// against /proc/self/status's VmSize) and data-size limit (RLIMIT_DATA, `ulimit -d`, against
// VmData), the lower of the two; -1 when neither is set. `limit`, when given, gets that limit in
// words: "the address-space limit (ulimit -v) of 146.5 MiB, of which 75.2 MiB is mapped already".
// Mapped, not resident: thread stacks and OpenBLAS's buffers count in full.
int64_t address_space_room(std::string* limit = nullptr);
// What OpenBLAS (0.3.21, x86_64) maps for every thread that runs a GEMM, its own threads and
// each thread that calls it at the same time: a 128 MiB buffer and a page. It maps it when the
// thread first needs it (its own threads: as the library loads) and, where an address-space
// limit leaves no room, retries for ever.
constexpr int64_t kOpenBlasBufferBytes = (int64_t{128} << 20) + 4096;
// The OpenBLAS buffers this process has mapped so far: whole 128 MiB blocks (adjacent buffers of
// kOpenBlasBufferBytes show as one region) of anonymous private read-write memory in
// /proc/self/maps, where nothing else maps that much before a run allocates; -1 when the maps
// cannot be read. OpenBLAS's own threads map theirs as they start, some only after main has begun:
// a check of the room left under an address-space limit counts those still to come (loom attn let a
// run through when one was not mapped yet, and libgomp could then not start its threads).
int64_t openblas_buffers_mapped();

// The environment variable `name` as seconds: `fallback` when unset or empty; otherwise a decimal
// number (no spaces, no hex) in [lo, hi], or InvalidArgument naming the variable and the range
// (LOOM_TIMEOUT_S, LOOM_FINALIZE_TIMEOUT_S, ...; the communicators' timeout and output_timeout_s).
double env_seconds(const char* name, double fallback, double lo, double hi);
// v in the fewest digits that read back as v, exponents without "+" and leading zeros (0.001, 60,
// 1e9 where a stream writes 1e+09): limits of seconds in messages.
std::string seconds_text(double v);
// "1.50 GiB", "12.0 MiB", "512 B".
std::string human_bytes(double bytes);
// Parses a size: a number of bytes in decimal digits (no sign, fraction or exponent) with an
// optional K, M, G or T suffix (powers of 1024; any case, optionally followed by B or iB), e.g.
// "8G", "512M", "64KiB", "1048576"; at least 1 byte and at most 2^63 - 1. Throws
// InvalidArgument naming `option`.
int64_t parse_size(const std::string& text, const std::string& option);
// Throws InvalidArgument when estimate > limit:
//   "<what> needs about 24.5 GiB (estimate) but the memory limit is 7.8 GiB (available memory);
//    lower the problem size or raise --memory-limit".
// limit_bytes < 0: the limit is the machine's available memory, MemAvailable or the cgroup's
// headroom (no check when neither is known). Whatever the limit, the estimate plus
// `mapped_bytes` (address space the run maps beyond what it uses, e.g. kOpenBlasBufferBytes for
// each thread that will call OpenBLAS) must fit address_space_room(), or it is refused naming
// that limit ("... needs about 900 MiB of address space (estimate) but the address-space limit
// (ulimit -v) of 586 MiB, of which 214 MiB is mapped already, leaves 372 MiB (the estimate counts
// 256 MiB of OpenBLAS buffers); ..."), `mapped_what` saying what mapped_bytes is (loom attn: "for
// the stacks and malloc arenas of its 512 threads"). An estimate that is NaN, negative or
// infinite (its byte counts overflowed) is refused whatever the limit.
void check_memory(double estimate_bytes, int64_t limit_bytes, const std::string& what,
                  const std::string& option, double mapped_bytes = 0,
                  const std::string& mapped_what = "of OpenBLAS buffers");

}  // namespace loom
