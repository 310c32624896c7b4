"""A Hugging Face ``Trainer`` joins a p2p_diloco swarm through the library API's callback.

The Trainer is the caller's own (its AdamW, its constant learning rate, its data loader over the embedded Moby-Dick
corpus, packed by train_loop.py's helpers); ``DiLoCoCallback`` makes it one learning unit. It can average with
train_loop.py's units: they share the model (the embedded tiny GPT-2 from seed 0) and the outer settings.

    p2p-diloco bootstrap --host-maddrs /ip4/127.0.0.1/tcp/0          # prints the multiaddr to join through
    python examples/hf_trainer.py --initial-peers MADDR --work-dir runs/trainer-a &
    python examples/train_loop.py --initial-peers MADDR --work-dir runs/loop-b --data-seed 1
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from train_loop import batches, example_arguments, paragraphs, seeded_tiny_model
from transformers import PreTrainedTokenizerBase, Trainer, TrainingArguments, default_data_collator

from p2p_diloco.api import DiLoCoCallback


class PackedRows(torch.utils.data.IterableDataset):
    """train_loop.py's packed sequences, one row at a time (the Trainer batches them again)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, texts: list[str], seed: int):
        self.tokenizer, self.texts, self.seed = tokenizer, texts, seed

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch in batches(self.tokenizer, self.texts, self.seed):
            for row in batch:
                yield {"input_ids": row, "labels": row}


def main() -> None:
    args = example_arguments(__doc__.splitlines()[0], Path("runs/trainer"))
    model, tokenizer = seeded_tiny_model()
    train, evaluation = paragraphs()
    held_out = [batch for batch, _ in zip(batches(tokenizer, evaluation, seed=0), range(4))]
    training = TrainingArguments(
        output_dir=str(args.work_dir / "trainer"), max_steps=args.steps, per_device_train_batch_size=4,
        learning_rate=3e-3, weight_decay=0.1, lr_scheduler_type="constant", max_grad_norm=1.0, use_cpu=True,
        include_num_input_tokens_seen=True, save_strategy="no", report_to="none", logging_steps=10,
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip

    with DiLoCoCallback(eval_batches=held_out, run_id=args.run_id, initial_peers=args.initial_peers,
                        work_dir=str(args.work_dir), save_dir=str(args.work_dir / "model"), inner_steps=10,
                        max_steps=args.steps, progress=False) as diloco:  # fmt: skip
        rows = PackedRows(tokenizer, train, args.data_seed)
        trainer = Trainer(model, training, train_dataset=rows, data_collator=default_data_collator,
                          processing_class=tokenizer, callbacks=[diloco])  # fmt: skip
        trainer.train()


if __name__ == "__main__":
    main()
