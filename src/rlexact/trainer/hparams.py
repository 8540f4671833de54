"""Hyperparameters of :class:`rlexact.RLModule` as plain values, so checkpoints load with ``weights_only=True``.

``save_hyperparameters`` keeps the constructor arguments as given: config dataclasses would be pickled as objects
(``torch.load(weights_only=True)``, torch's default, refuses them) and ``tokenizer=None`` would hide the tokenizer
actually used. ``RLModule`` records each resolved config through :func:`plain` (a dict of its fields, tuples as
lists) and the tokenizer as its resolved source.

An argument given as an object (a reward object or function, a tokenizer object, an ``optimizer`` /
``lr_scheduler`` callable) has no plain form. ``RLModule`` records :func:`unsaved_marker` in its place, a dict that
describes the object; a module constructed with such a marker (what ``RLModule.load_from_checkpoint(path)`` does)
holds an :class:`Unsaved` placeholder instead, which raises an error naming the argument, the object and the fix
(``RLModule.load_from_checkpoint(path, <argument>=...)``) wherever the object is used (:func:`require`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, NoReturn

__all__ = ["UNSAVED_KEY", "Unsaved", "is_plain", "is_unsaved", "plain", "require", "restore", "unsaved_marker"]

UNSAVED_KEY = "rlexact_unsaved"
"""The key that marks an :func:`unsaved_marker` dict; its value is the qualified name of the object's type."""

_REPR_CHARS = 120  # an unsaved object's repr is kept up to this many characters


def plain(value: Any) -> Any:
    """``value`` with dataclasses turned into dicts and tuples into lists, recursively (YAML- and
    ``weights_only``-safe)."""
    if is_dataclass(value) and not isinstance(value, type):
        return plain(asdict(value))
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def is_plain(value: Any) -> bool:
    """True if ``value`` is None, a bool, int, float or str, or a list or string-keyed dict of such values
    (recursively): what a YAML file and ``torch.load(weights_only=True)`` hold."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, list):
        return all(is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain(v) for k, v in value.items())
    return False


def unsaved_marker(value: Any) -> dict[str, str]:
    """The plain hyperparameter recorded in place of the object ``value``: ``{UNSAVED_KEY: <type>, "repr": <repr>}``,
    where the type is the qualified name of the object's class (of the object itself when it is a class or a
    function) and the repr is shortened."""
    named = value if inspect.isclass(value) or inspect.isroutine(value) else type(value)
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not stop the module's construction; the type still names the object
        text = object.__repr__(value)
    if len(text) > _REPR_CHARS:
        text = text[: _REPR_CHARS - 3] + "..."
    return {UNSAVED_KEY: f"{named.__module__}.{named.__qualname__}", "repr": text}


def is_unsaved(value: Any) -> bool:
    """True if ``value`` is an :func:`unsaved_marker` dict."""
    return isinstance(value, Mapping) and UNSAVED_KEY in value


@dataclass(frozen=True)
class Unsaved:
    """Stands in for the object of ``RLModule``'s argument ``name`` that the checkpoint did not hold (``marker``
    describes it). Calling it raises the error of :meth:`error`, as :func:`require` does."""

    name: str
    marker: Mapping[str, str]

    def error(self) -> RuntimeError:
        """The error that names the argument, the object it was and the fix."""
        described = f"{self.marker.get('repr', '?')} ({self.marker[UNSAVED_KEY]})"
        return RuntimeError(
            f"the checkpoint does not hold RLModule's {self.name} argument: it was an object, {described}, which "
            f"hyperparameters cannot store; pass it again: RLModule.load_from_checkpoint(path, {self.name}=...)"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise self.error()


def restore(name: str, value: Any) -> Any:
    """``value``, or an :class:`Unsaved` placeholder for argument ``name`` when ``value`` is an
    :func:`unsaved_marker`."""
    return Unsaved(name, dict(value)) if is_unsaved(value) else value


def require(value: Any) -> Any:
    """``value``; raises the placeholder's ``RuntimeError`` (:meth:`Unsaved.error`) when it is an :class:`Unsaved`."""
    if isinstance(value, Unsaved):
        raise value.error()
    return value
