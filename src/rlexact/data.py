"""Prompt datasets for RL: a LightningDataModule that yields lists of tokenized prompts (no padding).

Each batch is a ``list[dict]`` of ``batch_size`` items::

    {"prompt_ids": list[int],   # token ids fed to the generator (chat template applied if enabled)
     "prompt_text": str,        # the prompt as stored in the dataset (before any chat template)
     "answer": str | None,      # ground truth for the reward (None when the row/column has none)
     "index": int}              # row index in the (limited) dataset

Sources: a local ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file, a local directory (a ``save_to_disk`` folder
or a folder of data files), or a hub dataset name (passed to ``datasets.load_dataset``).

Order: the train sampler draws epoch ``e``'s permutation from ``seed + e`` only (Lightning calls ``set_epoch``), so
the order is a pure function of ``(seed, epoch)`` — identical after a restart from a checkpoint, and forwarded by
Lightning's distributed sampler wrapper under DDP.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = [
    "DEMO_TOKENIZER",
    "PromptDataModule",
    "PromptDataset",
    "SeededSampler",
    "collate_prompts",
    "encode_prompts",
    "load_prompt_rows",
    "load_tokenizer",
]

DEMO_TOKENIZER = "demo-char"
"""Special tokenizer name: :func:`rlexact.demo.tokenizer.build_char_tokenizer`."""

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object from ``"demo-char"``, a local path / hub name (``AutoTokenizer``), or an existing object."""
    if isinstance(tokenizer, (str, os.PathLike)):
        name = os.fspath(tokenizer)
        if name == DEMO_TOKENIZER:
            from rlexact.demo.tokenizer import build_char_tokenizer

            return build_char_tokenizer()
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    if tokenizer is None:
        raise ValueError("a tokenizer is required")
    return tokenizer


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


def load_prompt_rows(path: str | os.PathLike, split: str = "train", **load_kwargs: Any):
    """Load a ``datasets.Dataset`` from a local file, a local directory or a hub name.

    A single local file is one split (``split`` is ignored). A ``save_to_disk`` directory (or ``DatasetDict``) is
    indexed by ``split``. Anything else goes to ``datasets.load_dataset(path, split=split)``.
    """
    import datasets

    path = os.fspath(path)
    if os.path.isfile(path):
        ext = next((e for e in _FILE_BUILDERS if path.lower().endswith(e)), None)
        if ext is None:
            raise ValueError(f"unsupported file type {path!r}; expected one of {sorted(_FILE_BUILDERS)}")
        try:
            return datasets.load_dataset(_FILE_BUILDERS[ext], data_files=path, split="train", **load_kwargs)
        except Exception as e:  # datasets fails in varied ways on files with no rows
            if _file_has_no_rows(path, ext):
                raise ValueError(f"dataset {path!r} is empty") from e
            raise
    if os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json")):
        ds = datasets.load_from_disk(path)  # a save_to_disk folder
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"split {split!r} not in {path!r}; available splits: {sorted(ds)}")
            ds = ds[split]
        return ds
    return datasets.load_dataset(path, split=split, **load_kwargs)


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


def collate_prompts(items: list[dict]) -> list[dict]:
    """Identity collate: a batch is the list of item dicts (ragged ``prompt_ids``, no padding)."""
    return list(items)


class PromptDataset(Dataset):
    """In-memory prompts, already tokenized: item ``i`` is ``{"prompt_ids", "prompt_text", "answer", "index"}``."""

    def __init__(self, prompt_ids: list[list[int]], prompt_texts: list[Any], answers: list[str | None]):
        if not (len(prompt_ids) == len(prompt_texts) == len(answers)):
            raise ValueError("prompt_ids, prompt_texts and answers must have the same length")
        self.prompt_ids = prompt_ids
        self.prompt_texts = prompt_texts
        self.answers = answers

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def __getitem__(self, i: int) -> dict:
        return {
            "prompt_ids": list(self.prompt_ids[i]),
            "prompt_text": self.prompt_texts[i],
            "answer": self.answers[i],
            "index": int(i),
        }


class SeededSampler(Sampler[int]):
    """Indices ``0..n-1``, shuffled with a generator seeded by ``seed + epoch`` (or in order if not ``shuffle``).

    The order of an epoch depends only on ``(seed, epoch)``; Lightning calls :meth:`set_epoch` at each epoch start.
    """

    def __init__(self, num_items: int, seed: int = 0, shuffle: bool = True):
        self.num_items = int(num_items)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.num_items

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.num_items))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.num_items, generator=g).tolist())


