"""``python -m gpuops ...``: the ``gpuops`` command line (see gpuops.cli)."""

import sys

from .cli import main

sys.exit(main())
