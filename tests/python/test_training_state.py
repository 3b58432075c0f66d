"""gpuops.TrainingState: bit-exact resume, atomic saves under SIGKILL, corrupt-file fallback, keep-K,
signals and agreement across ranks."""

import os
import random
import signal
import time

import pytest
import torch

import gpuops


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.2), torch.nn.GELU(), torch.nn.Linear(32, 4))


def train(model, opt, scaler, steps):
    """Steps drawing data and dropout masks from the global RNG; returns the losses."""
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return losses


def test_a_resumed_run_reproduces_the_next_losses_bit_exactly(tmp_path):
    torch.manual_seed(0)
    model = make_model()
    opt = gpuops.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = gpuops.GradScaler("cpu", init_scale=256.0, growth_interval=2)
    with gpuops.TrainingState(tmp_path, keep=2) as state:
        train(model, opt, scaler, 5)
        state.save(step=5, model=model, optimizer=opt, scaler=scaler, epoch=1, data_position=40,
                   extras={"note": "half way"})
        straight = train(model, opt, scaler, 5)

    torch.manual_seed(12345)  # a different process state: everything must come from the file
    model2 = make_model()
    opt2 = gpuops.optim.AdamW(model2.parameters(), lr=1e-2)
    scaler2 = gpuops.GradScaler("cpu")
    with gpuops.TrainingState(tmp_path) as state:
        info = state.load(model=model2, optimizer=opt2, scaler=scaler2)
    assert (info["step"], info["epoch"], info["data_position"], info["extras"]) == (5, 1, 40, {"note": "half way"})
    assert train(model2, opt2, scaler2, 5) == straight  # bit-exact, dropout and data included


