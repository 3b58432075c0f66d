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


def grads_through_the_engine(model, seed, **options):
    """Gradients with every layer run through gpuops.checkpoint (the C++ engine), input requiring grad."""
    torch.manual_seed(seed)
    model.zero_grad()
    x = data().requires_grad_()
    h = x
    for layer in model.layers:
        h = gpuops.checkpoint(layer, h, **options)
    model.head(h).sum().backward()
    return [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]


def test_the_cpp_engine_gives_the_plain_gradients_bitwise():
    model = Stack()
    torch.manual_seed(7)
    model.zero_grad()
    x = data().requires_grad_()
    model(x).backward()
    plain = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(plain, grads_through_the_engine(model, 7)))
    # without replaying the RNG the recomputed dropout masks differ
    assert not all(torch.equal(a, b) for a, b in zip(plain, grads_through_the_engine(model, 7, preserve_rng_state=False)))


def test_the_cpp_engine_passes_non_tensors_returns_tuples_and_explains_its_limits():
    w = torch.randn(5, 5, requires_grad=True)
    a, b = torch.randn(3, 5, requires_grad=True), torch.randn(3, 5)

    def segment(x, y, scale, *, shift):
        h = x @ w * scale + shift
        return h.tanh(), (h * y).sum()

    outs = gpuops.checkpoint(segment, a, b, 0.5, shift=1.0)
    assert isinstance(outs, tuple) and len(outs) == 2
    (outs[0].sum() + outs[1]).backward()
    a2, w2 = a.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    h = a2 @ w2 * 0.5 + 1.0
    (h.tanh().sum() + (h * b).sum()).backward()
    assert torch.allclose(a.grad, a2.grad) and torch.allclose(w.grad, w2.grad)

    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):  # as torch's
        assert not gpuops.checkpoint(segment, b, b, 1.0, shift=0.0)[0].requires_grad
    out = gpuops.checkpoint(lambda x: x @ w, a).sum()
    with pytest.raises(RuntimeError, match="cannot reach into a checkpointed segment"):
        torch.autograd.grad(out, [a])
    assert gpuops.checkpoint(lambda x: 3, a) == 3  # non-tensor outputs pass through, as torch's


def test_the_cpp_engine_updates_batchnorm_statistics_once():
    plain, ckpt = torch.nn.BatchNorm1d(6), torch.nn.BatchNorm1d(6)
    x = torch.randn(16, 6) * 2 + 1
    plain(x.clone().requires_grad_()).sum().backward()
    gpuops.checkpoint(ckpt, x.clone().requires_grad_(), buffers=list(ckpt.buffers())).sum().backward()
    assert torch.allclose(plain.running_mean, ckpt.running_mean) and ckpt.num_batches_tracked.item() == 1


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


def test_a_segment_failing_in_its_recomputation_leaves_the_rng_state_and_buffers_as_they_were():
    calls = []
    buffer = torch.zeros(3)

    def segment(x):
        buffer.add_(1)
        calls.append(1)
        noisy = torch.nn.functional.dropout(x, 0.5)  # consumes the generator
        if len(calls) == 2:
            raise RuntimeError("the segment fails in its recomputation")
        return noisy * 2

    torch.manual_seed(3)
    out = gpuops.checkpoint(segment, torch.randn(4, 5, requires_grad=True), buffers=[buffer]).sum()
    torch.randn(7)  # the caller's generator moves on after the forward
    state, buffer_before = torch.get_rng_state(), buffer.clone()
    with pytest.raises(RuntimeError, match="fails in its recomputation"):
        out.backward()
    assert len(calls) == 2
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(buffer, buffer_before)


def test_without_use_reentrant_it_warns_as_torchs_checkpoint_does():
    x = torch.randn(3, requires_grad=True)
    with pytest.warns(UserWarning, match="pass use_reentrant explicitly"):
        out = gpuops.checkpoint(torch.sin, x)
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.cos(x.detach()))
    with pytest.raises(TypeError, match="use_reentrant must be True or False"):
        gpuops.checkpoint(torch.sin, x, use_reentrant="yes")


def test_a_hugging_face_model_with_its_default_kv_cache_trains_checkpointed():
    """transformers' models keep a key/value cache in training while config.use_cache is True (their default);
    a checkpointed layer's recomputation then failed with torch's CheckpointError. apply_checkpointing turns the
    cache off with a warning, as transformers' gradient_checkpointing_enable() does: the gradients then equal
    the plain model's."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(config).train()
    ours = transformers.LlamaForCausalLM(config).train()
    ours.load_state_dict(plain.state_dict())
    assert ours.config.use_cache is True
    with pytest.warns(UserWarning, match="use_cache was True"):
        gpuops.apply_checkpointing(ours.model.layers, every=1)
    assert ours.config.use_cache is False
    ids = torch.randint(0, 97, (2, 16))
    plain.config.use_cache = False  # the reference needs no cache either
    plain(ids, labels=ids).loss.backward()
    ours(ids, labels=ids).loss.backward()
    for (name, p), q in zip(plain.named_parameters(), ours.parameters()):
        assert torch.equal(p.grad, q.grad), name
