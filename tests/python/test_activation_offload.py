"""Activation offload (issue 33, item 2: gpuops.offload_activations, the C++ store gpuops::ActivationOffloader):
the tensors autograd saves inside chosen layers wait in host memory from the forward to the backward and come
back during the backward, the next layer's prefetched. Gradients are the bits of the plain layers' (dropout
included: nothing is recomputed), alone and mixed with checkpointed layers, on a Hugging Face Llama stack too;
the device (a gpuops.memory_budget) keeps what the derivation says between forward and backward; the timeline
shows each layer's copies; an activation changed in place is refused; bad arguments are refused by name."""

import random

import pytest
import torch

import gpuops
from conftest import requires_cuda

WIDTH, BATCH, BLOCKS = 64, 96, 4


def _stack(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                                     torch.nn.Dropout(0.1), torch.nn.Linear(4 * WIDTH, WIDTH),
                                                     torch.nn.LayerNorm(WIDTH)) for _ in range(BLOCKS)])


def _grads(seed, setup, device="cpu"):
    blocks = _stack(seed).to(device)
    handle = setup(blocks)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(seed)).to(device).requires_grad_(True)
    torch.manual_seed(seed + 1)  # dropout's masks
    blocks(x).square().mean().backward()
    if handle is not None:
        assert handle.host_bytes == 0 and handle.device_bytes == 0  # every copy released with the graph
    return [x.grad] + [p.grad for p in blocks.parameters()]


def test_gradients_are_the_bits_of_plain_layers():
    seed = random.randint(0, 2**31)
    plain = _grads(seed, lambda blocks: None)
    for prefetch in (0, 1, 3):
        got = _grads(seed, lambda blocks: gpuops.offload_activations(blocks, prefetch=prefetch))
        assert all(torch.equal(a, b) for a, b in zip(got, plain)), prefetch

    def mixed(blocks):  # keep, offload, recompute, offload: one choice per layer
        gpuops.apply_checkpointing(blocks, names=[2])
        return gpuops.offload_activations(blocks, names=[1, 3])

    got = _grads(seed, mixed)
    assert all(torch.equal(a, b) for a, b in zip(got, plain))


def test_the_device_keeps_what_was_not_offloaded():
    kept, host = {}, 0
    for offload in (False, True):
        blocks = _stack(0)
        handle = gpuops.offload_activations(blocks) if offload else None
        x = torch.randn(BATCH, WIDTH, requires_grad=True)
        with gpuops.memory_budget() as budget:
            out = blocks(x)
            kept[offload] = budget.current_bytes - out.nbytes  # what the graph holds for the backward
            if offload:
                host = handle.host_bytes
            out.square().mean().backward()
    # Every saved tensor of the blocks went to the host; the device originals are freed but x (the caller's).
    print(f"bytes the graph keeps between forward and backward: {kept}; on the host: {host}")
    assert host > 0
    assert kept[False] - kept[True] >= host - x.nbytes, (kept, host)


def test_timeline_each_layer_to_host_then_back_with_prefetch():
    blocks = _stack(0)
    handle = gpuops.offload_activations(blocks, prefetch=1)
    blocks(torch.randn(BATCH, WIDTH, requires_grad=True)).sum().backward()
    events = handle.timeline()
    to_host = [e for e in events if e[0] == "to host"]
    back = [e for e in events if e[0] != "to host"]
    assert {e[1] for e in to_host} == set(range(BLOCKS))
    assert max(e[4] for e in to_host) <= min(e[3] for e in back)  # the forward's copies, then the backward's
    assert sorted((e[1], e[2]) for e in to_host) == sorted((e[1], e[2]) for e in back)  # each tensor back once
    # The last layer's backward comes first: its tensors on demand; every earlier layer's prefetched, in
    # reverse order, while the layer after it runs its backward.
    assert {e[1] for e in back if e[0] == "back on demand"} == {BLOCKS - 1}
    assert [e[1] for e in back if e[0] == "prefetch"] == sorted((e[1] for e in back if e[0] == "prefetch"),
                                                               reverse=True)
    without = gpuops.offload_activations(_stack(0), prefetch=0)
    assert without is not None
    blocks = _stack(0)
    handle = gpuops.offload_activations(blocks, prefetch=0)
    blocks(torch.randn(BATCH, WIDTH, requires_grad=True)).sum().backward()
    assert {e[0] for e in handle.timeline()} == {"to host", "back on demand"}


