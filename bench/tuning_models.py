"""Training steps for bench/tune_batch_size.py --module: factory(device) -> step(batch).

make_gpt_step: a GPT-style decoder (token embedding, causal pre-norm transformer layers, LM head) trained with
gpuops.optim.AdamW, bf16 autocast on CUDA. On CUDA: width 512, 4 layers, sequence 512, vocabulary 8192 (21M
parameters, about 0.1 GiB of activations per sample); on the CPU a small one (width 64, 2 layers, sequence
64, vocabulary 512) so that scripts/gpu-run --rehearse runs it in seconds.
"""

from __future__ import annotations

import torch

import gpuops


def make_gpt_step(device):
    device = torch.device(device)
    width, layers, seq, vocab = (512, 4, 512, 8192) if device.type == "cuda" else (64, 2, 64, 512)
    torch.manual_seed(0)
    embed = torch.nn.Embedding(vocab, width)
    blocks = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0, batch_first=True, norm_first=True),
        layers, enable_nested_tensor=False)
    head = torch.nn.Linear(width, vocab)
    model = torch.nn.ModuleList([embed, blocks, head]).to(device)
    optimizer = gpuops.optim.AdamW(model.parameters(), lr=1e-4)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(seq, device=device)
    generator = torch.Generator(device).manual_seed(1)

    def step(batch: int) -> None:
        tokens = torch.randint(0, vocab, (batch, seq + 1), device=device, generator=generator)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = head(blocks(embed(tokens[:, :-1]), mask=mask, is_causal=True))
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()

    return step
