"""What the bench scripts share (plan_validate.py, train_validate.py, torch_compare.py,
bench_torch_binding.py): a command line whose bad values are one line and exit 2 before anything
runs, --json outputs checked before the run and written by loom's rules (docs/cli.md, "Files":
"-" is standard output, streams and devices written in place, files atomically), running loom,
the load."""
import argparse
import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the benchmarks' error form: one line, "<prog>: <what> (see --help)", exit 2
    (argparse's own printed the usage first: several lines)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def add_loom_and_json(ap):
    """The --loom and --json options of the scripts that run the loom command."""
    ap.add_argument("--loom", default="build/loom",
                    help="the loom command: a path, or a command on PATH")
    ap.add_argument("--json", default="",
                    help="also write the results as JSON: - is standard output (the table then "
                         "goes to standard error), /dev/stdout, a device or a FIFO are written in "
                         "place, a file atomically")


def check_loom_and_json(ap, a, inputs=()):
    """Before the run (--json was checked only when written, after minutes of it): --loom as a
    command (a name on PATH is found there; a.loom becomes its path), --json's path, and that
    --json names neither --loom nor another of the script's inputs (`inputs`: (option, path)
    pairs), whatever the name (check_not_input)."""
    a.loom = check_executable(ap, a.loom, "--loom")
    check_not_input(ap, a.json, [("--loom", a.loom)] + list(inputs))
    check_output(ap, a.json)


def _regular_file_id(path):
    """(device, inode) of the regular file path names ("-" and the process's own streams: the
    file behind the descriptor), else None."""
    fd = 1 if path == "-" else own_stream_fd(path)
    try:
        st = os.fstat(fd) if fd is not None else os.stat(path)  # symlinks followed
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def check_not_input(ap, path, inputs, option="--json"):
    """Refuses (ap.error: one line, exit 2) an output that is one of the inputs, by any name (a
    symlink, a hard link, "-" or /dev/stdout redirected to it): as loom refuses an output that is
    an input (check_distinct_outputs, include/loom/io.h). `--json build/loom` replaced the loom
    command with the report (atomically, so the executable was gone)."""
    if not path:
        return
    me = _regular_file_id(path)
    for other_option, other in inputs:
        if not other:
            continue
        same = me is not None and me == _regular_file_id(other)
        if not same and path != "-" and own_stream_fd(path) is None:
            same = os.path.realpath(path) == os.path.realpath(other)
        if same:
            ap.error(f"{option} {path} and {other_option} {other} name the same file (the "
                     f"report would replace it); give {option} a path of its own")


def int_at_least(lo):
    """An argparse type: an integer >= lo (--seq 0 timed nothing and printed 0.0 GFLOP/s rows,
    --seq -5 ended in a traceback)."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{value} is not >= {lo}")
        return value
    return parse


def own_stream_fd(path):
    """The descriptor that /dev/stdout, /dev/stderr, /dev/fd/N or /proc/self/fd/N names (the
    process's own open stream, written to directly), else None; as loom's (include/loom/io.h)."""
    if path == "/dev/stdout":
        return 1
    if path == "/dev/stderr":
        return 2
    for prefix in ("/dev/fd/", "/proc/self/fd/"):
        digits = path[len(prefix):]
        if path.startswith(prefix) and digits.isdigit() and len(digits) <= 9:
            return int(digits)
    return None


# The descriptor a --json - is written to: standard output as it was when check_output moved the
# text report off it (None: no --json -).
_json_stdout = None


def check_output(ap, path, option="--json"):
    """Refuses (ap.error: one line, exit 2) before the run an output that write_json could not
    write, by loom's rules (docs/cli.md, "Files"): "-" is standard output, and the text report
    then goes to standard error, children's included (the JSON on standard output parses); the
    process's own streams (/dev/stdout, /dev/stderr, /dev/fd/N, /proc/self/fd/N) must be open; an
    existing file that is not a regular one (a device such as /dev/null, a FIFO) is written
    directly and needs nothing more here; a directory is refused, and so is a regular or new file
    in a directory where the temporary beside it (for the atomic rename) cannot be created. A
    --json onto /nonexistent/x.json failed with a traceback after the whole run; --json
    /dev/stdout into a pipe was "cannot write in /proc/NNN/fd" (the link was resolved first)."""
    global _json_stdout
    if not path:
        return
    if path == "-":
        try:
            sys.stdout.flush()
            _json_stdout = os.dup(1)  # not inherited: the children's output goes to stderr
            os.dup2(2, 1)
        except OSError as e:
            ap.error(f"{option} -: standard output is not open ({e.strerror})")
        return
    fd = own_stream_fd(path)
    if fd is not None:
        try:
            os.fstat(fd)
        except OSError as e:
            ap.error(f"{option} {path}: descriptor {fd} is not open ({e.strerror})")
        return
    try:
        st = os.stat(path)  # symlinks followed
        if stat.S_ISDIR(st.st_mode):
            ap.error(f"{option} {path}: is a directory (a file was expected)")
        if not stat.S_ISREG(st.st_mode):
            return  # a device or a FIFO: written directly, never replaced
    except FileNotFoundError:
        pass  # a new file (or a dangling symlink: its target is created)
    except OSError as e:
        ap.error(f"{option} {path}: cannot write ({e.strerror})")
    target = os.path.realpath(path)
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        ap.error(f"{option} {path}: no directory {parent} to write it in")
    try:
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(target) + ".tmp.", dir=parent)
        os.close(fd)
        os.remove(tmp)
    except OSError as e:
        ap.error(f"{option} {path}: cannot write in {parent} ({e.strerror})")


def _write_fd(fd, data):
    while data:
        data = data[os.write(fd, data):]


def _write_in_place(target, data):
    """Writes data to an existing file that is not a regular one (a device, a FIFO), opened as it
    is: never replaced or truncated. A FIFO nobody reads is an error, not a wait for ever."""
    try:
        fd = os.open(target, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ENXIO:
            raise OSError(e.errno, "a FIFO that nobody reads; start the reader first") from None
        raise
    try:
        os.set_blocking(fd, True)
        _write_fd(fd, data)
    finally:
        os.close(fd)


def _write_atomic(target, data):
    """Writes data to a regular (or new) file: to a temporary beside it, renamed over it when
    complete (an interrupted run leaves the old file, never half a new one), keeping an existing
    file's permission bits."""
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(target) + ".tmp.",
                               dir=os.path.dirname(target))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(target):
            os.chmod(tmp, os.stat(target).st_mode & 0o7777)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json(path, doc, indent=2, option="--json"):
    """Writes doc as JSON to path by the rules check_output checked: "-" to standard output (as it
    was before check_output moved the text off it), the process's own streams to their
    descriptor, a device or FIFO in place, a regular or new file atomically (symlinks followed,
    the link kept). A failed write is one line and exit 1 (no traceback)."""
    data = (json.dumps(doc, indent=indent) + "\n").encode()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        if path == "-":
            _write_fd(_json_stdout if _json_stdout is not None else 1, data)
        elif own_stream_fd(path) is not None:
            _write_fd(own_stream_fd(path), data)
        else:
            target = os.path.realpath(path)
            if os.path.exists(target) and not stat.S_ISREG(os.stat(target).st_mode):
                _write_in_place(target, data)
            else:
                _write_atomic(target, data)
    except OSError as e:
        sys.exit(f"{os.path.basename(sys.argv[0])}: {option} {path}: write failed ({e.strerror})")


def check_executable(ap, path, option):
    """The program to run for path: a file that can be run, or a command name found on PATH (as a
    shell would: --loom loom). Refuses (ap.error) before the run one that cannot be run (a missing
    --loom was a FileNotFoundError traceback)."""
    found = shutil.which(path) if path else None
    if found is None:
        where = "" if os.sep in path else ", nor a command on PATH"
        ap.error(f"{option} {path}: not an executable file{where}")
    return found


def run(cmd, who):
    """stdout of cmd; on failure exits naming `who`, the command and its stderr."""
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.exit(f"{who}: failed: " + " ".join(cmd) + "\n" + r.stderr)
    return r.stdout


def run_json(cmd, path, who, keys=()):
    """Runs cmd (as run), which is to write a JSON object holding `keys` at path, and returns it.
    path is removed first (a stale file from an earlier command is not read as this one's). A
    command that writes none, or not that, is one line and exit 1: a --loom that is not loom
    (/bin/true) was a FileNotFoundError traceback."""
    if os.path.lexists(path):
        os.remove(path)
    run(cmd, who)
    return read_json(path, who, cmd, keys)


def read_json(path, who, cmd, keys=()):
    """The JSON object cmd wrote at path, holding `keys`; one line and exit 1 if it is not."""
    try:
        with open(path) as f:
            doc = json.load(f)
        missing = [k for k in keys if not isinstance(doc, dict) or k not in doc]
        why = f"no {', '.join(missing)} in it" if missing else ""
    except OSError as e:
        why = e.strerror or str(e)
    except ValueError as e:
        why = f"not JSON: {e}"
    if why:
        sys.exit(f"{who}: `{' '.join(cmd)}` exited 0 but {path} is not its report ({why}); is "
                 f"--loom {cmd[0]} the loom command?")
    return doc


def loadavg():
    """The 1-minute load average (NaN where the system has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")
