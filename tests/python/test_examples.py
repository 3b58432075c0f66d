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


def step_losses(stdout: str) -> dict:
    """{step: loss text} from the finetune examples' "step N loss X" lines (text: compared bit for bit)."""
    return {int(step): loss for step, loss in re.findall(r"^step (\d+) loss (\S+)$", stdout, re.M)}


def check_preempted_run_resumes_exactly(command, tmp_path, steps=10, stop_at=4):
    """An uninterrupted run; a run that signals itself (SIGUSR1) at `stop_at`, saves and exits 0; the same
    command again resumes from the state and prints the uninterrupted run's losses, bit for bit."""
    def run(folder, *extra):
        result = subprocess.run(command(tmp_path / folder, steps, *extra), capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    whole = step_losses(run("whole"))
    assert sorted(whole) == list(range(steps))
    assert float(whole[steps - 1]) < 0.5 * float(whole[0])  # it learns
    stopped = run("preempted", stop_at)
    assert "stop requested: saved" in stopped and sorted(step_losses(stopped)) == list(range(stop_at + 1))
    resumed = run("preempted")
    assert "resumed from" in resumed
    assert step_losses(resumed) == {s: whole[s] for s in range(stop_at + 1, steps)}


def test_python_finetune_example_resumes_a_preempted_run_bit_exactly(tmp_path):
    def command(folder, steps, *stop_at):
        extra = ["--signal-self-at", str(stop_at[0])] if stop_at else []
        return [sys.executable, str(ROOT / "examples" / "python" / "finetune.py"), "--steps", str(steps),
                "--state-dir", str(folder), *extra]

    check_preempted_run_resumes_exactly(command, tmp_path)
