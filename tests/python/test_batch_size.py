"""gpuops.find_max_batch_size and profile_memory on the CPU under memory_budget: the true maximum (checked
independently: b runs, b + 1 raises OOM), memory back to its baseline, trial counts, OOM in backward and in
the optimizer step, errors, several Gloo ranks with different budgets, the cache."""

import math
import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gpuops


class Mlp(torch.nn.Module):
    def __init__(self, width=64, inner=256):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, inner), torch.nn.GELU(), torch.nn.Linear(inner, width))
        self.width = width

    def batch(self, b):
        return torch.randn(b, self.width)


class TinyGpt(torch.nn.Module):
    """A GPT-2-style stack (pre-norm blocks, causal attention) over 16-token sequences."""

    def __init__(self, width=32, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(50, width)
        self.net = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(width, 2, 4 * width, dropout=0.0,
                                                                        batch_first=True, norm_first=True)
                                       for _ in range(layers))
        self.head = torch.nn.Linear(width, 50)

    def batch(self, b):
        return torch.randint(0, 50, (b, 16))

    def forward(self, tokens):
        h = self.embed(tokens)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for layer in self.net:
            h = layer(h, src_mask=mask, is_causal=True)
        return self.head(h)


def trainer(model):
    optimizer = gpuops.optim.AdamW(model.parameters(), lr=1e-3)

    def step(b):
        optimizer.zero_grad(set_to_none=True)
        out = model.net(model.batch(b)) if isinstance(model, Mlp) else model(model.batch(b))
        out.float().square().mean().backward()
        optimizer.step()

    return optimizer, step


def runs(step, b) -> bool:
    try:
        step(b)
        step(b)
        return True
    except torch.OutOfMemoryError:
        return False


@pytest.mark.parametrize("make_model, limit", [(Mlp, 3 << 20), (Mlp, 9 << 20), (TinyGpt, 6 << 20), (TinyGpt, 16 << 20)])
@pytest.mark.parametrize("seed", ["profile", None])
def test_finds_the_true_maximum_and_leaves_memory_as_found(make_model, limit, seed):
    torch.manual_seed(0)
    model = make_model()
    optimizer, step = trainer(model)
    step(1)  # optimizer state exists, as in a resumed run
    optimizer.zero_grad(set_to_none=True)
    with gpuops.memory_budget(limit) as budget:
        before = budget.current_bytes
        result = gpuops.find_max_batch_size(step, seed=seed, restore=[model, optimizer])
        assert budget.current_bytes == before  # restore= drops the last trial's gradients too
        b = result.max_batch
        if seed == "profile":
            assert len(result.trials) <= 6, result.trials
        else:
            assert len(result.trials) <= 2 * math.ceil(math.log2(b)) + 2, result.trials
        assert runs(step, b), b
        optimizer.zero_grad(set_to_none=True)
        assert not runs(step, b + 1), b
        optimizer.zero_grad(set_to_none=True)


