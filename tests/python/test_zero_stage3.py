"""gpuops.ZeroOptimizer stage 3 (parameters sharded, gathered unit by unit), over torch.distributed's Gloo group
with real processes (this file run as a script, one per rank; multiprocess_launch.py), on a small transformer
with its embedding tied to the LM head:
- 2 and 3 ranks (3 makes the padding real), fp32 with GradScaler, clipping, 2 micro-batches, one unit
  checkpointed non-reentrant and one reentrant, 30 steps: identical on every rank and from run to run, and
  within PARITY_FACTOR times the distance from float64 of a single process that averages every rank's gradient
  (gpuops.optim.AdamW; a bound derived on the machine that runs it, not tuned on one);
- bf16 parameters: fp32 masters within 1e-5 of a single process stepping fp32 masters on the fp32 average of
  every rank's bf16 gradient; each bf16 parameter is its master rounded. Without clipping: a clip coefficient
  one ulp apart (the global norm summed in another order) flips a bf16 rounding some steps later, and a bf16
  transformer then drifts away chaotically (measured at world 1: 1.7e-7 after 10 steps, 5.7e-4 after 20);
  clipping is checked in fp32;
- memory per rank (MemoryBudget): stage 3 keeps 1/N of the parameters, and its peak is below stage 2's by about
  (1 - 1/N) of the parameter bytes, less the units in flight;
- checkpoints: TrainingState saved by 3 ranks resumes on 2 and on 1 and continues as the run that never stopped;
  the gathered model state dict loads into a plain model;
- a killed rank and a stalled rank inside a forward's gather make the others raise within the timeout;
- what is refused: a parameter tied across units, units of another model, stage-3 options at stage 2."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

import gpuops
from multiprocess_launch import launch

DEADLINE_S = 120
VOCAB, WIDTH, SEQ = 37, 24, 8


def _ok(outputs, word):
    for rank, (code, out) in enumerate(outputs):
        assert code == 0, f"rank {rank}:\n{out}"
        assert f"{word} ok" in out, out
    print(outputs[0][1])


@pytest.mark.parametrize("world", [2, 3])
def test_fp32_matches_single_process(world):
    _ok(launch(__file__, "fp32", world, DEADLINE_S), "fp32")


def test_shared_and_skipped_units_eval_state_dict_scheduler():
    _ok(launch(__file__, "usage", 2, DEADLINE_S), "usage")


def test_matches_torch_fsdp2():
    _ok(launch(__file__, "fsdp2", 2, DEADLINE_S), "fsdp2")


def test_grad_accumulator_both_modes_and_traffic():
    _ok(launch(__file__, "accumulate", 2, DEADLINE_S), "accumulate")


def test_bf16_masters_match_single_process():
    _ok(launch(__file__, "bf16", 3, DEADLINE_S), "bf16")


def test_memory_per_rank():
    _ok(launch(__file__, "memory", 2, DEADLINE_S), "memory")


def test_training_state_reshards_3_2_1(tmp_path):
    env = {"GPUOPS_TEST_DIR": str(tmp_path)}
    _ok(launch(__file__, "save", 3, DEADLINE_S, env), "save")
    # Offline, without a job: the state exports to the full state_dict a plain model loads (strict, the tied head
    # included), bit for bit the model the 3 ranks held; loading it into a plain model without the optimizer says so.
    out = tmp_path.parent / f"{tmp_path.name}-export.pt"
    done = subprocess.run([sys.executable, "-m", "gpuops.state", "export", str(tmp_path), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "wrote" in done.stdout, done.stderr
    exported, held = torch.load(out), torch.load(tmp_path / "model-at-4.pt")
    plain = TinyLM()
    plain.load_state_dict(exported)
    assert exported.keys() == plain.state_dict().keys()
    assert all(torch.equal(exported[k], held[k]) for k in held)
    with pytest.raises(ValueError, match="python -m gpuops.state export"):
        gpuops.TrainingState(tmp_path, signals=()).load(model=TinyLM())
    _ok(launch(__file__, "resume", 2, DEADLINE_S, env), "resume")
    _ok(launch(__file__, "resume", 1, DEADLINE_S, env), "resume")


def test_sigterm_on_one_rank_saves_every_rank(tmp_path):
    outputs = launch(__file__, "sigterm", 2, DEADLINE_S, {"GPUOPS_TEST_DIR": str(tmp_path)})
    _ok(outputs, "sigterm")
    assert all("stopped at step 4" in out for _, out in outputs), outputs


def test_refused_layouts():
    _ok(launch(__file__, "refused", 2, DEADLINE_S), "refused")


def test_batch_search_restores_the_shards():
    _ok(launch(__file__, "restore", 2, DEADLINE_S), "restore")


def test_ranks_running_other_units_raise_together():
    _ok(launch(__file__, "diverge", 2, DEADLINE_S), "diverge")


@pytest.mark.parametrize("fault", ["killed", "stalled"])
def test_lost_rank_inside_a_gather(fault):
    outputs = launch(__file__, fault, 2, DEADLINE_S)
    code0, out0 = outputs[0]
    assert code0 == 0, out0
    assert "raised after" in out0, out0


# ----------------------------------------------------------------------------------------------------- model
class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)  # (a key bias has no gradient but rounding noise)
        self.proj, self.fc, self.out = torch.nn.Linear(d, d), torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(torch.nn.Module):
    """Embedding tied to the head; blocks in `layers`; `checkpointed`: block index -> use_reentrant."""

    def __init__(self, layers=3, checkpointed=None, order=None):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.pos = torch.nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.layers = torch.nn.ModuleList([Block(WIDTH) for _ in range(layers)])
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.checkpointed = dict(checkpointed or {})
        self.order = list(range(layers)) if order is None else list(order)  # blocks run, repeats and skips allowed

    def forward(self, idx):
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for i in self.order:
            block = self.layers[i]
            reentrant = self.checkpointed.get(i)
            x = block(x) if reentrant is None else gpuops.checkpoint(block, x, use_reentrant=reentrant)
        return self.head(self.norm(x))


def _model(dtype=torch.float32, **kw):
    torch.manual_seed(1234)
    return TinyLM(**kw).to(dtype)


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (4, SEQ), generator=g), torch.randint(0, VOCAB, (4, SEQ), generator=g)


def _loss(model, idx, y):
    logits = model(idx)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def _sharded_steps(model, opt, scaler, rank, steps, micro=2, clip=True):
    for step in steps:
        opt.zero_grad()
        for m in range(micro):
            loss = _loss(model, *_batch(micro * step + m, rank)) / micro
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()
        else:
            if clip:
                opt.clip_grad_norm_(1.0)
            opt.step()


def _reference_grads(model, world, step, micro, scaler, fp32_sum):
    """Every rank's gradient of each micro-batch, averaged over ranks (in fp32 when `fp32_sum`), summed over
    the micro-batches: what the sharded run reduces. None for a parameter no rank's backward reached (torch's
    rule: not stepped)."""
    params = list(model.parameters())
    acc = [torch.zeros_like(p, dtype=torch.float32 if fp32_sum else p.dtype) for p in params]
    reached = [False] * len(params)
    for m in range(micro):
        total = [torch.zeros_like(a) for a in acc]
        for r in range(world):
            loss = _loss(model, *_batch(micro * step + m, r)) / micro
            grads = torch.autograd.grad(scaler.scale(loss) if scaler else loss, params, allow_unused=True)
            total = [t if g is None else t + g.to(t.dtype) for t, g in zip(total, grads)]
            reached = [was or g is not None for was, g in zip(reached, grads)]
        acc = [a + t / world for a, t in zip(acc, total)]
    return [a if was else None for a, was in zip(acc, reached)]


def _reference_fp32(world, steps, micro=2, **kw):
    model = _model(**kw)
    opt = gpuops.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = gpuops.GradScaler("cpu", init_scale=256.0)
    for step in steps:
        opt.zero_grad()
        for p, g in zip(model.parameters(), _reference_grads(model, world, step, micro, scaler, False)):
            p.grad = g
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
    return model.state_dict()


def _reference_f64(world, steps, micro=2, **kw):
    """_reference_fp32 in float64 with torch's AdamW and clip_grad_norm_: the exact result to within 1e-12."""
    model = _model(torch.float64, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in steps:
        opt.zero_grad()
        for p, g in zip(model.parameters(), _reference_grads(model, world, step, micro, None, False)):
            p.grad = g
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model.state_dict()


# A float32 run's distance from the exact result depends on the CPU model (oneDNN/MKL choose their matmul
# blocking by its caches, and many clipped Adam steps amplify one rounding), so a sharded run is not held to a
# fixed distance from the single-process float32 run: both are compared with float64, and ours may be at most
# PARITY_FACTOR times as far as the single-process float32 run is on the same machine. Measured here (x86-64,
# 2026-11-29): 30 steps at 2 ranks 1.39e-5 against 1.38e-5, at 3 ranks 2.39e-4 against 2.39e-4, FSDP2's run
# 1.38e-5, 10 steps of the skipped-block model 5.9e-7 against 5.9e-7: ratios 1.00-1.01. So the bound catches
# an error of its own above about twice the float32 noise of the machine (2.8e-5 at 2 ranks, 4.8e-4 at 3):
# looser than the 1e-6 tuned on one machine, which failed on another, but derived; a sharding mistake (a wrong
# slice, a rank's gradient missing) moves parameters by 1e-2 and more. The direct distance to the float32 run is
# printed too.
PARITY_FACTOR = 3


def _within_float32_noise(ours: dict, ref32: dict, ref64: dict, what: str):
    err, base = _rel_err(ours, ref64), _rel_err(ref32, ref64)
    assert err <= PARITY_FACTOR * base, (f"{what}: max relative error {err:.3g} from float64, while the "
                                         f"single-process float32 run's is {base:.3g} (bound {PARITY_FACTOR}x)")
    return err, base


def _rel_err(a: dict, b: dict) -> float:
    return max(((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max()).item() for k in b)


def _every_rank_same(dist, full):
    """The gathered model, fingerprinted by its bits, is the same on every rank."""
    digest = [hash(tuple(t.float().reshape(-1).tolist())) for t in full.values()]
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, digest)
    assert all(g == got[0] for g in got), "ranks hold different parameters"


def _gathered_on_every_rank(opt, world):
    """full_state_dict(to=r) for every r (collective each); this rank's copy."""
    mine = None
    for r in range(world):
        full = opt.full_state_dict(r)
        if full is not None:
            mine = full
    return mine


# ----------------------------------------------------------------------------------------------------- ranks
def _rank_main(scenario):
    import datetime
    import gc

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    _run(scenario, dist)
    gc.collect()  # our objects hold the group: drop them before it is destroyed (test_zero_optimizer.py)
    dist.barrier()
    dist.destroy_process_group()


def _stage3(model, comm, **kw):
    kw.setdefault("lr", 1e-2)
    kw.setdefault("units", "layers")
    return gpuops.ZeroOptimizer(model.named_parameters(), "adamw", communicator=comm, stage=3, model=model, **kw)


def _run(scenario, dist):
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = gpuops.dist.Communicator(timeout=30)
    steps = range(30)
    if scenario == "fp32":
        runs = []
        for _ in range(2):  # twice: the same bits
            model = _model(checkpointed={1: False, 2: True})
            opt = _stage3(model, comm)
            assert opt._impl.unit_count() == 4 and all(p.numel() == 0 for p in model.parameters())
            _sharded_steps(model, opt, gpuops.GradScaler("cpu", init_scale=256.0), rank, steps)
            runs.append(_gathered_on_every_rank(opt, world))
            assert all(p.numel() == 0 for p in model.parameters()), "a unit stayed gathered after the step"
        assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0]), "two runs differ"
        _every_rank_same(dist, runs[0])
        if rank == 0:  # (every rank holds the same bits, checked above: the references run once)
            ref32 = _reference_fp32(world, steps)
            err, base = _within_float32_noise(runs[0], ref32, _reference_f64(world, steps), "stage 3 against float64")
            print(f"rank 0: stage 3, {world} ranks, 30 steps (scaler, clip, 2 micro-batches, 2 units "
                  f"checkpointed): max_rel_err from float64 {err:.3g}, single-process float32's {base:.3g}; from "
                  f"the single-process float32 run {_rel_err(runs[0], ref32):.3g}", flush=True)
        print("fp32 ok", flush=True)
    elif scenario == "usage":
        _usage(rank, world, comm)
        print("usage ok", flush=True)
    elif scenario == "fsdp2":
        _fsdp2(rank, comm)
        print("fsdp2 ok", flush=True)
    elif scenario == "accumulate":
        _accumulate(rank, world, comm, dist)
        print("accumulate ok", flush=True)
    elif scenario == "bf16":
        model = _model(torch.bfloat16)
        opt = _stage3(model, comm)
        _sharded_steps(model, opt, None, rank, steps, clip=False)
        opt.consolidate_state_dict(0)
        full = opt.full_state_dict(0)
        if rank == 0:
            names = [n for n, _ in model.named_parameters()]
            masters = {names[i]: s["master_param"] for i, s in opt.state_dict()["state"].items()}
            ref_model = _model(torch.bfloat16)
            ref_masters = [p.detach().float().clone().requires_grad_(True) for p in ref_model.parameters()]
            ref = gpuops.optim.AdamW(ref_masters, lr=1e-2)
            for step in steps:
                grads = _reference_grads(ref_model, world, step, 2, None, True)
                for m, g in zip(ref_masters, grads):
                    m.grad = g
                ref.step()
                with torch.no_grad():
                    for p, m in zip(ref_model.parameters(), ref_masters):
                        p.copy_(m)
            err = _rel_err(masters, dict(zip(names, ref_masters)))
            assert err <= 1e-5, f"bf16: masters' max relative error {err} against single-process"
            for name in names:
                assert torch.equal(full[name], masters[name].to(torch.bfloat16)), name
            print(f"rank 0: bf16 parameters, fp32 masters: max_rel_err={err:.3g}", flush=True)
        print("bf16 ok", flush=True)
    elif scenario == "memory":
        _memory(rank, world, comm)
        print("memory ok", flush=True)
    elif scenario == "sigterm":
        _sigterm(rank, comm, dist)
    elif scenario in ("save", "resume"):
        _state(scenario, rank, world, comm)
    elif scenario == "refused":
        model = _model()
        model.layers[1].fc.weight = model.layers[0].fc.weight  # tied across two units
        with pytest.raises(ValueError, match=r"'layers.0.fc.weight' is shared by units 'layers.0' and 'layers.1'"):
            _stage3(model, comm)
        model = _model()
        with pytest.raises(ValueError, match="names no submodule"):
            gpuops.ZeroOptimizer(model.parameters(), communicator=comm, stage=3, model=model, units="blocks")
        with pytest.raises(TypeError, match="stage 3 needs model="):
            gpuops.ZeroOptimizer(model.parameters(), communicator=comm, stage=3)
        with pytest.raises(ValueError, match="model= and units= are for stage 3"):
            gpuops.ZeroOptimizer(model.parameters(), communicator=comm, stage=2, units="layers")
        other = _model()
        with pytest.raises(ValueError, match="is not a parameter of model"):
            gpuops.ZeroOptimizer(list(model.parameters()) + [torch.nn.Parameter(torch.ones(3))], communicator=comm,
                                 stage=3, model=model, units="layers")
        with pytest.raises(ValueError, match="units\\[0\\] must be a submodule of the model"):
            gpuops.ZeroOptimizer(model.parameters(), communicator=comm, stage=3, model=model, units=[other.layers[0]])
        with pytest.raises(ValueError, match="prefetch must be in \\[0, 64\\]"):
            _stage3(model, comm, prefetch=-1)
        # Ranks that disagree on the units or their options: every rank raises, naming the field.
        with pytest.raises(ValueError, match="the ranks disagree on prefetch"):
            _stage3(model, comm, prefetch=1 + rank)
        with pytest.raises(ValueError, match="the ranks disagree on units"):
            _stage3(model, comm, units=list(model.layers)[: 2 + rank])
        # Nothing was changed by the refusals: the model still trains unsharded.
        assert all(p.numel() > 0 for p in model.parameters())
        print("refused ok", flush=True)
    elif scenario in ("killed", "stalled"):
        _fault(scenario, rank, dist)
    elif scenario == "diverge":
        _diverge(rank, world, comm, dist)
        print("diverge ok", flush=True)
    elif scenario == "restore":
        _restore(rank, world, comm, dist)
        print("restore ok", flush=True)


