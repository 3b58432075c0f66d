"""PyTorch's own reentrant-checkpoint tests, carried over to gpuops.checkpoint (the C++ engine).

Origin, restated in our own words: TestCheckpoint of PyTorch's test/test_utils.py (the ``use_reentrant=True``
cases of test_checkpoint_trigger, test_checkpoint_valid, test_checkpoint, test_checkpoint_module_list,
test_checkpoint_rng_cpu/cuda, test_checkpoint_non_tensor, test_checkpoint_non_tensor_inputs_outputs,
test_checkpoint_no_tensors, test_checkpoint_partial_grad) and the reentrant checkpoint tests of
test/test_autograd.py (test_checkpointing, test_checkpoint_valid_reset_on_error,
test_checkpointing_without_reentrant_detached_tensor_use_reentrant_True). torch.utils.checkpoint with
use_reentrant=True is the reference where behaviour is compared; what gpuops does beyond it (module buffers
protected by themselves) is tested against an un-checkpointed run.
"""

import random
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import gpuops

from conftest import DEVICES


def seeded():
    seed = random.randint(0, 2**31 - 1)
    torch.manual_seed(seed)
    return seed


def checkpoint_chunks(modules, chunks, x):
    """torch's checkpoint_sequential over gpuops.checkpoint: every chunk but the last runs checkpointed."""
    modules = list(modules)
    size = (len(modules) + chunks - 1) // chunks
    groups = [modules[i:i + size] for i in range(0, len(modules), size)]

    def run(group):
        def forward(h):
            for m in group:
                h = m(h)
            return h
        return forward

    for group in groups[:-1]:
        x = gpuops.checkpoint(run(group), x)
    return run(groups[-1])(x)


def mlp():
    return nn.Sequential(nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 20), nn.ReLU(), nn.Linear(20, 5), nn.ReLU())


# ------------------------------------------------------------------------------------------ test_utils.py
def test_each_checkpointed_segment_runs_again_in_the_backward_once():
    """test_checkpoint_trigger: 10 modules in 2 chunks; all run once forward, the checkpointed first half
    once more in the backward."""
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x * torch.tensor(2.0)

    modules = [Counting() for _ in range(10)]
    out = checkpoint_chunks(modules, 2, torch.randn(3, 4, requires_grad=True))
    assert [m.calls for m in modules] == [1] * 10
    out.sum().backward()
    assert [m.calls for m in modules] == [2] * 5 + [1] * 5


def test_autograd_grad_with_inputs_is_refused():
    """test_checkpoint_valid: the reentrant design cannot serve torch.autograd.grad(..., inputs): a RuntimeError
    with torch's words, saying to call backward() instead."""
    x = torch.randn(1, 100, requires_grad=True)
    out = checkpoint_chunks(list(mlp().children()), 2, x)
    with pytest.raises(RuntimeError, match="torch.utils.checkpoint is incompatible"):
        torch.autograd.grad(out, [x], grad_outputs=[torch.ones(1, 5)], create_graph=True)


