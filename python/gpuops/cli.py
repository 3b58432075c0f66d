"""The ``gpuops`` command line from Python: ``gpuops.cli.main(argv)`` or ``python -m gpuops.cli``.

The installed ``gpuops`` command is the native binary (torch-free, starts in milliseconds); both run the same
C++ ``gpuops::run_cli``, so they print the same bytes and exit with the same status."""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence, Union


def _write(stream, data: bytes) -> None:
    if stream is None:  # started with the descriptor closed (`gpuops ... >&-`)
        raise OSError(9, "the stream is closed")
    stream.flush()  # what Python itself wrote before, in order
    stream.buffer.write(data)
    stream.buffer.flush()


def _silence(stream) -> None:
    """Points a stream that failed at /dev/null: Python flushes it again at exit, and would print a traceback
    and exit 120 if that failed too."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, AttributeError, ValueError):
        pass


def main(argv: Optional[Sequence[Union[str, bytes]]] = None) -> int:
    """Runs ``gpuops <argv>`` and returns its exit status: 0, 2 for bad input, 1 when the output cannot be
    written (a full disk, a closed pipe). The arguments go to C++ as the bytes the OS gave (os.fsencode),
    and its output comes back as bytes, so any byte in a path or a name passes through unharmed."""
    from . import _C

    args = sys.argv[1:] if argv is None else argv
    code, out, err = _C.run_cli([os.fsencode(a) for a in args])
    try:
        _write(sys.stdout, out)
    except OSError as e:
        _silence(sys.stdout)
        err += f"gpuops: error: cannot write the output ({e.strerror or e})\n".encode()
        code = 1
    try:
        _write(sys.stderr, err)
    except OSError:
        _silence(sys.stderr)  # nowhere left to say it: the exit status does
    return code


if __name__ == "__main__":
    sys.exit(main())
