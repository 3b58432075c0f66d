"""Ranks agree or fail together (gpuops/agreement.h): real Gloo processes (this file run as a script, one per
rank; multiprocess_launch.py). A rank whose local check fails, or ranks that pass different layouts, options or
initial weights, make every rank raise within seconds, naming the rank or the field, with nothing changed;
none hangs and none trains on a mix. Each agreement completes its collectives on every rank before anyone
raises, so one pair of processes runs every scenario of a group in turn."""

import sys
import time

import pytest
import torch

import gpuops
from multiprocess_launch import launch

WORLD = 2
DEADLINE_S = 60  # every scenario of a group, process start-up included; one that hangs would take 30 s


def _run_group(group, *args):
    began = time.monotonic()
    results = launch(__file__, group, WORLD, DEADLINE_S, args=list(args))
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"rank {rank}:\n{out}"
        assert f"{group} ok" in out, out
    return time.monotonic() - began


def test_the_agreement_itself():
    _run_group("agreement")


def test_zero_optimizer_construction():
    _run_group("construction")


def test_zero_optimizer_loads(tmp_path):
    _run_group("loads", str(tmp_path))


def test_training_state(tmp_path):
    _run_group("training_state", str(tmp_path))


def test_a_rank_saving_alone_is_named_at_the_timeout(tmp_path):
    _run_group("alone", str(tmp_path))


# ----------------------------------------------------------------------------------------------------- ranks
def _raises(what, rank, expected, fn, seconds=10.0):
    """fn() raises on this rank with every string of `expected` in its message, within `seconds`."""
    began = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type is checked by the caller's expectations
        message = f"{type(e).__name__}: {e}"
        missing = [s for s in expected if s not in message]
        assert not missing, f"{what}: rank {rank} raised {message!r}, missing {missing}"
        assert time.monotonic() - began < seconds, f"{what}: rank {rank} took {time.monotonic() - began:.1f} s"
        print(f"rank {rank}, {what}: {message}".encode("utf-8", "backslashreplace").decode(), flush=True)
        return message
    raise AssertionError(f"{what}: rank {rank} did not raise")


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _agreement(comm, rank):
    assert comm.agree("probe", fields=[("shape", "4x4")], proposals=[("id", f"from {rank}")]) == [("id", "from 0")]
    _raises("a field differs", rank, ["probe: the ranks disagree on shape: rank 0 has 4x4, rank 1 has 4x5"],
            lambda: comm.agree("probe", fields=[("shape", "4x4" if rank == 0 else "4x5")]))
    expected = ["boom on one rank"] if rank == 1 else ["probe: rank 1 failed: boom on one rank; nothing was changed"]
    _raises("one rank fails", rank, expected, lambda: comm.agree("probe", error="boom on one rank" if rank else ""))
    # Python's helper: the failing rank raises its own exception, the other names it.
    if rank == 1:
        _raises("fail_together", rank, ["TypeError: bad argument"],
                lambda: gpuops.dist.fail_together(comm, "probe", TypeError("bad argument")))
    else:
        _raises("fail_together", rank, ["rank 1 failed: TypeError: bad argument"], lambda: comm.agree("probe"))
    assert comm.agree("probe", fields=[("still", "usable")]) == []  # the group went on
    # A rank at its memory budget's limit still takes part: the agreement's bytes, and Gloo's temporaries for
    # them on its own threads, are never refused (rank 1 raised out of memory alone; rank 0 waited).
    with gpuops.memory_budget(1 if rank == 1 else None):
        assert comm.agree("probe", fields=[("under a budget", "of 1 byte on rank 1")]) == []
        _raises("a field differs under a budget", rank, ["probe: the ranks disagree on shape"],
                lambda: comm.agree("probe", fields=[("shape", "4x4" if rank == 0 else "4x5")]))
    # Collectives that differ across ranks raise on every rank (Gloo aborted the process on a size mismatch).
    _raises("sizes differ", rank, ["all_reduce: the ranks call different collectives", "rank 0 calls all_reduce of 4 "
                                   "elements of Float (sum), rank 1 calls all_reduce of 5 elements"],
            lambda: comm.all_reduce(torch.ones(4 + rank)).wait())
    _raises("dtypes differ", rank, ["the ranks call different collectives", "Float", "Double"],
            lambda: comm.all_reduce(torch.ones(4, dtype=torch.float64 if rank else torch.float32)).wait())
    _raises("collectives differ", rank, ["the ranks call different collectives", "all_gather of 4 elements"],
            lambda: (comm.all_reduce(torch.ones(4)) if rank else comm.all_gather(torch.ones(8))).wait())
    # A rank whose own arguments are refused raises with the others, not alone (they waited in the check).
    expected = ["is not divisible"] if rank == 1 else ["rank 1 refused its arguments"]
    _raises("arguments refused on one rank", rank, expected, lambda: comm.all_gather(torch.zeros(4 - rank)).wait())
    # Errors that begin with a line break, or carry bytes that are not UTF-8, still reach the other ranks.
    _raises("a leading line break", rank, ["boom"], lambda: comm.agree("probe", error="\nboom" if rank else ""))
    if rank == 1:
        _raises("a lone surrogate", rank, ["bad"],
                lambda: gpuops.dist.fail_together(comm, "probe", ValueError("bad \udcff path")))
    else:
        _raises("a lone surrogate", rank, ["rank 1 failed: ValueError: bad \\udcff path"], lambda: comm.agree("probe"))
    buffer = torch.full((4,), float(rank + 1))
    comm.all_reduce(buffer).wait()  # the group went on
    assert buffer.tolist() == [3.0] * 4


