"""loom's errors in Python. Every error raised by loom (Python checks and the C++ engine alike)
is one of these; each message is one line naming the value that was wrong.

    Error            any loom error (a RuntimeError)
    InvalidArgument  bad shapes, dtypes, sizes, options (also a ValueError)
    NotSupported     a valid request this build cannot do, e.g. CUDA tensors (also a
                     NotImplementedError)
    CommError        a peer failed or the transport reported an error
    Timeout          a wait ran past loom's timeout (a CommError, also a TimeoutError)
    IoError          unreadable or unwritable files (also an OSError)
"""


class Error(RuntimeError):
    """Any error raised by loom."""


class InvalidArgument(Error, ValueError):
    """Bad shapes, dtypes, sizes or options."""


class NotSupported(Error, NotImplementedError):
    """A valid request this build or backend cannot do."""


class CommError(Error):
    """A peer failed, or the transport reported an error."""


class Timeout(CommError, TimeoutError):
    """A blocking wait ran past loom's timeout."""


class IoError(Error, OSError):
    """Unreadable, malformed or unwritable files."""
