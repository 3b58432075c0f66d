"""torch habits that go silently wrong under gpuops.ZeroOptimizer are caught (issue 21, item 3), on 2 real Gloo
ranks (this file run as a script, one per rank; multiprocess_launch.py) and at world size 1 in this process:

- ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` clips each rank by its own norm before the reduction,
  or is lost after it (``scaler.unscale_(opt)`` reduces): a warning naming the right call, once per optimizer
  (stage 2 after its reduction leaves the model no gradients at all: torch's clip then finds nothing, and
  nothing can tell; the docs say so);
- that right call, ``opt.clip_grad_norm_(c)``, trains exactly as torch's AdamW with torch's clipping on the
  whole batch, without a warning;
- a DistributedDataParallel wrapper reduces every gradient a second time: a warning naming DDP, same result;
- torch.amp.GradScaler checks and unscales the unreduced shards: refused at the step, naming gpuops.GradScaler.
"""

import datetime
import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import gpuops
from multiprocess_launch import launch

WORLD = 2
STEPS = 3
MAX_NORM = 1e-2  # far below the gradients' norm: every step clips


def test_torch_habits_under_zero_on_two_ranks():
    for rank, (code, out) in enumerate(launch(__file__, "pitfalls", WORLD, 120)):
        assert code == 0, f"rank {rank}:\n{out}"
        assert "pitfalls ok" in out, out


@pytest.mark.parametrize("reduce_in_backward", [False, True])
def test_at_world_size_one_only_a_lost_change_is_reported(reduce_in_backward):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        model = _model()
        opt = gpuops.ZeroOptimizer(model.parameters(), stage=1, lr=1e-2, reduce_in_backward=reduce_in_backward)
        caught = _steps(model, opt, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM), seed=0)
        # One rank: a clip before the reduction is the global one (right); after reduce_in_backward reduced the
        # gradients into separate shards it is lost.
        assert len(caught) == (1 if reduce_in_backward else 0), caught
        if reduce_in_backward:
            assert "after ZeroOptimizer reduced them" in caught[0] and "clip_grad_norm_(max_norm)" in caught[0]
    finally:
        import gc

        gc.collect()
        dist.destroy_process_group()


def test_torchs_scaler_is_refused_on_every_path_and_leaves_nothing_behind():
    """World size 1, in this process: torch.amp.GradScaler is refused with or without unscale_() and with the
    optimizer's own clip between them (which reduces, but is no scaler's check); the scale it handed over is
    removed, so a plain step afterwards works; gpuops.GradScaler on the same paths steps."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        model = _model()
        opt = gpuops.ZeroOptimizer(model.parameters(), stage=2, lr=1e-2)
        for between in (lambda s: None, lambda s: s.unscale_(opt),
                        lambda s: (s.unscale_(opt), opt.clip_grad_norm_(1.0)), lambda s: opt.clip_grad_norm_(1.0)):
            for scaler_cls, refused in ((torch.amp.GradScaler, True), (gpuops.GradScaler, False)):
                scaler = scaler_cls("cpu", init_scale=2.0**8)
                before = [p.detach().clone() for p in model.parameters()]
                opt.zero_grad()
                x, y = _batch(1, 0)
                scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
                between(scaler)
                if refused:
                    with pytest.raises(TypeError, match="Use gpuops.GradScaler"):
                        scaler.step(opt)
                    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
                    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
                else:
                    scaler.step(opt)
                    scaler.update()
                    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(_batch(2, 0)[0]), _batch(2, 0)[1]).backward()
        opt.step()  # no scaler: nothing left over refuses it
    finally:
        import gc

        gc.collect()
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------- helpers
def _model():
    torch.manual_seed(3)  # the same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))


def _batch(seed, rank):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(16, 12, generator=g), torch.randn(16, 5, generator=g)


def _steps(model, opt, between, seed, scaler=None, forward=None):
    """STEPS steps on this rank's batches, `between()` after backward; the warnings ZeroOptimizer gave."""
    rank = dist.get_rank()
    forward = forward or model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            opt.zero_grad()
            x, y = _batch(seed + step, rank)
            loss = torch.nn.functional.mse_loss(forward(x), y)
            (scaler.scale(loss) if scaler else loss).backward()
            between()
            scaler.step(opt) if scaler else opt.step()
            if scaler:
                scaler.update()
    return [str(w.message) for w in caught if "ZeroOptimizer" in str(w.message)]