def _describe(path: Any) -> str:
    return repr(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else type(path).__name__


class PromptDataModule(L.LightningDataModule):
    """Prompts (and ground-truth answers) for RL rollouts.

    Args:
        path: local ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file, local directory, or hub dataset name.
            A ``datasets.Dataset`` or a list of row dicts is also accepted when constructed in Python.
        tokenizer: ``"demo-char"`` (the built-in demo tokenizer), a path or name for ``AutoTokenizer``, or a
            tokenizer object.
        prompt_key: column holding the prompt (a string, or a chat conversation: a list of role/content dicts).
        answer_key: column holding the ground truth (values become ``str``); if the column is absent (or
            ``answer_key`` is None) answers are None.
        split: dataset split (for hub datasets and ``save_to_disk`` folders; a single file is one split).
        batch_size: prompts per rollout step.
        use_chat_template: apply the tokenizer's chat template; None = use it when the tokenizer has one.
        max_prompt_length: if set, a prompt with more tokens raises ValueError at setup (naming the row and length).
        shuffle: shuffle the train set (order is a pure function of ``seed`` and the epoch).
        seed: shuffle seed.
        num_workers: DataLoader workers.
        limit: keep only the first ``limit`` rows (before shuffling).
        val_path: optional evaluation prompts (same format and columns); enables ``val_dataloader``.
        val_batch_size: evaluation batch size (default ``batch_size``).
        val_limit: keep only the first ``val_limit`` evaluation rows.
        drop_last: drop the last incomplete train batch.
    """

    def __init__(
        self,
        path: Any,
        tokenizer: Any = DEMO_TOKENIZER,
        prompt_key: str = "prompt",
        answer_key: str | None = "answer",
        split: str = "train",
        batch_size: int = 8,
        use_chat_template: bool | None = None,
        max_prompt_length: int | None = None,
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
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_prompt_length is not None and max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1 or None, got {max_prompt_length}")
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0 or None, got {limit}")
        self.path = path
        self._tokenizer_arg = tokenizer
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.split = split
        self.batch_size = batch_size
        self.use_chat_template = use_chat_template
        self.max_prompt_length = max_prompt_length
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
    def tokenizer(self) -> Any:
        """The tokenizer object (loaded on first access)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self._tokenizer_arg)
        return self._tokenizer

    @property
    def chat_template_enabled(self) -> bool:
        """Whether prompts are rendered with the chat template (resolves ``use_chat_template=None``)."""
        if self.use_chat_template is None:
            return getattr(self.tokenizer, "chat_template", None) is not None
        return bool(self.use_chat_template)

    def _load_rows(self, path: Any, split: str, limit: int | None):
        import datasets

        if isinstance(path, datasets.Dataset):
            ds = path
        elif isinstance(path, list):
            ds = datasets.Dataset.from_list(path) if path else None
        else:
            ds = load_prompt_rows(path, split=split)
        if ds is None or len(ds) == 0:
            raise ValueError(f"dataset {_describe(path)} is empty")
        if limit is not None:
            ds = ds.select(range(min(limit, len(ds))))
            if len(ds) == 0:
                raise ValueError(f"dataset {_describe(path)} is empty (limit={limit})")
        return ds

    def build_dataset(self, path: Any, split: str | None = None, limit: int | None = None) -> PromptDataset:
        """Load, check and tokenize one source into a :class:`PromptDataset`."""
        ds = self._load_rows(path, split or self.split, limit)
        columns = list(ds.column_names)
        if self.prompt_key not in columns:
            raise ValueError(
                f"prompt_key {self.prompt_key!r} not in dataset {_describe(path)}; available columns: {columns}"
            )
        prompts = list(ds[self.prompt_key])
        for i, p in enumerate(prompts):
            if p is None or not isinstance(p, (str, list)):
                raise ValueError(
                    f"row {i} of {_describe(path)}: prompt must be a string or a list of messages, got "
                    f"{type(p).__name__}"
                )
        if self.answer_key is not None and self.answer_key in columns:
            answers = [None if a is None else str(a) for a in ds[self.answer_key]]
        else:
            answers = [None] * len(prompts)
        ids = encode_prompts(self.tokenizer, prompts, self.chat_template_enabled)
        for i, x in enumerate(ids):
            if not x:
                raise ValueError(f"row {i} of {_describe(path)}: prompt encodes to zero tokens")
            if self.max_prompt_length is not None and len(x) > self.max_prompt_length:
                raise ValueError(
                    f"row {i} of {_describe(path)}: prompt has {len(x)} tokens > max_prompt_length="
                    f"{self.max_prompt_length}"
                )
        texts = [p if isinstance(p, str) else _last_user_content(p) for p in prompts]
        return PromptDataset(ids, texts, answers)

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is None and stage in (None, "fit"):
            self.train_dataset = self.build_dataset(self.path, self.split, self.limit)
        if self.val_dataset is None and self.val_path is not None and stage in (None, "fit", "validate"):
            self.val_dataset = self.build_dataset(self.val_path, self.val_split or self.split, self.val_limit)

    def train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            self.setup("fit")
        return DataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=SeededSampler(len(self.train_dataset), seed=self.seed, shuffle=self.shuffle),
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