def _restore(rank, world, comm, dist):
    """find_max_batch_size(restore=[model, opt]) with stage 3: each rank puts its shard back (parameters and
    optimizer state, bit for bit); it failed with an unrelated "call consolidate_state_dict" error."""
    model = _model()
    opt = _stage3(model, comm)
    _sharded_steps(model, opt, None, rank, range(2), micro=1)
    params = _gathered_on_every_rank(opt, world)
    opt.consolidate_state_dict(0)
    state = opt.state_dict() if rank == 0 else None

    def step(batch):
        opt.zero_grad()
        g = torch.Generator().manual_seed(batch + 10 * rank)
        idx, y = torch.randint(0, VOCAB, (batch, SEQ), generator=g), torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        _loss(model, idx, y).backward()
        opt.step()

    with gpuops.memory_budget(256 << 20):
        found = gpuops.find_max_batch_size(step, high=6, seed=None, process_group=dist.group.WORLD,
                                           restore=[model, opt], verbose=False)
    assert found.max_batch == 6 and len(found.trials) > 1, found
    after = _gathered_on_every_rank(opt, world)
    assert all(torch.equal(params[k], after[k]) for k in params), "the parameters were not put back"
    opt.consolidate_state_dict(0)
    if rank == 0:
        again = opt.state_dict()["state"]
        assert all(torch.equal(state["state"][i][key], again[i][key]) for i in state["state"] for key in again[i])
    with pytest.raises(ValueError, match="put that optimizer in restore= too"):
        gpuops.find_max_batch_size(step, high=2, restore=[model])
    _sharded_steps(model, opt, None, rank, range(2, 3), micro=1)  # and it trains on


