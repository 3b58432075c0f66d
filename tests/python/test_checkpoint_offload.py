"""Offloaded checkpointing (issue 33, activation offload's first form: gpuops.checkpoint(..., offload=True), C++
CheckpointOptions::offload_inputs): the inputs a checkpointed segment keeps wait in host memory, outside the
device's budget, and come back for its recomputation. Gradients are the bits of plain checkpointing and of no
checkpointing; the device keeps none of the stack's boundary activations between forward and backward,
measured under gpuops.memory_budget; an input changed in place after the forward is still caught."""

import random

import pytest
import torch

import gpuops

WIDTH, BATCH, BLOCKS = 256, 64, 6


def _stack(seed):
    torch.manual_seed(seed)
    return torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Dropout(0.1))
                               for _ in range(BLOCKS))


def _forward(blocks, x, mode):
    for block in blocks:
        x = block(x) if mode == "plain" else gpuops.checkpoint(block, x, use_reentrant=True, offload=mode == "offload")
    return x


def test_gradients_are_the_bits_of_plain_checkpointing():
    seed = random.randint(0, 2**31)
    grads = {}
    for mode in ("plain", "checkpoint", "offload"):
        blocks = _stack(seed)
        x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        torch.manual_seed(seed + 1)  # dropout's masks: replayed in the recomputation
        _forward(blocks, x, mode).square().mean().backward()
        grads[mode] = [x.grad] + [p.grad for p in blocks.parameters()]
    for mode in ("checkpoint", "offload"):
        assert all(torch.equal(a, b) for a, b in zip(grads[mode], grads["plain"])), mode


def test_the_device_keeps_no_boundary_activation():
    kept = {}
    for mode in ("checkpoint", "offload"):
        blocks = _stack(0)
        x = torch.randn(BATCH, WIDTH, requires_grad=True)
        with gpuops.memory_budget() as budget:
            out = _forward(blocks, x, mode)
            kept[mode] = budget.current_bytes - out.nbytes  # what the graph holds for the backward
            out.square().mean().backward()
    boundary = (BLOCKS - 1) * BATCH * WIDTH * 4  # every block's input but the first (the caller's x)
    print(f"bytes the graph keeps between forward and backward: {kept} (boundary activations {boundary})")
    assert kept["checkpoint"] - kept["offload"] >= boundary, kept
    assert kept["offload"] < boundary // (BLOCKS - 1), kept


def test_an_input_changed_in_place_after_the_forward_is_refused():
    block = _stack(0)[0]
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    h = x * 2
    out = gpuops.checkpoint(block, h, use_reentrant=True, offload=True)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_bad_arguments_are_named():
    block = _stack(0)[0]
    x = torch.randn(2, WIDTH, requires_grad=True)
    with pytest.raises(TypeError, match="offload must be True or False"):
        gpuops.checkpoint(block, x, use_reentrant=True, offload="yes")
    with pytest.raises(ValueError, match="use use_reentrant=True with it"):
        gpuops.checkpoint(block, x, use_reentrant=False, offload=True)


def test_apply_checkpointing_offloads_every_chosen_layer():
    """apply_checkpointing(every=1, offload=True): the gradients of no checkpointing, bit for bit, and the graph
    keeps what gpuops.checkpoint(offload=True) keeps; a layer whose inputs need no grad is refused, named."""
    seed = random.randint(0, 2**31)
    grads, kept = {}, {}
    for offload in (None, False, True):
        blocks = _stack(seed)
        if offload is not None:
            assert gpuops.apply_checkpointing(blocks, every=1, offload=offload) == [str(i) for i in range(BLOCKS)]
        x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        torch.manual_seed(seed + 1)
        with gpuops.memory_budget() as budget:
            out = _forward(blocks, x, "plain")
            kept[offload] = budget.current_bytes - out.nbytes
            out.square().mean().backward()
        grads[offload] = [x.grad] + [p.grad for p in blocks.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[None]))
    assert kept[True] < kept[False] < kept[None], kept
    with pytest.raises(ValueError, match="no tensor argument of this layer requires grad"):
        _forward(blocks, torch.randn(2, WIDTH), "plain")
    with pytest.raises(TypeError, match="offload must be True or False"):
        gpuops.apply_checkpointing(blocks, every=1, offload=1)
