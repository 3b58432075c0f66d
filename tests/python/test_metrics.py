"""gpuops.metrics.Recorder (issue 24, first part): every figure against an independent computation on a small run,
no device read on the step path, the JSON Lines and CSV files (resume, a cut-off line), and bad input."""

import csv
import json
import math
import random

import pytest
import torch

import gpuops
from conftest import requires_cuda


def _run(recorder, steps, overflow_at=(), device="cpu", log=None):
    """A small AMP-style loop with our GradScaler (fp32 here), an overflow injected at the given steps; returns
    what the test computes itself per step: loss, grad norm, scale, skipped count and lrs."""
    torch.manual_seed(random.randint(0, 2**31))
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(device)
    optimizer = gpuops.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 3e-3}],
                                   lr=1e-3)
    scaler = gpuops.GradScaler(device, init_scale=2.0**10, growth_interval=3)
    truth = [] if log is None else log
    for step in range(1, steps + 1):
        loss = model(torch.randn(16, 6, device=device)).pow(2).mean()
        scaler.scale(loss).backward()
        if step in overflow_at:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        recorder.step_done(loss, optimizer=optimizer, scaler=scaler, grad_norm=norm, tokens=16 * 6, samples=16)
        truth.append(dict(loss=loss.item(), norm=norm.item(), scale=scaler.get_scale(),
                          skipped=scaler.skipped_steps, lrs=[g["lr"] for g in optimizer.param_groups]))
    return truth


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_every_figure_matches_the_run_it_records(tmp_path):
    path = tmp_path / "m.jsonl"
    recorder = gpuops.metrics.Recorder(log_every=5, jsonl=path)
    truth = _run(recorder, 12, overflow_at=(3, 9, 10))
    recorder.close()
    records = _records(path)
    assert [r["step"] for r in records] == [5, 10, 12]
    for record, (first, last) in zip(records, [(0, 5), (5, 10), (10, 12)]):
        window = truth[first:last]
        assert record["loss"] == pytest.approx(sum(t["loss"] for t in window) / len(window), rel=1e-12)
        assert record["loss_last"] == pytest.approx(window[-1]["loss"], rel=1e-12)
        assert record["nonfinite_losses"] == 0
        norms = [t["norm"] for t in window]
        if math.isfinite(norms[-1]):
            assert record["grad_norm"] == norms[-1]
        else:  # inf on an overflow step, written as null (JSON has no inf)
            assert record["grad_norm"] is None
        assert (record["grad_norm_max"] is None) == any(math.isinf(n) for n in norms)
        assert record["loss_scale"] == window[-1]["scale"]
        assert record["skipped_steps"] == window[-1]["skipped"]
        assert record["lr"] == window[-1]["lrs"]
        assert record["tokens_per_s"] > 0 and record["samples_per_s"] == pytest.approx(record["tokens_per_s"] / 6)
    assert [r["skipped_steps"] for r in records] == [1, 3, 3]
    assert [r["skip_streak"] for r in records] == [0, 2, 0]  # steps 9 and 10 skipped in a row, then 11 ran


def test_cpu_values_need_no_device_reads(tmp_path):
    """On the CPU every value is read where it is (no sync exists there): no device buffer, no device read. The
    CUDA path (values kept in a device buffer, read once per record) is the next test's, on a GPU."""
    recorder = gpuops.metrics.Recorder(log_every=10, jsonl=tmp_path / "m.jsonl")
    _run(recorder, 20)
    assert recorder.host_reads == 0 and len(_records(tmp_path / "m.jsonl")) == 2


@requires_cuda
def test_the_cuda_step_path_makes_no_host_sync(tmp_path):
    recorder = gpuops.metrics.Recorder(log_every=4, jsonl=tmp_path / "m.jsonl")
    _run(recorder, 2, device="cuda")  # warm-up: the scaler's and the recorder's tensors are made here
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(recorder, 1, device="cuda")  # step 3 of the interval: nothing may be read
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert recorder.host_reads == 0
    _run(recorder, 1, device="cuda")  # step 4 ends the interval: its one read
    assert recorder.host_reads == 1
    record = _records(tmp_path / "m.jsonl")
    assert record[-1]["peak_allocated_bytes"] > 0 and record[-1]["loss_scale"] is not None