def _diverge(rank, world, comm, dist):
    """Ranks that run their units differently raise together, naming each rank's unit, where Gloo aborted the
    process or the ranks waited for the timeout; the group stays usable and the ranks then train alike."""
    model = _model()
    opt = _stage3(model, comm)
    _sharded_steps(model, opt, None, rank, range(1), micro=1)
    idx, y = _batch(1, rank)
    model.order = [0, 1, 2] if rank == 0 else [0, 2, 1]  # LayerDrop-like: another order on rank 1
    opt.zero_grad()
    # (rank 1's second block prefetches the unit its first one freed: its gathers differ from rank 0's there)
    with pytest.raises(ValueError, match=r"the ranks gather different units: rank 0 unit \d for a \w+, rank 1 unit "):
        _loss(model, idx, y).backward()
    model.order = [0, 1, 2]
    opt.zero_grad()
    with pytest.raises(ValueError, match="rank 0 unit 0 for a forward, rank 1 unit 0 for a forward without autograd"):
        if rank == 1:  # an extra forward on one rank (an evaluation, a retry)
            with torch.no_grad():
                model(idx)
        _loss(model, idx, y)
    # A unit module replaced after the optimizer was built: its new parameters would train unsharded and outside
    # the optimizer, and the state dicts would hold the old ones (silently dropped before): refused, named.
    original = model.layers[1]
    model.layers[1] = Block(WIDTH)
    with pytest.raises(ValueError, match="'layers.1.ln1.weight' is no longer the parameter the optimizer shards"):
        _loss(model, idx, y)
    with pytest.raises(ValueError, match="no longer the parameter the optimizer shards"):
        opt.full_state_dict(0)
    model.layers[1] = original
    _sharded_steps(model, opt, None, rank, range(2, 4), micro=1)
    _every_rank_same(dist, _gathered_on_every_rank(opt, world))


