"""An existing PyTorch training loop joins a p2p_diloco swarm through the library API.

The loop is the caller's own: its model (the embedded tiny GPT-2, initialised from a seed shared by every peer), its
AdamW optimizer, its data (the embedded Moby-Dick corpus, tokenised and packed here) and its loss. Two lines join
the swarm: the ``DiLoCo`` context manager and ``diloco.step`` after each optimizer step.

    p2p-diloco bootstrap --host-maddrs /ip4/127.0.0.1/tcp/0          # prints the multiaddr to join through
    python examples/train_loop.py --initial-peers MADDR --work-dir runs/loop-a &
    python examples/train_loop.py --initial-peers MADDR --work-dir runs/loop-b --data-seed 1
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from p2p_diloco.api import DiLoCo
from p2p_diloco.presets import CORPUS, TINY_MODEL

SEQ_LEN, BATCH_SIZE = 64, 4


def paragraphs() -> tuple[list[str], list[str]]:
    """The corpus's paragraphs: those to train on, and every 50th held out for evals."""
    texts = [text for text in (CORPUS / "moby_dick.txt").read_text().split("\n\n") if text.strip()]
    return [t for i, t in enumerate(texts) if i % 50], [t for i, t in enumerate(texts) if i % 50 == 0]


def batches(tokenizer: PreTrainedTokenizerBase, texts: list[str], seed: int) -> Iterator[torch.Tensor]:
    """Packed sequences of ``texts`` in a shuffled order (a new one each epoch), forever."""
    order = random.Random(seed)
    while True:
        order.shuffle(texts)
        ids = [token for text in texts for token in tokenizer(text + "\n\n")["input_ids"]]
        rows = [ids[start : start + SEQ_LEN] for start in range(0, len(ids) - SEQ_LEN, SEQ_LEN)]
        for start in range(0, len(rows) - BATCH_SIZE + 1, BATCH_SIZE):
            yield torch.tensor(rows[start : start + BATCH_SIZE])


def example_arguments(description: str, work_dir: Path) -> argparse.Namespace:
    """The examples' command line: where the swarm is, the run, the work dir, the steps and the data order."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--initial-peers", nargs="*", default=[], help="multiaddrs of any live swarm member")
    parser.add_argument("--run-id", default="train-loop-example")
    parser.add_argument("--work-dir", type=Path, default=work_dir)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--data-seed", type=int, default=0, help="this peer's data order")
    return parser.parse_args()


def seeded_tiny_model() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The embedded tiny GPT-2, initialised from the seed every peer shares, and its tokenizer."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL)), AutoTokenizer.from_pretrained(
        TINY_MODEL
    )


def main() -> None:
    args = example_arguments(__doc__.splitlines()[0], Path("runs/train-loop"))
    model, tokenizer = seeded_tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    train, evaluation = paragraphs()
    stream = batches(tokenizer, train, args.data_seed)
    held_out = [batch for batch, _ in zip(batches(tokenizer, evaluation, seed=0), range(4))]

    with DiLoCo(model, optimizer, tokenizer, eval_batches=held_out, run_id=args.run_id,
                initial_peers=args.initial_peers, work_dir=str(args.work_dir), save_dir=str(args.work_dir / "model"),
                inner_steps=10, max_steps=args.steps, progress=False) as diloco:  # fmt: skip
        while True:
            batch = next(stream)
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            if diloco.step(tokens=batch.numel(), loss=loss.item()):
                break


if __name__ == "__main__":
    main()