def test_a_corrupt_or_truncated_newest_state_falls_back_to_the_previous(tmp_path):
    model = torch.nn.Linear(4, 4)
    with gpuops.TrainingState(tmp_path, keep=3) as state:
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight.fill_(step)
            state.save(step=step, model=model)
        newest = tmp_path / "state-000000000003" / "state.pt"
        data = newest.read_bytes()
        newest.write_bytes(data[: len(data) // 2])  # truncated
        with pytest.warns(UserWarning, match="state-000000000003/state.pt.*truncated"):
            info = state.load(model=model)
        assert info["step"] == 2 and torch.all(model.weight == 2)
        middle = tmp_path / "state-000000000002" / "state.pt"
        flipped = bytearray(middle.read_bytes())
        flipped[len(flipped) // 2] ^= 0xFF  # same size, one byte changed
        middle.write_bytes(bytes(flipped))
        with pytest.warns(UserWarning, match="state-000000000002/state.pt.*checksum"):
            assert state.load(model=model)["step"] == 1
        (tmp_path / "manifest.json").write_text("{not json")
        with pytest.warns(UserWarning, match="manifest.json.*unreadable"):
            assert state.load(model=model) is not None  # found by scanning the folder


def test_only_the_last_k_states_are_kept_and_latest_names_the_newest(tmp_path):
    with gpuops.TrainingState(tmp_path, keep=2) as state:
        for step in range(5):
            state.save(step=step, extras={"i": step})
    files = sorted(f.name for f in tmp_path.iterdir())
    assert files == ["LATEST", "manifest.json", "state-000000000003", "state-000000000004"]
    assert (tmp_path / "LATEST").read_text().strip() == "state-000000000004"


def _writer(directory):
    """Child: saves ever newer states whose every weight equals the step, until killed."""
    model = torch.nn.Linear(64, 64)
    state = gpuops.TrainingState(directory, keep=2, signals=())
    info = state.load(restore_rng=False)
    step = info["step"] + 1 if info else 0
    while True:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        state.save(step=step, model=model, extras={"step": step})
        step += 1


def test_sigkill_at_random_moments_never_leaves_an_unreadable_newest_state(tmp_path):
    rng = random.Random()
    newest = -1
    for _ in range(50):
        pid = os.fork()
        if pid == 0:  # the child never returns into pytest
            try:
                _writer(tmp_path)
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.0, 0.05))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        model = torch.nn.Linear(64, 64)
        info = gpuops.TrainingState(tmp_path, signals=()).load(model=model, restore_rng=False)
        if info is None:  # killed before its first save completed
            assert newest == -1
            continue
        assert info["extras"]["step"] == info["step"] >= newest
        assert all(torch.all(p == info["step"]) for p in model.parameters())  # complete and consistent
        newest = info["step"]
    assert newest > 0  # the writers did get states through


def test_signals_set_the_stop_flag_and_handlers_are_restored(tmp_path):
    previous = signal.getsignal(signal.SIGUSR1)
    with gpuops.TrainingState(tmp_path) as state:
        assert not state.should_stop()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert state.should_stop()
    assert signal.getsignal(signal.SIGUSR1) is previous


def _rank(rank, world, directory, rendezvous, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    state = gpuops.TrainingState(directory, process_group=dist.group.WORLD, signals=())
    first = state.should_stop()
    if rank == 1:
        state.request_stop()  # only rank 1 got the signal
    second = state.should_stop()
    state.save(step=7, extras={"rank": rank})
    results.put((rank, first, second))
    dist.destroy_process_group()


def test_every_rank_agrees_to_stop_when_one_got_the_signal(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rendezvous = tmp_path.parent / f"{tmp_path.name}-rendezvous"  # a file, not a port another process may hold
    procs = [ctx.Process(target=_rank, args=(r, 2, str(tmp_path), str(rendezvous), results)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got == [(0, False, True), (1, False, True)]
    assert (tmp_path / "LATEST").read_text().strip() == "state-000000000007"  # rank 0 wrote it once
    assert torch.load(tmp_path / "state-000000000007" / "state.pt", weights_only=True)["extras"] == {"rank": 0}


def test_a_state_that_does_not_fit_changes_nothing(tmp_path):
    saved = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Linear(2, 3))
    with gpuops.TrainingState(tmp_path) as state:
        state.save(step=1, model=saved)
        # The first layer fits (torch copies it in place), the second does not (5 outputs, not 3).
        other = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Linear(2, 5))
        before = {k: v.clone() for k, v in other.state_dict().items()}
        with pytest.raises(ValueError, match="does not fit the objects given .* nothing was changed"):
            state.load(model=other)
        assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())


@pytest.mark.parametrize("make", [
    lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20),
    lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
])
def test_an_lr_scheduler_is_saved_and_loaded_with_the_rest(tmp_path, make):
    """scheduler= as Lightning's and DeepSpeed's checkpoints hold it: a resumed schedule continues where it was
    (torch's schedulers over our AdamW); loading it from a state saved without one changes nothing."""
    model = torch.nn.Linear(4, 2)
    opt = gpuops.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = make(opt)
    for _ in range(random.randint(4, 9)):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
    state = gpuops.TrainingState(tmp_path / "s")
    state.save(step=1, model=model, optimizer=opt, scheduler=scheduler)
    model2 = torch.nn.Linear(4, 2)
    opt2 = gpuops.optim.AdamW(model2.parameters(), lr=0.01)
    scheduler2 = make(opt2)
    state.load(model=model2, optimizer=opt2, scheduler=scheduler2)
    assert scheduler2.last_epoch == scheduler.last_epoch and scheduler2.get_last_lr() == scheduler.get_last_lr()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    scheduler.step()
    scheduler2.step()
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()  # the schedule goes on alike

    plain = gpuops.TrainingState(tmp_path / "plain")
    plain.save(step=1, model=model, optimizer=opt)
    before = (scheduler2.last_epoch, list(scheduler2.get_last_lr()), model2.weight.detach().clone())
    with pytest.raises(ValueError, match="holds no scheduler"):
        plain.load(model=model2, optimizer=opt2, scheduler=scheduler2)
    assert before[:2] == (scheduler2.last_epoch, scheduler2.get_last_lr()) and torch.equal(before[2], model2.weight)
    with pytest.raises(TypeError, match="scheduler must have state_dict"):
        state.save(step=2, model=model, scheduler=3)