def _usage(rank, world, comm):
    """A block run twice in a forward and one not run at all; a forward without autograd; model.state_dict()
    and load_state_dict(); a torch LR scheduler."""
    kw = dict(order=[0, 1, 0])  # layers[0] twice, layers[2] never (its unit reduces zeros and is not stepped)
    model = _model(**kw)
    opt = _stage3(model, comm)
    _sharded_steps(model, opt, gpuops.GradScaler("cpu", init_scale=256.0), rank, range(10))
    full = opt.full_state_dict(0)
    if rank == 0:
        err, base = _within_float32_noise(full, _reference_fp32(world, range(10), **kw),
                                          _reference_f64(world, range(10), **kw), "a block run twice, one skipped")
        print(f"rank 0: a block run twice and one skipped, 10 steps: max_rel_err from float64 {err:.3g} "
              f"(single-process float32: {base:.3g})", flush=True)
    # Without autograd every unit is freed after its forward; the logits are the gathered model's.
    full = _gathered_on_every_rank(opt, world)
    plain = TinyLM(**kw)
    plain.load_state_dict(full)
    idx, _ = _batch(99, rank)
    with torch.no_grad():
        got = model(idx)
    assert torch.equal(got, plain(idx)) and all(p.numel() == 0 for p in model.parameters())
    # model.state_dict() leaves the sharded parameters out, with one warning; load_state_dict takes them all.
    with pytest.warns(UserWarning, match="left out"):
        partial = model.state_dict()
    assert "layers.0.fc.weight" not in partial and "head.weight" not in partial
    changed = {k: v + 1.0 for k, v in full.items()}
    model.load_state_dict(changed)  # every rank: each keeps its shard
    again = _gathered_on_every_rank(opt, world)
    assert all(torch.equal(again[k], changed[k]) for k in changed)
    model.load_state_dict(partial)  # what state_dict() gave: nothing reported missing
    with pytest.raises(ValueError, match="give all of them or none"):
        model.load_state_dict({k: v for k, v in changed.items() if k != "pos"})
    # The load is agreed: values that differ between ranks, a bad value or a partial dict on one rank raise on
    # every rank before anything is loaded (it was a patchwork of shards, or rank 0 raised while rank 1 loaded).
    other = dict(changed, pos=changed["pos"] + rank)
    with pytest.raises(ValueError, match="the ranks disagree on values loaded"):
        model.load_state_dict(other)
    bad = dict(changed, pos=changed["pos"][:-1]) if rank == 0 else changed
    with pytest.raises(ValueError, match=r"values\[\d+\] must be a floating tensor" if rank == 0 else "rank 0 failed"):
        model.load_state_dict(bad)
    lacking = {k: v for k, v in changed.items() if k != "pos"} if rank == 1 else changed
    with pytest.raises(ValueError, match="give all of them or none" if rank == 1 else "rank 1 failed"):
        model.load_state_dict(lacking)
    still = _gathered_on_every_rank(opt, world)
    assert all(torch.equal(still[k], changed[k]) for k in changed), "a refused load changed a shard"
    model.load_state_dict({k: v.double() for k, v in changed.items()})  # converted, as torch's load copies
    for k, a in _gathered_on_every_rank(opt, world).items():
        assert torch.equal(a, changed[k]), (k, a.dtype, changed[k].dtype, (a - changed[k]).abs().max())
    # A torch scheduler drives the group's lr, which reaches the C++ optimizer at the step.
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _sharded_steps(model, opt, None, rank, range(10, 12), micro=1)
    scheduler.step()
    _sharded_steps(model, opt, None, rank, range(12, 13), micro=1)
    assert opt.param_groups[0]["lr"] == 5e-3 and opt._impl.options["lr"] == 5e-3
    # A module.to() while sharded would be undone by the next gather: the next forward names it (every rank did it).
    model.to(torch.float64)
    with pytest.raises(ValueError, match=r"'pos' \(params\[0\], shape \[8, 24\]\) was replaced while sharded"):
        model(idx)
    model.to(torch.float32)
    _sharded_steps(model, opt, None, rank, range(13, 14), micro=1)
    # The consolidated optimizer state (torch's format) loads into another stage-3 optimizer on every rank.
    opt.consolidate_state_dict(0)
    shipped = [opt.state_dict() if rank == 0 else None]
    torch.distributed.broadcast_object_list(shipped, 0)
    other = _model(**kw)
    again = _stage3(other, comm)
    again.load_state_dict(shipped[0])
    again.consolidate_state_dict(0)
    if rank == 0:
        mine, theirs = shipped[0]["state"], again.state_dict()["state"]
        assert all(torch.equal(mine[i][k], theirs[i][k]) for i in mine for k in mine[i])


