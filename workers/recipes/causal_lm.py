"""Recipe `causal-lm`: fine-tune (or train from a config) a transformers causal LM on a local text/JSONL file.

Config (`config:` of the job spec):
  model_path | model_config   a local HF model folder, or a config dict for AutoConfig.for_model (no hub access)
  tokenizer_path              a local HF tokenizer; default: the model's folder if it has one, else bytes (0-255)
  dataset_path                a .txt file, or .jsonl with one {"text": ...} per line (`text_field` to rename)
  seq_len 128, batch_size (per worker; default strategy.micro_batch_size or 8), lr 5e-4, weight_decay 0.0,
  warmup_steps 0, epochs 1, max_steps (optional), log_every 1, checkpoint_every 0 (0: only at the end);
  epochs defaults to 1, or to "until max_steps" when only max_steps is given;
  strategy (optional: a strategy dict, for plain Ray Train use outside shunter)
Runs under whatever strategy the spec names; the final model is written with `save_pretrained` to
`<job storage>/<job id>/model` (SHUNTER_JOB_STORAGE, else the Ray Train run folder).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from service.spec.strategy import StrategySpec
from workers.checkpoint import full_state_dict
from workers.context import ENV_STORAGE
from workers.strategies import current_strategy, prepare, seed_everything, world

BYTE_VOCAB = 256


class ByteTokenizer:
    """UTF-8 bytes as token ids: a tokenizer that needs no files, for tests and smoke runs."""

    vocab_size = BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def save_pretrained(self, directory: str | Path) -> None:
        (Path(directory) / "shunter-tokenizer.json").write_text(json.dumps({"kind": "bytes", "vocab_size": 256}))


def load_tokenizer(config: dict[str, Any]) -> Any:
    path = config.get("tokenizer_path") or config.get("model_path")
    if path and (Path(path) / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    if config.get("tokenizer_path"):
        raise ValueError(f"config.tokenizer_path: no tokenizer in {path}")
    return ByteTokenizer()


def load_model(config: dict[str, Any]) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    if config.get("model_path"):
        return AutoModelForCausalLM.from_pretrained(config["model_path"], local_files_only=True)
    options = dict(config.get("model_config") or {})
    if "model_type" not in options:
        raise ValueError("config: give model_path, or model_config with a model_type (e.g. gpt2)")
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(options.pop("model_type"), **options))


def read_texts(path: str, text_field: str = "text") -> list[str]:
    from workers.context import locate

    file = locate(path, field="config.dataset_path")
    if file.suffix in (".jsonl", ".json"):
        return [json.loads(line)[text_field] for line in file.read_text().splitlines() if line.strip()]
    return [file.read_text()]


def token_blocks(texts: list[str], tokenizer: Any, seq_len: int) -> torch.Tensor:
    """All texts as one token stream, cut into equal blocks (the usual causal-LM packing)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer.encode(text))
        if eos is not None:
            stream.append(eos)
    count = len(stream) // seq_len
    if count == 0:
        raise ValueError(f"config.dataset_path: {len(stream)} tokens, fewer than one block of seq_len {seq_len}")
    return torch.tensor(stream[: count * seq_len], dtype=torch.long).view(count, seq_len)


def output_location() -> tuple[str, Any]:
    """(path, pyarrow filesystem or None for local) where the final model goes."""
    from workers import session

    storage = os.environ.get(ENV_STORAGE)
    if storage:
        # Beside the job's checkpoints: <storage>/<job id>/model.
        from workers.context import job_id
        from workers.storage import filesystem_for

        path, filesystem = filesystem_for(storage)
        return f"{path.rstrip('/')}/{job_id() or 'adhoc'}/model", filesystem
    path, filesystem = session.storage()
    return f"{path}/model", filesystem


