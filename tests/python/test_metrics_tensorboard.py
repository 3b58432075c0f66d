"""The telemetry's TensorBoard files (written by the C++ engine, here through Python): TensorBoard's own
EventAccumulator finds every figure at every logged step, equal to the record; every record is a TFRecord whose
checksums TensorBoard's reader accepts, holding an event that TensorBoard's own event_pb2 parses; a resumed run
writes no step twice as TensorBoard reads it; a folder that cannot be written is refused at creation; a write
that fails is a warning, leaves no partial record behind, and the training goes on."""

import glob
import json
import os
import struct
import subprocess
import sys
import textwrap

import pytest

import gpuops
from test_metrics import _run

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
pytestmark = pytest.mark.skipif(not gpuops.metrics.tensorboard_available(),
                                reason="this gpuops was built without TensorBoard files")


def tensorboard_scalars(folder):
    """{tag: [(step, value)]} as TensorBoard reads the folder."""
    reader = event_accumulator.EventAccumulator(str(folder), size_guidance={event_accumulator.SCALARS: 0})
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def _events(folder):
    """The events of the folder's one event file, read strictly: each TFRecord's two checksums must be those
    TensorBoard's reader computes, each event must parse as TensorBoard's Event, and no byte may be left over."""
    from tensorboard.compat.proto import event_pb2
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    [path] = glob.glob(os.path.join(str(folder), "events.out.tfevents.*"))
    data, at, events = open(path, "rb").read(), 0, []
    while at < len(data):
        header = data[at:at + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[at + 8:at + 12])[0] == masked_crc32c(header)
        body = data[at + 12:at + 12 + length]
        assert len(body) == length and struct.unpack("<I", data[at + 12 + length:at + 16 + length])[0] == \
            masked_crc32c(body)
        events.append(event_pb2.Event.FromString(body))
        at += 16 + length
    return events


def test_tensorboard_reads_every_figure_at_every_logged_step(tmp_path):
    records = []
    with gpuops.metrics.Recorder(log_every=4, tensorboard=tmp_path / "tb", callback=records.append) as recorder:
        _run(recorder, 10, overflow_at=(2,))
    assert [r["step"] for r in records] == [4, 8, 10]
    scalars = tensorboard_scalars(tmp_path / "tb")
    for record in records:
        for name, value in record.items():
            if name in ("step", "lr", "time") or value is None or value == float("inf"):
                continue
            # TensorBoard stores scalars as float32
            assert (record["step"], pytest.approx(value, rel=1e-6)) in scalars[f"gpuops/{name}"], name
        for group, lr in enumerate(record["lr"]):
            assert (record["step"], pytest.approx(lr, rel=1e-6)) in scalars[f"gpuops/lr/{group}"]
    assert [step for step, _ in scalars["gpuops/loss"]] == [4, 8, 10]
    assert (4, 0.0) in scalars["gpuops/nonfinite_losses"]  # a figure of 0 is a scalar of 0
    assert "gpuops/peak_allocated_bytes" not in scalars  # not reported on the CPU: no scalar, not a 0
    assert "gpuops/time" not in scalars  # the record's time is the event's wall time instead
    summaries = [e for e in _events(tmp_path / "tb") if e.HasField("summary")]
    assert [e.wall_time for e in summaries] == [r["time"] for r in records]


def test_the_files_are_tfrecords_of_tensorboards_schema(tmp_path):
    records = []
    with gpuops.metrics.Recorder(log_every=2, tensorboard=tmp_path, start_step=4, callback=records.append) as r:
        _run(r, 3)  # steps 5 to 7 of a resumed run: records at 6 and 7
    version, start, *summaries = _events(tmp_path)
    assert version.file_version == "brain.Event:2"
    assert start.session_log.status == start.session_log.START and start.step == 5  # TensorBoard purges from 5
    assert [e.step for e in summaries] == [6, 7]
    for event, record in zip(summaries, records):
        values = {v.tag: v for v in event.summary.value}
        assert all(v.HasField("simple_value") for v in values.values())  # zeros too
        assert values["gpuops/loss"].simple_value == pytest.approx(record["loss"], rel=1e-6)
        assert values["gpuops/skip_streak"].simple_value == record["skip_streak"]