def _fsdp2(rank, comm):
    """The same model under torch's FSDP2 (fully_shard per block and the root) with torch's AdamW and
    clip_grad_norm_, 2 micro-batches, one block checkpointed: 30 steps; ours as close to float64 as FSDP2's
    (within PARITY_FACTOR)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    theirs = _model(checkpointed={1: False})
    for block in theirs.layers:
        fully_shard(block)
    fully_shard(theirs)
    torch_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    for step in range(30):
        torch_opt.zero_grad()
        for m in range(2):
            (_loss(theirs, *_batch(2 * step + m, rank)) / 2).backward()
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0)
        torch_opt.step()
    ours = _model(checkpointed={1: False})
    opt = _stage3(ours, comm)
    _sharded_steps(ours, opt, None, rank, range(30))
    full = opt.full_state_dict(0)
    reference = get_model_state_dict(theirs, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        err, base = _within_float32_noise(full, reference, _reference_f64(2, range(30)), "against FSDP2")
        print(f"rank 0: against torch FSDP2 + torch AdamW, 30 steps: max_rel_err from float64 {err:.3g} (FSDP2's: "
              f"{base:.3g}; ours from FSDP2's {_rel_err(full, reference):.3g})", flush=True)


def _accumulate(rank, world, comm, dist):
    """GradAccumulator (2 micro-batches, clipping at 1) over both ways of accumulating: each micro-batch's unit
    gradients reduce-scattered into the fp32 shard (reduce_in_backward=True, the default) or the unit's full
    gradients accumulated locally and reduced once per window (False). Then the traffic of one step."""
    ref, ref64 = (_reference_clipped(world, range(30)), _reference_f64(world, range(30))) if rank == 0 else (None, None)
    for in_backward in (True, False):
        model = _model()
        opt = _stage3(model, comm, reduce_in_backward=in_backward)
        acc = gpuops.GradAccumulator(opt, 2, max_norm=1.0)
        most = 0
        for step in range(30):
            for m in range(2):
                idx, y = _batch(2 * step + m, rank)
                loss_sum = F.cross_entropy(model(idx).reshape(-1, VOCAB), y.reshape(-1), reduction="sum")
                acc.backward(loss_sum, y.numel())
                most = max(most, opt.gradient_bytes())
        full = opt.full_state_dict(0)
        err = _within_float32_noise(full, ref, ref64, f"reduce_in_backward={in_backward}")[0] if rank == 0 else 0.0
        print(f"rank {rank}: GradAccumulator, reduce_in_backward={in_backward}: max_rel_err={err:.3g}, gradient "
              f"bytes at most {most} (parameters {sum(opt.flat_numels()) * 4} B padded)", flush=True)
    # Traffic of one step of one micro-batch: every unit gathered for its forward and again for its backward,
    # its gradient reduce-scattered once: 1.5 all-reduces of the parameters. reshard_after_forward=False keeps
    # the units from forward to backward: one gather. Each gather is preceded by the unit-order check: two
    # int64 per rank (check_unit_order=False: none). The clip's norm is combined by an all-gather of two float64
    # per rank (the value and what it is: ZeroShards::combine).
    for reshard, check in ((True, True), (False, True), (True, False)):
        model = _model()
        opt = _stage3(model, comm, reshard_after_forward=reshard, check_unit_order=check)
        padded = sum(opt.flat_numels()) * 4
        comm.reset_traffic()
        _sharded_steps(model, opt, None, rank, range(1), micro=1)
        t = comm.traffic()
        gathers = (2 if reshard else 1) * opt._impl.unit_count()
        checks = gathers * 16 * world if check else 0
        norm = 16 * world
        assert t["all_gather"]["payload_bytes"] == (2 if reshard else 1) * padded + checks + norm, (t, padded)
        assert t["reduce_scatter"]["payload_bytes"] == padded, (t, padded)
        print(f"rank {rank}: reshard_after_forward={reshard}: all-gathers {t['all_gather']['payload_bytes']} B, "
              f"reduce-scatters {t['reduce_scatter']['payload_bytes']} B, parameters {padded} B padded", flush=True)


def _reference_clipped(world, steps, micro=2):
    model = _model()
    opt = gpuops.optim.AdamW(model.parameters(), lr=1e-2)
    for step in steps:
        opt.zero_grad()
        for p, g in zip(model.parameters(), _reference_grads(model, world, step, micro, None, False)):
            p.grad = g
        gpuops.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model.state_dict()


def _memory(rank, world, comm):
    """Per-rank bytes of stage 2 and stage 3 on the same 16-block model, construction and 3 steps inside one
    MemoryBudget each: what stays (current) and the peak of the last two steps."""
    figures = {}
    for stage in (2, 3):
        with gpuops.memory_budget() as mb:
            model = _model(layers=16)
            param_bytes = sum(p.numel() * 4 for p in model.parameters())
            unit_bytes = sum(p.numel() * 4 for p in model.layers[0].parameters())
            inner = {id(p) for p in model.layers.parameters()}
            root_bytes = sum(p.numel() * 4 for p in model.parameters() if id(p) not in inner)
            if stage == 3:
                opt = _stage3(model, comm)
            else:
                opt = gpuops.ZeroOptimizer(model.parameters(), "adamw", communicator=comm, stage=2,
                                           reduce_in_backward=True, bucket_bytes=unit_bytes, lr=1e-2)
            _sharded_steps(model, opt, None, rank, range(1), micro=1)  # the states exist from here on
            mb.reset_peak()
            _sharded_steps(model, opt, None, rank, range(1, 3), micro=1)
            figures[stage] = (mb.current_bytes, mb.peak_bytes)
            del opt
            import gc
            gc.collect()
    (kept2, peak2), (kept3, peak3) = figures[2], figures[3]
    sharded_away = param_bytes - param_bytes / world  # (1 - 1/N) of the parameters
    # Stage 2 keeps the whole parameters, stage 3 its shard of them; the rest (gradient and state shards) is alike.
    assert abs((kept2 - kept3) - sharded_away) <= 0.02 * param_bytes, (kept2, kept3, sharded_away)
    # The units in flight at the peak (backward's start): the rest of the model (unit 0: embedding and head, which
    # run first and last), the block running, the one prefetched, and one more for Gloo's full copy of the buffer
    # a gather or reduce-scatter works on (on the CPU; NCCL works in place).
    # (+2% of the parameters for small tensors: placeholders, flags; measured 1.4K over the units alone)
    in_flight = root_bytes + 3 * unit_bytes
    assert peak3 <= peak2 - sharded_away + in_flight + 0.02 * param_bytes, (peak2, peak3, sharded_away, in_flight)
    assert peak3 < peak2 - sharded_away / 2, (peak2, peak3)
    print(f"rank {rank}: parameters {param_bytes} B (a block {unit_bytes} B); kept: stage 2 {kept2} B, stage 3 "
          f"{kept3} B (difference {kept2 - kept3} B; (1-1/N) x parameters {sharded_away:.0f} B); peak: stage 2 "
          f"{peak2} B, stage 3 {peak3} B (difference {peak2 - peak3} B)", flush=True)


def _reference_chain(worlds):
    """Single-process AdamW over every rank's data averaged, the world size of step i being worlds[i]."""
    model = _model()
    opt = gpuops.optim.AdamW(model.parameters(), lr=1e-2)
    for step, world in enumerate(worlds):
        opt.zero_grad()
        for p, g in zip(model.parameters(), _reference_grads(model, world, step, 1, None, False)):
            p.grad = g
        gpuops.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model, opt


