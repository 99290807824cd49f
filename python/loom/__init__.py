"""loom: exact context-parallel attention. `import loom.torch` for the PyTorch ops."""
from .errors import CommError, Error, InvalidArgument, IoError, NotSupported, Timeout

__version__ = "0.1.0"
__all__ = ["Error", "InvalidArgument", "NotSupported", "CommError", "Timeout", "IoError"]
