"""zero-shard under Hugging Face's ``transformers.Trainer``: the optimizer is handed to it.

The same small Llama and standard-library bytes as ``hf_causal_lm.py``; the Trainer runs the
loop (its clip, ``max_grad_norm``, is torch's and works on zero-shard's grads), the schedule
and the logging. ``TrainingArguments`` comes first: under torchrun it joins the process group
that ``zero_shard.wrap`` then shards over. Needs ``pip install transformers accelerate``::

    python examples/hf_trainer.py                       # one process
    torchrun --nproc-per-node 2 examples/hf_trainer.py  # two ranks (the Trainer wraps the
                                                        # model in DDP; zero-shard turns its
                                                        # gradient sync off)
    python examples/hf_trainer.py --optimizer adamw     # plain torch AdamW, to compare
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
from gpt import read_stdlib_bytes, split_train_val, weight_decay_groups
from hf_causal_lm import SEQ_LEN, build_model

import zero_shard

try:
    import transformers
except ImportError:
    transformers = None


class LossLog(transformers.TrainerCallback if transformers else object):
    """The loss the Trainer logs at each logging step (over all ranks)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:  # type: ignore[no-untyped-def]
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def main(argv: list[str] | None = None) -> list[float]:
    """Trains as the flags say; returns the logged losses."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    parser.add_argument("--offload-fraction", type=float, default=0.5)
    parser.add_argument("--optimizer", choices=["zero-shard", "adamw"], default="zero-shard")
    args = parser.parse_args(argv)
    if transformers is None:
        sys.exit(
            "this example needs transformers and accelerate: pip install transformers accelerate"
        )
    train_data, _ = split_train_val(read_stdlib_bytes(1 << 20))
    windows = train_data[: (len(train_data) // SEQ_LEN) * SEQ_LEN].long().view(-1, SEQ_LEN)
    rows = [{"input_ids": window, "labels": window} for window in windows[:2048]]
    log = LossLog()
    with tempfile.TemporaryDirectory() as out:
        training = transformers.TrainingArguments(
            out, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
            learning_rate=2e-3, max_grad_norm=1.0, logging_steps=10, report_to=[],
            save_strategy="no", use_cpu=not torch.cuda.is_available(), seed=0, disable_tqdm=True,
        )  # fmt: skip
        model = build_model(training.device)
        opt = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=2e-3, betas=(0.9, 0.95))
        if args.optimizer == "zero-shard":
            policy = zero_shard.OffloadPolicy(fraction=args.offload_fraction)
            opt = zero_shard.wrap(opt, model, offload=policy)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        trainer = transformers.Trainer(
            model, training, train_dataset=rows, optimizers=(opt, scheduler), callbacks=[log]
        )
        trainer.train()
    return log.losses


if __name__ == "__main__":
    main()