def _state(scenario, rank, world, comm):
    """3 ranks train steps 0-3 and save; 2 ranks resume (resharded), train 4-7 and save; 1 rank resumes and trains
    8-9. Each hop against a single process over the same data; at the end the gathered model and consolidated
    optimizer state go into a plain model and AdamW, which continue as the sharded run does."""
    folder = os.environ["GPUOPS_TEST_DIR"]
    model = _model()
    opt = _stage3(model, comm)
    state = gpuops.TrainingState(folder)
    chain = [3] * 4 + [2] * 4 + [1] * 2
    if scenario == "save":
        begin = 0
    else:
        begin = state.load(model=model, optimizer=opt, allow_reshard=True)["step"]
        assert begin == {2: 4, 1: 8}[world], begin
        full = opt.full_state_dict(0)
        if rank == 0:
            saved = torch.load(os.path.join(folder, f"model-at-{begin}.pt"))
            assert all(torch.equal(full[k], saved[k]) for k in saved), "the resharded parameters differ"
    end = {3: 4, 2: 8, 1: 10}[world]
    _sharded_steps(model, opt, None, rank, range(begin, end), micro=1)
    full = opt.full_state_dict(0)
    if world > 1:
        state.save(step=end, model=model, optimizer=opt)
    if rank == 0:
        torch.save(full, os.path.join(folder, f"model-at-{end}.pt"))
        ref_model, ref_opt = _reference_chain(chain[:end])
        err = _rel_err(full, ref_model.state_dict())
        # (the reference sums 3 ranks' gradients in another order than Gloo, and clips by a norm summed otherwise:
        # 1.5e-6 measured after 4 steps; the resharding itself is checked bit for bit above)
        assert err <= 1e-5, f"after step {end} on {world} ranks: max relative error {err}"
        print(f"rank 0: steps {begin}-{end - 1} on {world} ranks after resharding: max_rel_err={err:.3g}", flush=True)
    if world == 1:  # the gathered model and the consolidated state continue in plain objects
        opt.consolidate_state_dict(0)
        plain = TinyLM()
        plain.load_state_dict(full)
        plain_opt = gpuops.optim.AdamW(plain.parameters(), lr=1e-2)
        plain_opt.load_state_dict(opt.state_dict())
        _sharded_steps(model, opt, None, rank, range(end, end + 2), micro=1)
        for step in range(end, end + 2):
            plain_opt.zero_grad()
            _loss(plain, *_batch(step, 0)).backward()
            gpuops.clip_grad_norm_(plain.parameters(), 1.0)
            plain_opt.step()
        err = _rel_err(opt.full_state_dict(0), plain.state_dict())
        assert err <= 1e-6, f"the plain model continued {err} away"
        print(f"rank 0: a plain model and AdamW loaded from the gathered state continue within {err:.3g}", flush=True)
    print(f"{scenario} ok", flush=True)


