"""A complete fine-tuning loop with gpuops: mixed precision (GradScaler for fp16 on CUDA, bf16 autocast on the
CPU), activation checkpointing chosen by policy, gradient accumulation normalised by the window's token
count, a preemption-safe TrainingState (periodic saves, a save on SIGTERM/SIGUSR1, resume), and the training's
figures (gpuops.metrics: JSON Lines, and TensorBoard files in <state-dir>.tb).

    .venv/bin/python examples/python/finetune.py --steps 40 --state-dir /tmp/finetune
    # kill -USR1 <pid> (or let the scheduler send SIGTERM): it saves and exits; run it again to resume

The task is synthetic next-token prediction on sequences of varying length (padding is ignored), so
micro-batches carry different token counts, the case where a mean of means goes wrong.
"""

import argparse
import os
import signal

import torch

import gpuops

VOCAB, WIDTH, LAYERS, SEQ, MICRO_BATCH = 64, 64, 4, 32, 8
PAD = -100  # ignored by cross_entropy


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.1, batch_first=True, norm_first=True)
            for _ in range(LAYERS))
        self.head = torch.nn.Linear(WIDTH, VOCAB)
        self.register_buffer("causal", torch.nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, src_mask=self.causal, is_causal=True)
        return self.head(h)


def micro_batch(index: int, device: torch.device):
    """The index-th micro-batch, the same on every run (so a resumed run sees the same data)."""
    g = torch.Generator().manual_seed(index)
    start = torch.randint(0, VOCAB, (MICRO_BATCH, 1), generator=g)
    tokens = (start + 3 * torch.arange(SEQ + 1)) % VOCAB  # a rule the model can learn
    lengths = torch.randint(SEQ // 4, SEQ + 1, (MICRO_BATCH, 1), generator=g)
    targets = tokens[:, 1:].clone()
    targets[torch.arange(SEQ) >= lengths] = PAD
    return tokens[:, :-1].to(device), targets.to(device)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--window", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--state-dir", default="finetune-state")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--signal-self-at", type=int, default=None,
                        help="send this process SIGUSR1 at that step (to try preemption)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--metrics", default=None, help="JSON Lines file of training figures, one record per 10 "
                        "steps (default: <state-dir>.metrics.jsonl; TensorBoard files in <state-dir>.tb)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16

    torch.manual_seed(0)
    model = TinyLM().to(device)
    checkpointed = gpuops.apply_checkpointing(model.layers, every=2)
    optimizer = gpuops.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scaler = gpuops.GradScaler(device.type, init_scale=2.0**12, enabled=dtype == torch.float16)
    accumulator = gpuops.GradAccumulator(optimizer, args.window, scaler, max_norm=1.0)

    with gpuops.TrainingState(args.state_dir, keep=2) as state:
        resumed = state.load(model=model, optimizer=optimizer, scaler=scaler, map_location=device)
        first_step = resumed["step"] if resumed else 0  # a state's step: the optimizer steps done
        print(f"checkpointed layers {checkpointed}; " +
              (f"resumed from {resumed['path']} after {resumed['step']} steps" if resumed else "fresh start"))
        metrics = args.metrics or args.state_dir.rstrip("/") + ".metrics.jsonl"
        tensorboard = args.state_dir.rstrip("/") + ".tb" if gpuops.metrics.tensorboard_available() else None
        recorder = gpuops.metrics.Recorder(log_every=10, jsonl=metrics, tensorboard=tensorboard,
                                           start_step=first_step)  # no step twice, in either
        for step in range(first_step, args.steps):
            window_loss = torch.zeros((), device=device)
            window_tokens = 0
            for micro in range(args.window):
                tokens, targets = micro_batch(step * args.window + micro, device)
                with torch.autocast(device.type, dtype=dtype):
                    logits = model(tokens)
                loss_sum = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                                             ignore_index=PAD, reduction="sum")
                count = int((targets != PAD).sum())
                accumulator.backward(loss_sum, count)  # steps on the window's last micro-batch
                window_loss += loss_sum.detach()
                window_tokens += count
            recorder.step_done(window_loss / window_tokens, optimizer=optimizer, scaler=scaler, tokens=window_tokens,
                               samples=args.window * MICRO_BATCH, grad_norm=accumulator.last_grad_norm)
            print(f"step {step} loss {(window_loss / window_tokens).item()!r}", flush=True)
            if args.signal_self_at == step:
                os.kill(os.getpid(), signal.SIGUSR1)
            if state.should_stop() or (step + 1) % args.save_every == 0 or step == args.steps - 1:
                path = state.save(step=step + 1, model=model, optimizer=optimizer, scaler=scaler,
                                  data_position=(step + 1) * args.window)
                if state.should_stop():
                    recorder.close()
                    print(f"stop requested: saved {path} after {step + 1} steps; run again to resume")
                    return
        recorder.close()
    print("done")


if __name__ == "__main__":
    main()
