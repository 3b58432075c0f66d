"""What a fused q|k|v projection with RoPE saves for the backward, against transformers' Llama of the same shape:
bytes of the tensors autograd saves in the decoder blocks (weights frozen, the blocks' input requiring grad, SDPA),
per layer and token, in units of the hidden size at the compute dtype (docs/estimator.md, "LitGPT's fused q|k|v").

    python bench/estimator_validation/fused_qkv_saved.py                     # transformers' Phi-3
    python bench/estimator_validation/fused_qkv_saved.py --litgpt DIR        # and LitGPT's GPT, from DIR

DIR holds LitGPT's `litgpt/model.py` and `litgpt/config.py` (e.g. unpacked from `pip download litgpt==0.5.3`);
they are imported with a one-function stand-in for `litgpt.utils` (LitGPT's package imports Lightning).
"""

import argparse
import os
import sys
import types

import torch

H, LAYERS, HEADS, WIDTH, VOCAB, BATCH, SEQ = 256, 2, 8, 688, 1024, 2, 128
DTYPE = torch.bfloat16


def saved_bytes(blocks, hidden) -> int:
    """Bytes of the storages autograd saves while `blocks(hidden)` runs (each storage once)."""
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        blocks(hidden.detach().requires_grad_(True))
    return sum(seen.values())


def hf_blocks(model):
    positions = torch.arange(SEQ).unsqueeze(0)

    def run(h):
        embeddings = model.model.rotary_emb(h, positions)
        for layer in model.model.layers:
            out = layer(h, position_embeddings=embeddings, position_ids=positions)
            h = out[0] if isinstance(out, tuple) else out
        return h
    return run


def hf_model(kind: str, kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

    common = dict(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=kv_heads,
                  intermediate_size=WIDTH, vocab_size=VOCAB, max_position_embeddings=SEQ, attn_implementation="sdpa")
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    return Phi3ForCausalLM(Phi3Config(**common, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                                      pad_token_id=0, sliding_window=None))


def litgpt_blocks(folder: str, kv_heads: int):
    package = types.ModuleType("litgpt")
    package.__path__ = [os.path.join(folder, "litgpt")]
    utils = types.ModuleType("litgpt.utils")
    utils.find_multiple = lambda n, k: n if n % k == 0 else n + k - n % k
    sys.modules.update({"litgpt": package, "litgpt.utils": utils})
    from litgpt.config import Config
    from litgpt.model import GPT

    package.config, package.model = sys.modules["litgpt.config"], sys.modules["litgpt.model"]

    config = Config(name="tiny", block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=LAYERS,
                    n_head=HEADS, n_embd=H, n_query_groups=kv_heads, rotary_percentage=1.0, parallel_residual=False,
                    bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=WIDTH)
    model = GPT(config).to(DTYPE)
    model.max_seq_length = SEQ

    def run(h):
        cos, sin = model.cos[:SEQ], model.sin[:SEQ]
        for block in model.transformer.h:
            h = block(h, cos, sin, None, None)
        return h
    return model, run


def per_layer_token(nbytes: int) -> float:
    return nbytes / (LAYERS * BATCH * SEQ * H * DTYPE.itemsize)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--litgpt", metavar="DIR", help="a folder holding litgpt/model.py and litgpt/config.py")
    args = parser.parse_args()
    torch.manual_seed(0)
    for kv_heads in (HEADS, HEADS // 4):
        figures = {}
        candidates = [("llama", hf_model("llama", kv_heads)), ("phi3", hf_model("phi3", kv_heads))]
        for name, model in candidates:
            model = model.to(DTYPE).requires_grad_(False)
            hidden = model.model.embed_tokens(torch.randint(0, VOCAB, (BATCH, SEQ)))
            figures[name] = per_layer_token(saved_bytes(hf_blocks(model), hidden))
        if args.litgpt:
            model, run = litgpt_blocks(args.litgpt, kv_heads)
            model.requires_grad_(False)
            hidden = model.transformer.wte(torch.randint(0, VOCAB, (BATCH, SEQ)))
            figures["litgpt"] = per_layer_token(saved_bytes(run, hidden))
        base = figures["llama"]
        print(f"k/v heads {kv_heads} of {HEADS}: " + ", ".join(
            f"{name} {value:.2f} h ({value - base:+.2f} h)" for name, value in figures.items()))


if __name__ == "__main__":
    main()
