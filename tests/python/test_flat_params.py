"""gpuops.FlatParams from Python: training through the flat buffers equals training without (our fused AdamW
and torch's), one clip over the flat gradient equals torch's over the parameters, errors leave things alone."""

import pytest
import torch

import gpuops

from conftest import DEVICES


def model(device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.GELU(), torch.nn.Linear(17, 5)).to(device)


@pytest.mark.parametrize("make_optimizer", [lambda p: gpuops.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
                                            lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)])
@pytest.mark.parametrize("device", DEVICES)
def test_training_through_flat_buffers_is_bit_identical(make_optimizer, device):
    plain, flattened = model(device), model(device)
    flat = gpuops.FlatParams(list(flattened.parameters()), world_size=2)
    plain_opt, flat_opt = make_optimizer(plain.parameters()), make_optimizer(flattened.parameters())
    for _ in range(5):
        x = torch.randn(8, 9, device=device)
        plain_opt.zero_grad()
        flat_opt.zero_grad(set_to_none=False)  # keeps the gradient aliases
        plain(x).square().mean().backward()
        flattened(x).square().mean().backward()
        assert flat.intact()
        plain_opt.step()
        flat_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), flattened.parameters()))
    bucket = flat.buckets[0]
    assert bucket.data.numel() % (2 * 4) == 0
    assert sum(gpuops.FlatParams.shard(bucket.grad, r, 2).numel() for r in range(2)) == bucket.grad.numel()


def test_one_clip_over_the_flat_gradient_equals_torch_over_the_parameters():
    plain, flattened = model(), model()
    flat = gpuops.FlatParams(list(flattened.parameters()))
    x = torch.randn(8, 9)
    plain(x).sum().backward()
    flattened(x).sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
    bucket = flat.buckets[0]
    holder = torch.nn.Parameter(bucket.data)  # one tensor whose .grad is the whole flat gradient
    holder.grad = bucket.grad
    norm = gpuops.clip_grad_norm_([holder], 0.5)
    torch.testing.assert_close(norm, expected)
    for a, b in zip(plain.parameters(), flattened.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_bad_input_is_refused_and_nothing_changes():
    w = torch.randn(3, 3, requires_grad=True)
    before = w.data_ptr()
    with pytest.raises(ValueError, match="given twice"):
        gpuops.FlatParams([w, w])
    with pytest.raises(ValueError, match="leaf tensor that requires grad"):
        gpuops.FlatParams([w, w * 2])
    with pytest.raises(ValueError, match="alignment_bytes must be a power of two"):
        gpuops.FlatParams([w], alignment_bytes=12)
    assert w.data_ptr() == before


@pytest.mark.parametrize("device", DEVICES)
def test_an_optimizer_over_the_flat_parameters_steps_once_per_buffer_and_matches(device):
    plain, flattened = model(device), model(device)
    flat = gpuops.FlatParams(list(flattened.parameters()))
    whole = flat.flat_parameters()
    assert len(whole) == 1 and whole[0].is_leaf and whole[0].grad is not None
    plain_opt = gpuops.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    flat_opt = gpuops.optim.AdamW(whole, lr=1e-2, weight_decay=0.1)  # its state is one flat buffer too
    for _ in range(5):
        x = torch.randn(8, 9, device=device)
        plain_opt.zero_grad()
        flat.zero_grad()
        plain(x).square().mean().backward()
        flattened(x).square().mean().backward()
        plain_opt.step()
        flat_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), flattened.parameters()))
    state = flat_opt.state[whole[0]]
    assert state["exp_avg"].shape == whole[0].shape
    padding = torch.ones_like(flat.buckets[0].data, dtype=torch.bool)
    for _, offset, numel in flat.buckets[0].slots:
        padding[offset:offset + numel] = False
    assert torch.count_nonzero(flat.buckets[0].data[padding]) == 0  # padding stays zero


@pytest.mark.parametrize("bad_grad", [lambda: torch.randn(3, 2), lambda: torch.randn(2, 3, dtype=torch.float64)])
def test_a_wrong_gradient_is_refused_before_any_parameter_moves(bad_grad):
    q, p = torch.randn(6, requires_grad=True), torch.randn(2, 3, requires_grad=True)
    q.grad, q_values, p_values = torch.randn(6), q.detach().clone(), p.detach().clone()
    p.grad = torch.zeros(2, 3)
    p.grad.data = bad_grad()  # torch refuses the assignment itself; .data goes around it, as careless code can
    where = (q.data_ptr(), q.grad.data_ptr(), p.data_ptr())
    with pytest.raises(ValueError, match=r"params\[1\]\.grad must be a dense tensor of the parameter's shape"):
        gpuops.FlatParams([q, p])
    assert (q.data_ptr(), q.grad.data_ptr(), p.data_ptr()) == where
    assert torch.equal(q, q_values) and torch.equal(p, p_values)


@pytest.mark.parametrize("kwargs, match", [(dict(alignment_bytes=2**40), r"alignment_bytes must be a power of two in \[1, 4096\]"),
                                           (dict(alignment_bytes=8192), r"in \[1, 4096\], got 8192"),
                                           (dict(world_size=2**40), r"world_size must be in \[1, 1048576\]"),
                                           (dict(world_size=2**63 - 1), "world_size must be in")])
def test_a_huge_alignment_or_world_size_is_a_clear_error(kwargs, match):
    a = torch.randn(5, requires_grad=True)
    where = a.data_ptr()
    with pytest.raises(ValueError, match=match):
        gpuops.FlatParams([a], **kwargs)
    assert a.data_ptr() == where
