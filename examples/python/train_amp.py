"""A mixed-precision training loop with gpuops: autocast, gpuops.GradScaler with fused clipping, and the
fused gpuops.optim.AdamW driven by a torch LR scheduler. Runs on CUDA when present, else on the CPU.

    .venv/bin/python examples/python/train_amp.py --steps 50
"""

import argparse

import torch

import gpuops


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16

    # A small regression task: learn y = sin(W x) with an MLP.
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)).to(device)
    target_weights = torch.randn(64, 8, device=device) / 8
    optimizer = gpuops.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    scaler = gpuops.GradScaler(device.type, init_scale=2.0**14, enabled=dtype == torch.float16)

    first_loss = None
    for step in range(args.steps):
        x = torch.randn(128, 64, device=device)
        y = torch.sin(x @ target_weights)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        grad_norm = scaler.clip_grad_norm_(optimizer, max_norm=1.0)  # pass 1: overflow flag + norm
        scaler.step(optimizer)  # pass 2: fused AdamW, skipped on the device after an overflow
        scaler.update()
        scheduler.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  grad-norm {grad_norm.item():.3f}  "
                  f"scale {scaler.get_scale():.0f}  skipped {scaler.skipped_steps}")
        first_loss = first_loss if first_loss is not None else loss.item()
    print(f"loss {first_loss:.4f} -> {loss.item():.4f}")


if __name__ == "__main__":
    main()