def _construction(comm, rank):
    def zero(**changes):
        options = dict(stage=2, lr=1e-3, bucket_bytes=1024)
        model = changes.pop("model", None) or _model()
        options.update(changes)
        return gpuops.ZeroOptimizer(model.parameters(), communicator=comm, **options)

    differ = [
        ("bucket_bytes", dict(bucket_bytes=1024 + 1024 * rank), ["disagree on bucket_bytes", "rank 0 has 1024",
                                                                 "rank 1 has 2048"]),
        ("lr", dict(lr=1e-3 * (1 + rank)), ["disagree on optimizer and options", "lr=0.001", "lr=0.002"]),
        ("kind", dict(optimizer_class=["AdamW", "SGD"][rank]), ["disagree on optimizer and options", "AdamW(",
                                                                "SGD("]),
        ("amsgrad", dict(amsgrad=bool(rank)), ["disagree on optimizer and options", "amsgrad=false", "amsgrad=true"]),
        ("stage", dict(stage=1 + rank), ["disagree on stage"]),
        ("initial weights", dict(model=_model(seed=rank)), ["disagree on initial parameter values"]),
        ("layout", dict(model=torch.nn.Linear(6, 3 + rank)), ["disagree on parameters (count, shapes, dtypes)"]),
    ]
    for what, changes, expected in differ:
        model = changes.get("model")
        before = [p.detach().clone() for p in (model or _model()).parameters()]
        _raises(what, rank, ["ZeroOptimizer: the ranks disagree on"] + expected, lambda: zero(**changes))
        if model is not None:  # refused before a parameter changed
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    named = _model()
    names = [(f"layer{i}" if rank == 0 else f"other{i}", p) for i, p in enumerate(named.parameters())]
    _raises("names", rank, ["disagree on param_names"],
            lambda: gpuops.ZeroOptimizer(names, communicator=comm, stage=1, lr=1e-3))
    # One rank fails a local check (C++, the binding, Python): it raises its own error, the other names it.
    failing = [  # (what, rank 1's arguments, in every message, the type rank 1 raises)
        ("float64", dict(model=_model().double()), ["params[0] is Double"], "ValueError"),
        ("stage 5", dict(stage=5), ["stage must be 1"], "ValueError"),
        ("lr text", dict(lr="abc"), ["lr must be a real number"], "TypeError"),
        ("optimizer name", dict(optimizer_class="lion"), ["optimizer_class must be AdamW, Adam or SGD"], "ValueError"),
        ("negative lr", dict(lr=-1.0), ["Invalid learning rate"], "ValueError"),
    ]
    for what, changes, expected, own_type in failing:
        if rank == 1:
            message = _raises(what, rank, expected, lambda: zero(**changes))
            assert message.startswith(own_type) and "rank 1 failed" not in message, message
        else:
            _raises(what, rank, ["ZeroOptimizer: rank 1 failed"] + expected, lambda: zero())
    zero()  # the group went on: a construction that agrees