def save_final(prepared: Any, tokenizer: Any) -> str | None:
    """Write the whole model in HF format from rank 0 (gathering shards first); returns where, on rank 0."""
    from transformers import AutoModelForCausalLM

    state = full_state_dict(prepared)  # collective
    if world()[0] != 0:
        return None
    model = AutoModelForCausalLM.from_config(prepared.module.config)
    model.load_state_dict(state)
    destination, filesystem = output_location()
    local = Path(tempfile.mkdtemp(prefix="shunter-model-"))
    try:
        model.save_pretrained(local)
        tokenizer.save_pretrained(local)
        if filesystem is None or type(filesystem).__name__ == "LocalFileSystem":
            shutil.copytree(local, destination, dirs_exist_ok=True)
        else:
            import pyarrow.fs

            pyarrow.fs.copy_files(str(local), destination, destination_filesystem=filesystem)
    finally:
        shutil.rmtree(local, ignore_errors=True)
    return destination


def train_loop(config: dict[str, Any]) -> None:
    """The causal-lm recipe's train_loop_per_worker."""
    # `strategy` in the config is for plain Ray Train use; under shunter the job spec's strategy applies.
    given = config.get("strategy")
    strategy = current_strategy(StrategySpec.model_validate(given) if given is not None else None)
    seed_everything(strategy.seed if strategy.seed is not None else 0)
    tokenizer = load_tokenizer(config)
    model = load_model(config)
    vocab = getattr(model.config, "vocab_size", None)
    if vocab is not None and vocab < len(getattr(tokenizer, "get_vocab", lambda: range(BYTE_VOCAB))()):
        raise ValueError(f"config.model_config.vocab_size: {vocab} is smaller than the tokenizer's vocabulary")
    seq_len = int(config.get("seq_len", 128))
    batch_size = int(config.get("batch_size") or strategy.micro_batch_size or 8)
    blocks = token_blocks(read_texts(config["dataset_path"], config.get("text_field", "text")), tokenizer, seq_len)
    loader = DataLoader(TensorDataset(blocks), batch_size=batch_size, shuffle=True, drop_last=True)
    warmup = int(config.get("warmup_steps", 0))
    lr, weight_decay = float(config.get("lr", 5e-4)), float(config.get("weight_decay", 0.0))
    prepared = prepare(
        model,
        lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay),
        loader,
        strategy=strategy,
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (warmup + 1))),
    )
    _, world_size = world()
    max_steps = config.get("max_steps")
    log_every, checkpoint_every = int(config.get("log_every", 1)), int(config.get("checkpoint_every", 0))
    tokens_per_step = batch_size * seq_len * prepared.gradient_accumulation_steps * world_size
    losses: list[torch.Tensor] = []
    started, steps_since = time.monotonic(), 0
    last_reported = last_checkpoint = prepared.step
    epochs = int(config.get("epochs") or (1 if max_steps is None else 2**31 - 1))  # max_steps alone: run until it
    for _ in prepared.epochs(epochs):
        for (ids,) in prepared.batches():
            loss = prepared.model(input_ids=ids, labels=ids).loss
            losses.append(loss.detach().float())
            if not prepared.backward(loss):
                continue
            steps_since += 1
            done = max_steps is not None and prepared.step >= int(max_steps)
            if prepared.step % log_every == 0 or done:
                mean = torch.stack(losses).mean().to(prepared.device)
                if world_size > 1:
                    dist.all_reduce(mean)
                    mean /= world_size
                elapsed = max(time.monotonic() - started, 1e-9)
                checkpoint = done or bool(checkpoint_every and prepared.step % checkpoint_every == 0)
                prepared.report(
                    loss=mean.item(),
                    tokens_per_s=tokens_per_step * steps_since / elapsed,
                    samples_per_s=tokens_per_step * steps_since / elapsed / seq_len,
                    checkpoint=checkpoint,
                )
                last_reported, losses, started, steps_since = prepared.step, [], time.monotonic(), 0
                last_checkpoint = prepared.step if checkpoint else last_checkpoint
            if done:
                break
        if max_steps is not None and prepared.step >= int(max_steps):
            break
    if last_checkpoint != prepared.step or prepared.step == 0:  # the end of training is always checkpointed
        loss = torch.stack(losses).mean().item() if losses and last_reported != prepared.step else None
        prepared.report({"loss": loss} if loss is not None else None, checkpoint=True)
    destination = save_final(prepared, tokenizer)
    if destination:
        print(f"[shunter] causal-lm: model saved to {destination}", flush=True)
