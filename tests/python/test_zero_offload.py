"""gpuops.ZeroOptimizer(offload="cpu") (issue 33) over Gloo, real processes (multiprocess_launch.py): the shard
parameters (fp32 masters) and optimizer state in host memory, each bucket's gradient copied there after its
reduction, stepped on the host bucket by bucket and copied back before the all-gather.

- at 1, 2 and 3 ranks, stages 1-3, float32 and bfloat16, 32- and 8-bit moments, with a GradScaler that
  skips a step, clipping and accumulation: the bits of the same training not offloaded (the same CPU math);
- the device side (a MemoryBudget over everything but the host's allocations) keeps no masters, moments or
  gradient shards: its bytes drop by at least the optimizer's state bytes, measured;
- the timeline: every bucket's gradient reaches the host before its step, and its values go back after it;
  reducing in the backward, the gradients leave during the backward of each micro-batch;
- shard files (TrainingState) are those of a run not offloaded: an offloaded run resumes without offload and
  back, equal bit for bit;
- what it does not support yet is refused naming it, and so is a host without room for the shard (checked up
  front under a ulimit -d, and at 2 ranks when one rank alone is short or the ranks disagree on offload);
- SIGTERM in an offloaded backward: every rank saves the last whole step, and a job without offload resumes
  from it; a rank killed in its backward while its buckets leave for the host: the other raises within the
  timeout."""

import os
import signal
import sys
import time

import pytest
import torch

import gpuops
from multiprocess_launch import expect_ok, launch, run_gloo_rank
from test_zero_adam8 import _batch, _full_params, _model, _params, _same_state, _train

DEADLINE_S = 180
STEPS = 12


def _expect(scenario, world, tmp_path=None):
    expect_ok(__file__, scenario, world, DEADLINE_S, tmp_path)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_offloaded_gives_the_bits_of_not_offloaded(world):
    _expect("bits", world)


def test_device_bytes_and_timeline():
    _expect("memory", 2)


def test_resumes_without_offload_and_back(tmp_path):
    _expect("save", 2, tmp_path)
    _expect("resume", 2, tmp_path)


def test_single_process_form_without_a_process_group():
    """No torch.distributed group at all (a one-GPU user): ZeroOptimizer(offload="cpu") makes a one-rank group of
    its own and steps to gpuops.optim.AdamW's bits (the same CPU math)."""
    code = """
import random, torch, gpuops
seed = random.randint(0, 2**31)
torch.manual_seed(seed)
model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 8))
ref = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 8))
ref.load_state_dict(model.state_dict())
opt = gpuops.ZeroOptimizer(model.parameters(), offload="cpu", lr=1e-2, weight_decay=0.1)
ref_opt = gpuops.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
for step in range(6):
    x = torch.randn(16, 64)
    for m, o in ((model, opt), (ref, ref_opt)):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
assert not torch.distributed.is_initialized() and opt.communicator.size == 1
assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters())), seed
assert opt.offload_timeline()
print("single process ok")
"""
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "single process ok" in done.stdout, done.stdout + done.stderr


def test_refused_where_not_supported():
    _expect("refused", 1)


def test_sigterm_mid_step_saves_the_last_whole_step_on_every_rank(tmp_path):
    """SIGTERM reaches rank 1 in its backward of step 3 (offloaded, its buckets leaving for the host): the step
    finishes, every rank agrees to stop and saves step 3; a job without offload resumes from it with the
    parameters and state the offloaded ranks held."""
    _expect("sigterm", 2, tmp_path)
    _expect("after_sigterm", 2, tmp_path)


def test_a_rank_killed_mid_backward_makes_the_other_raise_within_the_timeout():
    """Rank 1 is killed in its backward after its first buckets left for the host (reduce_in_backward); rank 0,
    reducing and copying on, raises within the communicator's 5 s timeout instead of hanging."""
    (code0, out0), (code1, _) = launch(__file__, "killed", 2, DEADLINE_S)
    assert code1 == -signal.SIGKILL
    assert code0 == 0 and "raised after" in out0, out0


# ----------------------------------------------------------------------------------------------------- ranks
def _zero(model, comm, stage, offload, in_backward=False, **options):
    # Stage 3: a unit per layer (the Sequential's children); stages 1-2: several buckets.
    return gpuops.ZeroOptimizer(model.named_parameters(), "adamw", communicator=comm, stage=stage,
                                model=model if stage == 3 else None, units=model if stage == 3 else None,
                                offload="cpu" if offload else None, bucket_bytes=8192,
                                reduce_in_backward=in_backward, **{"lr": 2e-2, "weight_decay": 0.05, **options})


def _consolidated(opt):
    opt.consolidate_state_dict(0)
    return opt.state_dict()["state"] if opt.communicator.rank == 0 else None