def _loads(comm, rank, folder):
    """Loads are all or nothing on every rank: a state dict or a file set that fails on one rank, or differs
    between ranks, changes no rank's optimizer."""
    import copy
    import json

    model = _model()
    opt = gpuops.ZeroOptimizer(model.parameters(), communicator=comm, stage=2, lr=1e-2, bucket_bytes=256)
    for step in range(3):
        opt.zero_grad()
        torch.manual_seed(100 + 10 * step + rank)
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()

    def consolidated():
        opt.consolidate_state_dict(0)
        return copy.deepcopy(opt.state_dict()) if rank == 0 else None

    good = consolidated()
    good = [good]
    torch.distributed.broadcast_object_list(good, src=0)
    good = good[0]

    def unchanged(what):
        now = consolidated()
        if rank == 0:
            for i, entry in good["state"].items():
                for key, value in entry.items():
                    assert torch.equal(torch.as_tensor(value), torch.as_tensor(now["state"][i][key])), (what, i, key)
            assert now["param_groups"][0]["lr"] == good["param_groups"][0]["lr"], what

    def spoiled(change):
        bad = copy.deepcopy(good)
        change(bad)
        return bad

    as_json = json.loads(json.dumps({"state": {i: {k: v.tolist() for k, v in e.items()} for i, e in
                                               good["state"].items()}, "param_groups": good["param_groups"]}))
    as_json["state"] = {k: {n: torch.tensor(v) for n, v in e.items()} for k, e in as_json["state"].items()}
    on_one_rank = [  # (what, rank 1's state dict, what rank 1's error says)
        ("string keys", as_json, "none of the parameter ids"),
        ("lr nan", spoiled(lambda d: d["param_groups"][0].update(lr=float("nan"))), "Invalid learning rate"),
        ("lr -1", spoiled(lambda d: d["param_groups"][0].update(lr=-1.0)), "Invalid learning rate"),
        ("lr text", spoiled(lambda d: d["param_groups"][0].update(lr="abc")), "lr"),
        ("step -5", spoiled(lambda d: d["state"][0].update(step=torch.tensor(-5.0))), "must be one number in [0, 2**53]"),
        ("step 1e30", spoiled(lambda d: d["state"][0].update(step=torch.tensor(1e30))), "must be one number"),
        ("step inf", spoiled(lambda d: d["state"][0].update(step=torch.tensor(float("inf")))), "must be one number"),
        ("a shape", spoiled(lambda d: d["state"][0].update(exp_avg=torch.zeros(3))), "has shape (3,)"),
    ]
    for what, bad, says in on_one_rank:
        if rank == 1:
            _raises(what, rank, [says], lambda: opt.load_state_dict(bad))
        else:
            _raises(what, rank, ["ZeroOptimizer.load_state_dict: rank 1 failed", says],
                    lambda: opt.load_state_dict(good))
        unchanged(what)
    other = spoiled(lambda d: d["state"][0]["exp_avg"].mul_(2.0))
    _raises("states differ", rank, ["ZeroOptimizer.load_state_dict: the ranks disagree on state"],
            lambda: opt.load_state_dict(good if rank == 0 else other))
    unchanged("states differ")
    other_lr = spoiled(lambda d: d["param_groups"][0].update(lr=0.5))
    _raises("lr differs", rank, ["ZeroOptimizer.load_state_dict: the ranks disagree on lr"],
            lambda: opt.load_state_dict(good if rank == 0 else other_lr))
    unchanged("lr differs")
    # Shard files: of two saves; a file missing on one rank; then every rank loads one save.
    opt.save_shard(folder / f"first-{rank}.pt")
    opt.zero_grad()
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    opt.save_shard(folder / f"second-{rank}.pt")
    comm.barrier().wait()
    after = consolidated()
    mixed = [folder / "first-0.pt", folder / "second-1.pt"]
    _raises("two saves", rank, ["ZeroOptimizer.load_shards: the ranks disagree on checkpoint"], lambda: opt.load_shards(mixed))
    missing = [folder / "first-0.pt", folder / ("first-1.pt" if rank == 0 else "nowhere-1.pt")]
    _raises("a missing file", rank, ["nowhere-1.pt' cannot be read"] + ([] if rank == 1 else ["rank 1 failed"]),
            lambda: opt.load_shards(missing))
    good = after  # (rank 0's view) nothing of the failed loads stuck
    unchanged("failed shard loads")
    expected = ["allow_reshard must be a bool"] if rank == 1 else ["load_shards: rank 1 failed", "allow_reshard"]
    _raises("allow_reshard not a bool on one rank", rank, expected,
            lambda: opt.load_shards([folder / "first-0.pt", folder / "first-1.pt"], allow_reshard="yes" if rank else False))
    bad_to = 5 if rank == 1 else 0
    _raises("consolidate to", rank, ["to must be a rank in [0, 2)"], lambda: opt.consolidate_state_dict(bad_to))
    opt.load_shards([folder / "first-0.pt", folder / "first-1.pt"])  # every rank, one save: loads


