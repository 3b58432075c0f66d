"""Every figure of the estimator over a fixed spread of models and setups, written to (or compared with)
tests/data/estimator_snapshot.json. A change of code that should leave the estimates as they are (a restructure)
must leave this file as it is: tests/python/test_estimator_snapshot.py compares. A change of terms rewrites it in
the same commit, which names the cause:

    .venv/bin/python bench/estimator_validation/snapshot.py            # what differs from the stored snapshot
    .venv/bin/python bench/estimator_validation/snapshot.py --write    # store the current figures
"""

import argparse
import itertools
import json
import os
import sys

import gpuops

HERE = os.path.dirname(os.path.abspath(__file__))
PATH = os.path.join(HERE, "..", "..", "tests", "data", "estimator_snapshot.json")
sys.path.insert(0, os.path.join(HERE, "published"))
import validate_published  # noqa: E402

MODELS = ["gpt2", "llama-2-7b", "llama-3-8b", "tinyllama-1.1b", "gemma-2-2b", "phi-3-mini", "mixtral-8x7b",
          "deepseek-v2-lite", "bert-base"]
# Each setup feature once on its own, then combined with the others in a few mixes; the shape is small so that
# every model fits the int64 figures and every phase is reached.
BASE = dict(precision="bf16-mixed", micro_batch=2, seq_len=512)
FEATURES = [
    {}, dict(precision="fp32"), dict(precision="bf16"), dict(precision="fp16-mixed"), dict(amp="master-copy"),
    dict(optimizer="sgd-momentum"), dict(optimizer="adamw-8bit"), dict(optimizer="adafactor"),
    dict(optimizer="paged-adamw-32bit"), dict(optimizer_impl="fused"), dict(optimizer_impl="for-loop"),
    dict(checkpointing="full"), dict(checkpointing="every:2"), dict(checkpointing="selective"),
    dict(attention="eager"), dict(attention="flash"), dict(loss="chunked:8"), dict(loss="fused-linear-ce"),
    dict(held_logits="model"), dict(held_logits="fp32"), dict(compile=True), dict(zero_grad="zeros"),
    dict(grad_accum=4), dict(lora_rank=16, lora_targets=["q", "v"]),
    dict(lora_rank=8, lora_targets=["q", "k", "v", "o", "gate", "up", "down"], lora_dropout=0.1),
    dict(lora_rank=16, lora_targets=["q", "v"], base_dtype="nf4"), dict(lora_rank=16, lora_targets=["q", "v"],
                                                                        base_dtype="int8", bnb_version="0.42.0"),
    dict(num_gpus=4), dict(num_gpus=4, zero_stage=1), dict(num_gpus=4, zero_stage=2, zero_reduce="backward"),
    dict(num_gpus=4, zero_stage=3), dict(num_gpus=4, sharding="fsdp2", reduce_dtype="fp32"),
    dict(num_gpus=4, sharding="fsdp2", reshard_after_forward=False), dict(num_gpus=4, sharding="gpuops",
                                                                          zero_prefetch=2),
    dict(num_gpus=4, zero_stage=2, offload_optimizer=True), dict(model_code="litgpt"),
    dict(num_gpus=4, sharding="fsdp1"), dict(loss="no-upcast"), dict(loss="chunked-no-upcast:8"),
    dict(num_gpus=4, sharding="fsdp1", fsdp_orig_params=True, lora_rank=16, lora_targets=["q", "v"]),
]
MIXES = [
    dict(precision="bf16", checkpointing="full", lora_rank=64, lora_targets=["q", "v"], base_dtype="nf4",
         held_logits="fp32", loss="chunked:4", num_gpus=2, zero_stage=3),
    dict(precision="bf16-mixed", amp="master-copy", checkpointing="selective", compile=True, num_gpus=8,
         sharding="fsdp2", reduce_dtype="fp32", loss="chunked:8"),
    dict(precision="fp32", optimizer="sgd-momentum", attention="eager", grad_accum=2, zero_grad="zeros",
         held_logits="model"),
]
DEVICES = [dict(device="cpu"), dict(gpu="A100-80GB"), dict(gpu="RTX-4090", cuda=12, module_loading="eager")]
FIGURES = ["weights", "gradients", "master_weights", "optimizer_states", "activations", "logits", "temporaries",
           "workspaces", "block_rounding", "allocator_slack", "cuda_context", "nccl_buffers", "host_memory",
           "band_below", "band_above", "allocated_peak", "reserved_peak", "total_bytes", "peak_phase"]


def key_of(model, setup, device) -> str:
    return json.dumps({"model": model, **setup, **device}, sort_keys=True)


def cases():
    for model, setup, device in itertools.product(MODELS, FEATURES + MIXES, DEVICES):
        yield model, {**BASE, **setup}, device
    for row in validate_published.load_rows():
        if row["id"] in validate_published.MAPPING:
            kw = validate_published.keywords(row)
            yield kw.pop("model", None), kw, {}


def figures(model, setup, device) -> dict:
    """The estimate's figures, or the error it refuses the setup with (refusals are part of the behaviour)."""
    try:
        b = gpuops.estimate(model, **setup, **device)
    except (ValueError, TypeError) as e:
        return {"refused": str(e).split(";")[0]}
    return {name: getattr(b, name) for name in FIGURES}


def current() -> dict:
    return {key_of(m, s, d): figures(m, s, d) for m, s, d in cases()}


def differences(stored: dict, now: dict) -> list:
    out = [f"only stored: {k}" for k in stored.keys() - now.keys()] + [f"only now: {k}" for k in now.keys() - stored.keys()]
    for k in sorted(stored.keys() & now.keys()):
        if stored[k] != now[k]:
            changed = {f: (stored[k].get(f), now[k].get(f)) for f in set(stored[k]) | set(now[k])
                       if stored[k].get(f) != now[k].get(f)}
            out.append(f"{k}: {changed}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="store the current figures")
    args = parser.parse_args()
    now = current()
    if args.write:
        tmp = PATH + ".tmp"
        with open(tmp, "w") as f:
            json.dump(now, f, indent=0, sort_keys=True)
            f.write("\n")
        os.replace(tmp, PATH)
        print(f"{len(now)} cases written to {os.path.normpath(PATH)}")
        return 0
    with open(PATH) as f:
        diff = differences(json.load(f), now)
    print("\n".join(diff[:50]) or f"{len(now)} cases, as stored")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
