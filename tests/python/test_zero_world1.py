"""gpuops.ZeroOptimizer at world size 1, in this process: over ProcessGroupNCCL with CUDA parameters where a GPU
is visible (NCCL refuses two ranks on one GPU, so one GPU tests NCCL at world size 1), over Gloo with CPU
parameters everywhere. At world size 1 every shard is the whole buffer: the sharded step must train as the
unsharded gpuops.optim.AdamW does (with GradScaler, clipping and accumulation), overlapped gathers must give the
same bits, and the state must round-trip (shard files, and a consolidated state dict that torch's AdamW loads).
scripts/gpu-run runs this file on the GPU machine (checklist step 7)."""

import copy
import datetime
import random

import pytest
import torch
import torch.distributed as dist

import gpuops
from conftest import requires_cuda

BACKENDS = [pytest.param(("gloo", "cpu"), id="gloo-cpu"), pytest.param(("nccl", "cuda"), id="nccl-cuda",
                                                                         marks=requires_cuda)]
STEPS = 12


@pytest.fixture(params=BACKENDS)
def device(request):
    """A world of one over the backend; yields the parameters' device; the group is destroyed afterwards."""
    backend, device = request.param
    if backend == "nccl" and not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    options = dict(device_id=torch.device("cuda", 0)) if backend == "nccl" else {}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60), **options)
    try:
        yield torch.device(device)
    finally:
        import gc

        gc.collect()  # our communicators hold the group: drop them before it is destroyed
        dist.destroy_process_group()


def _model(device, dtype=torch.float32):
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 9)).to(device, dtype)


