"""The peer of `cargo run --example transformer_lm`: the same model, batch and optimizer in
PyTorch, through Hugging Face Accelerate when it is installed (as the issue's comparison ran
it), timed the same way (tokens per second over the updates after the first three, as the example
excludes its warm-up updates).

Model: byte vocabulary (256), context 128, 4 pre-norm layers, d_model 256, 4 heads, MLP 1024
(exact GELU), learned positions, output tied to the token embedding, no dropout; AdamW (lr
3e-4, betas 0.9/0.95, weight decay 0.1), global clipping at 1.0, 32 sequences per process,
loss summed over tokens and divided by the batch's token count. Random bytes as data: the
speed does not depend on the text.

    python benches/pytorch/transformer_lm.py --steps 30 --threads 2
    accelerate launch --num_processes 2 benches/pytorch/transformer_lm.py --threads 1
    torchrun --nproc_per_node 2 benches/pytorch/transformer_lm.py --threads 1  # DDP, gloo
    python benches/pytorch/transformer_lm.py --mixed-precision bf16

`--mixed-precision bf16` (or fp16) is Accelerate's `mixed_precision` when it is installed, else
`torch.autocast("cpu", dtype)` around the forward pass and the loss, which is what Accelerate
does on the CPU for bf16.
"""

import argparse
import os
import time

import torch
from torch import nn


class TransformerLm(nn.Module):
    def __init__(self, vocab=256, context=128, layers=4, d_model=256, heads=4, mlp=1024):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(context, d_model)
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, mlp, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, tokens):
        seq = tokens.shape[1]
        positions = torch.arange(seq, device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)[None]
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=tokens.device)
        x = self.layers(x, mask=mask, is_causal=True)
        return self.norm(x) @ self.tokens.weight.T


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)  # at least 4
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default="no")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    try:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True, mixed_precision=args.mixed_precision)
    except ImportError:
        accelerator = None
    model = TransformerLm()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1
    )
    ddp = accelerator is None and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if accelerator is not None:
        model, optimizer = accelerator.prepare(model, optimizer)
    elif ddp:
        # Launched by torchrun without Accelerate: plain DDP over gloo.
        torch.distributed.init_process_group("gloo")
        model = nn.parallel.DistributedDataParallel(model)
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.mixed_precision)

    def autocast():
        if accelerator is not None:
            return accelerator.autocast()
        return torch.autocast("cpu", dtype=compute, enabled=compute is not None)

    context, tokens_per_step = 128, args.batch * 128
    warm_up = 3
    start = None
    for step in range(args.steps):
        if step == warm_up:
            start = time.perf_counter()
        data = torch.randint(0, 256, (args.batch, context + 1))
        inputs, targets = data[:, :-1], data[:, 1:]
        with autocast():
            logits = model(inputs)
            loss = nn.functional.cross_entropy(
                logits.reshape(-1, 256), targets.reshape(-1), reduction="sum"
            ) / tokens_per_step
        optimizer.zero_grad()
        if accelerator is not None:
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    elapsed = time.perf_counter() - start
    if accelerator is not None:
        processes = accelerator.num_processes
    else:
        processes = torch.distributed.get_world_size() if ddp else 1
    rate = (args.steps - warm_up) * tokens_per_step * processes / elapsed
    main_process = (
        accelerator.is_main_process
        if accelerator is not None
        else (not ddp or torch.distributed.get_rank() == 0)
    )
    if main_process:
        via = "accelerate" if accelerator is not None else ("ddp" if ddp else "plain")
        print(
            f"pytorch {torch.__version__} ({via}, {args.mixed_precision}, {processes} process(es), {args.threads} "
            f"thread(s)): {rate:.0f} tokens/s over {args.steps - warm_up} updates, loss {loss.item():.4f}"
        )


if __name__ == "__main__":
    main()
