"""loss="no-upcast": cross_entropy on the 16-bit logits, outside autocast (LitGPT's and Thunder's loss), against the
measured CPU peak of two training steps of a pure-bf16 Hugging Face Llama whose loss is Hugging Face's own
(ForCausalLMLoss: labels padded and shifted, mean over tokens) without its `logits.float()`. The upcast estimate
("standard") overstates that run by the fp32 log-softmax and its fp32 gradients; the no-upcast estimate matches
it to the same 0.01% as the held-logits check."""

import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "estimator_validation"))
import validate  # noqa: E402
from measure import make_config, measure_peak, model_factory_for, optimizer_factory_for  # noqa: E402

import gpuops  # noqa: E402


def loss_without_upcast(logits, input_ids):
    """transformers' ForCausalLMLoss with its `logits = logits.float()` left out."""
    labels = torch.nn.functional.pad(input_ids, (0, 1), value=-100)[..., 1:].contiguous()
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)


def test_no_upcast_saves_and_grows_in_the_logits_dtype():
    """The op itself: cross_entropy on bf16 logits saves a bf16 log-softmax and the int64 labels, and its backward
    makes bf16 gradients (the estimator's loss term with 2-byte logits)."""
    n, v = 96, 2000
    logits = torch.randn(n, v, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = torch.nn.functional.cross_entropy(logits, labels)
    # The bf16 log-softmax, the labels and a scalar: nothing in fp32 (that would be n * v * 4 more).
    assert n * v * 2 + n * 8 <= sum(saved.values()) <= n * v * 2 + n * 8 + 64
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["llama-gqa-untied", "llama-tied"])
def test_no_upcast_matches_the_measured_peak(name):
    kind, cfg = validate.MODELS[name]
    config = make_config(kind, cfg, "sdpa").to_dict()
    batch, seq = 2, 64
    measured = measure_peak(model_factory_for(kind, cfg, "sdpa"), optimizer_factory_for("adamw"), batch, seq, "bf16",
                            meter="gpuops", loss_fn=loss_without_upcast)
    est = {loss: gpuops.estimate(config=config, precision="bf16", micro_batch=batch, seq_len=seq, device="cpu",
                                 loss=loss) for loss in ("no-upcast", "standard")}
    peak = measured["peak"]
    assert abs(est["no-upcast"].total_bytes - peak) <= 1e-4 * peak, (est["no-upcast"].total_bytes, peak)
    assert est["standard"].total_bytes > peak  # the upcast model overstates this run
    assert est["standard"].total_bytes - est["no-upcast"].total_bytes >= batch * seq * cfg["V"] * 2


def test_loss_names_round_trip_and_bad_ones_are_refused():
    import json

    for name in ("no-upcast", "chunked-no-upcast:8"):
        code, out, err = gpuops._C.run_cli(["estimate", "--model", "llama-3.2-1b", "--precision", "bf16", "--loss",
                                            name, "--json"])
        assert code == 0, err
        assert json.loads(out)["runs"][0]["setup"]["loss"] == name
    for bad in ("no-upcast:2", "chunked-no-upcast:0", "chunked-no-upcast", "upcast"):
        with pytest.raises(ValueError, match="loss"):
            gpuops.estimate("llama-3.2-1b", loss=bad)
