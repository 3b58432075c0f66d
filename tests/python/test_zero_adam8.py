"""gpuops.ZeroOptimizer with 8-bit moments (AdamW(state_bits=8), issue 32) over Gloo, real processes (this file
run as a script per rank; multiprocess_launch.py). A model whose two large weights keep 8-bit moments and whose
small tensors keep float32 ones:

- same data on 2 ranks: stages 1-3 give the bits of the unsharded gpuops.optim.AdamW(state_bits=8) (the
  parameters, and the consolidated codes, scales and moments), through a GradScaler that skips one step and
  accumulation: each parameter's blocks are its own in the flat buffers, so nothing is quantised differently;
- each rank's own data on 3 ranks, with clipping: within the float32 noise of the single-process run on the
  concatenated batch (parity.py's rule), stages 1-3;
- TrainingState saved at 3 ranks, resumed at 2 (resharded): the consolidated state equal bit for bit, and
  loadable by the unsharded optimizer (bits again) and by torch.optim.AdamW in its dequantized form;
- memory: the moments of the large weights cost 2 bytes per element plus a scale per 256, measured;
- switching state_bits to 8 after a construction at 32, and crafted full states (another code book, negative
  scales, the wrong number of scales) are refused naming the cause, nothing changed."""

import os
import sys

import pytest
import torch

import gpuops
from multiprocess_launch import expect_ok, run_gloo_rank
from parity import within_noise

DEADLINE_S = 120
STEPS = 24
OPTIONS = dict(lr=2e-2, weight_decay=0.05, state_bits=8)


def _expect(scenario, world, tmp_path=None):
    expect_ok(__file__, scenario, world, DEADLINE_S, tmp_path)


def test_same_bits_as_unsharded():
    _expect("bits", 2)


def test_within_noise_of_single_process():
    _expect("noise", 3)


def test_estimator_to_the_byte():
    pytest.importorskip("transformers")
    _expect("estimate", 3)


def test_reshard_3_to_2_exact(tmp_path):
    _expect("save", 3, tmp_path)
    _expect("resume", 2, tmp_path)


# ----------------------------------------------------------------------------------------------------- ranks
def _model():
    torch.manual_seed(4321)  # weights of 6144 and 4608 elements (8-bit moments), the rest float32 moments
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 48), torch.nn.Tanh(),
                               torch.nn.Linear(48, 8))


def _batch(step, micro, rank=0):
    g = torch.Generator().manual_seed(7000 + 100 * step + 10 * micro + rank)
    x, y = torch.randn(8, 64, generator=g), torch.randn(8, 8, generator=g)
    if step == 9 and micro == 1 and rank == 0:
        x[0, 0] = float("inf")  # an overflow: every rank skips the step
    return x, y


def _train(model, opt, batch_of, steps, clip=None, chunks=1):
    scaler = gpuops.GradScaler("cpu", init_scale=512.0, growth_interval=5)
    dtype = next(model.parameters()).dtype
    for step in steps:
        opt.zero_grad()
        for micro in range(2):
            x, y = (t.to(dtype) for t in batch_of(step, micro))
            loss = sum(torch.nn.functional.mse_loss(model(a), b) for a, b in zip(x.chunk(chunks), y.chunk(chunks)))
            scaler.scale(loss / chunks).backward()
        scaler.set_grad_divisor(opt, 2)
        if clip:
            scaler.clip_grad_norm_(opt, clip)
        scaler.step(opt)
        scaler.update()
    return scaler


