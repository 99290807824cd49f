"""What the bench scripts share (plan_validate.py, train_validate.py, torch_compare.py,
bench_torch_binding.py): a command line whose bad values are one line and exit 2 before anything
runs, --json outputs checked before the run and written atomically, running loom, the load."""
import argparse
import json
import os
import subprocess
import sys
import tempfile


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the benchmarks' error form: one line, "<prog>: <what> (see --help)", exit 2
    (argparse's own printed the usage first: several lines)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


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


def check_output(ap, path, option="--json"):
    """Refuses (ap.error: one line, exit 2) before the run an output that write_json could not
    write: a directory, an existing file that is not a regular one (a FIFO, a device), or a
    directory to hold it in which no file can be created (the temporary and the rename need it).
    A --json onto /nonexistent/x.json failed with a traceback after the whole run."""
    if not path:
        return
    target = os.path.realpath(path)
    if os.path.isdir(target):
        ap.error(f"{option} {path}: is a directory (a file was expected)")
    if os.path.exists(target) and not os.path.isfile(target):
        ap.error(f"{option} {path}: is not a regular file")
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        ap.error(f"{option} {path}: no directory {parent} to write it in")
    try:
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(target) + ".tmp.", dir=parent)
        os.close(fd)
        os.remove(tmp)
    except OSError as e:
        ap.error(f"{option} {path}: cannot write in {parent} ({e.strerror})")


def write_json(path, doc, indent=2):
    """Writes doc to path atomically: to a temporary file beside it, renamed over it when complete
    (an interrupted run leaves the old file, never half a new one); symlinks followed."""
    target = os.path.realpath(path)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(target) + ".tmp.",
                               dir=os.path.dirname(target))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=indent)
            f.write("\n")
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


def check_executable(ap, path, option):
    """Refuses (ap.error) before the run a program that cannot be run (a missing --loom was a
    FileNotFoundError traceback)."""
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        ap.error(f"{option} {path}: not an executable file")


def run(cmd, who):
    """stdout of cmd; on failure exits naming `who`, the command and its stderr."""
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.exit(f"{who}: failed: " + " ".join(cmd) + "\n" + r.stderr)
    return r.stdout


def loadavg():
    """The 1-minute load average (NaN where the system has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")
