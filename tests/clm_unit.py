"""A causal-LM script built the way transformers' ``examples/pytorch/language-modeling/run_clm.py`` builds its
Trainer (``HfArgumentParser`` over dataclasses of arguments, ``logging.basicConfig`` to stdout, a text dataset
tokenized and grouped into blocks, the ``Trainer`` built before any p2p_diloco code), made a learning unit by the
README's change alone: the lines marked ``p2p_diloco``. The swarm's address, run id and stop time come from the
environment here (a user writes their own). tests/test_api.py runs two of them as one swarm.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import datasets
import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

from p2p_diloco.api import DiLoCoCallback  # p2p_diloco

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    config_name: str = field(metadata={"help": "the config to pre-train from"})
    tokenizer_name: str = field(metadata={"help": "the tokenizer"})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "a text file"})
    validation_split_percentage: int = field(default=5)
    block_size: int = field(default=64)


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%m/%d/%Y %H:%M:%S",
                        handlers=[logging.StreamHandler(sys.stdout)])  # fmt: skip
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    torch.set_num_threads(1)
    set_seed(training_args.seed)

    split = data_args.validation_split_percentage
    files = {"train": data_args.train_file}
    raw = datasets.DatasetDict({
        "validation": datasets.load_dataset("text", data_files=files, split=f"train[:{split}%]"),
        "train": datasets.load_dataset("text", data_files=files, split=f"train[{split}%:]"),
    })  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_args.config_name))
    tokenized = raw.map(lambda examples: tokenizer(examples["text"]), batched=True, remove_columns=["text"])

    def group_texts(examples: dict[str, list[Any]]) -> dict[str, list[Any]]:
        concatenated = {name: list(chain(*examples[name])) for name in examples}
        length = len(concatenated["input_ids"]) // data_args.block_size * data_args.block_size
        result = {name: [values[i : i + data_args.block_size] for i in range(0, length, data_args.block_size)]
                  for name, values in concatenated.items()}  # fmt: skip
        result["labels"] = result["input_ids"].copy()
        return result

    lm_datasets = tokenized.map(group_texts, batched=True)
    trainer = Trainer(model=model, args=training_args, train_dataset=lm_datasets["train"],
                      eval_dataset=lm_datasets["validation"], processing_class=tokenizer,
                      data_collator=default_data_collator)  # fmt: skip

    with DiLoCoCallback(
        run_id=os.environ["RUN_ID"],
        initial_peers=[os.environ["SWARM_MADDR"]],  # p2p_diloco
        inner_steps=10,
        work_dir=os.environ["UNIT_WORK_DIR"],  # p2p_diloco
        stop_at=float(os.environ["STOP_AT"]),
        progress=False,
    ).attach(trainer):  # p2p_diloco
        train_result = trainer.train()
    trainer.save_model()
    trainer.log_metrics("train", train_result.metrics)


if __name__ == "__main__":
    main()
