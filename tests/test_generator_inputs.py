"""The generator's and the trainer path's argument checks that a transformers user meets (CPU): temperatures whose
reciprocal overflows float32, ``score``'s sampling arguments, stop ids outside the vocabulary, and the fix the
left-padding error names."""

from __future__ import annotations

import pytest
import torch

import rlexact
from models import tiny_model
from rlexact.checks import MIN_TEMPERATURE
from rlexact.config import RolloutConfig
from rlexact.rollout import Generator, SamplingParams

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79]]
VOCAB = 97
"""tiny_model's default vocabulary."""


@pytest.fixture(scope="module")
def qwen() -> torch.nn.Module:
    return rlexact.exactify(tiny_model("qwen3"))


@pytest.mark.parametrize("temperature", [1e-39, MIN_TEMPERATURE / 2])
def test_a_temperature_whose_reciprocal_overflows_is_refused(qwen, temperature: float) -> None:
    with pytest.raises(ValueError, match="temperature must be at least .* overflows float32 .* 0 for greedy"):
        SamplingParams(temperature=temperature)
    with pytest.raises(ValueError, match="temperature must be at least .* overflows float32"):
        Generator(qwen).score(PROMPTS, temperature=temperature)
    with pytest.raises(ValueError, match="temperature must be at least .* overflows float32"):
        rlexact.sequence_logprobs(qwen, PROMPTS, temperature)
    with pytest.raises(ValueError, match="rollout.temperature must be at least .* overflows float32"):
        RolloutConfig(temperature=temperature)


def test_the_smallest_temperature_is_greedy_with_finite_logprobs(qwen) -> None:
    """Negative control: at the bound itself the reciprocal fits, the draw is the argmax and the log-probs are
    finite."""
    small = SamplingParams(max_new_tokens=4, temperature=MIN_TEMPERATURE * 2, ignore_eos=True)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    gen = Generator(qwen)
    outs, ref = gen.generate(PROMPTS, small), gen.generate(PROMPTS, greedy)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert all(torch.isfinite(o.logprobs).all() for o in outs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top_k": 2.5}, "top_k must be an int"),
        ({"top_k": True}, "top_k must be an int"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"top_p": "0.5"}, "top_p must be a finite number"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ],
)
def test_score_checks_its_arguments_as_sampling_params_do(qwen, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Generator(qwen).score(PROMPTS, **kwargs)


def test_stop_ids_outside_the_vocabulary_are_refused(qwen) -> None:
    with pytest.raises(ValueError, match=rf"stop_token_ids has ids \[{VOCAB}\] outside the vocabulary"):
        Generator(qwen).generate(PROMPTS, SamplingParams(max_new_tokens=2, stop_token_ids=[5, VOCAB]))
    Generator(qwen).generate(PROMPTS, SamplingParams(max_new_tokens=2, stop_token_ids=[5, VOCAB - 1]))


def test_left_padded_forward_error_names_the_positions_that_work(qwen) -> None:
    """A plain forward on left-padded ids counts positions from the padding: refused, naming ``position_ids`` from
    the mask; with those positions each row's logits equal its unpadded forward's bit for bit."""
    ids = torch.tensor([[0, 0, 35, 89, 79], [3, 14, 15, 92, 65]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"position_ids=\(attention_mask.cumsum\(-1\) - 1\).clamp\(min=0\)"):
            qwen(ids, attention_mask=mask, use_cache=False)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        padded = qwen(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        alone = qwen(ids[:1, 2:], use_cache=False).logits
    assert torch.equal(padded[0, 2:], alone[0])
