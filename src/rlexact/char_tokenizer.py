"""A tiny character-level tokenizer for the embedded demo, built in code (no downloads).

The tokenizer is a real :class:`transformers.PreTrainedTokenizerFast` (a ``tokenizers`` ``WordLevel`` model over single
characters), so it saves with ``save_pretrained`` and loads back with ``AutoTokenizer.from_pretrained(local_dir)``.

Vocabulary (``VOCAB``, 50 tokens, ids are stable):

====  =================  ==========================================
id    token              role
====  =================  ==========================================
0     ``<pad>``          ``pad_token_id`` (``PAD_ID``)
1     ``<unk>``          ``unk_token_id`` (any character not below)
2     ``<|im_start|>``   chat turn start (``IM_START_ID``)
3     ``<|im_end|>``     ``eos_token_id`` (``EOS_ID``), chat turn end
4-13  ``0`` … ``9``      digits (``"0"`` is id 4, ``"9"`` id 13)
14-   ``+ - * =``        operators
      space, newline     whitespace
      ``a`` … ``z``      lowercase letters (input is lower-cased)
      ``? : , .``        punctuation
====  =================  ==========================================

There is no BOS token and no post-processor: ``tokenizer("12+7=")["input_ids"]`` is exactly one id per character.
The input is normalized with ``Lowercase`` (special tokens are matched before normalization, so they are unaffected).

The chat template is Qwen-style::

    <|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n      (with add_generation_prompt=True)
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = [
    "CHAT_TEMPLATE",
    "EOS_ID",
    "EOS_TOKEN",
    "IM_START_ID",
    "IM_START_TOKEN",
    "PAD_ID",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "UNK_ID",
    "UNK_TOKEN",
    "VOCAB",
    "build_char_tokenizer",
]

PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
IM_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, UNK_TOKEN, IM_START_TOKEN, EOS_TOKEN)

_CHARS: tuple[str, ...] = (
    tuple(string.digits) + ("+", "-", "*", "=", " ", "\n") + tuple(string.ascii_lowercase) + ("?", ":", ",", ".")
)

VOCAB: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + _CHARS)}
"""Token → id. 4 special tokens followed by 46 characters (50 in total)."""

PAD_ID: int = VOCAB[PAD_TOKEN]  # 0
UNK_ID: int = VOCAB[UNK_TOKEN]  # 1
IM_START_ID: int = VOCAB[IM_START_TOKEN]  # 2
EOS_ID: int = VOCAB[EOS_TOKEN]  # 3

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
"""Qwen-style jinja chat template (string ``content`` only)."""


def build_char_tokenizer(model_max_length: int = 4096) -> PreTrainedTokenizerFast:
    """Build the demo character-level tokenizer (see the module docstring for the vocabulary).

    Args:
        model_max_length: stored as ``tokenizer.model_max_length``.

    Returns:
        A ``PreTrainedTokenizerFast`` with ``eos_token="<|im_end|>"`` (id 3), ``pad_token="<pad>"`` (id 0),
        ``unk_token="<unk>"`` (id 1), no BOS, and :data:`CHAT_TEMPLATE` as ``chat_template``.
    """
    tok = Tokenizer(models.WordLevel(vocab=dict(VOCAB), unk_token=UNK_TOKEN))
    tok.normalizer = normalizers.Lowercase()
    # One pre-token per character (newline included: "[\s\S]" matches any character).
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # concatenate characters with no separator
    tok.add_special_tokens(list(SPECIAL_TOKENS))

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=None,
        additional_special_tokens=[IM_START_TOKEN],
        model_max_length=model_max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    assert hf.eos_token_id == EOS_ID and hf.pad_token_id == PAD_ID, "demo tokenizer ids drifted"
    return hf
