"""The JSON Lines and CSV sinks never harm the files around the run: only regular files are written (symbolic
links, FIFOs and devices refused naming the path, without blocking or reading), an existing file that gpuops
did not write is refused and left byte for byte as it was (never cut or appended to), a large log of ours is
continued reading only its ends, and paths are str or os.PathLike only (no int, bytes or NUL). The folder of
jsonl=/csv= is made when missing, as tensorboard= makes its own."""

import os
import pathlib
import threading

import pytest
import torch

import gpuops


def _recorder(**kw):
    return gpuops.metrics.Recorder(log_every=1, rank=0, world_size=1, **kw)


def _step(recorder, loss=1.0):
    recorder.step_done(torch.tensor(loss))


def _rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_a_symbolic_link_is_refused_and_its_target_untouched(tmp_path, kind):
    target = tmp_path / "passwd"
    target.write_text("root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/sh")  # no last newline
    before = target.read_bytes()
    link = tmp_path / f"m.{kind}"
    link.symlink_to(target)
    with pytest.raises(ValueError, match=f"m.{kind}.*symbolic link"):
        _recorder(**{kind: link})
    assert target.read_bytes() == before


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom", "/dev/full", "/dev/null"])
def test_a_device_is_refused_without_reading_it(device):
    rss = _rss_bytes()
    with pytest.raises(ValueError, match="not a regular file"):
        _recorder(jsonl=device)
    assert _rss_bytes() - rss < 64 << 20


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "m.jsonl"
    os.mkfifo(fifo)
    result = {}

    def open_it():
        try:
            _recorder(jsonl=fifo)
        except ValueError as e:
            result["error"] = str(e)

    thread = threading.Thread(target=open_it, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "opening a FIFO blocked"
    assert "not a regular file" in result.get("error", ""), result


@pytest.mark.parametrize("kind,content", [
    ("jsonl", b"root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/sh"),  # a passwd-like file
    ("jsonl", bytes(range(256)) * 64),  # a binary checkpoint
    ("jsonl", b'{"step": 1}\n{"model": "other tool"}\n'),  # JSON Lines of another tool, ending otherwise
    ("csv", b"epoch,accuracy\n1,0.5\n2,0.7"),  # another tool's CSV, its last line unterminated
    ("csv", b"step,loss\n1,2.0\n"),  # another tool's CSV that happens to start with step
])
def test_a_file_gpuops_did_not_write_is_refused_and_left_as_it_was(tmp_path, kind, content):
    path = tmp_path / f"m.{kind}"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"m.{kind}"):
        _recorder(**{kind: path})
    assert path.read_bytes() == content


def test_a_large_log_is_continued_reading_only_its_ends(tmp_path):
    path = tmp_path / "m.jsonl"
    first = _recorder(jsonl=path)
    _step(first)
    first.close()
    head, rest = path.read_text().split('"step":1', 1)  # one record of ours, step 1

    def line(step):
        return f'{head}"step":{step}{rest}'

    with open(path, "w") as f:  # 96 MB of our records, steps 1 .. n
        n = (96 << 20) // len(line(1))
        f.write("".join(line(s) for s in range(1, n + 1)))
        f.write(line(n + 1)[:20])  # and a record cut by a crash
    rss = _rss_bytes()
    second = _recorder(jsonl=path, start_step=n)
    grown = _rss_bytes() - rss
    assert second.resumed_after == n
    _step(second)
    second.close()
    assert grown < 16 << 20, f"opening a 96 MB log took {grown >> 20} MB"
    with open(path, "rb") as f:
        f.seek(-3 * len(line(n)), os.SEEK_END)
        tail = f.read().decode()
    assert tail.endswith("\n") and f'"step":{n + 1},' in tail.splitlines()[-1] and f'"step":{n},' in tail


def test_the_folder_is_made_as_for_tensorboard(tmp_path):
    recorder = _recorder(jsonl=tmp_path / "run" / "metrics.jsonl", csv=str(tmp_path / "run2" / "deeper" / "m.csv"))
    _step(recorder)
    recorder.close()
    assert (tmp_path / "run" / "metrics.jsonl").is_file() and (tmp_path / "run2" / "deeper" / "m.csv").is_file()


@pytest.mark.parametrize("kind", ["jsonl", "csv", "tensorboard"])
def test_paths_are_str_or_pathlike_without_nul(tmp_path, kind):
    for bad in (3, b"m.jsonl", 2.5):
        with pytest.raises(TypeError, match=kind):
            _recorder(**{kind: bad})
    with pytest.raises(ValueError, match="NUL"):
        _recorder(**{kind: str(tmp_path / "m\0x")})
    assert not any(tmp_path.iterdir()) and not pathlib.Path("3").exists()
