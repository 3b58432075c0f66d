"""The ``gpuops`` command: the same C++ command line as the native ``gpuops`` binary."""

from __future__ import annotations

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    from . import _C

    code, out, err = _C.run_cli(list(sys.argv[1:] if argv is None else argv))
    sys.stdout.write(out)
    sys.stderr.write(err)
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