def _training_state(comm, rank, folder):
    """TrainingState with a ZeroOptimizer and with a plain one over a process group: the step saved and the
    state loaded are agreed; a rank failing alone raises on every rank; failed saves leave nothing behind."""
    import shutil

    import numpy
    import torch.distributed as dist

    def leftovers(directory):
        return sorted(p.name for p in directory.iterdir() if p.name.startswith(".tmp")) if directory.exists() else []

    model = _model()
    opt = gpuops.ZeroOptimizer(model.parameters(), communicator=comm, stage=2, lr=1e-2)
    shared = folder / "shared"
    state = gpuops.TrainingState(shared)
    for step in (1, 2, 3):
        state.save(step=step, model=model, optimizer=opt)
    _raises("steps differ", rank, ["TrainingState.save: the ranks disagree on step: rank 0 has 4, rank 1 has 5"],
            lambda: state.save(step=4 + rank, model=model, optimizer=opt))
    expected = ["TypeError", "extras['x'] is a numpy.ndarray"] if rank == 1 else ["rank 1 failed", "numpy.ndarray"]
    _raises("numpy extras", rank, expected,
            lambda: state.save(step=6, model=model, optimizer=opt, extras={"x": numpy.zeros(2) if rank else 1}))
    comm.barrier().wait()
    assert [s.step for s in state._store.states()[0]] == [3, 2, 1] and leftovers(shared) == []
    # Folder copies whose newest states differ; a rank that sees no state; a bad map_location on one rank.
    if rank == 0:
        shutil.copytree(shared, folder / "copy")
        shutil.rmtree(next(p for p in (folder / "copy").iterdir() if p.name.endswith("000003")))
        (folder / "empty").mkdir()
    comm.barrier().wait()
    mine = lambda name: gpuops.TrainingState(shared if rank == 0 else folder / name)  # noqa: E731
    _raises("newest states differ", rank, ["TrainingState.load: the ranks disagree on the state to load",
                                           "rank 0 has step 3", "rank 1 has step 2"],
            lambda: mine("copy").load(model=model, optimizer=opt))
    _raises("one rank sees none", rank, ["disagree on the state to load", "rank 1 has no state"],
            lambda: mine("empty").load(model=model, optimizer=opt))
    bad = "cuda:7" if rank == 1 else None
    _raises("map_location", rank, ["map_location 'cuda:7' is not a usable device"] + ([] if rank else ["rank 1 failed"]),
            lambda: state.load(model=model, optimizer=opt, map_location=bad))
    loaded = state.load(model=model, optimizer=opt)  # then every rank, the same state: loads
    assert loaded["step"] == 3
    none = gpuops.TrainingState(folder / "nothing").load(model=model, optimizer=opt)
    assert none is None  # every rank sees none: a fresh start, agreed

    # A plain optimizer over a process group: rank 0 writes, every rank loads.
    plain_model = _model()
    plain = gpuops.TrainingState(folder / "plain", process_group=dist.group.WORLD)
    adamw = gpuops.optim.AdamW(plain_model.parameters(), lr=1e-2)
    plain.save(step=1, model=plain_model, optimizer=adamw)
    _raises("plain steps differ", rank, ["the ranks disagree on step"],
            lambda: plain.save(step=2 + rank, model=plain_model, optimizer=adamw))
    expected = ["TypeError"] if rank == 1 else ["rank 1 failed"]
    _raises("plain numpy extras", rank, expected,
            lambda: plain.save(step=2, model=plain_model, extras={"x": numpy.zeros(2) if rank else 1}))
    assert leftovers(folder / "plain") == []
    # Rank 1's objects do not fit the state (a scheduler it never saved): rank 0's, which loaded, are put back.
    target = _model(seed=5)
    before = [p.detach().clone() for p in target.parameters()]
    scheduler = torch.optim.lr_scheduler.StepLR(adamw, 1) if rank == 1 else None
    expected = ["does not fit the objects given"] + (["rank 1 failed"] if rank == 0 else ["holds no scheduler"])
    _raises("objects that do not fit on one rank", rank, expected,
            lambda: plain.load(model=target, scheduler=scheduler))
    assert all(torch.equal(a, b) for a, b in zip(before, target.parameters()))
    # Another model on one rank: its layout differs, refused before anything loads.
    other = target if rank == 0 else torch.nn.Linear(6, 4)
    _raises("another model on one rank", rank, ["TrainingState.load: the ranks disagree on model layout"],
            lambda: plain.load(model=other))
    assert all(torch.equal(a, b) for a, b in zip(before, target.parameters()))
    _own_parts(comm, rank, folder, model, opt, state, plain_model)