def _round_up(n, m):
    return -(-n // m) * m


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _zero(model, comm, stage, **extra):
    return gpuops.ZeroOptimizer(model.named_parameters(), "adamw", communicator=comm, stage=stage,
                                model=model if stage == 3 else None, **{**OPTIONS, **extra})


def _full_params(model, opt, stage):
    """The parameters' full values on rank 0 (stage 3 gathers them there); None on the other ranks at stage 3."""
    if stage != 3:
        return _params(model)
    full = opt.full_state_dict(0)
    return None if full is None else [full[name] for name, _ in _model().named_parameters()]


def _same_state(got, want, what):
    assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    for i in want:
        assert sorted(got[i]) == sorted(want[i]), (what, i, sorted(got[i]), sorted(want[i]))
        for key, value in want[i].items():
            same = value == got[i][key] if isinstance(value, str) else torch.equal(got[i][key], value)
            assert same, f"{what}: state[{i}][{key!r}] differs: {got[i][key]!r}"




def _run(scenario, dist):
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = gpuops.dist.Communicator(timeout=60)
    if scenario == "bits":
        ref_model = _model()
        ref_opt = gpuops.optim.AdamW(ref_model.parameters(), **OPTIONS)
        scaler = _train(ref_model, ref_opt, _batch, range(STEPS))
        assert scaler.skipped_steps == 1
        ref_state = ref_opt.state_dict()["state"]
        assert sum("exp_avg_codes" in s for s in ref_state.values()) == 2  # the two large weights
        for stage in (1, 2, 3):
            model = _model()
            opt = _zero(model, comm, stage)
            _train(model, opt, _batch, range(STEPS))
            got = _full_params(model, opt, stage)
            if got is not None:
                assert len(got) == 6 and all(torch.equal(a, b) for a, b in zip(got, _params(ref_model))), (
                    f"stage {stage}: parameters differ")
            opt.consolidate_state_dict(0)
            if rank == 0:  # (stage 3's state also holds each parameter's fp32 values: checked above)
                state = {i: {k: v for k, v in s.items() if k != "master_param"}
                         for i, s in opt.state_dict()["state"].items()}
                _same_state(state, ref_state, f"stage {stage}")
            if stage < 3:  # (stage 3's buffers are per unit)
                # The two large weights (whole blocks each) in one buffer padded to whole blocks per rank: 2 bytes
                # per element and a float32 scale per 256; the six small tensors: 8 bytes per element; a float32
                # step counter per parameter and rank.
                blocked = _round_up(6144 + 4608, 256 * world) // world
                small = _round_up(96 + 48 + 384 + 8, 4 * world) // world
                assert opt.state_bytes() == 2 * blocked + 8 * blocked // 256 + 8 * small + 4 * 6, opt.state_bytes()
            print(f"rank {rank}: stage {stage}: the bits of the unsharded 8-bit AdamW (parameters, codes, scales, "
                  f"float32 moments of the small tensors); state {opt.state_bytes()} bytes on this rank", flush=True)
        # Ranks that pass different state_bits raise together, naming it, before anything is flattened.
        model = _model()
        with pytest.raises(ValueError, match=r"state_bits=8\).*state_bits=32\)|state_bits=32\).*state_bits=8\)"):
            _zero(model, comm, 2, state_bits=8 if rank == 0 else 32)
        assert all(p.is_leaf and p.grad is None for p in model.parameters())
        # state_bits=8 needs the block layout made at construction: a switch from 32 is refused, nothing stepped.
        model = _model()
        wide = _zero(model, comm, 1, state_bits=32)
        torch.nn.functional.mse_loss(model(_batch(0, 0)[0]), _batch(0, 0)[1]).backward()
        wide.param_groups[0]["state_bits"] = 8
        before = _params(model)
        with pytest.raises(ValueError, match="construct the ZeroOptimizer with state_bits=8"):
            wide.step()
        assert all(torch.equal(a, b) for a, b in zip(_params(model), before))
        # bfloat16 parameters (stepped on fp32 master shards, rounded to nearest even as the unsharded step does).
        ref_model = _model().to(torch.bfloat16)
        ref_opt = gpuops.optim.AdamW(ref_model.parameters(), **OPTIONS)
        _train(ref_model, ref_opt, _batch, range(STEPS))
        for stage in (1, 2):  # (stage 3 reduces each micro-batch: its sum is float32, the unsharded one bfloat16)
            model = _model().to(torch.bfloat16)
            opt = _zero(model, comm, stage)
            _train(model, opt, _batch, range(STEPS))
            assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(ref_model))), f"bf16 stage {stage}"
            opt.consolidate_state_dict(0)
            if rank == 0:
                _same_state(opt.state_dict()["state"], ref_opt.state_dict()["state"], f"bf16 stage {stage}")
        print("bits ok", flush=True)
    elif scenario == "noise":
        mine = lambda s, m: _batch(s, m, rank)  # noqa: E731

        def concatenated(s, m):
            xs, ys = zip(*[_batch(s, m, r) for r in range(world)])
            return torch.cat(xs), torch.cat(ys)

        ref_model, other_model = _model(), _model()
        _train(ref_model, gpuops.optim.AdamW(ref_model.parameters(), **OPTIONS), concatenated, range(STEPS), clip=0.5)
        _train(other_model, gpuops.optim.AdamW(other_model.parameters(), **OPTIONS), concatenated, range(STEPS),
               clip=0.5, chunks=world)
        init = _params(_model())
        assert max(((r - i).abs().max() / r.abs().max()).item() for r, i in zip(_params(ref_model), init)) > 0.1
        for stage in (1, 2, 3):
            model = _model()
            opt = _zero(model, comm, stage)
            _train(model, opt, mine, range(STEPS), clip=0.5)
            got = _full_params(model, opt, stage)
            if got is None:
                continue
            worst, noise = within_noise(got, _params(ref_model), _params(other_model), f"stage {stage}")
            print(f"rank {rank}: stage {stage}, {world} ranks, clipped: max_rel_err={worst:.3g} (references "
                  f"{noise:.3g})", flush=True)
        print("noise ok", flush=True)
    elif scenario == "estimate":  # `gpuops estimate --optimizer gpuops-adamw-8bit --zero N` against the tensors
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "estimator_validation"))
        from measure import make_config, model_factory_for

        # An untied Llama: embedding, LM head and projections of 4096 values or more (k and v exactly 4096), 1-D
        # norms under it.
        kind, cfg = "llama", dict(h=128, L=3, a=8, kv=2, i=344, V=4000, tied=False)
        for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            for stage in (1, 2):
                torch.manual_seed(0)
                module = model_factory_for(kind, cfg, "sdpa")().to(dtype)
                opt = gpuops.ZeroOptimizer(module.parameters(), "adamw", communicator=comm, stage=stage, **OPTIONS)
                ids = torch.randint(0, cfg["V"], (2, 16), generator=torch.Generator().manual_seed(rank))
                module(input_ids=ids).logits.float().square().mean().backward()
                opt.step()
                masters = 4 * sum(opt.flat_numels()) // world if dtype != torch.float32 else 0
                measured = opt.state_bytes() - masters
                est = gpuops.estimate(config=make_config(kind, cfg, "sdpa").to_dict(), precision=precision,
                                      optimizer="gpuops-adamw-8bit", zero_stage=stage, num_gpus=world, device="cpu",
                                      micro_batch=2, seq_len=64)
                assert est.optimizer_states == measured, (precision, stage, est.optimizer_states, measured)
                print(f"rank {rank}: {precision} stage {stage}: estimate {est.optimizer_states} = measured "
                      f"{measured} bytes of moments and counters on this rank", flush=True)
        print("estimate ok", flush=True)
    elif scenario in ("save", "resume"):
        directory = os.environ["GPUOPS_TEST_DIR"]
        for stage in (1, 2, 3):
            model = _model()
            opt = _zero(model, comm, stage)
            folder = f"{directory}/stage{stage}"
            with gpuops.TrainingState(folder, process_group=dist.group.WORLD) as state:
                if scenario == "save":
                    _train(model, opt, lambda s, m: _batch(s, m, rank), range(8), clip=0.5)
                    state.save(step=8, model=model, optimizer=opt)
                    opt.consolidate_state_dict(0)
                    if rank == 0:
                        torch.save(opt.state_dict(), f"{folder}/consolidated.pt")
                    continue
                with pytest.raises(ValueError, match="allow_reshard"):
                    state.load(model=model, optimizer=opt)
                state.load(model=model, optimizer=opt, allow_reshard=True)
            opt.consolidate_state_dict(0)
            if rank == 0:
                saved = torch.load(f"{folder}/consolidated.pt")
                _same_state(opt.state_dict()["state"], saved["state"], f"stage {stage}: resharded 3 -> 2")
                # The consolidated state is the unsharded optimizer's: it loads it and gives it back unchanged.
                single = gpuops.optim.AdamW(_model().parameters(), **OPTIONS)
                single.load_state_dict(saved)
                _same_state(single.state_dict()["state"], saved["state"], f"stage {stage}: unsharded load")
                # torch's AdamW takes the dequantized form.
                torch_opt = torch.optim.AdamW(_model().parameters(), lr=OPTIONS["lr"])
                torch_opt.load_state_dict(opt.dequantized_state_dict())
                decoded = torch_opt.state_dict()["state"]
                assert all("exp_avg" in s and "exp_avg_codes" not in s for s in decoded.values())
            print(f"rank {rank}: stage {stage}: resumed at {world} ranks from 3, state equal bit for bit", flush=True)
        if scenario == "resume":  # a full state loads on every rank; crafted ones are refused, nothing changed
            saved = torch.load(f"{directory}/stage2/consolidated.pt")
            model = _model()
            opt = _zero(model, comm, 2)
            opt.load_state_dict(saved)
            opt.consolidate_state_dict(0)
            if rank == 0:
                _same_state(opt.state_dict()["state"], saved["state"], "load_state_dict at 2 ranks")
            first = next(k for k, s in saved["state"].items() if "exp_avg_codes" in s)
            for change, message in ((dict(state_format="dynamic8-block64"), "state_format is 'dynamic8-block64'"),
                                    (dict(exp_avg_scales=-saved["state"][first]["exp_avg_scales"] - 1), "negative"),
                                    (dict(exp_avg_sq_scales=torch.ones(3)), "one per 256")):
                crafted = {**saved, "state": {**saved["state"], first: {**saved["state"][first], **change}}}
                with pytest.raises(ValueError, match=message):
                    opt.load_state_dict(crafted)
                opt.consolidate_state_dict(0)
                if rank == 0:
                    _same_state(opt.state_dict()["state"], saved["state"], f"refused {sorted(change)}")
        print(f"{scenario} ok", flush=True)


if __name__ == "__main__":
    run_gloo_rank(_run, sys.argv[1], timeout_s=60)
