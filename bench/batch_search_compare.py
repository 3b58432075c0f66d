"""Batch-size search against the peers, same model, same memory budget, same process:
gpuops.find_max_batch_size (profile-seeded and unseeded), Lightning's BatchSizeFinder (power and binsearch)
and Accelerate's find_executable_batch_size. Reports trials, wall time, the batch found, the true maximum
(checked independently: it runs, one more does not), and whether the found batch survives 20 further steps.

    .venv/bin/python -m pip install -r requirements/bench.txt   # lightning, accelerate
    .venv/bin/python bench/batch_search_compare.py

On the CPU the budget is a gpuops.memory_budget, whose OOM is torch.OutOfMemoryError. The peers recognise
OOM by matching message strings ("DefaultCPUAllocator: can't allocate memory", "CUDA ... out of memory"),
so their step re-raises it as the RuntimeError a real CPU OOM gives; nothing else is changed for them.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

import gpuops

PEER_OOM = "DefaultCPUAllocator: can't allocate memory: "  # what the peers' string matchers look for


class Gpt(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(256, 64)
        self.blocks = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True,
                                                                           norm_first=True) for _ in range(2))
        self.head = torch.nn.Linear(64, 256)

    def loss(self, b):
        tokens = torch.randint(0, 256, (b, 32))
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, src_mask=torch.nn.Transformer.generate_square_subsequent_mask(32), is_causal=True)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), tokens.roll(-1, 1).flatten())


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))

    def loss(self, b):
        return self.net(torch.randn(b, 128)).square().mean()


INDICES = torch.arange(1 << 16)  # Lightning's dataset, made outside every budget: only the model is measured
MODELS = {"gpt-2x64-seq32": (Gpt, 48 << 20), "mlp-128-512": (Mlp, 24 << 20)}


@contextlib.contextmanager
def as_peer_oom():
    """Re-raises our OOM as the RuntimeError text the peers match."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        raise RuntimeError(PEER_OOM + str(e)) from None


def fresh(model_cls):
    torch.manual_seed(0)
    model = model_cls()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer


def make_step(model, optimizer, log):
    def step(b):
        log.append(b)
        optimizer.zero_grad(set_to_none=True)
        model.loss(b).backward()
        optimizer.step()

    return step


def survives(step, b, steps=20) -> bool:
    try:
        for _ in range(steps):
            step(b)
        return True
    except torch.OutOfMemoryError:
        return False


def ours(model_cls, seed):
    model, optimizer = fresh(model_cls)
    log = []
    step = make_step(model, optimizer, log)
    result = gpuops.find_max_batch_size(step, seed=seed, restore=[model, optimizer])
    return result.max_batch, len(result.trials), step


def accelerate_finder(model_cls, start):
    from accelerate.utils import find_executable_batch_size

    model, optimizer = fresh(model_cls)
    log = []
    step = make_step(model, optimizer, log)
    trials = []

    @find_executable_batch_size(starting_batch_size=start)
    def trial(batch_size):
        trials.append(batch_size)
        with as_peer_oom():
            step(batch_size)
            step(batch_size)
        return batch_size

    return trial(), len(trials), step


def lightning_finder(model_cls, mode):
    import lightning.pytorch as pl
    from lightning.pytorch.tuner import Tuner

    inner, _ = fresh(model_cls)
    trials = []

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.inner = inner
            self.batch_size = 2

        def train_dataloader(self):
            return torch.utils.data.DataLoader(INDICES, batch_size=self.batch_size)

        def training_step(self, batch, _):
            b = batch.shape[0]
            if not trials or trials[-1] != b or self._new_trial:
                trials.append(b)
                self._new_trial = False
            with as_peer_oom():
                return self.inner.loss(b)

        def backward(self, loss, *args, **kwargs):
            with as_peer_oom():
                super().backward(loss, *args, **kwargs)

        def optimizer_step(self, *args, **kwargs):
            with as_peer_oom():
                super().optimizer_step(*args, **kwargs)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    module = Module()
    module._new_trial = True
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir="/tmp/gpuops-pl")
    found = Tuner(trainer).scale_batch_size(module, mode=mode, steps_per_trial=2, init_val=2, max_trials=25)
    optimizer = torch.optim.AdamW(inner.parameters(), lr=1e-4)
    return found, len(trials), make_step(inner, optimizer, [])


def true_maximum(model_cls, limit) -> int:
    """Checked the slow, sure way: the largest b whose two steps run, by bisection over single trials."""
    with gpuops.memory_budget(limit):  # the model made inside the budget, as every finder's is below
        model, optimizer = fresh(model_cls)
        step = make_step(model, optimizer, [])
        result = gpuops.find_max_batch_size(step, seed=None, restore=[model, optimizer])
        assert survives(step, result.max_batch, 2) and not survives(step, result.max_batch + 1, 2)
    return result.max_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args()
    finders = {
        "gpuops (profile seed)": lambda m: ours(m, "profile"),
        "gpuops (no seed)": lambda m: ours(m, None),
        "Lightning power": lambda m: lightning_finder(m, "power"),
        "Lightning binsearch": lambda m: lightning_finder(m, "binsearch"),
        "Accelerate (start 128)": lambda m: accelerate_finder(m, 128),
        "Accelerate (start 8192)": lambda m: accelerate_finder(m, 8192),
    }
    print("| model | budget | true max | finder | trials | seconds | found | survives 20 steps |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (model_cls, limit) in MODELS.items():
        truth = true_maximum(model_cls, limit)
        for finder, run in finders.items():
            with gpuops.memory_budget(limit):
                start = time.perf_counter()
                try:
                    found, trials, step = run(model_cls)
                except Exception as e:  # noqa: BLE001 - a peer failing is a result too
                    print(f"| {name} | {limit >> 20} MiB | {truth} | {finder} | - | - | failed: {type(e).__name__}: "
                          f"{str(e)[:60]} | - |")
                    continue
                seconds = time.perf_counter() - start
                ok = survives(step, found)
            print(f"| {name} | {limit >> 20} MiB | {truth} | {finder} | {trials} | {seconds:.2f} | {found} | "
                  f"{'yes' if ok else 'no (OOM)'} |", flush=True)


if __name__ == "__main__":
    main()