def _sigterm(rank, comm, dist):
    """A SIGTERM on rank 1 at step 3: every rank sees should_stop() at the same step, saves and stops; the saved
    state loads into a fresh stage-3 model that holds the same parameters."""
    import signal as signals

    folder = os.environ["GPUOPS_TEST_DIR"]
    model = _model()
    opt = _stage3(model, comm)
    state = gpuops.TrainingState(folder, process_group=dist.group.WORLD)
    for step in range(10):
        _sharded_steps(model, opt, None, rank, range(step, step + 1), micro=1)
        if step == 3 and rank == 1:
            os.kill(os.getpid(), signals.SIGTERM)  # a scheduler's signal, caught by TrainingState
        if state.should_stop():
            state.save(step=step + 1, model=model, optimizer=opt)
            print(f"rank {rank}: stopped at step {step + 1}", flush=True)
            break
    saved = opt.full_state_dict(0)
    fresh = _model()
    again = _stage3(fresh, comm)
    assert gpuops.TrainingState(folder).load(model=fresh, optimizer=again)["step"] == 4
    loaded = again.full_state_dict(0)
    if rank == 0:
        assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    print("sigterm ok", flush=True)


def _fault(scenario, rank, dist):
    comm = gpuops.dist.Communicator(timeout=4)
    model = _model()
    opt = _stage3(model, comm)
    _sharded_steps(model, opt, None, rank, range(1), micro=1)
    dist.barrier()
    if rank == 1:
        time.sleep(0.3)
        if scenario == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # stalled: never joins the next gather
        os._exit(0)
    start = time.monotonic()
    try:
        _loss(model, *_batch(0, rank)).backward()  # the first unit's gather waits for rank 1
    except RuntimeError as e:
        elapsed = time.monotonic() - start
        print(f"raised after {elapsed:.3f} s (timeout 4 s): {str(e).splitlines()[0]}", flush=True)
        assert elapsed < 4 + 3, elapsed
        os._exit(0)  # the group is broken: skip torch.distributed's teardown
    os._exit(1)


if __name__ == "__main__":
    _rank_main(sys.argv[1])
