"""Embedded demo assets built in code: a character-level tokenizer and a synthetic arithmetic task."""

from rlexact.char_tokenizer import EOS_ID, PAD_ID, build_char_tokenizer
from rlexact.demo.task import ArithmeticTask, make_dataset, read_jsonl, write_jsonl

__all__ = [
    "EOS_ID",
    "PAD_ID",
    "ArithmeticTask",
    "build_char_tokenizer",
    "make_dataset",
    "read_jsonl",
    "write_jsonl",
]