def _own_parts(comm, rank, folder, model, opt, state, plain_model):
    """Each rank resumes with its own RNG states, data position and extras (every rank got rank 0's), with a
    plain optimizer and with a sharded one; the ranks must agree on the folder, keep and the model's layout."""
    import shutil

    import torch.distributed as dist

    group = dist.group.WORLD
    own = gpuops.TrainingState(folder / "own", process_group=group)
    for saving, target in ((own, dict(model=plain_model)), (state, dict(model=model, optimizer=opt))):
        torch.manual_seed(100 + rank)
        saving.save(step=11, data_position=10 * rank + 1, extras={"rank": rank}, **target)
        drawn = torch.rand(3)  # what this rank's generator gives next
        torch.manual_seed(999)
        got = saving.load(**target)
        assert got["data_position"] == 10 * rank + 1 and got["extras"] == {"rank": rank}, got
        assert torch.equal(torch.rand(3), drawn), "this rank's RNG state was not the one restored"
        assert [(r["data_position"], r["extras"]) for r in got["ranks"]] == [(1, {"rank": 0}), (11, {"rank": 1})]
    comm.barrier().wait()
    if rank == 0:  # one process loading a state of two ranks: rank 0's, every rank's listed
        alone = gpuops.TrainingState(folder / "own").load(model=_model())
        assert alone["data_position"] == 1 and len(alone["ranks"]) == 2
        shutil.copytree(folder / "own", folder / "own-copy")
    comm.barrier().wait()
    # Folders, keep or model layouts that differ: raised on every rank, naming the field (a rank saved into
    # another folder, or the sharded optimizer's shard into rank 0's, without a word).
    apart = gpuops.TrainingState(folder / f"apart-{rank}", process_group=group)
    _raises("folders differ", rank, ["TrainingState.save: the ranks disagree on folder"],
            lambda: apart.save(step=12, model=plain_model))
    _raises("sharded, folders differ", rank, ["TrainingState.save: the ranks disagree on folder"],
            lambda: gpuops.TrainingState(folder / f"apart-{rank}").save(step=12, model=model, optimizer=opt))
    keeps = gpuops.TrainingState(folder / "own", keep=3 + rank, process_group=group)
    _raises("keep differs", rank, ["the ranks disagree on keep: rank 0 has 3, rank 1 has 4"],
            lambda: keeps.save(step=12, model=plain_model))
    other_model = plain_model if rank == 0 else torch.nn.Linear(6, 4)
    _raises("layouts differ", rank, ["the ranks disagree on model layout"],
            lambda: own.save(step=12, model=other_model))
    mixed = gpuops.TrainingState(folder / "mixed", process_group=group)  # a ZeroOptimizer on rank 0 only
    mine = opt if rank == 0 else gpuops.optim.AdamW(plain_model.parameters(), lr=1e-2)
    _raises("a sharded optimizer on one rank", rank, ["TrainingState.save: the ranks disagree on optimizer: rank 0 "
                                                      "has sharded, rank 1 has unsharded"],
            lambda: mixed.save(step=12, model=model if rank == 0 else plain_model, optimizer=mine))
    copy = gpuops.TrainingState(folder / ("own" if rank == 0 else "own-copy"), process_group=group)
    _raises("an identical copy elsewhere", rank, ["TrainingState.load: the ranks disagree on folder"],
            lambda: copy.load(model=plain_model))
    assert [s.step for s in own._store.states()[0]] == [11], "a refused save left a state"