class BigBackward(torch.autograd.Function):
    """Identity whose backward allocates per_sample bytes for each sample (as an attention backward might)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        scratch = torch.empty(grad.shape[0], 64 * 1024, dtype=torch.uint8)  # 64 KiB per sample
        scratch.fill_(1)
        return grad + scratch[:, :1].float() * 0


class ScratchSgd(torch.optim.SGD):
    """SGD whose step allocates a scratch buffer growing with the batch it was last given."""

    batch = 1

    def step(self, closure=None):
        scratch = torch.empty(self.batch, 96 * 1024, dtype=torch.uint8)
        scratch.fill_(0)
        return super().step(closure)


@pytest.mark.parametrize("where", ["backward", "optimizer"])
def test_oom_inside_backward_or_the_optimizer_step_is_handled(where):
    layer = torch.nn.Linear(8, 8)
    optimizer = ScratchSgd(layer.parameters(), lr=0.1)

    def step(b):
        optimizer.zero_grad()
        x = torch.randn(b, 8, requires_grad=True)  # so that the backward runs through BigBackward
        y = layer(BigBackward.apply(x) if where == "backward" else x)
        y.sum().backward()
        optimizer.batch = b if where == "optimizer" else 1
        optimizer.step()

    with gpuops.memory_budget(4 << 20):
        result = gpuops.find_max_batch_size(step, seed=None)
        assert any(not t.ok for t in result.trials)
        per_sample = 64 * 1024 if where == "backward" else 96 * 1024
        assert result.max_batch <= (4 << 20) // per_sample
        assert runs(step, result.max_batch) and not runs(step, result.max_batch + 1)


def test_other_errors_propagate_and_the_smallest_batch_failing_is_explained():
    def buggy(b):
        if b >= 4:
            raise KeyError(f"bug at batch {b}")
        torch.ones(b)

    with pytest.raises(KeyError, match="bug at batch 4"):
        gpuops.find_max_batch_size(buggy, seed=None)
    model = Mlp()
    _, step = trainer(model)
    with gpuops.memory_budget(1 << 12):
        with pytest.raises(torch.OutOfMemoryError, match="even the smallest batch, 1"):
            gpuops.find_max_batch_size(step)
    with pytest.raises(ValueError, match="margin must be in"):
        gpuops.find_max_batch_size(step, margin=1.5)
    with pytest.raises(ValueError, match="seed must be"):
        gpuops.find_max_batch_size(step, seed="guess")


def test_margin_multiple_of_validation_and_cache(tmp_path):
    model = Mlp()
    optimizer, step = trainer(model)
    validated = []
    with gpuops.memory_budget(3 << 20):
        key = gpuops.batch_size.cache_key(model=model, dtype=torch.float32, sequence_length=0)
        result = gpuops.find_max_batch_size(step, multiple_of=8, margin=0.1, validate=validated.append,
                                            cache_file=tmp_path / "batch.json", cache_key=key,
                                            restore=[model, optimizer])
        assert result.max_batch % 8 == 0 and result.recommended % 8 == 0
        assert result.recommended <= 0.9 * result.max_batch < result.recommended + 8
        assert validated and all(b % 8 == 0 for b in validated)
        again = gpuops.find_max_batch_size(step, multiple_of=8, cache_file=tmp_path / "batch.json", cache_key=key)
        assert again.from_cache and again.max_batch == result.max_batch and not again.trials
        # A maximum over multiples of 8 says nothing exact about multiples of 1: searched again, not reused.
        with pytest.warns(UserWarning, match="multiple_of 8, which does not divide 1"):
            finer = gpuops.find_max_batch_size(step, cache_file=tmp_path / "batch.json", cache_key=key,
                                               restore=[model, optimizer])
        assert not finer.from_cache and result.max_batch <= finer.max_batch < result.max_batch + 8


def test_profile_memory_predicts_and_reports_non_linear_memory():
    model = Mlp()
    optimizer, step = trainer(model)
    step(1)
    profile = gpuops.profile_memory(step, batch_sizes=(64, 128, 256))
    assert profile.linear, profile.note
    with gpuops.memory_budget() as counter:
        step(192)
        step(192)
    assert abs(profile.predict(192) - counter.peak_bytes) <= 0.05 * counter.peak_bytes
    with pytest.warns(UserWarning, match="not linear"):
        bent = gpuops.profile_memory(step, batch_sizes=(1, 2, 128))
    assert not bent.linear


def _rank_search(rank, world, port, limits, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Mlp()
    optimizer, step = trainer(model)
    with gpuops.memory_budget(limits[rank]):
        found = gpuops.find_max_batch_size(step, process_group=dist.group.WORLD, restore=[model, optimizer])
        optimizer.zero_grad(set_to_none=True)
        alone = gpuops.find_max_batch_size(step, restore=[model, optimizer])  # this rank's own maximum
    results[rank] = (found.max_batch, alone.max_batch, len(found.trials))
    dist.destroy_process_group()


def test_ranks_with_different_budgets_agree_on_the_minimum():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    limits = [3 << 20, 2 << 20, 5 << 20]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_search, args=(3, port, limits, results), nprocs=3, join=True)
        found = [results[r] for r in range(3)]
    agreed = {f[0] for f in found}
    assert len(agreed) == 1, found
    assert agreed.pop() == min(f[1] for f in found)  # the smallest rank's own maximum
    assert found[1][1] < found[0][1] < found[2][1]


def test_a_seed_from_the_analytic_estimator_or_a_profile_finds_the_same_maximum():
    model = Mlp()
    optimizer, step = trainer(model)
    with gpuops.memory_budget(3 << 20):
        truth = gpuops.find_max_batch_size(step, seed=None, restore=[model, optimizer]).max_batch
        # A rough analytic breakdown (the estimator's categories, made up here): only the start changes.
        rough = gpuops.Breakdown(weights=80_000, gradients=80_000, master_weights=0, optimizer_states=160_000,
                                 activations=8 * 2_000, logits=0, temporaries=8 * 1_000, cuda_context=0,
                                 allocator_slack=0)
        profile = gpuops.batch_size.analytic_profile(rough, micro_batch=8)
        assert profile.per_sample_bytes == 3_000 and profile.fixed_bytes == 320_000
        seeded = gpuops.find_max_batch_size(step, seed=profile, restore=[model, optimizer])
        assert seeded.max_batch == truth
        with pytest.raises(ValueError, match="micro_batch"):
            gpuops.batch_size.analytic_profile(rough, micro_batch=0)


@pytest.mark.parametrize("seed", ["profile", None, 10])
def test_a_step_that_never_runs_out_of_memory_ends_with_a_clear_error(seed):
    calls = []
    with pytest.raises(ValueError, match="does not grow with its batch argument.*high="):
        gpuops.find_max_batch_size(calls.append, seed=seed)
    assert len(calls) <= 2 * 70  # bounded by the host's memory: log2 of it, two steps each
    with gpuops.memory_budget(180 << 20), pytest.raises(ValueError, match="does not grow"):
        gpuops.find_max_batch_size(lambda b: None, seed=seed)
    assert gpuops.find_max_batch_size(lambda b: None, seed=seed, high=1000).max_batch == 1000
    tried = []
    gpuops.find_max_batch_size(tried.append, seed=seed, low=2, high=3)
    assert max(tried) == 3


def test_restore_under_a_tight_budget_puts_everything_back_and_keeps_the_search_error():
    torch.manual_seed(0)
    model = Mlp()
    optimizer, step = trainer(model)
    step(1)
    optimizer.zero_grad(set_to_none=True)
    weights = [p.detach().clone() for p in model.parameters()]
    moments = {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state_dict()["state"][0].items()}

    def trains_then_runs_out(b):
        step(b)  # the weights and the optimizer state move, then the step runs out of memory
        torch.empty(1 << 30, dtype=torch.uint8)

    with gpuops.memory_budget(300_000) as budget:  # less than the snapshot of the model and its optimizer
        before = budget.current_bytes
        with pytest.raises(torch.OutOfMemoryError, match="even the smallest batch"):
            gpuops.find_max_batch_size(trains_then_runs_out, restore=[model, optimizer])
        assert budget.current_bytes == before
    assert all(torch.equal(p, w) and p.grad is None for p, w in zip(model.parameters(), weights))
    state = optimizer.state_dict()["state"][0]
    assert all(torch.equal(state[k], v) if torch.is_tensor(v) else state[k] == v for k, v in moments.items())


def test_bad_arguments_name_themselves():
    for kwargs, match in [(dict(high=2.5), "high must be an int"), (dict(low="1"), "low must be an int"),
                          (dict(multiple_of=2**70), "multiple_of must be an int"), (dict(seed=True), "seed must be"),
                          (dict(margin="0.1"), "margin must be a number"), (dict(max_trials=-1), "max_trials")]:
        with pytest.raises(ValueError, match=match):
            gpuops.find_max_batch_size(lambda b: None, **kwargs)


def test_a_cache_that_is_a_folder_or_holds_bad_entries(tmp_path):
    folder = tmp_path / "cache.json"
    folder.mkdir()
    calls = []
    with pytest.raises(ValueError, match="cache_file must be a regular file.*directory"):
        gpuops.find_max_batch_size(calls.append, cache_file=folder, cache_key="k", high=64)
    assert not calls and [p.name for p in tmp_path.iterdir()] == ["cache.json"]  # no trial, no temporary file
    model = Mlp()
    optimizer, step = trainer(model)
    cache = tmp_path / "batch.json"
    with gpuops.memory_budget(3 << 20):
        truth = gpuops.find_max_batch_size(step, restore=[model, optimizer]).max_batch
        for bad in ['{"k": {"max_batch": "many", "multiple_of": 1}}', '{"k": {"max_batch": -5, "multiple_of": 1}}',
                    '{"k": 7}', '[1, 2]']:
            cache.write_text(bad)
            with pytest.warns(UserWarning, match="cache"):
                result = gpuops.find_max_batch_size(step, cache_file=cache, cache_key="k", restore=[model, optimizer])
            assert not result.from_cache and result.max_batch == truth
            again = gpuops.find_max_batch_size(step, cache_file=cache, cache_key="k")
            assert again.from_cache and again.max_batch == truth


def test_without_a_budget_on_the_cpu_the_search_is_bounded_said_aloud_and_logged(capfd):
    chunk = 1 << 26  # 64 MiB a sample, allocated and never touched: only the budget's count grows
    limit = gpuops._C.default_search_limit("cpu")
    available = gpuops.device_info().free_memory_bytes if gpuops.device_info().type == "cpu" else None
    if available is not None:
        assert 0.8 * available < limit <= 0.95 * available
    with gpuops.memory_budget(1 << 30):
        assert gpuops._C.default_search_limit("cpu") == -1  # an active budget is the bound
    capfd.readouterr()
    with pytest.warns(UserWarning, match=r"no memory budget is active on the CPU.*GiB.*memory_budget"):
        found = gpuops.find_max_batch_size(lambda b: torch.empty(b * chunk, dtype=torch.uint8), seed=None)
    # Whatever MemAvailable said at the search's start, its 90% bounds the batch (it moves a little meanwhile).
    assert abs(found.max_batch - limit // chunk) <= max(2, limit // chunk // 20)
    log = capfd.readouterr().err.splitlines()
    trial_lines = [line for line in log if line.startswith("find_max_batch_size: batch ")]
    assert len(trial_lines) == len(found.trials)
    assert any("out of memory" in line for line in trial_lines) and any("runs, peak" in line for line in trial_lines)
    with gpuops.memory_budget(10 * chunk):  # a budget given: no warning, and verbose=False logs nothing
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            quiet = gpuops.find_max_batch_size(lambda b: torch.empty(b * chunk, dtype=torch.uint8), verbose=False)
    assert quiet.max_batch in (9, 10) and "find_max_batch_size: batch" not in capfd.readouterr().err
    with pytest.raises(ValueError, match="verbose must be True or False"):
        gpuops.find_max_batch_size(lambda b: None, verbose=1)
