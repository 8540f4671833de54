"""Rewards for synthetic tasks with a short, exact answer (e.g. :mod:`rlexact.demo.task`).

Both rewards first cut the completion at the first stop text (newline or an eos text such as ``"<|im_end|>"``, see
:data:`~rlexact.rewards.base.DEFAULT_STOP_TEXTS`) and strip surrounding whitespace.

:class:`ArithmeticReward` partial credit (``partial_credit=True``), for an integer ground truth ``g`` and a
completion ``p`` that is not numerically equal to it:

==========================================  =======================================================
condition                                   credit
==========================================  =======================================================
``p`` is not an integer (``[+-]?\\d+``)      0.0 in total
``p`` is a well-formed integer               +0.1  (format)
same number of digits and same sign          +0.2  (length)
digits equal at aligned positions            +0.6 × matches / max(#digits p, #digits g), positions
                                             aligned from the units digit (carries propagate
                                             right to left); halved if the signs differ
==========================================  =======================================================

Digits are compared on the canonical form (``int(p)``, so leading zeros are ignored). A correct answer scores 1.0 and
every wrong answer scores at most ``0.3 + 0.6 (L-1)/L < 0.9``, so the exact answer is always strictly best; the
score is a pure function of ``(completion, answer)``. For ``"12+7="`` → ``"19"``: ``"19"`` 1.0, ``"18"`` 0.6,
``"29"`` 0.6, ``"9"`` 0.1 + 0.3 = 0.4, ``"191"`` 0.1, ``"x"`` 0.0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from rlexact.rewards.base import DEFAULT_STOP_TEXTS, PerSampleReward, truncate_at_stop

__all__ = ["ArithmeticReward", "ExactMatchReward"]

_INT_RE = re.compile(r"[+-]?\d+")


class ExactMatchReward(PerSampleReward):
    """1.0 if the completion (cut at the first stop text, stripped) equals the stripped answer, else 0.0.

    Args:
        stop_texts: the completion is cut at the earliest of these.
        case_sensitive: compare case-sensitively (default True).
        normalize_whitespace: collapse runs of whitespace to one space on both sides before comparing.
    """

    def __init__(
        self,
        stop_texts: Sequence[str] = DEFAULT_STOP_TEXTS,
        case_sensitive: bool = True,
        normalize_whitespace: bool = False,
    ):
        self.stop_texts = tuple(stop_texts)
        self.case_sensitive = case_sensitive
        self.normalize_whitespace = normalize_whitespace

    def _norm(self, s: str) -> str:
        s = s.strip()
        if self.normalize_whitespace:
            s = " ".join(s.split())
        if not self.case_sensitive:
            s = s.casefold()
        return s

    def score(self, prompt: str, completion: str, answer: str | None) -> float:
        if answer is None or completion is None:
            return 0.0
        pred = truncate_at_stop(str(completion), self.stop_texts)
        return 1.0 if self._norm(pred) == self._norm(str(answer)) else 0.0


class ArithmeticReward(PerSampleReward):
    """Integer-answer reward: 1.0 if the completion's integer equals the answer; optional partial credit.

    Args:
        partial_credit: if True, wrong but well-formed integers get a graded score in ``[0.1, 0.9)`` (format,
            length and right-aligned digit matches; see the module docstring). If False (default) the reward is
            0/1 accuracy.
        stop_texts: the completion is cut at the earliest of these.

    A non-integer ground truth falls back to an exact string match (no partial credit).
    """

    FORMAT_CREDIT = 0.1
    LENGTH_CREDIT = 0.2
    DIGIT_CREDIT = 0.6

    def __init__(self, partial_credit: bool = False, stop_texts: Sequence[str] = DEFAULT_STOP_TEXTS):
        self.partial_credit = partial_credit
        self.stop_texts = tuple(stop_texts)

    def score(self, prompt: str, completion: str, answer: str | None) -> float:
        if answer is None or completion is None:
            return 0.0
        pred = truncate_at_stop(str(completion), self.stop_texts).strip()
        gold = str(answer).strip()
        if not _INT_RE.fullmatch(gold):
            return 1.0 if pred == gold else 0.0
        if not _INT_RE.fullmatch(pred):
            return 0.0
        p, g = int(pred), int(gold)
        if p == g:
            return 1.0
        if not self.partial_credit:
            return 0.0
        return self.partial_score(p, g)

    @classmethod
    def partial_score(cls, pred: int, gold: int) -> float:
        """Graded score of a wrong integer ``pred`` against ``gold`` (``pred != gold``), in ``[0.1, 0.9)``."""
        pd, gd = str(abs(pred)), str(abs(gold))
        same_sign = (pred < 0) == (gold < 0)
        score = cls.FORMAT_CREDIT
        if len(pd) == len(gd) and same_sign:
            score += cls.LENGTH_CREDIT
        matches = sum(a == b for a, b in zip(reversed(pd), reversed(gd)))
        digit = cls.DIGIT_CREDIT * matches / max(len(pd), len(gd))
        if not same_sign:
            digit *= 0.5
        return round(score + digit, 6)
