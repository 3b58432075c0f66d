"""gpuops.estimate(module) on a module that is not a Hugging Face model: no architecture is read, so the answer
says so (an EstimateWarning, Breakdown.notes, the plot's title and labels) and counts only what it can: the
trainable floating-point parameters get gradients and states; frozen parameters, buffers and integer tensors are
held at their own size."""

import re
import warnings

import pytest

torch = pytest.importorskip("torch")

import gpuops  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.trained = torch.nn.Linear(64, 32)                      # 2,080 trainable
        self.frozen = torch.nn.Linear(32, 16).requires_grad_(False)  # 528 fp32 frozen: 2,112 bytes
        self.register_buffer("table", torch.zeros(100, dtype=torch.float16))  # 200 bytes
        self.register_buffer("codes", torch.zeros(300, dtype=torch.int8))     # 300 bytes (a quantised weight)


def estimate_quietly(*args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gpuops.EstimateWarning)
        return gpuops.estimate(*args, **kw)


def test_only_trainable_parameters_get_gradients_and_states():
    net = Net()
    b = estimate_quietly(net, precision="fp32", device="cpu")
    bare = gpuops.estimate(params=2080, precision="fp32", device="cpu")
    assert b.gradients == bare.gradients == 2080 * 4
    assert b.optimizer_states == bare.optimizer_states == 2080 * 8
    assert b.weights - bare.weights == 2112 + 200 + 300  # held as stored
    tied = torch.nn.Linear(10, 10)
    shared = torch.nn.Sequential(tied, tied)
    assert estimate_quietly(shared, precision="fp32", device="cpu").gradients == 110 * 4  # a shared tensor once


def test_the_answer_says_what_it_leaves_out():
    with pytest.warns(gpuops.EstimateWarning, match="activations and logits are not modelled.*Net"):
        b = gpuops.estimate(Net(), micro_batch=8, seq_len=512)
    assert b.activations == b.logits == 0
    assert len(b.notes) == 1 and "lower bound" in b.notes[0]
    assert gpuops.estimate("gpt2", device="cpu").notes == ()
    assert "not modelled" in gpuops.estimate(params="7B", device="cpu").notes[0]
    with pytest.warns(gpuops.EstimateWarning):
        rows = gpuops.fit_table(Net())
    assert all(r.max_micro_batch is None for r in rows)


def test_the_picture_names_the_module_and_does_not_claim_a_fit():
    with pytest.warns(gpuops.EstimateWarning):
        svg = gpuops.estimate_svg(Net())
    title = re.search(r'class="title"[^>]*>([^<]*)<', svg).group(1)
    assert title == "full fine-tune of Net: 2 080 trainable parameters (activations and logits not modelled)"
    assert ">fits<" not in svg and "activations unknown" in svg
    bare = gpuops.estimate_svg(params=1003000)
    assert "of 1 003 000 trainable parameters" in bare


def test_a_module_with_nothing_to_train_is_refused():
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ValueError, match="model: the Linear has no trainable"):
        gpuops.estimate(frozen)
    with pytest.raises(ValueError, match="model: the Module has no trainable"):
        gpuops.estimate(torch.nn.Module())
