"""Two figures of each record that come from outside the step: the share of the interval spent waiting for data
(given per step, or timed from the loader by ``Recorder.timed``), and the training states saved since the last
record (count, seconds and bytes, reported by the state store itself), against the test's own clock and the
saved state's files."""

import json
import os
import random
import time

import pytest
import torch

import gpuops


def test_the_data_wait_share_is_the_waits_over_the_interval():
    records = []
    recorder = gpuops.metrics.Recorder(log_every=4, callback=records.append)
    waits = [random.uniform(0.001, 0.01) for _ in range(8)]
    for wait in waits:
        time.sleep(wait)  # inside the interval: the share cannot pass 1
        recorder.step_done(1.0, data_wait=wait)
    recorder.close()
    for record, window in zip(records, (waits[:4], waits[4:])):
        interval = record["step_time_s"] * len(window)
        assert record["data_wait_share"] == pytest.approx(sum(window) / interval, rel=1e-9)
        assert 0 < record["data_wait_share"] < 1


class _SlowLoader:
    """Batches that take `delay` seconds each to come."""

    def __init__(self, batches, delay):
        self.batches, self.delay = batches, delay

    def __iter__(self):
        for _ in range(self.batches):
            time.sleep(self.delay)
            yield torch.randn(8, 4)


def test_timed_measures_what_the_loader_made_each_step_wait():
    records = []
    model = torch.nn.Linear(4, 1)
    recorder = gpuops.metrics.Recorder(log_every=3, callback=records.append)
    for batch in recorder.timed(_SlowLoader(6, 0.02)):
        model(batch).pow(2).mean().backward()
        recorder.step_done(1.0)
    recorder.close()
    assert [r["step"] for r in records] == [3, 6]
    for record in records:
        waited = record["data_wait_share"] * record["step_time_s"] * 3
        assert 3 * 0.02 <= waited < record["step_time_s"] * 3  # each next() slept 20 ms, inside the interval


def test_without_waits_there_is_no_share():
    with gpuops.metrics.Recorder(log_every=2) as recorder:
        recorder.step_done(1.0)
        recorder.step_done(2.0)
        assert recorder.flush() is None  # already recorded at step 2
    with pytest.raises(TypeError, match="data_wait"):
        recorder.step_done(1.0, data_wait="1s")
    with pytest.raises(ValueError, match="data_wait_s -1 is not accepted"):
        recorder.step_done(1.0, data_wait=-1)
    assert recorder.step == 2  # refused reports count no step


def test_checkpoint_saves_since_the_last_record(tmp_path):
    records = []
    recorder = gpuops.metrics.Recorder(log_every=2, callback=records.append)
    model = torch.nn.Linear(64, 64)
    optimizer = gpuops.optim.AdamW(model.parameters())
    spans = []
    with gpuops.TrainingState(tmp_path / "states", keep=3) as state:
        for step in range(1, 7):
            model(torch.randn(4, 64)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step in (3, 4):
                start = time.perf_counter()
                path = state.save(step=step, model=model, optimizer=optimizer)
                spans.append((time.perf_counter() - start, path))
            recorder.step_done(1.0)
    assert [r["checkpoint_saves"] for r in records] == [0, 2, 0]
    assert records[0]["checkpoint_save_s"] is None and records[0]["checkpoint_bytes"] is None
    saved = records[1]
    assert 0 < saved["checkpoint_save_s"] <= sum(seconds for seconds, _ in spans)
    files = 0
    for _, path in spans:
        with open(os.path.join(path, "checksums.json")) as f:
            files += sum(os.path.getsize(os.path.join(path, entry["name"])) for entry in json.load(f)["files"])
    assert saved["checkpoint_bytes"] == files
