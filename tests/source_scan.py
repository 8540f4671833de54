"""Scans of the repository's Python sources for tests that check a property of every kernel."""

from __future__ import annotations

import ast


def jitted(tree: ast.Module) -> set[str]:
    """Names of the functions a module decorates with a ``jit`` (``@triton.jit``, ``@gluon.jit``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if ast.unparse(target).split(".")[-1] == "jit":
                    names.add(node.name)
    return names
