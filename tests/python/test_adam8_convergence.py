"""8-bit moments train a small decoder as float32 ones do (issue 32): a 2-layer causal transformer on a synthetic
token stream (a fixed sparse bigram chain: the loss can fall from ln(128) to about ln(4)), 300 steps, 3 seeds
(each its own initialisation and data order), trained with torch's AdamW (float32 moments), ours with
state_bits=8 and torchao's AdamW8bit (the same block-wise method; requirements/peers.txt pins it into
.venv/peers, outside site-packages, so it runs in a process of its own with that folder on its path). The
8-bit runs' mean final loss must lie within the float32 runs' seed-to-seed spread of theirs: the criterion of
Dettmers et al. (8-bit optimizers match 32-bit ones within run-to-run noise)."""

import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

import gpuops

PEERS = os.path.join(sys.prefix, "peers")  # scripts/bootstrap's folder for requirements/peers.txt

V, D, HEADS, LAYERS, SEQ, BATCH, STEPS = 128, 64, 4, 2, 32, 16, 300
SEEDS = (11, 22, 33)
LR, WEIGHT_DECAY = 3e-3, 0.01


class Decoder(torch.nn.Module):
    """Token embedding (8192 values), 2 pre-norm causal layers (in-projection 12288, out-projection 4096, MLP
    2 x 16384: 8-bit moments), norms and biases (float32 moments), an untied head (8192)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(V, D)
        layer = torch.nn.TransformerEncoderLayer(D, HEADS, 4 * D, dropout=0.0, batch_first=True, norm_first=True)
        self.layers = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(D)
        self.head = torch.nn.Linear(D, V, bias=False)
        self.register_buffer("causal", torch.nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, tokens):
        return self.head(self.norm(self.layers(self.embed(tokens), mask=self.causal, is_causal=True)))


def _chain():
    """The bigram chain (the same for every seed): 4 successors per token with probabilities 0.4/0.3/0.2/0.1."""
    g = torch.Generator().manual_seed(0)
    successors = torch.stack([torch.randperm(V, generator=g)[:4] for _ in range(V)])
    return successors, torch.tensor([0.4, 0.3, 0.2, 0.1])


def _batches(seed, chain):
    successors, probs = chain
    g = torch.Generator().manual_seed(1000 + seed)
    for _ in range(STEPS):
        tokens = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, V, (BATCH,), generator=g)
        for t in range(SEQ):
            pick = torch.multinomial(probs, BATCH, replacement=True, generator=g)
            tokens[:, t + 1] = successors[tokens[:, t], pick]
        yield tokens[:, :-1], tokens[:, 1:]


def _final_loss(make_optimizer, seed, chain):
    torch.manual_seed(seed)
    model = Decoder()
    optimizer = make_optimizer(model.parameters())
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, STEPS)
    losses = []
    for x, y in _batches(seed, chain):
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], (losses[0], losses[-1])  # it learned the chain
    return statistics.mean(losses[-30:]), optimizer


def _torchao_finals():
    """torchao's AdamW8bit over the seeds, in a process with .venv/peers on its path (None: not installed)."""
    if not os.path.isdir(os.path.join(PEERS, "torchao")):
        return None
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PEERS, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, __file__, "torchao"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_8bit_states_end_within_the_seed_spread_of_float32():
    chain = _chain()
    stacks = {
        "torch AdamW (float32)": lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=WEIGHT_DECAY),
        "gpuops AdamW state_bits=8": lambda p: gpuops.optim.AdamW(p, lr=LR, weight_decay=WEIGHT_DECAY, state_bits=8),
    }
    finals = {}
    for name, make in stacks.items():
        finals[name] = []
        for seed in SEEDS:
            loss, optimizer = _final_loss(make, seed, chain)
            finals[name].append(loss)
        if name.startswith("gpuops"):  # the large tensors did keep 8-bit moments
            assert sum("exp_avg_codes" in s for s in optimizer.state.values()) == 4 * LAYERS + 2
    theirs = _torchao_finals()
    if theirs is None:
        print("torchao is not in .venv/peers (scripts/bootstrap installs it): its AdamW8bit is left out")
    else:
        finals["torchao AdamW8bit"] = theirs
    fp32 = finals["torch AdamW (float32)"]
    spread = max(fp32) - min(fp32)
    for name, values in finals.items():
        print(f"{name}: final losses {[round(v, 4) for v in values]}, mean {statistics.mean(values):.4f}")
    print(f"float32 seed-to-seed spread {spread:.4f}")
    for name in finals:
        gap = abs(statistics.mean(finals[name]) - statistics.mean(fp32))
        assert gap <= spread, f"{name}: mean final loss {gap:.4f} from float32's, beyond its seed spread {spread:.4f}"


if __name__ == "__main__":  # torchao's runs (its own process: see the docstring)
    from torchao.optim import AdamW8bit

    print(json.dumps([_final_loss(lambda p: AdamW8bit(p, lr=LR, weight_decay=WEIGHT_DECAY), seed, _chain())[0]
                      for seed in SEEDS]))