@pytest.mark.parametrize("as_module_list", [False, True])
def test_chunked_checkpointing_gives_the_plain_outputs_and_gradients(as_module_list):
    """test_checkpoint / test_checkpoint_module_list."""
    seeded()
    model = mlp()
    modules = nn.ModuleList(model.children()) if as_module_list else list(model.children())
    x = torch.randn(4, 100, requires_grad=True)
    out = model(x)
    out.sum().backward()
    plain = [out.detach(), x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    x2 = x.detach().requires_grad_()
    out2 = checkpoint_chunks(modules, 2, x2)
    out2.sum().backward()
    ours = [out2.detach(), x2.grad] + [p.grad for p in model.parameters()]
    for a, b in zip(plain, ours):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_is_replayed_in_the_recomputation(device):
    """test_checkpoint_rng_cpu / test_checkpoint_rng_cuda."""
    for _ in range(3):
        seeded()
        x = torch.randn(20000, device=device).requires_grad_()
        phase1, phase2 = nn.Dropout(), nn.Dropout()
        state = torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state()
        gpuops.checkpoint(phase2, phase1(x)).sum().backward()
        with_checkpoint = x.grad
        (torch.set_rng_state if device == "cpu" else torch.cuda.set_rng_state)(state)
        x.grad = None
        phase2(phase1(x)).sum().backward()
        assert torch.equal(with_checkpoint, x.grad)


def test_a_none_argument_passes_through():
    """test_checkpoint_non_tensor."""
    def fn(a, b):
        return a if b is None else a + b

    x = torch.randn(1, 100, requires_grad=True)
    gpuops.checkpoint(fn, x, None).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_non_tensor_arguments_and_outputs_and_an_input_returned_as_is():
    """test_checkpoint_non_tensor_inputs_outputs: non-tensor outputs come back as they are, tensor outputs
    (an input returned as is among them) carry gradients that match the plain run, and a second backward
    through a used segment raises as torch's does."""
    def foo(t1, t2, scale, t3):
        t4 = (t1 + t2 * t3) * scale
        t5 = (t1 * t2 + t3) * scale
        return scale, t4, None, True, t5, "bar", t1

    t1, t2, t3 = torch.rand(10, requires_grad=True), torch.rand(10, requires_grad=True), torch.rand(10)
    scale = random.randint(1, 10)
    res = gpuops.checkpoint(foo, t1, t2, scale, t3)
    assert isinstance(res, tuple) and len(res) == 7
    assert (res[0], res[2], res[3], res[5]) == (scale, None, True, "bar")
    torch.testing.assert_close(res[1], (t1 + t2 * t3) * scale)
    torch.testing.assert_close(res[4], (t1 * t2 + t3) * scale)
    assert torch.equal(res[6], t1) and t1.grad_fn is None and t1.is_leaf  # the caller's tensor is untouched
    res[1].sum().backward(retain_graph=True)
    res[4].sum().backward(retain_graph=True)
    res[6].sum().backward()
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        res[6].sum().backward()
    grads = (t1.grad, t2.grad)
    t1.grad = t2.grad = None
    plain = foo(t1, t2, scale, t3)
    torch.autograd.backward([plain[1].sum(), plain[4].sum(), plain[6].sum()])
    assert torch.allclose(t1.grad, grads[0]) and torch.allclose(t2.grad, grads[1])


def test_no_tensor_arguments_at_all():
    """test_checkpoint_no_tensors: plain numbers in, numbers out (with torch's warning)."""
    def foo(t1, t2, scale, t3):
        return scale, (t1 + t2 * t3) * scale, None, True, (t1 * t2 + t3) * scale, "bar", t1

    args = (random.random(), random.random(), random.randint(0, 10), random.random())
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        res = gpuops.checkpoint(foo, *args)
    assert res == foo(*args)


def test_partial_grads_and_an_output_that_needs_none():
    """test_checkpoint_partial_grad: an output not needing grad beside one that does is fine; a segment whose
    only output needs no grad is marked as needing one (the forward ran without grad, as torch's) and its
    backward raises torch's error."""
    a, b = torch.randn(1, 4, requires_grad=True), torch.randn(1, 4)
    out = gpuops.checkpoint(lambda x, y: (x, y), a, b)
    out[0].sum().backward()
    assert torch.equal(a.grad, torch.ones_like(a))

    a, b = torch.randn(1, 4), torch.randn(1, 4, requires_grad=True)
    for ckpt in (gpuops.checkpoint, lambda *args: torch_checkpoint(*args, use_reentrant=True)):
        out = ckpt(lambda x, y: x, a, b)
        assert out.requires_grad  # as torch's
        with pytest.raises(RuntimeError, match=r"none of output has requires_grad=True, this checkpoint\(\) is not"):
            out.sum().backward()
    assert a.grad_fn is None and not a.requires_grad  # the returned input was copied, not rewired


# --------------------------------------------------------------------------------------- test_autograd.py
def test_many_small_checkpointed_segments_sum_to_the_plain_gradients():
    """test_checkpointing (fewer segments), with the gradients compared to the plain run."""
    seeded()
    module = nn.Sequential(nn.Linear(10, 200), nn.ReLU(), nn.Linear(200, 10))
    data = [torch.rand(1, 10, requires_grad=True) for _ in range(200)]
    torch.stack([gpuops.checkpoint(module, d) for d in data]).mean().backward()
    ours = [d.grad for d in data] + [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    plain_data = [d.detach().requires_grad_() for d in data]
    torch.stack([module(d) for d in plain_data]).mean().backward()
    plain = [d.grad for d in plain_data] + [p.grad for p in module.parameters()]
    for a, b in zip(ours, plain):
        torch.testing.assert_close(a, b)


def test_the_grad_refusal_leaves_checkpointing_usable():
    """test_checkpoint_valid_reset_on_error."""
    a = torch.randn(2, 2, requires_grad=True)
    with pytest.raises(Exception, match="torch.utils.checkpoint is incompatible"):  # torch's test's match
        torch.autograd.grad(gpuops.checkpoint(torch.exp, a, use_reentrant=True).sum(), (a,))
    gpuops.checkpoint(torch.exp, a).sum().backward()
    torch.testing.assert_close(a.grad, a.exp())


def test_a_segment_computed_without_grad_raises_in_every_backward():
    """test_checkpointing_without_reentrant_detached_tensor_use_reentrant_True: a module whose forward runs
    under no_grad, its output then added to in place; every backward raises torch's error."""
    class NoGrad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin1, self.lin2 = nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False)

        def forward(self, x):
            with torch.no_grad():
                return self.lin2(self.lin1(x))

    module, a = NoGrad(), torch.randn(2, 2, requires_grad=True)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="none of output has requires_grad=True"):
            out = gpuops.checkpoint(module, a)
            out += a
            out.sum().backward()


