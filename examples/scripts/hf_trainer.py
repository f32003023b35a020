"""A causal-LM fine-tuning script in the shape of Hugging Face's published examples (`HfArgumentParser` over
`TrainingArguments`, a `Trainer`, `--resume_from_checkpoint`), made tiny and offline: a GPT-2 built from a config and
byte-level tokens of a local text file, so nothing is downloaded. Nothing in it knows shunter.

    torchrun --nproc_per_node=2 examples/scripts/hf_trainer.py --output_dir out --max_steps 12 --save_steps 4 \
        --logging_steps 1 --use_cpu --ddp_backend gloo --report_to none

Under shunter the same file and arguments run as a script job (`examples/hf-trainer.yaml`): `outputs: [out]` keeps
what it saves, `resume_arg: --resume_from_checkpoint` continues a retry from the newest saved checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field

import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainerCallback, TrainingArguments


@dataclass
class DataArguments:
    train_file: str = field(default="examples/data/tiny.jsonl", metadata={"help": "JSON lines with a `text` field"})
    block_size: int = field(default=32, metadata={"help": "tokens per training example"})
    n_embd: int = field(default=32, metadata={"help": "model width (a tiny GPT-2)"})
    n_layer: int = field(default=2)
    step_seconds: float = field(default=0.0, metadata={"help": "sleep after each step (to watch a slow run)"})


class ByteBlocks(torch.utils.data.Dataset):
    """Byte-level tokens (vocabulary 256) of the file's texts, cut into blocks; labels are the inputs (causal LM)."""

    def __init__(self, path: str, block_size: int) -> None:
        with open(path, encoding="utf-8") as handle:
            text = "\n".join(json.loads(line)["text"] for line in handle if line.strip())
        ids = list(text.encode("utf-8"))
        self.blocks = [ids[i : i + block_size] for i in range(0, len(ids) - block_size + 1, block_size)]

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.tensor(self.blocks[index])
        return {"input_ids": ids, "labels": ids.clone()}


class Slow(TrainerCallback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
        time.sleep(self.seconds)


def main() -> None:
    data_args, training_args = HfArgumentParser((DataArguments, TrainingArguments)).parse_args_into_dataclasses()
    torch.manual_seed(training_args.seed)
    dataset = ByteBlocks(data_args.train_file, data_args.block_size)
    config = GPT2Config(vocab_size=256, n_positions=data_args.block_size, n_embd=data_args.n_embd,
                        n_layer=data_args.n_layer, n_head=2)  # fmt: skip
    trainer = Trainer(
        model=GPT2LMHeadModel(config),
        args=training_args,
        train_dataset=dataset,
        callbacks=[Slow(data_args.step_seconds)] if data_args.step_seconds else [],
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()  # the final model, into output_dir
    if trainer.is_world_process_zero():
        print(f"done at step {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
    # A finished run skips the interpreter's shutdown. PyTorch's gloo threads may still be releasing the tensors of the
    # last collective (the Trainer's final all_gather of FLOPs) when it starts; Python 3.11 ends a thread that asks
    # for the GIL then, and C++ aborts the process: "terminate called without an active exception", SIGABRT on a rank
    # after "done", one plain torchrun in seven on a loaded 2-core machine (gdb: ~AsyncAllgatherWork in
    # ProcessGroupGloo::runLoop). destroy_process_group() does not help: the DDP model keeps the group alive.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