def test_the_same_tensor_saved_twice_is_copied_once():
    class Twice(torch.nn.Module):
        def forward(self, x):
            h = x.exp()
            return h * h.sin()  # h saved by mul and by sin

    layer = torch.nn.Sequential(Twice())
    handle = gpuops.offload_activations(layer, min_bytes=0)
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    y = layer(x)
    to_host = [e for e in handle.timeline() if e[0] == "to host"]
    expected_bytes = sum(e[2] for e in to_host)
    assert handle.host_bytes == expected_bytes
    y.sum().backward()
    ref = x.detach().clone().requires_grad_(True)
    h = ref.exp()
    (h * h.sin()).sum().backward()
    assert torch.equal(x.grad, ref.grad)


def test_retain_graph_backward_twice_and_a_dropped_graph_releases_the_host():
    blocks = _stack(1)
    handle = gpuops.offload_activations(blocks)
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    loss = blocks(x).square().mean()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    assert handle.host_bytes > 0  # the graph is kept: so are the copies
    x.grad = None
    loss.backward()
    assert torch.equal(x.grad, first)
    assert handle.host_bytes == 0
    loss = blocks(x).square().mean()
    assert handle.host_bytes > 0
    del loss  # dropped without a backward
    assert handle.host_bytes == 0 and handle.device_bytes == 0


def test_no_grad_and_remove():
    blocks = _stack(2).eval()  # (dropout off: the same output twice)
    handle = gpuops.offload_activations(blocks)
    x = torch.randn(BATCH, WIDTH)
    with torch.no_grad():
        before = blocks(x)
    assert handle.timeline() == [] and handle.host_bytes == 0
    handle.remove()
    assert all("_gpuops_offloaded" not in b.__dict__ for b in blocks)
    with torch.no_grad():
        assert torch.equal(blocks(x), before)


def test_an_activation_changed_in_place_after_the_forward_is_refused():
    class Saves(torch.nn.Module):
        def forward(self, x):
            self.h = x * 2
            return self.h.sin()  # h saved by sin

    layer = torch.nn.Sequential(Saves())
    gpuops.offload_activations(layer, min_bytes=0)
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    y = layer(x)
    with torch.no_grad():
        layer[0].h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_a_hugging_face_llama_stack_gives_the_same_gradients():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    seed = random.randint(0, 2**31)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(seed))
    grads = []
    for offload in (False, True):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)
        handle = gpuops.offload_activations(model.model.layers) if offload else None
        model(input_ids=ids, labels=ids).loss.backward()
        if handle is not None:
            assert any(e[0] == "prefetch" for e in handle.timeline())
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_bad_arguments_are_refused_by_name():
    blocks = _stack(0)
    with pytest.raises(ValueError, match="min_bytes must be >= 0, got -1"):
        gpuops.offload_activations(blocks, min_bytes=-1)
    with pytest.raises(ValueError, match=r"prefetch must be in \[0, 64\] layers, got 65"):
        gpuops.offload_activations(blocks, prefetch=65)
    with pytest.raises(ValueError, match=r"names \['9'\] are not layers"):
        gpuops.offload_activations(blocks, names=[9])
    with pytest.raises(TypeError, match="names must be a list"):
        gpuops.offload_activations(blocks, names="01")
    with pytest.raises(ValueError, match="layers must be an nn.ModuleList"):
        gpuops.offload_activations(torch.nn.Linear(2, 2))
    gpuops.apply_checkpointing(blocks, names=[0])
    with pytest.raises(ValueError, match="layer '0' is checkpointed"):
        gpuops.offload_activations(blocks)
    assert all("_gpuops_offloaded" not in b.__dict__ for b in blocks)  # nothing changed
    handle = gpuops.offload_activations(blocks, names=[1, 2])
    with pytest.raises(ValueError, match="layer '1' is offloaded already"):
        gpuops.offload_activations(blocks, names=[1])
    with pytest.raises(ValueError, match=r"layers \['2'\] offload their activations"):
        gpuops.apply_checkpointing(blocks, names=[2, 3])
    assert "_gpuops_forward" in blocks[0].__dict__ and "_gpuops_forward" not in blocks[3].__dict__  # unchanged
    handle.remove()
    store = gpuops._C.ActivationOffloader()
    with pytest.raises(ValueError, match="handle 7 is unknown or released"):
        store.unpack(7)
    with pytest.raises(ValueError, match="layer must be >= 0, got -2"):
        store.enter_layer(-2)


# ------------------------------------------------------------------------------------- the budget policy
def _held_between_forward_and_backward(blocks, x):
    with gpuops.memory_budget() as budget:
        out = blocks(x)
        held = budget.current_bytes - out.nbytes
        out.square().mean().backward()
    return held


