"""The record files survive a SIGKILL during training: a process writing large records as fast as it can is killed
at a random moment. Every finished line of its JSON Lines and CSV files is a whole record (one write per record on
an O_APPEND file); the kernel may have cut the last write short (a kill ends a write between two pages), and
that unfinished line is all: the plot's reader skips it, and a recorder reopening the files cuts it off and
continues after the last whole step without writing one twice."""

import csv
import json
import random
import signal
import subprocess
import sys
import time

import pytest

import gpuops
from gpuops.metrics.plot import read_records

WRITER = """
import sys, torch, gpuops
recorder = gpuops.metrics.Recorder(log_every=1, jsonl=sys.argv[1], csv=sys.argv[2])
lrs = [1e-3] * 4000  # records of tens of kilobytes: many pages per write
class Groups:
    param_groups = [{"lr": lr} for lr in lrs]
print("writing", flush=True)
step = 0
while True:
    step += 1
    recorder.step_done(torch.tensor(float(step)), optimizer=Groups)
"""


def test_a_killed_writer_leaves_whole_lines_and_a_resume_continues(tmp_path):
    jsonl, table = tmp_path / "m.jsonl", tmp_path / "m.csv"
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(jsonl), str(table)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "writing"
    time.sleep(random.uniform(0.3, 1.0))
    child.send_signal(signal.SIGKILL)
    child.wait()
    text = jsonl.read_text()
    assert len(text) > 100_000, len(text)
    whole = text[:text.rfind("\n") + 1]  # at most an unfinished last line after the last newline
    steps = [json.loads(line)["step"] for line in whole.splitlines()]  # every finished line a whole record
    assert steps == list(range(1, len(steps) + 1))
    assert [r["step"] for r in read_records(str(jsonl))] == steps
    rows = list(csv.reader(table.read_text()[:table.read_text().rfind("\n") + 1].splitlines()))
    assert all(len(row) == len(rows[0]) for row in rows)  # every finished row whole
    assert [int(row[0]) for row in rows[1:]] == list(range(1, len(rows)))

    last = max(steps[-1], len(rows) - 1)
    resumed = gpuops.metrics.Recorder(log_every=1, jsonl=jsonl, csv=table, start_step=last - 2)
    assert resumed.resumed_after == last
    for value in range(5):  # steps last-1 .. last+3: the first two are in the files already
        resumed.step_done(float(value))
    resumed.close()
    assert jsonl.read_text().endswith("\n") and table.read_text().endswith("\n")  # the unfinished lines cut off
    steps = [json.loads(line)["step"] for line in jsonl.read_text().splitlines()]
    assert steps == list(range(1, last + 4))
    with open(table, newline="") as f:
        assert [int(row[0]) for row in list(csv.reader(f))[1:]][-4:] == [last, last + 1, last + 2, last + 3][-4:]


def test_the_reader_skips_an_unfinished_last_line_with_a_warning(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    with pytest.warns(UserWarning, match="m.jsonl:3: an unfinished last line"):
        assert [r["step"] for r in read_records(str(path))] == [1, 2]