@requires_cuda
def test_the_gpu_step_time_is_the_device_time_between_step_ends(tmp_path):
    """gpu_step_time_s against the test's own CUDA events, recorded at each step's end on the same stream."""
    recorder = gpuops.metrics.Recorder(log_every=5, jsonl=tmp_path / "m.jsonl")
    x = torch.randn(2048, 2048, device="cuda")
    ends = []
    for step in range(10):
        for _ in range(step % 3 + 1):  # uneven steps
            x = torch.tanh(x @ x) / 64
        ends.append(torch.cuda.Event(enable_timing=True))
        ends[-1].record()
        recorder.step_done(x[0, 0])  # a CUDA loss: the recorder's event follows the test's on the stream
    recorder.close()
    torch.cuda.synchronize()
    first, second = _records(tmp_path / "m.jsonl")
    # the first interval runs from the first step's end (4 steps), the second from the fifth's (5 steps)
    assert first["gpu_step_time_s"] == pytest.approx(ends[0].elapsed_time(ends[4]) / 1e3 / 4, rel=0.05)
    assert second["gpu_step_time_s"] == pytest.approx(ends[4].elapsed_time(ends[9]) / 1e3 / 5, rel=0.05)


def test_a_nonfinite_loss_is_counted_and_training_goes_on(tmp_path):
    recorder = gpuops.metrics.Recorder(log_every=3, jsonl=tmp_path / "m.jsonl")
    for value in (1.0, float("nan"), 3.0):
        recorder.step_done(torch.tensor(value))
    (record,) = _records(tmp_path / "m.jsonl")
    assert record["nonfinite_losses"] == 1 and record["loss"] == 2.0 and record["loss_last"] == 3.0


def test_a_resumed_run_replaces_the_abandoned_steps_and_a_cut_line_is_dropped(tmp_path):
    path, table = tmp_path / "m.jsonl", tmp_path / "m.csv"
    first = gpuops.metrics.Recorder(log_every=5, jsonl=path, csv=table)
    _run(first, 12)
    first.close()
    with open(path, "a") as f:
        f.write('{"step": 99, "lo')  # a SIGKILL during a write
    with open(table, "a") as f:
        f.write("99,0.5")
    second = gpuops.metrics.Recorder(log_every=5, jsonl=path, csv=table, start_step=10)  # resumed at step 10
    assert second.resumed_after == 12
    _run(second, 5)  # steps 11-15: the abandoned run's record of step 12 goes (TensorBoard drops it too)
    second.close()
    assert [r["step"] for r in _records(path)] == [5, 10, 15]
    with open(table) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [5, 10, 15]
    assert float(rows[-1]["lr_1"]) == pytest.approx(3e-3) and rows[0]["loss_scale"] != ""


def test_ranks_write_only_where_asked(tmp_path):
    quiet = gpuops.metrics.Recorder(log_every=1, jsonl=tmp_path / "m.jsonl", rank=1, world_size=2)
    quiet.step_done(torch.tensor(1.0))
    assert not (tmp_path / "m.jsonl").exists() and quiet.step == 1
    loud = gpuops.metrics.Recorder(log_every=1, jsonl=tmp_path / "m.jsonl", rank=1, world_size=2,
                                   every_rank_writes=True)
    loud.step_done(torch.tensor(1.0))
    assert [r["step"] for r in _records(tmp_path / "m.jsonl.rank1")] == [1]