def _reference(seed, world):
    """torch's AdamW with torch's clipping on the gradient averaged over every rank's batch."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        opt.zero_grad()
        sum(torch.nn.functional.mse_loss(model(x), y) / world
            for x, y in (_batch(seed + step, r) for r in range(world))).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
    return [p.detach() for p in model.parameters()]


def _expect(condition, message):
    if not condition:
        raise AssertionError(message)


def _pitfalls():
    rank, world = dist.get_rank(), dist.get_world_size()
    for stage in (1, 2):
        for in_backward in (False, True):
            where = f"stage {stage}, reduce_in_backward={in_backward}"
            # The torch habit: a warning that names the right call, once for three steps.
            model = _model()
            opt = gpuops.ZeroOptimizer(model.parameters(), stage=stage, lr=1e-2, reduce_in_backward=in_backward)
            grads_seen = []
            caught = _steps(model, opt, lambda: grads_seen.append(
                sum(p.grad is not None for p in model.parameters()) +
                0 * torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)), 0)
            if stage == 2 and in_backward:  # backward reduced and freed every gradient: torch's clip finds none
                _expect(not caught and grads_seen == [0] * STEPS, f"{where}: {caught}, {grads_seen}")
            else:
                _expect(len(caught) == 1 and grads_seen == [4] * STEPS, f"{where}: {caught}, {grads_seen}")
                when = "after ZeroOptimizer reduced them" if in_backward else "before ZeroOptimizer reduced them"
                _expect(all(s in caught[0] for s in (when, "torch.nn.utils.clip_grad_norm_",
                                                     "clip_grad_norm_(max_norm)")), f"{where}: {caught[0]}")
            wrong = [(got.detach() - want).abs().max().item() for got, want in zip(model.parameters(), _reference(0, world))]
            _expect(max(wrong) > 1e-4, f"{where}: the habit trained as the reference did ({wrong}): no pitfall")
            # The right call: exact against torch, silent.
            model = _model()
            opt = gpuops.ZeroOptimizer(model.parameters(), stage=stage, lr=1e-2, reduce_in_backward=in_backward)
            norms = []
            caught = _steps(model, opt, lambda: norms.append(opt.clip_grad_norm_(MAX_NORM)), 0)
            _expect(not caught, f"{where}: {caught}")
            _expect(all(n > MAX_NORM for n in norms), f"{where}: the norms {norms} did not need a clip")
            for got, want in zip(model.parameters(), _reference(0, world)):
                torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)
    # With a GradScaler: unscale_ reduces, so torch's clip afterwards lands in this rank's shard only (stage 1).
    model = _model()
    opt = gpuops.ZeroOptimizer(model.parameters(), stage=1, lr=1e-2)
    scaler = gpuops.GradScaler("cpu", init_scale=2.0**8)
    caught = _steps(model, opt, lambda: (scaler.unscale_(opt),
                                         torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)), 0, scaler)
    _expect(len(caught) == 1 and "after ZeroOptimizer reduced them" in caught[0], f"scaler: {caught}")
    # The right call with a scaler: silent and exact.
    model = _model()
    opt = gpuops.ZeroOptimizer(model.parameters(), stage=2, lr=1e-2)
    scaler = gpuops.GradScaler("cpu", init_scale=2.0**8)
    caught = _steps(model, opt, lambda: scaler.clip_grad_norm_(opt, MAX_NORM), 0, scaler)
    _expect(not caught, f"scaler.clip_grad_norm_: {caught}")
    for got, want in zip(model.parameters(), _reference(0, world)):
        torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)
    # DDP around the model: named, and (averaging twice) the same result.
    for wrap_first in (True, False):
        model = _model()
        if wrap_first:
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            opt = gpuops.ZeroOptimizer(ddp.parameters(), stage=1, lr=1e-2)
        else:
            opt = gpuops.ZeroOptimizer(model.parameters(), stage=1, lr=1e-2)
            ddp = torch.nn.parallel.DistributedDataParallel(model)
        caught = _steps(model, opt, lambda: opt.clip_grad_norm_(MAX_NORM), 0, forward=ddp)
        _expect(len(caught) == 1 and "DistributedDataParallel" in caught[0] and "without the DDP wrapper" in caught[0],
                f"DDP (wrapped first: {wrap_first}): {caught}")
        for got, want in zip(model.parameters(), _reference(0, world)):
            torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)
        del ddp
    # torch.amp.GradScaler: it checks and unscales this rank's unreduced shard only (tried with the refusal
    # bypassed: NaN parameters after an inf on one rank, scales 1024 vs 512 across ranks): refused on every rank,
    # at the step, with the whole model as it was; with unscale_() first too.
    for stage, unscale_first in ((1, False), (2, True)):
        model = _model()
        opt = gpuops.ZeroOptimizer(model.parameters(), stage=stage, lr=1e-2)
        before = [p.detach().clone() for p in model.parameters()]
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        x, y = _batch(5, rank)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if unscale_first:
            scaler.unscale_(opt)
        try:
            scaler.step(opt)
            _expect(False, f"stage {stage}: torch's GradScaler was not refused")
        except TypeError as error:
            _expect("Use gpuops.GradScaler" in str(error), str(error))
        _expect(all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "a refused step moved weights")
    _mixed_steps(rank)
    print(f"rank {rank}: pitfalls ok", flush=True)


def _mixed_steps(rank):
    """Ranks stepping differently raise together, naming the cause, long before the 60 s timeout (each waited
    for it before): rank 0 with torch's GradScaler while rank 1 uses ours; then rank 0 clipping first while rank
    1's scaler checks for overflow first."""
    import time

    def one(stage, scaler, between):
        model = _model()
        opt = gpuops.ZeroOptimizer(model.parameters(), stage=stage, lr=1e-2, **({"model": model} if stage == 3 else {}))
        before = [p.detach().clone() for p in model.parameters()]  # (stage 3: placeholders, not compared)
        x, y = _batch(7, rank)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        started = time.monotonic()
        try:
            between(opt)
            scaler.step(opt)
            _expect(False, f"rank {rank}, stage {stage}: a mixed step was not refused")
        except (TypeError, ValueError) as error:
            waited = time.monotonic() - started
            _expect(waited < 30, f"rank {rank}: raised only after {waited:.1f} s (the timeout's error?): {error}")
            _expect(stage == 3 or all(torch.equal(p, b) for p, b in zip(model.parameters(), before)),
                    "a refused step moved weights")
            return str(error)

    for stage in (1, 2, 3):
        theirs = rank == 0
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if theirs else gpuops.GradScaler("cpu", 2.0**8)
        said = one(stage, scaler, lambda opt: None)
        want = "Use gpuops.GradScaler" if theirs else "rank 0 nothing: it refused to step with a GradScaler other"
        _expect(want in said, f"rank {rank}, stage {stage}: {said}")
    scaler = gpuops.GradScaler("cpu", init_scale=2.0**8)
    said = one(2, scaler, (lambda opt: opt.clip_grad_norm_(1.0)) if rank == 0 else scaler.unscale_)
    _expect("different points of the step" in said and "gradient norm (clip_grad_norm_)" in said
            and "overflow flag" in said, f"rank {rank}: {said}")


if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        {"pitfalls": _pitfalls}[sys.argv[1]]()
    finally:
        dist.destroy_process_group()
    os._exit(0)
