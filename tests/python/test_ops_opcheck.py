"""Custom-op hygiene of every torch.ops.gpuops operator: torch.library.opcheck (schema, autograd registration,
fake tensors, AOT dispatch) on random inputs of each dtype an op takes, and honest autograd: the tensors an op
writes get their version bumped (as torch's in-place ops do), so autograd notices a saved tensor overwritten."""

import random

import pytest
import torch

import gpuops

from conftest import DEVICES


def _generator():
    return torch.Generator().manual_seed(random.randint(0, 2**31))


SHAPES = [(4, 3), (7,), (2, 2, 5)]


def _adam_cases(device, g):
    """(op, args) for the fused Adam steps: float32 params, and 16-bit params on fp32 masters."""
    cases = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for amsgrad, amp, lr_tensor in ((False, True, False), (True, False, True)):
            params = [torch.randn(s, generator=g).to(device, dtype) for s in SHAPES]
            grads = [torch.randn(s, generator=g).to(device, dtype) for s in SHAPES]
            state = [[torch.rand(s, generator=g).to(device) for s in SHAPES] for _ in range(3)]
            steps = [torch.tensor(float(random.randint(0, 5)), device=device) for _ in SHAPES]
            options = (1e-2, 0.9, 0.999, 1e-8, 1e-2, random.random() < 0.5, amsgrad, random.random() < 0.5,
                       torch.tensor([4.0], device=device) if amp else None,
                       torch.zeros(1, device=device) if amp else None,
                       torch.tensor([1e-3], device=device) if lr_tensor else None)
            lists = (state[0], state[1], state[2] if amsgrad else [], steps)
            if dtype == torch.float32:
                cases.append((torch.ops.gpuops.adam_step_, (params, grads, *lists, *options)))
            else:
                masters = [p.float() for p in params]
                cases.append((torch.ops.gpuops.adam_step_master_, (params, grads, masters, *lists, *options)))
    return cases


def _sgd_cases(device, g):
    cases = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for momentum in (0.0, 0.9):
            params = [torch.randn(s, generator=g).to(device, dtype) for s in SHAPES]
            grads = [torch.randn(s, generator=g).to(device, dtype) for s in SHAPES]
            buffers = [torch.randn(s, generator=g).to(device) for s in SHAPES] if momentum else []
            steps = [torch.tensor(float(random.randint(0, 5)), device=device) for _ in SHAPES]
            nesterov = momentum > 0 and random.random() < 0.5  # needs zero dampening
            options = (1e-2, momentum, 0.0 if nesterov else 0.1, 1e-4, nesterov, random.random() < 0.5,
                       torch.tensor([8.0], device=device), torch.zeros(1, device=device), None)
            if dtype == torch.float32:
                cases.append((torch.ops.gpuops.sgd_step_, (params, grads, buffers, steps, *options)))
            else:
                masters = [p.float() for p in params]
                cases.append((torch.ops.gpuops.sgd_step_master_, (params, grads, masters, buffers, steps, *options)))
    return cases