def test_bad_input_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match="log_every 0 .*accepted: >= 1"):
        gpuops.metrics.Recorder(log_every=0)
    with pytest.raises(ValueError, match="rank 3 .*world_size"):
        gpuops.metrics.Recorder(rank=3, world_size=2)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="a-file"):  # its folder cannot be made: a file stands there
        gpuops.metrics.Recorder(jsonl=tmp_path / "a-file" / "m.jsonl")
    with pytest.raises(ValueError, match="start_step"):
        gpuops.metrics.Recorder(start_step=-1)
    recorder = gpuops.metrics.Recorder(log_every=2)
    with pytest.raises(ValueError, match="loss must be a one-element tensor"):
        recorder.step_done(torch.ones(3))
    with pytest.raises(ValueError, match="tokens -1"):
        recorder.step_done(torch.tensor(1.0), tokens=-1)
    with pytest.raises(TypeError, match="loss must be a tensor, a number or None, got str"):
        recorder.step_done("1.5")
    with pytest.raises(TypeError, match="samples must be an int"):
        recorder.step_done(1.5, samples=2.5)
    recorder.step_done(1.5, grad_norm=3)  # numbers are accepted as they are
    assert recorder.step == 1  # the refused calls counted no step


@pytest.mark.skipif(gpuops.metrics.tensorboard_available(), reason="this gpuops writes TensorBoard files")
def test_tensorboard_files_are_refused_by_a_build_without_them_naming_what_it_lacks(tmp_path):
    with pytest.raises(ValueError, match="tensorboard .* built without TensorBoard files .*libprotobuf-dev"):
        gpuops.metrics.Recorder(jsonl=tmp_path / "m.jsonl", tensorboard=tmp_path / "tb")
    assert not (tmp_path / "m.jsonl").exists() and not (tmp_path / "tb").exists()


