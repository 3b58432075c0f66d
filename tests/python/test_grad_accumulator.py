"""gpuops.GradAccumulator: K micro-batches of unequal token counts equal one big batch (the mean over every
token of the window, not a mean of means), a short last window, clipping, and overflow skipping."""

import random

import pytest
import torch

import gpuops

IN, OUT = 12, 5


def model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(IN, 16), torch.nn.Tanh(), torch.nn.Linear(16, OUT))


def micro_batches(sizes):
    """Per micro-batch: inputs, targets and a token mask (unequal token counts, some tokens padded)."""
    g = torch.Generator().manual_seed(random.randint(0, 2**31))
    batches = []
    for n in sizes:
        x, y = torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)
        mask = torch.rand(n, OUT, generator=g) < 0.7
        mask[0, 0] = True
        batches.append((x, y, mask))
    return batches


def token_loss_sum(net, batch):
    x, y, mask = batch
    return ((net(x) - y).square() * mask).sum(), mask.sum()


def big_batch_step(net, optimizer, batches, max_norm=None):
    losses, counts = zip(*(token_loss_sum(net, b) for b in batches))
    (sum(losses) / sum(counts)).backward()  # the mean over every token of the window
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad()


OPTIMIZERS = {
    "gpuops-sgd": lambda p: gpuops.optim.SGD(p, lr=0.5),  # fused: 1/count rides on the step
    "torch-sgd": lambda p: torch.optim.SGD(p, lr=0.5),  # unfused: 1/count rides on the unscale pass
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_window_equals_one_big_batch_with_unequal_counts(name):
    batches = micro_batches([3, 7, 1, 5])
    ours, ref = model(), model()
    ours_opt, ref_opt = OPTIMIZERS[name](ours.parameters()), OPTIMIZERS[name](ref.parameters())
    accumulator = gpuops.GradAccumulator(ours_opt, window=4)
    stepped = [accumulator.backward(*token_loss_sum(ours, b)) for b in batches]
    assert stepped == [False, False, False, True]
    big_batch_step(ref, ref_opt, batches)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

    # The test can fail: a mean of per-micro-batch means moves the parameters elsewhere.
    wrong = model()
    wrong_opt = OPTIMIZERS[name](wrong.parameters())
    sum(loss / count for loss, count in (token_loss_sum(wrong, b) for b in batches)).div(4).backward()
    wrong_opt.step()
    assert max((a - w).abs().max().item() for a, w in zip(ours.parameters(), wrong.parameters())) > 1e-3


def test_a_short_last_window_is_normalised_by_its_own_count():
    batches = micro_batches([4, 2, 6, 3, 5])
    ours, ref = model(), model()
    ours_opt, ref_opt = gpuops.optim.SGD(ours.parameters(), lr=0.5), gpuops.optim.SGD(ref.parameters(), lr=0.5)
    accumulator = gpuops.GradAccumulator(ours_opt, window=3)
    for b in batches:
        accumulator.backward(*token_loss_sum(ours, b))
    assert accumulator.micro_batches == 2
    assert accumulator.flush() and not accumulator.flush()
    big_batch_step(ref, ref_opt, batches[:3])
    big_batch_step(ref, ref_opt, batches[3:])
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_clipping_applies_to_the_window_mean_gradient():
    batches = micro_batches([5, 2, 8])
    ours, ref = model(), model()
    ours_opt, ref_opt = gpuops.optim.SGD(ours.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    accumulator = gpuops.GradAccumulator(ours_opt, window=3, max_norm=0.05)
    for b in batches:
        accumulator.backward(*token_loss_sum(ours, b))
    big_batch_step(ref, ref_opt, batches, max_norm=0.05)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert accumulator.last_grad_norm.item() > 0.05  # the norm was above the limit: clipping happened


def test_with_a_scaler_an_overflow_anywhere_in_the_window_skips_its_step():
    net = model()
    opt = gpuops.optim.AdamW(net.parameters(), lr=1e-2)
    scaler = gpuops.GradScaler("cpu", init_scale=2.0**10)
    accumulator = gpuops.GradAccumulator(opt, window=3, scaler=scaler, on_boundary=lambda: calls.append(1))
    calls = []
    batches = micro_batches([2, 3, 4])
    before = [p.detach().clone() for p in net.parameters()]
    for i, b in enumerate(batches):
        loss, count = token_loss_sum(net, b)
        if i == 1:
            loss = loss * float("inf")  # an overflow in the middle of the window
        accumulator.backward(loss, count)
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before))
    assert scaler.skipped_steps == 1 and scaler.get_scale() == 2.0**9 and calls == [1]
    for b in batches:  # the next window steps
        accumulator.backward(*token_loss_sum(net, b))
    assert not all(torch.equal(p, q) for p, q in zip(net.parameters(), before))
    assert scaler.skipped_steps == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(window=0), "window"),
    (dict(window=2, max_norm=0.0), "max_norm"),
    (dict(window=2, scaler=torch.amp.GradScaler("cpu")), "scaler"),
])
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gpuops.GradAccumulator(gpuops.optim.SGD(model().parameters(), lr=0.1), **kwargs)


def test_a_non_positive_count_is_refused():
    net = model()
    accumulator = gpuops.GradAccumulator(gpuops.optim.SGD(net.parameters(), lr=0.1), window=2)
    loss, _ = token_loss_sum(net, micro_batches([2])[0])
    with pytest.raises(ValueError, match="count"):
        accumulator.backward(loss, 0)
    assert accumulator.micro_batches == 0