def test_the_policy_keeps_offloads_or_recomputes_within_the_budget():
    seed = random.randint(0, 2**31)
    blocks = _stack(seed)
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    # The measurement counts x with the first layer's saved tensors; the budget here leaves it out (allocated
    # before): the policy's budgets are the held bytes plus x's.
    everything = _held_between_forward_and_backward(blocks, x) + x.nbytes
    sample = lambda: blocks(x).square().mean().backward()  # noqa: E731
    plan = gpuops.apply_activation_policy(blocks, everything, sample)
    assert set(plan.choices.values()) == {"keep"} and plan.offloaded is None  # it fits as it is
    budget = everything // 3
    plan = gpuops.apply_activation_policy(blocks, budget, sample)
    print(f"held {everything} bytes plainly; budget {budget}: {plan.choices}")
    assert set(plan.choices) == {str(i) for i in range(BLOCKS)}
    assert set(plan.choices.values()) - {"keep"}, plan.choices
    held = _held_between_forward_and_backward(blocks, x) + x.nbytes
    assert held <= budget, (held, budget, plan.choices)
    offloaded = [name for name, c in plan.choices.items() if c == "offload"]
    assert (plan.offloaded is None) == (not offloaded)
    if plan.offloaded is not None:
        assert plan.offloaded.names == offloaded
    recomputed = {name for name, b in blocks.named_children() if "_gpuops_forward" in b.__dict__}
    assert recomputed == {name for name, c in plan.choices.items() if c == "recompute"}
    # The gradients are the plain stack's (dropout replayed by the recomputation, kept by the offload).
    grads = []
    for policy in (False, True):
        torch.manual_seed(seed)
        model = _stack(seed)
        if policy:
            gpuops.apply_checkpointing(model, names=[n for n, c in plan.choices.items() if c == "recompute"])
            gpuops.offload_activations(model, names=offloaded)
        xx = x.detach().clone().requires_grad_(True)
        torch.manual_seed(seed + 1)
        model(xx).square().mean().backward()
        grads.append([xx.grad] + [p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_the_policy_without_a_way_to_fit_changes_nothing():
    blocks = _stack(0)
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    sample = lambda: blocks(x).square().mean().backward()  # noqa: E731
    gpuops.apply_checkpointing(blocks, names=[1])
    with pytest.raises(ValueError, match=r"budget_bytes 0 is below what checkpointing or offloading every layer "
                                         r"still holds; accepted: >= \d+"):
        gpuops.apply_activation_policy(blocks, 0, sample)
    assert ["_gpuops_forward" in b.__dict__ for b in blocks] == [False, True, False, False]  # as it was
    assert all("_gpuops_offloaded" not in b.__dict__ for b in blocks)
    # Offloading that copies nothing (every tensor under min_bytes) saves nothing: never chosen.
    plan = gpuops.apply_activation_policy(blocks, _held_between_forward_and_backward(_stack(0), x) // 2, sample,
                                          min_bytes=2**40)
    assert "offload" not in plan.choices.values() and "recompute" in plan.choices.values(), plan.choices
    plan = gpuops.apply_activation_policy(blocks, 10**12, sample, min_bytes=0)
    with pytest.raises(ValueError, match="budget_bytes must be an int >= 0"):
        gpuops.apply_activation_policy(blocks, -1, sample)
    with pytest.raises(ValueError, match="sample must be a callable"):
        gpuops.apply_activation_policy(blocks, 100, None)
    with pytest.raises(ValueError, match="prefetch must be in"):
        gpuops.apply_activation_policy(blocks, 100, sample, prefetch=-1)
    gpuops.offload_activations(blocks, names=[0])
    with pytest.raises(ValueError, match=r"layers \['0'\] are offloaded already"):
        gpuops.apply_activation_policy(blocks, 100, sample)


@requires_cuda
def test_cuda_side_stream_copies_give_the_plain_bits_and_free_the_device():
    """Beside a GPU: pinned copies on a side stream, events between the streams; the gradients are the plain
    stack's bits (dropout's masks drawn alike), and between forward and backward the device holds only what
    was not offloaded."""
    seed = random.randint(0, 2**31)
    plain = _grads(seed, lambda blocks: None, "cuda")
    got = _grads(seed, lambda blocks: gpuops.offload_activations(blocks, prefetch=2), "cuda")
    assert all(torch.equal(a, b) for a, b in zip(got, plain))
    kept = {}
    for offload in (False, True):
        blocks = _stack(0).cuda()
        handle = gpuops.offload_activations(blocks) if offload else None
        x = torch.randn(BATCH, WIDTH, device="cuda", requires_grad=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = blocks(x)
        torch.cuda.synchronize()
        kept[offload] = torch.cuda.memory_allocated() - before - out.nbytes
        host = handle.host_bytes if offload else 0
        out.square().mean().backward()
        if offload:
            assert {e[0] for e in handle.timeline()} == {"to host", "back on demand", "prefetch"}
    print(f"CUDA: bytes kept between forward and backward {kept}; on the host {host}")
    assert kept[False] - kept[True] >= host - x.nbytes, (kept, host)