def _alone(rank, folder):
    """Rank 1 saves without the sharded optimizer and without a process group: it cannot know of the others and
    writes alone (the torch idiom of saving on one rank only), so rank 0's agreement can only time out; its
    error names the call and that cause (it named a bare all_gather). On a group of its own, 2 s timeout."""
    import torch.distributed as dist

    short = gpuops.dist.Communicator(dist.new_group(backend="gloo"), timeout=2)
    model = _model()
    opt = gpuops.ZeroOptimizer(model.parameters(), communicator=short, stage=2, lr=1e-2)
    if rank == 0:
        _raises("a rank saving alone", rank, ["TrainingState.save: the ranks did not all take part",
                                              "without the sharded optimizer and without process_group"],
                lambda: gpuops.TrainingState(folder / "zero").save(step=1, model=model, optimizer=opt))
    else:
        gpuops.TrainingState(folder / "alone").save(step=1, model=model)
    dist.barrier()  # rank 1 stays until rank 0 timed out (on the default group, which stays usable)


def _rank_main(group):
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    comm = gpuops.dist.Communicator(timeout=30)
    if group == "alone":
        from pathlib import Path

        _alone(dist.get_rank(), Path(sys.argv[2]))
    elif group in ("loads", "training_state"):
        from pathlib import Path

        {"loads": _loads, "training_state": _training_state}[group](comm, dist.get_rank(), Path(sys.argv[2]))
    else:
        {"agreement": _agreement, "construction": _construction}[group](comm, dist.get_rank())
    print(f"{group} ok", flush=True)
    import gc

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[1])
