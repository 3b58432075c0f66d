"""gpuops.checkpoint / apply_checkpointing: gradients identical to a plain run (dropout on), the activation
peak of a 12-layer transformer under gpuops.memory_budget, and the budget policy's choice."""

import pytest
import torch

import gpuops

LAYERS, WIDTH, BATCH, SEQ = 12, 64, 4, 64


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(WIDTH, 4, dim_feedforward=4 * WIDTH, dropout=0.1, batch_first=True)
            for _ in range(LAYERS))
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


def data():
    return torch.randn(BATCH, SEQ, WIDTH, generator=torch.Generator().manual_seed(1))


def grads_of(model, seed=7):
    torch.manual_seed(seed)  # the dropout masks
    model.zero_grad()
    model(data()).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_gradients_with_checkpointing_equal_the_plain_ones_bitwise():
    model = Stack()
    plain = grads_of(model)
    assert gpuops.apply_checkpointing(model.layers, every=1) == [str(i) for i in range(LAYERS)]
    checkpointed = grads_of(model)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))
    # and the comparison has teeth: another dropout draw gives other gradients
    assert not all(torch.equal(a, b) for a, b in zip(plain, grads_of(model, seed=8)))


def saved_after_forward(model):
    """Bytes the forward leaves alive for the backward (what checkpointing trades), and the step's peak."""
    x = data()
    with gpuops.memory_budget() as mb:
        loss = model(x)
        kept = mb.current_bytes
        loss.backward()
        peak = mb.peak_bytes
    model.zero_grad(set_to_none=True)
    return kept, peak


def test_full_checkpointing_cuts_the_activation_peak_by_60_percent():
    model = Stack()
    for p in model.parameters():  # gradients exist before measuring, so both runs count them alike
        p.grad = torch.zeros_like(p)
    _, plain_peak = saved_after_forward(model)
    gpuops.apply_checkpointing(model.layers, every=1)
    _, ckpt_peak = saved_after_forward(model)
    assert ckpt_peak <= 0.4 * plain_peak, (ckpt_peak, plain_peak)


def test_the_budget_policy_fits_its_budget_and_recomputes_less_than_everything():
    model = Stack()
    costs = gpuops.checkpointing.measure_layers(model.layers, lambda: model(data()).backward())
    assert all(c.saved_bytes > c.checkpointed_bytes > 0 and c.forward_seconds > 0 for c in costs)
    total = sum(c.saved_bytes for c in costs)
    budget = total // 2
    plain_kept, _ = saved_after_forward(model)
    chosen = gpuops.apply_checkpointing(model.layers, budget_bytes=budget, sample=lambda: model(data()).backward())
    assert 0 < len(chosen) < LAYERS  # not everything: less recomputation than full checkpointing
    chosen_kept, _ = saved_after_forward(model)
    # measured independently of the policy's arithmetic: the forward now keeps at least (total - budget)
    # bytes less, so the layers' activations fit in the budget
    assert plain_kept - chosen_kept >= total - budget
    by_name = {c.name: c for c in costs}
    assert sum(by_name[n].forward_seconds for n in chosen) < sum(c.forward_seconds for c in costs)
    gpuops.remove_checkpointing(model.layers)
    assert saved_after_forward(model)[0] == plain_kept


def test_a_budget_below_the_layer_inputs_is_refused_naming_the_floor():
    costs = [gpuops.checkpointing.LayerCost(str(i), 1000, 100, 1.0) for i in range(4)]
    with pytest.raises(ValueError, match="budget_bytes 50 .* accepted: >= 400"):
        gpuops.checkpointing.choose_for_budget(costs, 50)
    assert gpuops.checkpointing.choose_for_budget(costs, 4000) == []
    assert len(gpuops.checkpointing.choose_for_budget(costs, 2500)) == 2  # 4000 - 2500 = 1500: two layers


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "exactly one policy"),
    (dict(every=0), "every"),
    (dict(names=["3", "x"]), "names"),
    (dict(budget_bytes=10), "sample"),
])
def test_bad_policies_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gpuops.apply_checkpointing(Stack().layers, **kwargs)
