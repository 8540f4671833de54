"""Prompt datasets for RL: a LightningDataModule that yields lists of tokenized prompts (no padding).

Each batch is a ``list[dict]`` of ``batch_size`` items::

    {"prompt_ids": list[int],   # token ids fed to the generator (chat template applied if enabled)
     "prompt_text": str,        # the prompt as stored in the dataset (before any chat template)
     "answer": str | None,      # ground truth for the reward (None when the row/column has none)
     "index": int,              # row index in the (limited) dataset, kept when overlong rows are filtered out
     "epoch": int}              # train batches only: the data epoch (pass over the prompts) the item comes from

Sources: a local ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file, a local directory (a ``save_to_disk`` folder
or a folder of data files), or a hub dataset name (passed to ``datasets.load_dataset``).

Order and exact resume: epoch ``e`` visits the rows in the permutation drawn from ``seed + e`` only (Lightning calls
``set_epoch``); under data parallelism rank ``r`` of ``W`` takes positions ``r, r + W, ...`` of it. The train loader
(:class:`ResumableDataLoader`) implements ``state_dict`` / ``load_state_dict``, so Lightning stores the epoch and the
number of batches handed out in every checkpoint (``loops.fit_loop.state_dict.combined_loader``) and a resumed run
continues with the next unseen batch of the same permutation instead of restarting the epoch.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from rlexact.char_tokenizer import build_char_tokenizer
from rlexact.resources import first_line, load_named, missing_local_path, resolve

__all__ = [
    "DEMO_TOKENIZER",
    "PromptDataModule",
    "PromptDataset",
    "ResumableDataLoader",
    "ResumableSampler",
    "check_tokenizer_source",
    "collate_prompts",
    "describe_source",
    "encode_prompts",
    "load_prompt_rows",
    "load_tokenizer",
    "missing_local_source",
]

DEMO_TOKENIZER = "demo-char"
"""Special tokenizer name: :func:`rlexact.char_tokenizer.build_char_tokenizer` (the demo's 50-token vocabulary)."""

ANSWER_KEY = "answer"
"""The default ``answer_key`` of :class:`PromptDataModule`."""

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""The data file extensions rlexact reads, and the ``datasets`` builder of each."""
_FILE_TYPES = ", ".join(sorted(_FILE_BUILDERS)[:-1]) + " or " + sorted(_FILE_BUILDERS)[-1]

_SOURCES = (
    f"prompt data is a {_FILE_TYPES} file, a folder of such files (a split per file name, e.g. train.jsonl and "
    "test.jsonl), a datasets save_to_disk folder, a packaged file such as 'rlexact://demo/data/train.jsonl' or a "
    "Hugging Face Hub dataset name"
)
"""The prompt sources :func:`load_prompt_rows` reads, as the errors about an unreadable source name them."""


def load_tokenizer(tokenizer: Any, setting: str = "tokenizer") -> Any:
    """A tokenizer object from ``"demo-char"``, a local path / hub name (``AutoTokenizer``), or an existing object.
    ``setting`` names where the source was given, in the error for a name that loads from nowhere."""
    if tokenizer is None:
        raise ValueError(
            "a tokenizer is required: pass the model's tokenizer (a path or hub name, e.g. the model checkpoint "
            "directory, or a tokenizer object)"
        )
    if isinstance(tokenizer, (str, os.PathLike)):
        name = resolve(os.fspath(tokenizer))
        if name == DEMO_TOKENIZER:
            return build_char_tokenizer()
        from transformers import AutoTokenizer

        check_tokenizer_source(name)
        return load_named(AutoTokenizer.from_pretrained, os.path.expanduser(name), name, setting)
    return tokenizer


def check_tokenizer_source(tokenizer: Any) -> None:
    """Raise ``FileNotFoundError`` when ``tokenizer`` is a path that can only be local (a leading ``/``, ``.`` or
    ``~``) and nothing is there (checked where the argument is given; the tokenizer loads on first use)."""
    if isinstance(tokenizer, (str, os.PathLike)) and missing_local_path(tokenizer) is not None:
        raise FileNotFoundError(f"tokenizer {os.fspath(tokenizer)!r} does not exist; pass the model's tokenizer: its "
                                f"checkpoint directory, a Hub name, or a tokenizer object")  # fmt: skip


def _chat_text(tokenizer: Any, prompt: str | list[dict]) -> str:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_prompts(tokenizer: Any, texts: Sequence[str | list[dict]], use_chat_template: bool) -> list[list[int]]:
    """Tokenize prompts for generation.

    Args:
        tokenizer: a transformers tokenizer.
        texts: prompt strings, or chat conversations (lists of ``{"role", "content"}`` dicts; these need
            ``use_chat_template=True``).
        use_chat_template: wrap each string as one user turn and render with ``tokenizer.apply_chat_template(...,
            add_generation_prompt=True)``, then tokenize without adding special tokens (the template has them).
            If False, tokenize the raw text with the tokenizer's default special tokens (e.g. a BOS for Llama;
            nothing for Qwen or the demo tokenizer).

    Returns:
        One list of token ids per prompt.
    """
    texts = list(texts)
    if not texts:
        return []
    if use_chat_template:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("use_chat_template=True but the tokenizer has no chat_template")
        rendered = [_chat_text(tokenizer, t) for t in texts]
        add_special = False
    else:
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise ValueError(
                f"prompt {bad} is a {type(texts[bad]).__name__}, not a string; chat-format prompts need "
                "use_chat_template=True"
            )
        rendered = texts
        add_special = True
    ids = tokenizer(rendered, add_special_tokens=add_special)["input_ids"]
    return [list(map(int, x)) for x in ids]


def load_prompt_rows(path: str | os.PathLike, split: str = "train", **load_kwargs: Any) -> Any:
    """Load a ``datasets.Dataset`` from a local data file, a local folder or a Hub name (``_SOURCES`` lists them).

    A single local file is one split (``split`` is ignored). A ``save_to_disk`` folder (or ``DatasetDict``) is
    indexed by ``split``; a folder of data files and a Hub name go to ``datasets.load_dataset(path, split=split)``.
    A malformed ``.jsonl`` / ``.json`` file raises ``ValueError`` naming the file and the first bad line. ``~`` is
    expanded; a missing path that can only be local (a data file's extension, or a leading ``/`` or ``.``) raises
    ``FileNotFoundError`` without a Hub lookup. A file of another type, a folder without data files or one that
    ``datasets`` cannot read raise ``ValueError``, and a name that is neither here nor on the Hub raises
    ``FileNotFoundError``; each names the sources accepted.
    """
    import datasets

    problem = missing_local_source(path)
    if problem is not None:
        raise FileNotFoundError(f"data file {problem}")
    name = os.fspath(path)
    path = os.path.expanduser(resolve(name))
    if os.path.isfile(path):
        return _load_file(path, load_kwargs)
    if os.path.isdir(path):
        return _load_folder(path, split, load_kwargs)
    try:
        return datasets.load_dataset(path, split=split, **load_kwargs)
    except OSError as e:  # datasets' DatasetNotFoundError, or ConnectionError offline
        raise FileNotFoundError(
            f"prompt data {name!r} is no file or folder here (looked for {os.path.abspath(path)!r}) and did not load "
            f"as a Hub dataset ({first_line(e)}); {_SOURCES} (start a local path with ./ to skip the Hub lookup)"
        ) from e


def _load_file(path: str, load_kwargs: dict[str, Any]) -> Any:
    """One local data file of a :data:`_FILE_BUILDERS` type as one split."""
    import datasets

    ext = next((e for e in _FILE_BUILDERS if path.lower().endswith(e)), None)
    if ext is None:
        raise ValueError(f"prompt data file {path!r} is not of a type rlexact reads; {_SOURCES}")
    try:
        return datasets.load_dataset(_FILE_BUILDERS[ext], data_files=path, split="train", **load_kwargs)
    except Exception as e:  # datasets fails in varied ways on empty or malformed files
        if _file_has_no_rows(path, ext):
            raise ValueError(f"dataset {path!r} is empty") from e
        problem = _json_problem(path, ext)
        if problem is not None:
            raise ValueError(problem) from e
        raise


def _load_folder(path: str, split: str, load_kwargs: dict[str, Any]) -> Any:
    """Split ``split`` of a ``save_to_disk`` folder, or of a folder of data files (``datasets.load_dataset``)."""
    import datasets

    if any(os.path.exists(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json")):
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"split {split!r} not in {path!r}; available splits: {sorted(ds)}")
            ds = ds[split]
        return ds
    if not _holds_data_files(path):
        raise ValueError(
            f"prompt data folder {os.path.abspath(path)!r} is neither a datasets save_to_disk folder nor holds "
            f"{_FILE_TYPES} files; {_SOURCES}"
        )
    try:
        return datasets.load_dataset(path, split=split, **load_kwargs)
    except (ValueError, OSError) as e:  # no split `split`, data files of several types, ...
        raise ValueError(
            f"prompt data folder {os.path.abspath(path)!r} did not load as one dataset of its data files (datasets: "
            f"{first_line(e)}); {_SOURCES}"
        ) from e


def _holds_data_files(folder: str) -> bool:
    """True if ``folder`` or a folder below it holds a :data:`_FILE_BUILDERS` file, hidden names (``.``, ``__``)
    aside as ``datasets`` leaves them aside."""
    for _, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        if any(f.lower().endswith(tuple(_FILE_BUILDERS)) and not f.startswith((".", "__")) for f in files):
            return True
    return False


def missing_local_source(path: Any) -> str | None:
    """Why the prompt source ``path`` cannot be read, when it can only be a local path (a data file's extension, or a
    leading ``/``, ``.`` or ``~``) and nothing is there; None for anything else (an existing path, a Hub name,
    in-memory rows)."""
    name = missing_local_path(path, tuple(_FILE_BUILDERS)) if isinstance(path, (str, os.PathLike)) else None
    if name is None:
        return None
    return (f"{name!r} not found (looked for {os.path.abspath(name)!r}); a path that ends in "
            f"{', '.join(sorted(_FILE_BUILDERS))} or starts with '/' or '.' is read as a local file, never looked up "
            f"on the Hub: fix the path")  # fmt: skip


def _file_has_no_rows(path: str, ext: str) -> bool:
    """True if a local data file holds no rows (only called after datasets failed to load it)."""
    try:
        if ext == ".parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows == 0
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
        if ext == ".csv":
            return len(lines) <= 1  # at most a header
        return not lines or "".join(lines).strip() in ("[]", "{}")
    except Exception:
        return False


def _json_problem(path: str, ext: str) -> str | None:
    """The first syntax problem of a ``.jsonl`` / ``.json`` file as ``"<path>, line <n>: ..."``, or None."""
    if ext not in (".jsonl", ".json"):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        return f"cannot read {path!r}: {e}"
    if ext == ".json" and text.lstrip().startswith("["):
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            return f"{path}, line {e.lineno}: not valid JSON ({e.msg})"
        return None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            return (
                f"{path}, line {lineno}: not valid JSON ({e.msg}, column {e.colno}); each line of a JSON-lines file "
                "must be one JSON object"
            )
        if not isinstance(row, dict):
            return f"{path}, line {lineno}: expected a JSON object per line, got {type(row).__name__}"
    return None


def collate_prompts(items: list[dict]) -> list[dict]:
    """Identity collate: a batch is the list of item dicts (ragged ``prompt_ids``, no padding)."""
    return list(items)


class PromptDataset(Dataset):
    """In-memory prompts, already tokenized: item ``i`` is ``{"prompt_ids", "prompt_text", "answer", "index"}``.

    ``indices`` are the items' row indices in the source (default ``0..n-1``); they differ from the positions when
    rows were filtered out.
    """

    def __init__(
        self,
        prompt_ids: list[list[int]],
        prompt_texts: list[Any],
        answers: list[str | None],
        indices: list[int] | None = None,
    ):
        indices = list(range(len(prompt_ids))) if indices is None else list(indices)
        if not (len(prompt_ids) == len(prompt_texts) == len(answers) == len(indices)):
            raise ValueError("prompt_ids, prompt_texts, answers and indices must have the same length")
        self.prompt_ids = prompt_ids
        self.prompt_texts = prompt_texts
        self.answers = answers
        self.indices = indices

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def __getitem__(self, i: int) -> dict:
        return {
            "prompt_ids": list(self.prompt_ids[i]),
            "prompt_text": self.prompt_texts[i],
            "answer": self.answers[i],
            "index": int(self.indices[i]),
        }

    @property
    def longest_prompt(self) -> tuple[int, int]:
        """``(tokens, row index)`` of the longest prompt (the first of equal ones; ``(0, -1)`` when empty)."""
        if not self.prompt_ids:
            return 0, -1
        k = max(range(len(self.prompt_ids)), key=lambda i: len(self.prompt_ids[i]))
        return len(self.prompt_ids[k]), int(self.indices[k])

    @property
    def max_token_id(self) -> int:
        """The largest token id of any prompt (-1 for an empty dataset)."""
        return max((max(x) for x in self.prompt_ids if x), default=-1)


class ResumableSampler(DistributedSampler):
    """This rank's share of a seeded per-epoch permutation, able to continue an epoch after its first items.

    Data epoch ``d``'s global order is ``torch.randperm(n, generator=seed + d)`` (``range(n)`` without ``shuffle``);
    rank ``r`` of ``num_replicas`` takes positions ``r, r + num_replicas, ...`` (padded by wrapping around, as
    ``DistributedSampler`` does). The order is a pure function of ``(seed, d, rank, num_replicas)``. Being a
    ``DistributedSampler``, Lightning neither wraps nor replaces it, and calls :meth:`set_epoch` each epoch.

    The data epoch is Lightning's epoch minus an offset that is 0 except after a resume from a checkpoint that
    Lightning counts as the end of an epoch although the data epoch was not finished (a checkpoint written by
    ``on_train_epoch_end`` when ``max_steps`` stopped the run mid-epoch): the rest of the data epoch then comes first,
    so the stream of batches is the one of an uninterrupted run.
    """

    def __init__(
        self,
        num_items: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        num_replicas: int = 1,
        rank: int = 0,
    ):
        super().__init__(range(int(num_items)), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.offset = 0
        self.data_epoch = 0
        self.last_start = 0
        self._resume: tuple[int, int] | None = None

    def resume(self, data_epoch: int, start: int) -> None:
        """Make the next iteration continue data epoch ``data_epoch`` at item ``start`` of this rank's share."""
        self._resume = (int(data_epoch), int(start))
        self.data_epoch = int(data_epoch)

    def __iter__(self) -> Iterator[int]:
        start = 0
        if self._resume is not None:
            resume_epoch, start = self._resume
            self.offset = self.epoch - resume_epoch
            self._resume = None
        self.data_epoch = self.epoch - self.offset
        self.last_start = start
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.data_epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        pad = self.total_size - n
        order = order + (order * (pad // n + 1))[:pad] if pad > 0 else order[: self.total_size]
        return iter(order[self.rank : self.total_size : self.num_replicas][start:])


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ResumableSampler` whose position in the data order is checkpointed.

    ``state_dict()`` is ``{"epoch", "batches", "batch_size", "num_items", "seed", "shuffle", "num_replicas"}``:
    ``epoch`` is the data epoch and ``batches`` counts its batches handed out so far (Lightning does not prefetch
    from a loader with a length, so at a checkpoint this equals the batches trained on). ``load_state_dict`` makes
    the next iterator start at the first batch not yet handed out (or, when the saved epoch was complete, at the
    next epoch). Lightning calls both for the train loader (it checks for the two methods). Each item of a batch
    gets ``"epoch"``: the data epoch (which sampling keys should use; it equals Lightning's epoch except after the
    resume described in :class:`ResumableSampler`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, ResumableSampler):
            raise TypeError(f"ResumableDataLoader needs a ResumableSampler, got {type(self.sampler).__name__}")
        self._batches = 0

    def __iter__(self) -> Iterator[Any]:
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        # a generator: the sampler starts (and takes a pending resume) when the first batch is requested, after
        # Lightning's set_epoch
        first = True
        for batch in super().__iter__():
            if first:
                self._batches = self.sampler.last_start // int(self.batch_size)
                first = False
            self._batches += 1
            for item in batch:
                item["epoch"] = self.sampler.data_epoch
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The data order's position: data epoch and batches handed out, with what identifies the order."""
        s = self.sampler
        return {
            "epoch": int(s.data_epoch),
            "batches": int(self._batches),
            "batch_size": int(self.batch_size),
            "num_items": len(s.dataset),
            "seed": int(s.seed),
            "shuffle": bool(s.shuffle),
            "num_replicas": int(s.num_replicas),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after ``state`` (from :meth:`state_dict`); the data and its order must be the same."""
        s = self.sampler
        now = self.state_dict()
        for key, hint in (
            ("num_items", "the same prompts (data.path, data.limit, data.max_prompt_length)"),
            ("seed", "the same data.seed"),
            ("shuffle", "the same data.shuffle"),
        ):
            if state.get(key) != now[key]:
                raise ValueError(
                    f"cannot resume the data order: the checkpoint's train loader had {key}={state.get(key)!r}, "
                    f"this run has {key}={now[key]!r}; resume with {hint}"
                )
        epoch, batches = int(state["epoch"]), int(state["batches"])
        if batches >= len(self):  # the saved epoch was complete: start the next one
            epoch, batches = epoch + 1, 0
        elif batches and (state.get("batch_size"), state.get("num_replicas")) != (now["batch_size"], s.num_replicas):
            raise ValueError(
                f"cannot resume mid-epoch: the checkpoint was written with batch_size={state.get('batch_size')} on "
                f"{state.get('num_replicas')} data-parallel rank(s), this run has batch_size={now['batch_size']} on "
                f"{s.num_replicas}; resume with the same data.batch_size and number of ranks (or from an "
                "end-of-epoch checkpoint)"
            )
        s.resume(epoch, batches * int(self.batch_size))
        self._batches = batches


def describe_source(path: Any) -> str:
    """A path or name as its ``repr`` (for error messages), any other source (a tokenizer or dataset object) as its
    type name."""
    return repr(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else type(path).__name__


class RowList:
    """In-memory rows (a list of dicts) with the part of the ``datasets.Dataset`` interface the data module reads:
    ``column_names`` (the keys of every row, in first-seen order), ``len``, ``ds[column]`` and ``select``."""

    def __init__(self, rows: list[dict]) -> None:
        bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
        if bad is not None:
            raise TypeError(f"row {bad} of the in-memory dataset is {type(rows[bad]).__name__}, not a dict")
        self.rows = rows
        self.column_names = list(dict.fromkeys(k for r in rows for k in r))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, column: str) -> list:
        return [r.get(column) for r in self.rows]

    def select(self, indices: Iterable[int]) -> RowList:
        return RowList([self.rows[i] for i in indices])


class PromptDataModule(L.LightningDataModule):
    """Prompts (and ground-truth answers) for RL rollouts.

    Args:
        path: local ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file, local folder of such files (a split per
            file name) or ``save_to_disk`` folder, hub dataset name, or a packaged file such as
            ``"rlexact://demo/data/train.jsonl"`` (:mod:`rlexact.resources`); another source raises an error naming
            these (:func:`load_prompt_rows`).
            A ``datasets.Dataset`` or a list of row dicts is also accepted when constructed in Python.
        tokenizer: the policy's tokenizer (required): a path or hub name for ``AutoTokenizer`` (normally the model
            checkpoint directory, the same value as ``RLModule(model_path=...)``), a tokenizer object, ``"demo"``
            (the packaged demo checkpoint's tokenizer) or ``"demo-char"`` (the same character tokenizer built in
            code). :class:`rlexact.RLModule` checks at setup that it
            agrees with its own tokenizer and that every prompt token id fits the model's vocabulary.
        prompt_key: column holding the prompt (a string, or a chat conversation: a list of role/content dicts).
        answer_key: column holding the ground truth (values become ``str``); None: the rows have none (answers are
            None). A source without the column raises, except for the default ``"answer"``, which warns (rewards
            that compare with a ground truth would score 0) and gives None answers.
        split: dataset split (for hub datasets and ``save_to_disk`` folders; a single file is one split).
        batch_size: prompts per rollout step (per data-parallel rank).
        use_chat_template: render each prompt with the tokenizer's chat template (a user turn plus the generation
            prompt). Off by default: the prompts are tokenized as stored; turn it on for chat / instruct models.
            When on, one rendered prompt is logged at setup.
        max_prompt_length: longest prompt in tokens (after the chat template); see ``overlong``.
        overlong: what a prompt longer than ``max_prompt_length`` does: ``"filter"`` drops it (the count is logged
            and kept in :attr:`num_filtered`), ``"raise"`` stops at setup with the row and its length.
        shuffle: shuffle the train set (order is a pure function of ``seed`` and the epoch).
        seed: shuffle seed.
        num_workers: DataLoader workers.
        limit: keep only the first ``limit`` rows (before filtering and shuffling).
        val_path: optional evaluation prompts (same format and columns); enables ``val_dataloader``.
        val_split: split of ``val_path`` (default ``split``).
        val_batch_size: evaluation batch size (default ``batch_size``).
        val_limit: keep only the first ``val_limit`` evaluation rows.
        drop_last: drop the last incomplete train batch.
    """

    def __init__(
        self,
        path: Any,
        tokenizer: Any,
        prompt_key: str = "prompt",
        answer_key: str | None = ANSWER_KEY,
        split: str = "train",
        batch_size: int = 8,
        use_chat_template: bool = False,
        max_prompt_length: int | None = None,
        overlong: Literal["filter", "raise"] = "filter",
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        limit: int | None = None,
        val_path: Any = None,
        val_split: str | None = None,
        val_batch_size: int | None = None,
        val_limit: int | None = None,
        drop_last: bool = False,
    ):
        super().__init__()
        if tokenizer is None:
            load_tokenizer(None)  # raises the "tokenizer is required" error
        check_tokenizer_source(tokenizer)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_prompt_length is not None and max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1 or None, got {max_prompt_length}")
        if overlong not in ("filter", "raise"):
            raise ValueError(f"overlong must be 'filter' or 'raise', got {overlong!r}")
        if use_chat_template is None or not isinstance(use_chat_template, bool):
            raise ValueError(f"use_chat_template must be True or False, got {use_chat_template!r}")
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0 or None, got {limit}")
        for setting, source in (("path", path), ("val_path", val_path)):
            if (problem := missing_local_source(source)) is not None:
                raise FileNotFoundError(f"PromptDataModule {setting} {problem}")
        self.path = path
        self._tokenizer_arg = tokenizer
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.split = split
        self.batch_size = batch_size
        self.use_chat_template = use_chat_template
        self.max_prompt_length = max_prompt_length
        self.overlong = overlong
        self.shuffle = shuffle
        self.seed = seed
        self.num_workers = num_workers
        self.limit = limit
        self.val_path = val_path
        self.val_split = val_split
        self.val_batch_size = val_batch_size
        self.val_limit = val_limit
        self.drop_last = drop_last
        self._tokenizer = None
        self.num_filtered: dict[str, int] = {}
        self.train_dataset: PromptDataset | None = None
        self.val_dataset: PromptDataset | None = None
        self._hide_val_dataloader()
        if isinstance(tokenizer, (str, os.PathLike)) and isinstance(path, (str, os.PathLike)):
            self.save_hyperparameters()

    def _hide_val_dataloader(self) -> None:
        # Without val_path, present the base-class method so Lightning sees no val_dataloader (and skips
        # validation without empty-loader warnings).
        if self.val_path is None:
            self.val_dataloader = L.LightningDataModule.val_dataloader.__get__(self)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("val_dataloader", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._hide_val_dataloader()

    @property
    def tokenizer_source(self) -> Any:
        """The ``tokenizer`` argument as given (a path / name or an object)."""
        return self._tokenizer_arg

    @property
    def tokenizer(self) -> Any:
        """The tokenizer object (loaded on first access)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self._tokenizer_arg)
        return self._tokenizer

    @property
    def chat_template_enabled(self) -> bool:
        """Whether prompts are rendered with the chat template."""
        return self.use_chat_template

    def _load_rows(self, path: Any, split: str, limit: int | None):
        if isinstance(path, list):
            ds = RowList(path) if path else None
        elif "datasets" in sys.modules and isinstance(path, sys.modules["datasets"].Dataset):
            ds = path  # a user's datasets.Dataset (in-memory rows need no datasets import)
        else:
            ds = load_prompt_rows(path, split=split)
        if ds is None or len(ds) == 0:
            raise ValueError(f"dataset {describe_source(path)} is empty")
        if limit is not None:
            ds = ds.select(range(min(limit, len(ds))))
            if len(ds) == 0:
                raise ValueError(f"dataset {describe_source(path)} is empty (limit={limit})")
        return ds

    def _missing_answers(self, path: Any, columns: list[str]) -> None:
        """Raise for a named ``answer_key`` that ``path`` lacks; warn for the default one."""
        where = f"{self.answer_key!r} not in dataset {describe_source(path)}; available columns: {columns}"
        if self.answer_key != ANSWER_KEY:
            raise ValueError(f"answer_key {where} (answer_key=None: the rows have no ground truth)")
        rank_zero_warn(
            f"answer_key {where}. Every answer is None, so a reward that compares with a ground truth (math, "
            "exact_match, arithmetic) scores 0: set answer_key to the column that holds the answers, or "
            "answer_key=None where the rows have none."
        )

    def build_dataset(self, path: Any, split: str | None = None, limit: int | None = None) -> PromptDataset:
        """Load, check, tokenize and length-filter one source into a :class:`PromptDataset`."""
        ds = self._load_rows(path, split or self.split, limit)
        columns = list(ds.column_names)
        if self.prompt_key not in columns:
            raise ValueError(
                f"prompt_key {self.prompt_key!r} not in dataset {describe_source(path)}; available columns: {columns}"
            )
        prompts = list(ds[self.prompt_key])
        for i, p in enumerate(prompts):
            if p is None or not isinstance(p, (str, list)):
                raise ValueError(
                    f"row {i} of {describe_source(path)}: prompt must be a string or a list of messages, got "
                    f"{type(p).__name__}"
                )
        if self.answer_key is not None and self.answer_key in columns:
            answers = [None if a is None else str(a) for a in ds[self.answer_key]]
        else:
            if self.answer_key is not None:
                self._missing_answers(path, columns)
            answers = [None] * len(prompts)
        ids = encode_prompts(self.tokenizer, prompts, self.chat_template_enabled)
        if self.chat_template_enabled:
            preview = self.tokenizer.decode(ids[0]) if ids else ""
            rank_zero_info(f"rlexact: chat template on; prompt 0 of {describe_source(path)} renders as {preview!r}")
        keep = []
        for i, x in enumerate(ids):
            if not x:
                raise ValueError(f"row {i} of {describe_source(path)}: prompt encodes to zero tokens")
            if self.max_prompt_length is not None and len(x) > self.max_prompt_length:
                if self.overlong == "raise":
                    raise ValueError(
                        f"row {i} of {describe_source(path)}: prompt has {len(x)} tokens > max_prompt_length="
                        f"{self.max_prompt_length} (overlong='raise'; overlong='filter' drops such rows)"
                    )
                continue
            keep.append(i)
        filtered = len(ids) - len(keep)
        self.num_filtered[describe_source(path)] = filtered
        if filtered:
            if not keep:
                raise ValueError(
                    f"every prompt of {describe_source(path)} is longer than "
                    f"max_prompt_length={self.max_prompt_length} tokens; raise max_prompt_length"
                )
            rank_zero_info(
                f"rlexact: filtered {filtered} of {len(ids)} prompts of {describe_source(path)} longer than "
                f"max_prompt_length={self.max_prompt_length} tokens"
            )
        texts = [p if isinstance(p, str) else _last_user_content(p) for p in prompts]
        return PromptDataset([ids[i] for i in keep], [texts[i] for i in keep], [answers[i] for i in keep], keep)

    def setup(self, stage: str | None = None) -> None:
        if stage == "validate" and self.val_path is None:
            raise ValueError(
                "validation needs evaluation prompts: set PromptDataModule(val_path=...) (in a config: "
                "data.init_args.val_path, e.g. --data.init_args.val_path eval.jsonl)"
            )
        if self.train_dataset is None and stage in (None, "fit"):
            self.train_dataset = self.build_dataset(self.path, self.split, self.limit)
        if self.val_dataset is None and self.val_path is not None and stage in (None, "fit", "validate"):
            self.val_dataset = self.build_dataset(self.val_path, self.val_split or self.split, self.val_limit)

    def _shard(self) -> tuple[int, int]:
        """``(num_replicas, rank)`` of the attached trainer's data-parallel layout (``(1, 0)`` without one)."""
        trainer = self.trainer
        kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
        if not kwargs:
            return 1, 0
        return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))

    def train_dataloader(self) -> ResumableDataLoader:
        """The resumable, rank-sharded train loader; ``ValueError`` where ``drop_last`` would leave it no batch."""
        if self.train_dataset is None:
            self.setup("fit")
        num_replicas, rank = self._shard()
        sampler = ResumableSampler(
            len(self.train_dataset), seed=self.seed, shuffle=self.shuffle, num_replicas=num_replicas, rank=rank
        )
        if self.drop_last and len(sampler) < self.batch_size:
            raise ValueError(
                f"the training prompts make no batch: {len(sampler)} prompts per rank ({len(self.train_dataset)} over "
                f"{num_replicas} rank(s)) are fewer than batch_size={self.batch_size}, and drop_last=True drops that "
                "incomplete batch; lower batch_size or set drop_last=False"
            )
        return ResumableDataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            collate_fn=collate_prompts,
            num_workers=self.num_workers,
            drop_last=self.drop_last,
        )

    def val_dataloader(self) -> DataLoader | list:
        if self.val_path is None:
            return []
        if self.val_dataset is None:
            self.setup("validate")
        return DataLoader(
            self.val_dataset,
            batch_size=self.val_batch_size or self.batch_size,
            shuffle=False,
            collate_fn=collate_prompts,
            num_workers=self.num_workers,
        )


def _last_user_content(messages: list[dict]) -> str:
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            return str(m.get("content", ""))
    return str(messages[-1].get("content", "")) if messages and isinstance(messages[-1], dict) else ""