def _train(model, optimizer, device, seed, accumulation=2, snapshot=None):
    """STEPS steps of `accumulation` micro-batches with our GradScaler and clipping; the parameters after each
    (or what `snapshot` returns)."""
    generator = torch.Generator().manual_seed(seed)
    scaler = gpuops.GradScaler(device.type, init_scale=2.0**10, growth_interval=5)
    dtype = next(model.parameters()).dtype
    history = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        for _ in range(accumulation):
            x = torch.randn(8, 24, generator=generator).to(device, dtype)
            y = torch.randn(8, 9, generator=generator).to(device, dtype)
            scaler.scale(torch.nn.functional.mse_loss(model(x).float(), y.float())).backward()
        scaler.set_grad_divisor(optimizer, accumulation)
        scaler.clip_grad_norm_(optimizer, 0.5)
        scaler.step(optimizer)
        scaler.update()
        history.append(snapshot() if snapshot else torch.cat([p.detach().float().flatten().cpu()
                                                              for p in model.parameters()]))
    return history


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("reduce_in_backward", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trains_as_the_unsharded_optimizer(device, stage, reduce_in_backward, dtype):
    """fp32: every step gives the bits of gpuops.optim.AdamW on the same model; and it ends far from the start.
    bf16 (both step fp32 masters): within bf16 rounding, as the sharded path sums in fp32 where the plain one
    sums bf16 values (the clipping norm over the flat fp32 gradients; reduced in the backward, the micro-batches'
    gradients in fp32 buffers, where autograd accumulates the plain optimizer's in bf16)."""
    seed = random.randint(0, 2**31)
    sharded_model, plain_model = _model(device, dtype), _model(device, dtype)
    start = torch.cat([p.detach().float().flatten().cpu() for p in plain_model.parameters()])
    options = dict(lr=2e-2, weight_decay=0.01)
    sharded = _train(sharded_model, gpuops.ZeroOptimizer(sharded_model.parameters(), stage=stage,
                                                         reduce_in_backward=reduce_in_backward, bucket_bytes=1024,
                                                         **options), device, seed)
    plain = _train(plain_model, gpuops.optim.AdamW(plain_model.parameters(), **options), device, seed)
    for step, (a, b) in enumerate(zip(sharded, plain)):
        if dtype == torch.float32:
            assert torch.equal(a, b), f"step {step}"
        else:  # bf16 keeps 8 significant bits: 2**-8 relative is its rounding
            assert ((a - b).norm() / b.norm()).item() <= 2.0**-8, f"step {step}"
    assert ((plain[-1] - start).abs().max() / start.abs().max()).item() > 0.05


def test_overlapped_gathers_give_the_same_bits(device):
    seed = random.randint(0, 2**31)
    results = []
    for overlap in (False, True):
        model = _model(device)
        optimizer = gpuops.ZeroOptimizer(model.parameters(), stage=2, lr=1e-2, bucket_bytes=1024,
                                         overlap_param_gather=model if overlap else False)
        results.append(_train(model, optimizer, device, seed)[-1])
    assert torch.equal(results[0], results[1])


def test_state_round_trips_through_shard_files_and_torchs_adamw(device, tmp_path):
    """Half the steps, save the shard, load it into a new optimizer and finish: the bits of an uninterrupted
    run. The consolidated state dict loads into torch.optim.AdamW with the same moments."""
    seed = random.randint(0, 2**31)
    model = _model(device)
    optimizer = gpuops.ZeroOptimizer(model.parameters(), stage=2, lr=1e-2)
    uninterrupted = _train(model, optimizer, device, seed) + _train(model, optimizer, device, seed + 1)

    model = _model(device)
    optimizer = gpuops.ZeroOptimizer(model.parameters(), stage=2, lr=1e-2)
    _train(model, optimizer, device, seed)
    optimizer.save_shard(tmp_path / "shard0.pt")
    resumed_model = copy.deepcopy(model)
    resumed = gpuops.ZeroOptimizer(resumed_model.parameters(), stage=2, lr=1e-2)
    resumed.load_shards([tmp_path / "shard0.pt"])
    assert torch.equal(_train(resumed_model, resumed, device, seed + 1)[-1], uninterrupted[-1])

    optimizer.consolidate_state_dict(0)
    full = optimizer.state_dict()
    reference = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference.load_state_dict(full)
    for p, ours in zip(model.parameters(), full["state"].values()):
        assert torch.equal(reference.state[p]["exp_avg"], ours["exp_avg"].to(p.device))
        assert ours["exp_avg"].abs().sum() > 0


def test_stage3_built_on_the_cpu_trains_as_the_unsharded_optimizer(device):
    """Stage 3 from a model built on the CPU with ``device=`` the training device (the GPU machine: the shards
    and gathered units live there, the CPU held the model once), each Linear a unit: every step within 1e-6 of
    gpuops.optim.AdamW on a model built on the device (not its bits: the clipping norm sums per-unit buffers,
    measured one ulp apart, 5e-8 relative, on some steps; elements whose gradient cancels to 1e-5 of the rest
    then step several ulps apart, so the bound is on the norm: 1.4e-7 measured, a sharding error gives 1e-3)."""
    seed = random.randint(0, 2**31)
    host_model, plain_model = _model("cpu"), _model(device)
    options = dict(lr=2e-2, weight_decay=0.01)
    sharded = gpuops.ZeroOptimizer(host_model.named_parameters(), stage=3, model=host_model,
                                   units=[host_model[0], host_model[2]], device=device, **options)
    assert all(p.device.type == device.type and p.numel() == 0 for p in host_model.parameters())  # cuda:0 vs cuda

    def gathered():
        return torch.cat([t.float().flatten() for t in sharded.full_state_dict(0).values()])

    ours = _train(host_model, sharded, device, seed, snapshot=gathered)
    plain = _train(plain_model, gpuops.optim.AdamW(plain_model.parameters(), **options), device, seed)
    for step, (a, b) in enumerate(zip(ours, plain)):
        err = ((a - b).norm() / b.norm()).item()
        assert err <= 1e-6, f"step {step}: {err}"
    other = _model("cpu")
    with pytest.raises(ValueError, match="device must name a device"):
        gpuops.ZeroOptimizer(other.parameters(), stage=3, model=other, device="gpu0")
    assert all(p.numel() > 0 for p in other.parameters())  # refused before anything changed


@pytest.mark.parametrize("stage", [2, 3])
def test_data_replaced_in_place_keeps_the_reduction_hooks(device, stage):
    """torch's C++ Module::load set_s the loaded tensor into each parameter, and autograd then gives the parameter
    a new gradient accumulator, without the optimizer's hooks. Found on the stage-3 C++ example, whose resumed
    run diverged (its gradients never reached the shards; the same would hold for reduce_in_backward at stages 1
    and 2). The optimizer hooks the new accumulator: the same bits as a run without the replacement."""
    seed = random.randint(0, 2**31)
    results = []
    for replace in (False, True):
        model = _model(device)
        units = dict(model=model, units=[model[0], model[2]]) if stage == 3 else dict(reduce_in_backward=True)
        optimizer = gpuops.ZeroOptimizer(model.parameters(), stage=stage, lr=1e-2, **units)
        _train(model, optimizer, device, seed, snapshot=lambda: torch.zeros(1))
        if replace:
            with torch.no_grad():
                for p in model.parameters():  # as InputArchive::read does (stage 3: a placeholder for a placeholder)
                    p.set_(p.detach().clone())
        gathered = (lambda: torch.cat([t.float().flatten() for t in optimizer.full_state_dict(0).values()])) \
            if stage == 3 else None
        results.append(_train(model, optimizer, device, seed + 1, snapshot=gathered)[-1])
    assert torch.equal(results[0], results[1])


def test_training_state_of_stage3_saves_and_loads_without_the_state_dict_warning(device, tmp_path):
    """model.state_dict() warns that a stage-3 model leaves its sharded parameters out (for a user who saves
    the model by hand); TrainingState saves them with the shard files, so its own save and load stay quiet,
    and the warning still comes to the user afterwards."""
    import warnings

    model = _model(device)
    opt = gpuops.ZeroOptimizer(model.named_parameters(), stage=3, model=model, units=[model[0], model[2]], lr=1e-2)
    _train(model, opt, device, seed=3)
    state = gpuops.TrainingState(tmp_path / "state")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state.save(step=1, model=model, optimizer=opt)
        assert state.load(model=model, optimizer=opt)["step"] == 1
    with pytest.warns(UserWarning, match="left out"):
        model.state_dict()


def test_meta_parameters_and_an_absent_gpu_are_refused_naming_them(device):
    """Clear errors instead of a raw NotImplementedError or driver error, nothing changed."""
    meta = torch.nn.Linear(4, 3, device="meta")
    with pytest.raises(ValueError, match="'weight' is on meta.*to_empty"):
        gpuops.ZeroOptimizer(meta.named_parameters(), stage=2, lr=1e-2)
    if torch.cuda.is_available():
        return
    model = _model("cpu")
    with pytest.raises(ValueError, match="device cuda is not available: this process sees 0 CUDA device"):
        gpuops.ZeroOptimizer(model.parameters(), stage=3, model=model, device="cuda")
    assert all(p.numel() > 0 for p in model.parameters())