def _adam8_cases(device, g):
    """The 8-bit step (float32 and 16-bit parameters) and its quantisation ops: sizes across a block boundary."""
    cases, shapes = [], [(300,), (4, 65)]
    blocks = [-(-torch.Size(s).numel() // 256) for s in shapes]
    for dtype in (torch.float32, torch.bfloat16):
        params = [torch.randn(s, generator=g).to(device, dtype) for s in shapes]
        grads = [torch.randn(s, generator=g).to(device, dtype) for s in shapes]
        codes = [[torch.randint(0, 256, s, generator=g, dtype=torch.uint8).to(device) for s in shapes]
                 for _ in range(2)]
        scales = [[torch.rand(b, generator=g).to(device) for b in blocks] for _ in range(2)]
        steps = [torch.tensor(float(random.randint(0, 5)), device=device) for _ in shapes]
        masters = [p.float() for p in params] if dtype != torch.float32 else []
        cases.append((torch.ops.gpuops.adam8_step_,
                      (params, grads, masters, codes[0], scales[0], codes[1], scales[1], steps, 1e-2, 0.9, 0.999,
                       1e-8, 1e-2, True, random.random() < 0.5, torch.tensor([4.0], device=device),
                       torch.zeros(1, device=device), None)))
    values = torch.randn(300, generator=g).to(device)
    cases.append((torch.ops.gpuops.quantize_state_, (values, torch.empty(300, dtype=torch.uint8, device=device),
                                                     torch.empty(2, device=device), True)))
    cases.append((torch.ops.gpuops.dequantize_state, (codes[0][0], scales[0][0], False)))
    return cases


def _amp_cases(device, g):
    cases = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        grads = [torch.randn(s, generator=g).to(device, dtype) for s in SHAPES]
        inv_scale = torch.tensor([random.choice([0.25, 1.0, 1 / 1024])], device=device)
        cases.append((torch.ops.gpuops.unscale_and_check_, (grads, torch.zeros(1, device=device), inv_scale)))
        cases.append((torch.ops.gpuops.unscaled_grad_norm_, ([t.clone() for t in grads], inv_scale,
                                                             torch.zeros(1, device=device))))
    for found in (0.0, 1.0):
        cases.append((torch.ops.gpuops.update_scale_,
                      (torch.tensor([1024.0], device=device), torch.tensor([1], dtype=torch.int32, device=device),
                       torch.tensor([2], dtype=torch.int32, device=device), torch.tensor([found], device=device),
                       2.0, 0.5, 2, 2, 1.0, 65536.0)))
    return cases


def _cases(device):
    g = _generator()
    return _adam_cases(device, g) + _adam8_cases(device, g) + _sgd_cases(device, g) + _amp_cases(device, g)


def _registered_ops():
    return {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("gpuops::")}


def test_every_registered_op_has_cases():
    """A new op in the gpuops namespace must be added here (and get its fake and autograd kernels)."""
    assert {op._qualified_op_name.split("::")[1] for op, _ in _cases("cpu")} == _registered_ops()


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_passes_for_every_op(device):
    for op, args in _cases(device):
        torch.library.opcheck(op, args)  # raises on the first failing test, naming it


def _written_tensors(op, args):
    """The tensors in the op's Tensor(a!) arguments, and the others, by the schema."""
    written, read = [], []
    for argument, value in zip(op.default._schema.arguments, args):
        values = value if isinstance(value, (list, tuple)) else [value]
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        is_write = argument.alias_info is not None and argument.alias_info.is_write
        (written if is_write else read).extend(tensors)
    return written, read


@pytest.mark.parametrize("device", DEVICES)
def test_each_op_bumps_the_version_of_exactly_the_tensors_it_writes(device):
    for op, args in _cases(device):
        written, read = _written_tensors(op, args)
        before = [t._version for t in written], [t._version for t in read]
        op(*args)
        assert [t._version for t in written] == [v + 1 for v in before[0]], op
        assert [t._version for t in read] == before[1], op


def test_autograd_notices_a_parameter_the_step_overwrote():
    """As with torch's optimizers: a backward that needs a parameter written by a step since raises, instead of
    silently using the new values."""
    param = torch.nn.Parameter(torch.randn(5))
    optimizer = gpuops.optim.AdamW([param], lr=0.1)
    param.grad = torch.randn(5)
    saved = (param * param).sum()  # saves param for its backward
    optimizer.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()


def test_writing_a_tensor_that_requires_grad_with_grad_mode_on_is_refused_and_changes_nothing():
    param = torch.nn.Parameter(torch.randn(6))
    before = param.detach().clone()
    args = ([param], [torch.randn(6)], [torch.zeros(6)], [torch.zeros(6)], [], [torch.tensor(0.0)], 0.1, 0.9, 0.999,
            1e-8, 0.0, True, False, False, None, None)
    with pytest.raises(RuntimeError, match=r"params\[0\] is a leaf Variable that requires grad"):
        torch.ops.gpuops.adam_step_(*args)
    assert torch.equal(param, before) and param._version == 0
    with torch.no_grad():
        torch.ops.gpuops.adam_step_(*args)
    assert not torch.equal(param, before)


@pytest.mark.parametrize("make", [lambda p: gpuops.optim.AdamW(p, lr=1e-2),
                                  lambda p: gpuops.optim.SGD(p, lr=1e-2, momentum=0.9)], ids=["adamw", "sgd"])
def test_the_steady_state_master_step_reads_nothing_back(make, monkeypatch):
    """Our step bumps the 16-bit parameter's version; the optimizer records the version after its own write, so
    the next step does not take it for a foreign write (which compares the master with the parameter: a host
    read on a GPU)."""
    param = torch.nn.Parameter(torch.randn(16, generator=_generator()).bfloat16())
    optimizer = make([param])
    compared = []
    real_equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: compared.append(1) or real_equal(a, b))
    for _ in range(3):
        param.grad = torch.randn(16).bfloat16()
        optimizer.step()
    assert compared == []
    with torch.no_grad():
        param.add_(1.0)  # a foreign write is still noticed
    param.grad = torch.randn(16).bfloat16()
    optimizer.step()
    assert compared == [1]