def test_no_input_requiring_grad_warns_and_gives_outputs_that_need_none():
    """torch's check_backward_validity: a warning, the segment runs without grad, the parameters inside get
    no gradient (it was a ValueError here). Same as torch's reentrant checkpoint, side by side."""
    seeded()
    layer = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    results = []
    for ckpt in (gpuops.checkpoint, lambda *args: torch_checkpoint(*args, use_reentrant=True)):
        with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
            out = ckpt(layer, x)
        results.append(out)
        assert not out.requires_grad and out.grad_fn is None
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], layer(x).detach())
    assert layer.weight.grad is None
    with warnings.catch_warnings():  # with grad off there is nothing to warn about
        warnings.simplefilter("error")
        with torch.no_grad():
            gpuops.checkpoint(layer, x, use_reentrant=True)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_is_replayed_in_the_recomputation(device):
    """The reentrant checkpoint restores the forward's autocast state for the recomputation."""
    seeded()
    layer = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 8)).to(device)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    dtype = torch.bfloat16
    with torch.autocast(device_type=device, dtype=dtype):
        out = gpuops.checkpoint(layer, x)
    assert out.dtype == dtype
    out.float().sum().backward()
    ours = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    x.grad = None
    with torch.autocast(device_type=device, dtype=dtype):
        plain = layer(x)
    plain.float().sum().backward()
    for a, b in zip(ours, [x.grad] + [p.grad for p in layer.parameters()]):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------- beyond torch
def batchnorm_net():
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4), nn.BatchNorm1d(4))


@pytest.mark.parametrize("how", ["module", "bound_method", "listed_too"])
def test_module_buffers_are_updated_once_without_being_listed(how):
    """gpuops.checkpoint(module, x) (or module.forward) protects the module's buffers by itself: BatchNorm's
    running statistics and num_batches_tracked after forward + backward equal an un-checkpointed run's, and
    so do the gradients. Torch's reentrant checkpoint updates them twice (shown alongside)."""
    seeded()
    plain, ours, theirs = batchnorm_net(), batchnorm_net(), batchnorm_net()
    ours.load_state_dict(plain.state_dict())
    theirs.load_state_dict(plain.state_dict())
    for step in range(2):
        x = torch.randn(16, 6) * 3 + 1
        xp, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
        plain(xp).square().sum().backward()
        fn = ours if how != "bound_method" else ours.forward
        buffers = [ours[1].running_mean] if how == "listed_too" else ()
        gpuops.checkpoint(fn, xo, buffers=buffers).square().sum().backward()
        torch_checkpoint(theirs, x.clone().requires_grad_(), use_reentrant=True).square().sum().backward()
        for name, buffer in plain.named_buffers():
            assert torch.equal(buffer, dict(ours.named_buffers())[name]), name
        assert torch.equal(xp.grad, xo.grad)
        for a, b in zip(plain.parameters(), ours.parameters()):
            torch.testing.assert_close(a.grad, b.grad)
    assert ours[1].num_batches_tracked.item() == 2
    assert theirs[1].num_batches_tracked.item() == 4  # torch's: counted in the forward and the recomputation
