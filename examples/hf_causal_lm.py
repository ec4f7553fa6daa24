"""zero-shard with a Hugging Face ``transformers`` causal LM, in a few lines.

A small Llama is built from a config with random weights (nothing is downloaded) and trained on
the same standard-library bytes as ``train_gpt.py``; its AdamW is wrapped by ``zero_shard.wrap``.
Run it the same ways (needs ``pip install transformers``)::

    python examples/hf_causal_lm.py                       # one process
    torchrun --nproc-per-node 2 examples/hf_causal_lm.py  # two ranks
"""

from __future__ import annotations

import argparse
import sys

import torch
from gpt import VOCAB_SIZE, global_batch, read_stdlib_bytes, split_train_val, weight_decay_groups
from train_gpt import default_device, mean_over_ranks, process_group, rows_of_rank

import zero_shard

try:
    import transformers
except ImportError:
    transformers = None

SEQ_LEN = 128


def build_model(device: torch.device) -> torch.nn.Module:
    """A 2-layer Llama over byte tokens, randomly initialized from a fixed seed."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(device)


def main(argv: list[str] | None = None) -> list[float]:
    """Trains as the flags say; returns the loss of every step (averaged over ranks)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=16, help="over all ranks")
    parser.add_argument("--offload-fraction", type=float, default=0.5)
    args = parser.parse_args(argv)
    if transformers is None:
        sys.exit("this example needs transformers: pip install transformers")
    train_data, _ = split_train_val(read_stdlib_bytes(4 << 20))
    losses = []
    with process_group(torch.device(args.device).type) as ranks:
        model = build_model(ranks.device)
        opt = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=2e-3, betas=(0.9, 0.95))
        # The one zero-shard line: shard the optimizer over the ranks, offload a share of it.
        opt = zero_shard.wrap(
            opt, model, offload=zero_shard.OffloadPolicy(fraction=args.offload_fraction)
        )
        for step in range(1, args.steps + 1):
            windows = global_batch(
                train_data, batch_size=args.batch_size, seq_len=SEQ_LEN, seed=0, step=step
            )
            tokens = rows_of_rank(windows, ranks).to(ranks.device)
            loss = model(input_ids=tokens, labels=tokens).loss  # the model shifts the labels
            loss.backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            losses.append(mean_over_ranks(loss))
            if ranks.rank == 0 and (step == 1 or step % 10 == 0):
                print(f"step {step}: loss {losses[-1]:.3f}")
    return losses


if __name__ == "__main__":
    main()