def test_a_run_is_drawn_and_a_bad_file_is_refused(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "m.jsonl"
    recorder = gpuops.metrics.Recorder(log_every=2, jsonl=path)
    _run(recorder, 6, overflow_at=(3,))
    recorder.close()
    out = tmp_path / "run.png"
    done = subprocess.run([sys.executable, "-m", "gpuops.metrics", "plot", str(path), "-o", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.jsonl").write_text('{"step": 1}\nnot json\n')
    bad = subprocess.run([sys.executable, "-m", "gpuops.metrics", "plot", str(tmp_path / "bad.jsonl")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "bad.jsonl:2 is not a JSON record" in bad.stderr


def test_a_callback_gets_every_record_and_its_failure_is_a_warning():
    seen = []
    recorder = gpuops.metrics.Recorder(log_every=2, callback=seen.append)
    for value in (1.0, 2.0, 3.0, 4.0):
        recorder.step_done(torch.tensor(value))
    assert [(r["step"], r["loss"]) for r in seen] == [(2, 1.5), (4, 3.5)]

    def broken(record):
        raise RuntimeError("sink down")

    failing = gpuops.metrics.Recorder(log_every=1, callback=broken)
    with pytest.warns(UserWarning, match="callback failed on the record of step 1.*sink down"):
        failing.step_done(torch.tensor(1.0))
    failing.step_done(torch.tensor(2.0))  # training goes on
    assert failing.step == 2
    with pytest.raises(TypeError, match="callback must be callable"):
        gpuops.metrics.Recorder(callback=3)


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_a_callback_that_stops_the_run_is_not_swallowed(stop):
    def interrupted(record):
        raise stop("the user stops")

    recorder = gpuops.metrics.Recorder(log_every=1, callback=interrupted)
    with pytest.raises(stop, match="the user stops"):
        recorder.step_done(torch.tensor(1.0))
    with pytest.raises(stop):
        recorder.step_done(torch.tensor(2.0), tokens=3)
    assert recorder.step == 2  # each step was recorded before its record's callback stopped the run
    closing = gpuops.metrics.Recorder(log_every=10, callback=interrupted)
    closing.step_done(torch.tensor(1.0))  # no record yet
    with pytest.raises(stop):  # the last record's callback, at close()
        closing.close()


def test_an_unreadable_value_is_dropped_with_one_warning_and_the_recorder_goes_on(tmp_path):
    recorder = gpuops.metrics.Recorder(log_every=2, jsonl=tmp_path / "m.jsonl")
    with pytest.warns(UserWarning, match="grad_norm is on meta.*left out"):
        recorder.step_done(torch.tensor(1.0), grad_norm=torch.empty((), device="meta"))
    recorder.step_done(torch.tensor(3.0), grad_norm=torch.tensor(0.5))
    recorder.step_done(torch.tensor(5.0), grad_norm=torch.empty((), device="meta"))  # said once
    recorder.step_done(torch.tensor(7.0))
    recorder.close()
    records = _records(tmp_path / "m.jsonl")
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in records] == [(2, 2.0, 0.5), (4, 6.0, None)]


def test_tflops_and_mfu_follow_a_flop_count_done_by_hand(monkeypatch):
    """PaLM's count by hand for Llama-2-7B at 4096 tokens: 6 x (parameters - the 32000 x 4096 token table)
    + 12 x 32 layers x 4096 x 4096; the recorder's TFLOPS is tokens/s times that, its MFU over the peak."""
    params = 6_738_415_616  # LlamaForCausalLM(llama-2-7b).num_parameters(), transformers' own count
    by_hand = 6 * (params - 32000 * 4096) + 12 * 32 * 4096 * 4096
    spec = gpuops.estimator._model_spec("llama-2-7b", None, None)
    assert spec.parameter_count == params and spec.training_flops_per_token(4096) == by_hand
    tied = gpuops.estimator._model_spec("gpt2", None, None)  # GPT-2's head is its token table: its matmul counts
    assert tied.training_flops_per_token(1024) == 6 * tied.parameter_count + 12 * 12 * 768 * 1024
    seen = []
    recorder = gpuops.metrics.Recorder(log_every=2, model="llama-2-7b", seq_len=4096, gpu="H100-80GB",
                                       callback=seen.append)
    for value in (1.0, 2.0):
        recorder.step_done(torch.tensor(value), tokens=8192)
    (record,) = seen
    assert record["tflops"] == pytest.approx(record["tokens_per_s"] * by_hand / 1e12, rel=1e-12)
    h100 = next(g["tensor_tflops"] for g in gpuops.gpu_catalog() if g["name"] == "H100-80GB")
    assert record["peak_tflops"] == h100 and record["mfu"] == pytest.approx(record["tflops"] / h100, rel=1e-12)
    with pytest.raises(ValueError, match="mixtral-8x7b.*experts"):
        gpuops.metrics.Recorder(model="mixtral-8x7b", seq_len=4096)
    with pytest.raises(ValueError, match="seq_len"):
        gpuops.metrics.Recorder(model="llama-2-7b")
    with pytest.raises(ValueError, match="peak_tflops must be a finite number > 0, got nan"):
        gpuops.metrics.Recorder(peak_tflops=float("nan"), flops_per_token=1.0)
    with pytest.raises(ValueError, match="gpu 'B200' is not in the catalog"):
        gpuops.metrics.Recorder(peak_tflops=None, gpu="B200", flops_per_token=1.0)


@pytest.mark.parametrize("device_name, catalog_name", [
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"), ("NVIDIA H100 80GB HBM3", "H100-80GB"), ("NVIDIA H200", "H200"),
    ("NVIDIA GeForce RTX 4090", "RTX-4090"), ("NVIDIA L4", "L4"), ("Tesla T4", "T4"), ("Quadro RTX 8000", None)])
def test_the_peak_is_the_catalog_gpu_the_device_name_names(monkeypatch, device_name, catalog_name):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: device_name)
    peak = gpuops.metrics._peak_flops(None, None)
    expected = next((g["tensor_tflops"] for g in gpuops.gpu_catalog() if g["name"] == catalog_name), 0.0)
    assert peak == expected * 1e12


def test_a_csv_with_other_columns_is_refused_not_misaligned(tmp_path):
    path = tmp_path / "old.csv"
    path.write_text("step,loss,loss_last,time,lr_0\n10,1.5,1.4,1700000000,0.001\n")  # an older version's columns
    with pytest.raises(ValueError, match="other columns"):
        gpuops.metrics.Recorder(csv=path)
    assert path.read_text().count("\n") == 2  # left as it was
