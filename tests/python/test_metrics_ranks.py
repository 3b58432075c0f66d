"""gpuops.metrics.Recorder with a communicator: two real processes over Gloo (this file run as a script, one per
rank, each writing its own file). The all-rank figures equal what each rank recorded itself, combined (sum of
rates, max of step times), on every rank, and the collective bytes per step are the ring's 2(N-1)/N of what the
loop all-reduced (the recorder's own all-reduces left out)."""

import json
import os
import sys

import torch

import gpuops
from multiprocess_launch import launch

NUMEL, STEPS, LOG_EVERY = 1 << 12, 6, 3


def test_figures_over_ranks(tmp_path):
    outputs = launch(__file__, "record", 2, 40, args=(str(tmp_path / "m.jsonl"),))
    assert all(code == 0 for code, _ in outputs), "\n".join(f"rank {r} ({code}):\n{out}"
                                                           for r, (code, out) in enumerate(outputs))
    own = []
    for rank in range(2):
        with open(tmp_path / f"m.jsonl.rank{rank}") as f:
            own.append([json.loads(line) for line in f])
    assert [r["step"] for r in own[0]] == [r["step"] for r in own[1]] == [3, 6]
    for mine, theirs in zip(*own):
        for figure in ("tokens_per_s_all_ranks", "step_time_s_max_rank", "comm_bytes_per_step"):
            assert mine[figure] == theirs[figure]
        assert mine["tokens_per_s_all_ranks"] == mine["tokens_per_s"] + theirs["tokens_per_s"]
        assert mine["step_time_s_max_rank"] == max(mine["step_time_s"], theirs["step_time_s"])
        assert mine["comm_bytes_per_step"] == 2 * (2 - 1) / 2 * NUMEL * 4  # one fp32 all-reduce a step
        assert mine["peak_allocated_bytes_max_rank"] is None  # the CPU reports no device memory


def test_ranks_recording_different_steps_raise_naming_the_call(tmp_path):
    """Rank 1 records every 2 steps, rank 0 every 3: at step 2 rank 1's record all-reduces while rank 0 runs the
    training's own; the checked communicator's agreement makes both raise, naming the call, within seconds."""
    for rank, (code, out) in enumerate(launch(__file__, "disagree", 2, 30, args=(str(tmp_path / "m.jsonl"),))):
        assert code == 0, f"rank {rank}:\n{out}"
        assert "raised: " in out and "rank 1 calls all_reduce of 2 elements of Double" in out, out


def test_ranks_recording_other_steps_in_step_raise_naming_them(tmp_path):
    """Rank 1 resumed at another step than rank 0 (start_step 4 and 0), the same log_every 4: their first records
    meet in the same all-reduces, of steps 4 and 8 (they were combined without a word): every rank raises,
    naming the steps, and neither writes the record."""
    for rank, (code, out) in enumerate(launch(__file__, "offset", 2, 30, args=(str(tmp_path / "m.jsonl"),))):
        assert code == 0, f"rank {rank}:\n{out}"
        assert "raised: " in out and "the ranks make records of different steps (from 4 to 8" in out, out
    for rank in range(2):
        assert (tmp_path / f"m.jsonl.rank{rank}").read_text() == ""


def test_a_rank_that_dies_alone_makes_the_other_raise_within_seconds(tmp_path):
    """Rank 1 dies mid-interval (after step 2 of 3): rank 0's record at step 3 all-reduces with a rank that is gone,
    and raises within seconds instead of hanging; what it recorded before stays in its file."""
    (code0, out0), (code1, _) = launch(__file__, "alone", 2, 40, args=(str(tmp_path / "m.jsonl"),))
    assert code1 == 3  # the rank that died
    assert code0 == 0 and "raised: " in out0, out0
    seconds = float(out0.split("\nafter ")[1].split(" s")[0])  # from the step_done whose record raised
    assert seconds < 12, out0


def _rank_main(path):
    import datetime
    import faulthandler

    faulthandler.dump_traceback_later(15, exit=True)  # a hung rank prints where it is

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    comm = gpuops.dist.Communicator(timeout=20)
    mode = sys.argv[1]
    log_every = 3 - comm.rank if mode == "disagree" else 4 if mode == "offset" else LOG_EVERY
    recorder = gpuops.metrics.Recorder(log_every=log_every, jsonl=path, communicator=comm, every_rank_writes=True,
                                       start_step=4 * comm.rank if mode == "offset" else 0)
    import time
    start = time.monotonic()
    try:
        for step in range(STEPS):
            if mode == "alone" and comm.rank == 1 and step == 2:
                os._exit(3)  # dies between two records; rank 0's next record is the only collective left
            if mode != "alone":
                comm.all_reduce(torch.ones(NUMEL)).wait()  # the training's own collective
            start = time.monotonic()
            recorder.step_done(torch.tensor(float(step)), tokens=100 * (comm.rank + 1))
        recorder.close()
    except (RuntimeError, ValueError) as e:  # ValueError: the agreement names both ranks' calls
        print(f"raised: {e}\nafter {time.monotonic() - start:.1f} s", flush=True)
        os._exit(0)  # the group may be broken: skip torch.distributed's teardown
    import gc

    del recorder, comm  # our communicators go before the group is destroyed (test_communicator.py)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[2])