def _run(scenario, dist):
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = gpuops.dist.Communicator(timeout=60)
    mine = lambda s, m: _batch(s, m, rank)  # noqa: E731
    if scenario == "bits":
        cases = [(stage, dtype, bits, False) for stage in (1, 2, 3) for dtype in (torch.float32, torch.bfloat16)
                 for bits in (32, 8)]
        cases += [(stage, dtype, 32, True) for stage in (1, 2, 3) for dtype in (torch.float32, torch.bfloat16)]
        for stage, dtype, bits, in_backward in cases:
            runs = []
            for offload in (False, True):
                model = _model().to(dtype)
                opt = _zero(model, comm, stage, offload, in_backward, state_bits=bits)
                _train(model, opt, mine, range(STEPS), clip=0.5)
                runs.append((_full_params(model, opt, stage), _consolidated(opt)))
            what = (f"stage {stage}, {dtype}, {bits}-bit moments, reduced "
                    f"{'in the backward' if in_backward else 'at the step'}")
            if rank == 0 or stage != 3:  # (stage 3 gathers the full parameters on rank 0)
                assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0])), f"{what}: parameters"
            if rank == 0:
                _same_state(runs[1][1], runs[0][1], what)
            print(f"rank {rank}: {what}, {world} ranks: offloaded = not offloaded, bit for bit", flush=True)
        print("bits ok", flush=True)
    elif scenario == "memory":
        for stage in (3, 2):  # (stage 2's optimizer is the one whose timeline is read below)
            kept, states = {}, {}
            for offload in (False, True):
                model = _model()
                with gpuops.memory_budget() as budget:
                    opt = _zero(model, comm, stage, offload)
                    _train(model, opt, mine, range(3))
                    kept[offload] = budget.current_bytes
                states[offload] = opt.state_bytes()
            # Not offloaded, the device holds the moments, counters and the fp32 gradient shards; offloaded, none
            # (stage 3 keeps the parameters' shard there, what its units gather).
            drop = kept[False] - kept[True]
            assert drop >= states[False], (stage, kept, states)
            assert states[True] >= states[False]  # the host holds them (and an fp32 copy of each shard)
            print(f"rank {rank}: stage {stage}, device bytes kept {kept[False]} -> {kept[True]} offloaded (the "
                  f"state: {states[False]} bytes; host state offloaded {states[True]})", flush=True)
        events = opt.offload_timeline()
        buckets = {b for _, b, _, _ in events}
        assert len(buckets) >= 3, events  # bucket_bytes 8192: several buckets
        for b in buckets:
            when = {what: (begin, end) for what, k, begin, end in events if k == b}
            assert set(when) == {"gradient to host", "step", "parameters to device"}, when
            assert when["gradient to host"][1] <= when["step"][0] <= when["step"][1] <= when["parameters to device"][0]
        # Ranks that disagree on offload, or one whose host is short alone, make every rank raise, naming it.
        with pytest.raises(ValueError, match="offload"):
            _zero(_model(), comm, 2, rank == 0)
        import resource

        big = torch.nn.Linear(4096, 4096, bias=False)  # 2^24 elements: 128 MiB per rank offloaded at 2 ranks
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        if rank == 1:
            with open("/proc/self/status") as status:
                used = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmData:"))
            resource.setrlimit(resource.RLIMIT_DATA, (used + (64 << 20), hard))  # 64 MiB left on rank 1 only
        try:
            with pytest.raises(ValueError, match="needs about 0.125 GiB of host memory"):
                gpuops.ZeroOptimizer(big.parameters(), communicator=comm, offload="cpu")
        finally:
            resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        # Reducing in the backward: each bucket's gradient leaves during the backward of each micro-batch (the
        # second added to the first on the host), all before the first bucket steps.
        model = _model()
        opt = _zero(model, comm, 2, True, in_backward=True)
        _train(model, opt, mine, range(2))
        backward = opt.offload_timeline()
        first_step = min(begin for what, _, begin, _ in backward if what == "step")
        for b in buckets:
            moved = [(what, end) for what, k, _, end in backward if k == b and what != "step" and "device" not in what]
            assert sorted(w for w, _ in moved) == ["gradient added on host", "gradient to host"], moved
        launched = [end for what, _, _, end in backward if what == "gradient added on host"]
        assert max(launched) <= first_step, backward
        if rank == 0:
            for title, timeline in (("reduced at the step", events), ("reduced in the backward", backward)):
                print(f"rank 0: {title}:", flush=True)
                for what, b, begin, end in timeline:
                    print(f"  bucket {b}: {what} {1e3 * begin:.3f} .. {1e3 * end:.3f} ms", flush=True)
        print("memory ok", flush=True)
    elif scenario in ("save", "resume"):
        directory = os.environ["GPUOPS_TEST_DIR"]
        for offload in (False, True):  # saved offloaded or not; resumed the other way
            folder = f"{directory}/{'offloaded' if offload else 'device'}"
            model = _model()
            opt = _zero(model, comm, 2, offload if scenario == "save" else not offload)
            with gpuops.TrainingState(folder, process_group=dist.group.WORLD) as state:
                if scenario == "save":
                    _train(model, opt, mine, range(5), clip=0.5)
                    state.save(step=5, model=model, optimizer=opt)
                    consolidated = _consolidated(opt)
                    if rank == 0:
                        torch.save((consolidated, _params(model)), f"{folder}/expected.pt")
                    continue
                state.load(model=model, optimizer=opt)
            expected, params = torch.load(f"{folder}/expected.pt")
            assert all(torch.equal(a, b) for a, b in zip(_params(model), params))
            got = _consolidated(opt)
            if rank == 0:
                _same_state(got, expected, f"saved {'offloaded' if offload else 'on the device'}, resumed the other way")
            _train(model, opt, mine, range(5, 7), clip=0.5)  # and it trains on
        print(f"{scenario} ok", flush=True)
    elif scenario in ("sigterm", "after_sigterm"):
        directory = os.environ["GPUOPS_TEST_DIR"]
        model = _model()
        opt = _zero(model, comm, 2, scenario == "sigterm", in_backward=True)
        with gpuops.TrainingState(f"{directory}/run", process_group=dist.group.WORLD) as state:
            if scenario == "after_sigterm":
                loaded = state.load(model=model, optimizer=opt)
                assert loaded["step"] == 3, loaded["step"]
                expected, params = torch.load(f"{directory}/at_stop.pt")
                assert all(torch.equal(a, b) for a, b in zip(_params(model), params))
                got = _consolidated(opt)
                if rank == 0:
                    _same_state(got, expected, "resumed without offload after a SIGTERM")
                print(f"{scenario} ok", flush=True)
                return
            hook = None
            for step in range(1, 100):
                if step == 3 and rank == 1:  # the signal arrives while the backward sends the buckets
                    hook = model[0].weight.register_hook(lambda g: os.kill(os.getpid(), signal.SIGTERM))
                _train(model, opt, mine, range(step - 1, step))
                if hook is not None:
                    hook.remove()
                    hook = None
                if state.should_stop():  # agreed by every rank
                    state.save(step=step, model=model, optimizer=opt)
                    break
            assert step == 3, step
            consolidated = _consolidated(opt)
            if rank == 0:
                torch.save((consolidated, _params(model)), f"{directory}/at_stop.pt")
        print(f"{scenario} ok", flush=True)
    elif scenario == "killed":
        comm = gpuops.dist.Communicator(timeout=5)
        model = _model()
        opt = gpuops.ZeroOptimizer(model.parameters(), communicator=comm, stage=2, reduce_in_backward=True,
                                   bucket_bytes=8192, offload="cpu", lr=1e-2)
        _train(model, opt, mine, range(2))  # both ranks train: copies and host steps run
        if rank == 1:  # killed in the backward, after its first bucket was reduced and sent to the host
            hook = model[0].weight.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
        start = time.monotonic()
        try:
            _train(model, opt, mine, range(2, 4))
        except RuntimeError as error:
            elapsed = time.monotonic() - start
            print(f"rank {rank}: raised after {elapsed:.3f} s (timeout 5 s): {str(error)[:300]}", flush=True)
            assert elapsed < 5 + 5, elapsed
            os._exit(0)  # the group is broken: skip torch.distributed's teardown
        hook.remove()
        os._exit(1)
    elif scenario == "refused":
        model = _model()
        with pytest.raises(ValueError, match="offload must be None or 'cpu'"):
            gpuops.ZeroOptimizer(model.parameters(), communicator=comm, offload="nvme")
        with pytest.raises(TypeError, match="offload must be None or 'cpu'"):
            gpuops.ZeroOptimizer(model.parameters(), communicator=comm, offload=True)
        # Host memory short: refused at construction, naming what it needs and what is left, parameters unchanged.
        import resource

        big = torch.nn.Linear(4096, 4096, bias=False)  # 2^24 elements: 256 MiB offloaded (16 bytes each with AdamW)
        before = big.weight.detach().clone()
        with open("/proc/self/status") as status:
            used = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmData:"))
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        resource.setrlimit(resource.RLIMIT_DATA, (used + (128 << 20), hard))  # 128 MiB left under ulimit -d
        try:
            with pytest.raises(ValueError, match=r"offload='cpu' needs about 0.25 GiB of host memory on this rank .*"
                                                 r"but 0.1\d* GiB is left"):
                gpuops.ZeroOptimizer(big.parameters(), communicator=comm, offload="cpu")
            assert torch.equal(big.weight, before)
            _zero(_model(), comm, 1, True)  # a model that fits is taken
        finally:
            resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        print("refused ok", flush=True)


if __name__ == "__main__":
    run_gloo_rank(_run, sys.argv[1], timeout_s=60)
