"""torchrun that works on Debian bookworm: /usr/bin/python3 -m loom.torchrun [torchrun args].

Debian's torch 1.13 with Python 3.11 crashes in torchrun before starting any worker
("AttributeError: 'NoneType' object has no attribute 'get'" in elastic/multiprocessing/api.py
to_map): iterating the Std flag enum no longer yields its zero member NONE on Python 3.11, so the
default `--redirects 0 --tee 0` parses to None. This wrapper teaches Std.from_str the zero value
and then runs torch.distributed.run unchanged; the workers it starts are plain processes of the
given script. Passing `--redirects 1 --tee 1` to the real torchrun is another work-around.
"""
import sys

from torch.distributed.elastic.multiprocessing import api as _api
import torch.distributed.run as _run


def _patch():
    original = _api.Std.from_str

    def from_str(vm):
        if isinstance(vm, str) and vm.strip() == "0":
            return _api.Std.NONE
        result = original(vm)
        if isinstance(result, dict):
            return {k: (_api.Std.NONE if v is None else v) for k, v in result.items()}
        return _api.Std.NONE if result is None else result

    _api.Std.from_str = staticmethod(from_str)


def main(argv=None):
    _patch()
    _run.main(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
