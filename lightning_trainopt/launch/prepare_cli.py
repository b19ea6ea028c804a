"""``trainopt-prepare`` / ``python prepare.py``: local text, JSONL or Parquet -> token shards (conf/prepare.yaml).

The work is done by :func:`lightning_trainopt.data.prepare.prepare_corpus`; this module reads the Hydra config,
draws the progress and prints the command that trains on the result.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from lightning_trainopt.config.keys import check_config_keys
from lightning_trainopt.data.manifest import Manifest, Shard
from lightning_trainopt.data.prepare import prepare_corpus
from lightning_trainopt.data.tokenizer import hf_offline
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.launch.cli import run_hydra

__all__ = ["RichPrepareProgress", "prepare", "prepare_main"]

_PHASES = {"train": "training the BPE", "tokenize": "tokenizing"}


class RichPrepareProgress:
    """A progress bar over the input files per pass, with the documents and tokens so far; a line per shard."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("files, {task.fields[documents]:,} documents, {task.fields[tokens]:,} tokens"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self.task: TaskID | None = None
        self.phases = 0

    def __enter__(self) -> RichPrepareProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.phases:
            self.progress.stop()

    def phase(self, name: str, files: int) -> None:
        # Drawn from the first pass on, so that a refusal or an up-to-date directory prints no empty display.
        if not self.phases:
            self.progress.start()
        self.phases += 1
        self.task = self.progress.add_task(_PHASES.get(name, name), total=files, documents=0, tokens=0)

    def update(self, files_done: int, documents: int, tokens: int) -> None:
        if self.task is not None:
            self.progress.update(self.task, completed=files_done, documents=documents, tokens=tokens)

    def shard(self, shard: Shard) -> None:
        self.progress.console.print(f"{shard.file}: {shard.tokens:,} tokens, {shard.documents:,} documents")


def _required(cfg: DictConfig, key: str, example: str) -> Any:
    value = cfg.get(key)
    if value is None or value == "":
        raise ConfigError(key, value, f"prepare needs {key}=..., e.g. {example}.")
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _summary(manifest: Manifest, output: str, up_to_date: bool) -> str:
    """What was prepared, and the train.py command that trains on it."""
    state = "already prepared, nothing to do" if up_to_date else "prepared"
    return (
        f"{output}: {state}: {manifest.tokens:,} tokens in {manifest.documents:,} documents "
        f"({manifest.skipped_documents:,} empty skipped), {len(manifest.shards)} shard(s) of {manifest.dtype}; "
        f"vocabulary {manifest.vocab_size:,}, EOS id {manifest.eos_id} ({manifest.eos_token}).\n"
        f"train on it: python train.py data=tokenized data.path={output}"
    )


def prepare(cfg: DictConfig) -> Manifest:
    """Prepare the corpus ``cfg`` describes (the composed ``conf/prepare.yaml``) and print what was done.

    Raises:
        ConfigError: a missing or bad value (nothing is written then).
        ConfigKeysError: keys the tokenizer does not take.
    """
    hf_offline()
    check_config_keys(cfg)
    inputs = _required(cfg, "input", "input='corpus/**/*.jsonl'")
    output = str(_required(cfg, "output", "output=data/corpus"))
    tokenizer = instantiate(cfg.tokenizer)
    # progress=false keeps the sink (it tells whether anything was done) and silences its console.
    progress = RichPrepareProgress(None if cfg.progress else Console(stderr=True, quiet=True))
    options = {
        "format": cfg.format,
        "text_column": cfg.text_column,
        "encoding": cfg.encoding,
        "shard_tokens": cfg.shard_tokens,
        "batch_documents": cfg.batch_documents,
        "overwrite": cfg.overwrite,
    }
    with progress:
        manifest = prepare_corpus(inputs, output, tokenizer, progress=progress, **options)
    print(_summary(manifest, str(Path(output)), up_to_date=progress.phases == 0), file=sys.stdout)
    return manifest


def _prepare_task(cfg: DictConfig) -> None:
    prepare(cfg)


def prepare_main() -> None:
    """``trainopt-prepare`` / ``python prepare.py``."""
    run_hydra(_prepare_task, "prepare")
