"""The Python examples run and learn."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gpuops
from parity import NOISE_FACTOR, TWO_ULPS

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
    # The training figures (MetricsRecorder): the resumed run continued the file without a step twice, and its
    # checkpoint figures saw the saves.
    with open(f"{tmp_path / 'preempted'}.metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    recorded = [r["step"] for r in records]
    assert recorded == sorted(set(recorded)) and recorded[-1] == steps, recorded
    assert sum(r["checkpoint_saves"] for r in records) >= 1 and all(r["loss"] > 0 for r in records)
    assert all(r["grad_norm"] is not None and r["grad_norm"] > 0 for r in records)  # the accumulator's norm
    # The same records as TensorBoard reads its files (written where the build has TensorBoard files): the
    # resumed run's first step had TensorBoard drop what the stopped run wrote after its save.
    if gpuops.metrics.tensorboard_available() and importlib.util.find_spec("tensorboard") is not None:
        from test_metrics_tensorboard import tensorboard_scalars

        losses = tensorboard_scalars(f"{tmp_path / 'preempted'}.tb")["gpuops/loss"]
        assert [step for step, _ in losses] == recorded
        assert [value for _, value in losses] == pytest.approx([r["loss"] for r in records], rel=1e-6)


def test_python_finetune_example_resumes_a_preempted_run_bit_exactly(tmp_path):
    def command(folder, steps, *stop_at):
        extra = ["--signal-self-at", str(stop_at[0])] if stop_at else []
        return [sys.executable, str(ROOT / "examples" / "python" / "finetune.py"), "--steps", str(steps),
                "--state-dir", str(folder), *extra]

    check_preempted_run_resumes_exactly(command, tmp_path)


@pytest.mark.parametrize("stage", [2, 3])
def test_python_zero_example_under_torchrun_resumes_at_another_world_size(tmp_path, stage):
    """examples/python/train_zero.py under torchrun: 2 processes, preempted by a SIGTERM on rank 1 (every rank
    saves the same step and exits 0), resumed on 1 process (the optimizer state, and at stage 3 the sharded
    parameters, resharded on load): the resumed losses follow the uninterrupted 2-process run's (the reductions
    differ in order: bounded by the 1-rank run's distance)."""
    def run(folder, nproc, *extra):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                   str(ROOT / "examples" / "python" / "train_zero.py"), "--steps", "16", "--state-dir",
                   str(tmp_path / folder), "--stage", str(stage), *extra]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                                env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    check_zero_resume_at_another_world_size(run, ["--signal-self-at", "6"], lambda folder: tmp_path / folder)


def check_zero_resume_at_another_world_size(run, stop_at_6, folder_path):
    """The train_zero examples (16 steps): `run(folder, world, *extra)` -> rank 0's output; `folder_path(folder)`
    the state folder. A 2-rank run; one stopped by a SIGTERM on rank 1 after step 6 (every rank saves step 7 and
    exits 0); resumed on 1 rank (the optimizer resharded on load), whose losses follow the uninterrupted run's
    (reductions in another order), and whose training figures continue the file."""
    whole = step_losses(run("whole", 2))
    assert sorted(whole) == list(range(16)) and float(whole[15]) < 0.75 * float(whole[0])  # it learns
    stopped = run("preempted", 2, *stop_at_6)
    assert "stop requested: saved" in stopped and sorted(step_losses(stopped)) == list(range(7))
    resumed = run("preempted", 1)
    assert "resumed from" in resumed and "at step 7 on 1 rank(s)" in resumed
    got = step_losses(resumed)
    assert sorted(got) == list(range(7, 16))
    # The bound, derived here: the uninterrupted run on 1 rank differs from the 2-rank one only by the order of
    # its float32 sums (one batch, not two halves averaged), as the resumed run does for fewer steps; parity.py's
    # factor on that distance, plus the printed losses' resolution (6 decimals).
    alone = step_losses(run("whole-alone", 1))
    noise = max(abs(float(alone[s]) - float(whole[s])) / float(whole[s]) for s in got)
    for s in got:
        bound = NOISE_FACTOR * max(noise, TWO_ULPS) * float(whole[s]) + 1e-6
        assert abs(float(got[s]) - float(whole[s])) <= bound, (s, got[s], whole[s], noise)
    # The training figures (rank 0's file): continued across the resume without a step twice; over both ranks
    # while there were two (the samples of both, the optimizer's collective traffic).
    with open(f"{folder_path('preempted')}.metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [5, 7, 10, 15, 16], records
    for record in records:
        assert record["loss"] > 0
        two_ranks = record["step"] <= 7
        assert record["samples_per_s_all_ranks"] == pytest.approx(record["samples_per_s"] * (2 if two_ranks else 1),
                                                                  rel=0.5)
        assert (record["comm_bytes_per_step"] > 0) == two_ranks
