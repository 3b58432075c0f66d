"""The telemetry's TensorBoard sink: TensorBoard's own EventAccumulator reads the event files a training run
wrote and finds every figure at every logged step, equal to the record; a resumed run writes no step twice as
TensorBoard reads it; a folder that cannot be written is refused at creation; a failing write is a warning."""

import pytest

import gpuops
from test_metrics import _run

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _scalars(folder):
    """{tag: [(step, value)]} as TensorBoard reads the folder."""
    reader = event_accumulator.EventAccumulator(str(folder), size_guidance={event_accumulator.SCALARS: 0})
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def test_tensorboard_reads_every_figure_at_every_logged_step(tmp_path):
    records = []
    with gpuops.metrics.Recorder(log_every=4, tensorboard=tmp_path / "tb", callback=records.append) as recorder:
        _run(recorder, 10, overflow_at=(2,))
    assert [r["step"] for r in records] == [4, 8, 10]
    scalars = _scalars(tmp_path / "tb")
    for record in records:
        for name, value in record.items():
            if name in ("step", "lr") or value is None:
                continue
            # TensorBoard stores scalars as float32
            assert (record["step"], pytest.approx(value, rel=1e-6)) in scalars[f"gpuops/{name}"], name
        for group, lr in enumerate(record["lr"]):
            assert (record["step"], pytest.approx(lr, rel=1e-6)) in scalars[f"gpuops/lr/{group}"]
    assert [step for step, _ in scalars["gpuops/loss"]] == [4, 8, 10]
    assert "gpuops/peak_allocated_bytes" not in scalars  # not reported on the CPU: no scalar, not a 0


def test_a_resumed_run_writes_no_step_twice(tmp_path):
    first, second = [], []
    with gpuops.metrics.Recorder(log_every=2, tensorboard=tmp_path, callback=first.append) as recorder:
        _run(recorder, 6)  # records at 2, 4, 6; the checkpoint was taken at step 2
    with gpuops.metrics.Recorder(log_every=2, tensorboard=tmp_path, start_step=2, callback=second.append) as recorder:
        _run(recorder, 4)  # steps 3 to 6 again: records at 4 and 6
    losses = _scalars(tmp_path)["gpuops/loss"]
    assert [step for step, _ in losses] == [2, 4, 6]
    expected = [first[0]["loss"], second[0]["loss"], second[1]["loss"]]
    assert [value for _, value in losses] == pytest.approx(expected, rel=1e-6)


def test_a_folder_that_cannot_be_written_is_refused_at_creation(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="tensorboard .* cannot be a writable folder"):
        gpuops.metrics.Recorder(jsonl=tmp_path / "m.jsonl", tensorboard=tmp_path / "a-file" / "tb")
    assert not (tmp_path / "m.jsonl").exists()


def test_a_failing_write_is_a_warning_and_training_goes_on(tmp_path):
    recorder = gpuops.metrics.Recorder(log_every=1, tensorboard=tmp_path)
    writer = recorder._tensorboard._writer
    add_scalar, failures = writer.add_scalar, []

    def fails_once(*args, **kwargs):  # the disk is full for the first record only
        if not failures:
            failures.append(args)
            raise OSError("disk full")
        add_scalar(*args, **kwargs)

    writer.add_scalar = fails_once
    with pytest.warns(UserWarning, match="record of step 1 was not written to TensorBoard: disk full"):
        recorder.step_done(1.0)
    recorder.step_done(2.0)  # the next step is recorded as usual
    recorder.close()
    assert recorder.step == 2
    assert _scalars(tmp_path)["gpuops/loss"] == [(2, 2.0)]
