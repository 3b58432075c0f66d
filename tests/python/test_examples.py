"""The Python examples run and learn."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_train_amp_example_reduces_the_loss():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "python" / "train_amp.py"), "--steps", "60"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", result.stdout).groups())
    assert last < 0.5 * first, result.stdout
