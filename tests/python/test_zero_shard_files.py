"""gpuops.ZeroOptimizer's shard files against hostile files and paths (issue 31), at world size 1 over Gloo:
crafted files (a step of -3, inf or 0.5; a buffer whose state was emptied) are refused as load_state_dict
refuses them, with nothing changed; files written before per-parameter step counters (one per buffer) load;
save_shard writes only where a regular file or nothing stands (a symbolic link, a FIFO, a folder refused,
naming the path, and nothing left behind), and a full disk is an error, not the end of the process."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import gpuops


def _trained(steps=2):
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    opt = gpuops.ZeroOptimizer(model.parameters(), stage=2, lr=0.05, bucket_bytes=64)  # a bucket per parameter
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 5)).square().sum().backward()
        opt.step()
    return model, opt


def _state(opt):
    opt.consolidate_state_dict(0)
    return {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}


def _same(a, b):
    return a.keys() == b.keys() and all(a[i].keys() == b[i].keys() and all(torch.equal(a[i][k], b[i][k]) for k in a[i])
                                        for i in a)


def _crafted(tmp_path, source, name, edit):
    archive = torch.jit.load(str(source))
    edit(archive._c)
    path = tmp_path / name
    torch.jit.save(archive, str(path))
    return path


@pytest.mark.parametrize("step", [-3.0, float("inf"), float("nan"), 0.5])
def test_a_crafted_step_is_refused_and_nothing_changes(world1, tmp_path, step):
    model, opt = _trained()
    opt.save_shard(tmp_path / "good.pt")
    before = _state(opt)
    bad = _crafted(tmp_path, tmp_path / "good.pt", "bad.pt",
                   lambda a: a.getattr("bucket.1").getattr("state").setattr("step", torch.tensor([step])))
    with pytest.raises(ValueError, match="'step' of flat buffer 1 must hold whole numbers >= 0"):
        opt.load_shards([bad])
    assert _same(_state(opt), before)


def test_a_buffer_whose_state_was_emptied_is_refused(world1, tmp_path):
    model, opt = _trained()
    opt.save_shard(tmp_path / "good.pt")
    before = _state(opt)
    bad = _crafted(tmp_path, tmp_path / "good.pt", "bad.pt", lambda a: a.getattr("bucket.2").setattr("fields", ""))
    with pytest.raises(ValueError, match="entries for 3 of the 4 flat buffers"):
        opt.load_shards([bad])
    assert _same(_state(opt), before)


def test_a_file_with_one_step_counter_per_buffer_loads(world1, tmp_path):
    """Files written before per-parameter counters hold a 0-dim step per buffer: every parameter gets it."""
    model, opt = _trained(steps=3)
    opt.save_shard(tmp_path / "good.pt")

    def old_format(a):
        for k in range(4):
            a.getattr(f"bucket.{k}").getattr("state").setattr("step", torch.tensor(3.0))

    old = _crafted(tmp_path, tmp_path / "good.pt", "old.pt", old_format)
    _, fresh = _trained(steps=1)
    fresh.load_shards([old])
    assert _same(_state(fresh), _state(opt))


@pytest.mark.parametrize("kind", ["symlink", "fifo", "folder"])
def test_save_shard_writes_only_where_a_regular_file_or_nothing_stands(world1, tmp_path, kind):
    model, opt = _trained()
    target = tmp_path / "target"
    target.write_text("someone else's file\n")
    path = tmp_path / "shard.pt"
    if kind == "symlink":
        path.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    with pytest.raises(ValueError, match=f"shard.pt is {'a folder' if kind == 'folder' else 'not a regular file'}"):
        opt.save_shard(path)
    assert target.read_text() == "someone else's file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard.pt", "target"]  # no temporary left
    opt.save_shard(tmp_path / "fine.pt")
    opt.save_shard(tmp_path / "fine.pt")  # a regular file of ours is replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fine.pt", "shard.pt", "target"]


def test_a_full_disk_during_save_shard_is_an_error_not_an_abort(tmp_path):
    """RLIMIT_FSIZE makes every write past 4 KiB fail (EFBIG) as a full disk does: torch's writer used to throw
    from its destructor while the first error unwound, and the process aborted."""
    script = textwrap.dedent(f"""
        import datetime, resource, signal, torch, torch.distributed as dist, gpuops
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        model = torch.nn.Linear(64, 64)
        opt = gpuops.ZeroOptimizer(model.parameters(), stage=1, lr=0.1)
        opt.zero_grad(); model(torch.randn(2, 64)).sum().backward(); opt.step()
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            opt.save_shard({str(tmp_path / "shard.pt")!r})
        except RuntimeError as e:
            print("raised:", str(e).splitlines()[0])
        del opt
        dist.destroy_process_group()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "raised: ZeroOptimizer.save_shard: cannot write" in done.stdout and "File too large" in done.stdout, done.stdout
    assert list(tmp_path.iterdir()) == []  # neither the shard nor a temporary


def test_export_refuses_what_it_cannot_export(tmp_path):
    """python -m gpuops.state export: a path that is not a folder, a folder without a state, a state saved without
    a sharded optimizer (its state.pt holds the whole model) and wrong arguments are refused, naming them, with
    nothing written."""
    import gpuops.state

    out = tmp_path / "out.pt"
    with pytest.raises(ValueError, match="is not a folder"):
        gpuops.state.export(tmp_path / "missing", out)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no training state"):
        gpuops.state.export(tmp_path / "empty", out)
    plain = gpuops.TrainingState(tmp_path / "plain", signals=())
    plain.save(step=1, model=torch.nn.Linear(3, 2))
    plain.close()
    with pytest.raises(ValueError, match="saved without a sharded optimizer"):
        gpuops.state.export(tmp_path / "plain", out)
    assert not out.exists()
    link = tmp_path / "link.pt"
    link.symlink_to(tmp_path / "someone-elses")
    for bad in (link, tmp_path / "empty"):  # a rename would put a regular file in place of a link or folder
        with pytest.raises(ValueError, match="is not a regular file"):
            gpuops.state.export(tmp_path / "plain", bad)
    assert link.is_symlink() and (tmp_path / "empty").is_dir()
    usage = subprocess.run([sys.executable, "-m", "gpuops.state", "export", str(tmp_path / "plain")],
                           capture_output=True, text=True, timeout=120)
    assert usage.returncode == 2 and "usage: python -m gpuops.state export FOLDER OUT.pt" in usage.stderr
    refused = subprocess.run([sys.executable, "-m", "gpuops.state", "export", str(tmp_path / "plain"), str(out)],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "saved without a sharded optimizer" in refused.stderr and not out.exists()