def test_a_resumed_run_writes_no_step_twice(tmp_path):
    """A run rolled back to an earlier checkpoint: TensorBoard and the JSON Lines file show the same steps and
    values (the file kept the abandoned run's records of the repeated steps while TensorBoard showed the new)."""
    first, second = [], []
    jsonl = tmp_path / "m.jsonl"
    with gpuops.metrics.Recorder(log_every=2, tensorboard=tmp_path, jsonl=jsonl, callback=first.append) as recorder:
        _run(recorder, 8)  # records at 2, 4, 6, 8; the checkpoint was taken at step 2
    with gpuops.metrics.Recorder(log_every=2, tensorboard=tmp_path, jsonl=jsonl, start_step=2,
                                 callback=second.append) as recorder:
        _run(recorder, 4)  # steps 3 to 6 again: records at 4 and 6
    losses = tensorboard_scalars(tmp_path)["gpuops/loss"]
    assert [step for step, _ in losses] == [2, 4, 6]
    expected = [first[0]["loss"], second[0]["loss"], second[1]["loss"]]
    assert [value for _, value in losses] == pytest.approx(expected, rel=1e-6)
    with open(jsonl) as f:
        written = [json.loads(line) for line in f]
    assert [(r["step"], r["loss"]) for r in written] == [(2, first[0]["loss"]), (4, second[0]["loss"]),
                                                         (6, second[1]["loss"])]


def test_each_rank_writes_its_own_folder_only_when_asked(tmp_path):
    with gpuops.metrics.Recorder(log_every=1, tensorboard=tmp_path / "all", rank=1, world_size=2,
                                 every_rank_writes=True) as recorder:
        recorder.step_done(0.5)
    assert tensorboard_scalars(tmp_path / "all" / "rank1")["gpuops/loss"] == [(1, 0.5)]
    with gpuops.metrics.Recorder(log_every=1, tensorboard=tmp_path / "zero", rank=1, world_size=2) as recorder:
        recorder.step_done(0.5)
    assert not (tmp_path / "zero").exists()  # rank 0 writes


def test_a_folder_that_cannot_be_written_is_refused_at_creation(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="tensorboard .* cannot be a writable folder"):
        gpuops.metrics.Recorder(jsonl=tmp_path / "m.jsonl", tensorboard=tmp_path / "a-file" / "tb")
    assert not (tmp_path / "m.jsonl").exists()


@pytest.mark.parametrize("start_step", [0, 4])  # a fresh run, a resumed one
def test_a_failing_write_is_a_warning_leaves_no_partial_record_and_training_goes_on(tmp_path, start_step):
    # A file size limit makes the first record's write fail part way (the disk-full case, without a full disk);
    # run in a process of its own, whose limit nothing else shares.
    script = textwrap.dedent("""
        import glob, os, resource, signal, sys, warnings
        import gpuops
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of a kill
        recorder = gpuops.metrics.Recorder(log_every=1, tensorboard=sys.argv[1], start_step=int(sys.argv[2]))
        [path] = glob.glob(os.path.join(sys.argv[1], "events.out.tfevents.*"))
        size = os.path.getsize(path)
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 40, limits[1]))  # 40 bytes of the record fit
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            recorder.step_done(1.0)
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        print(os.path.getsize(path) - size, " | ".join(str(w.message) for w in caught))
        recorder.step_done(2.0)  # the next step is recorded as usual
        recorder.close()
        print(recorder.step)
    """)
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path), str(start_step)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    first, steps = result.stdout.strip().splitlines()
    grown, warning = first.split(" ", 1)
    assert grown == "0", first  # what the failed write had written was cut off again
    assert f"record of step {start_step + 1} was not written" in warning and "File too large" in warning, warning
    assert steps == str(start_step + 2)
    assert tensorboard_scalars(tmp_path)["gpuops/loss"] == [(start_step + 2, 2.0)]
    events = _events(tmp_path)  # whole records only
    assert [e.step for e in events if e.HasField("summary")] == [start_step + 2]
    # The run's first step decides the START, though its record failed: none for a fresh run, else at that step.
    starts = [e.step for e in events if e.HasField("session_log")]
    assert starts == ([start_step + 1] if start_step else [])
