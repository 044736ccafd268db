"""A dict that computes what it lacks: the caches of the string-match reward's hot paths.

An ``lru_cache`` hit costs a call (a tuple of arguments, a key, a move to the front of its list); a
:class:`Memo` hit is one subscription (``memo[key]``), a few times cheaper. A miss calls ``compute(key)`` and
keeps the value; a full memo empties itself (``maxsize`` entries) rather than evicting one by one. Like
``lru_cache`` it keeps no exception, and it has ``cache_clear()``; calling it (``memo(key)``) reads it too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Memo(dict):
    """``memo[key]``: ``compute(key)``, computed once (see the module docstring)."""

    __slots__ = ("compute", "maxsize")

    def __init__(self, compute: Callable[[Any], Any], maxsize: int = 65536):
        super().__init__()
        self.compute, self.maxsize = compute, maxsize

    def __missing__(self, key: Any) -> Any:
        if len(self) >= self.maxsize:
            self.clear()
        value = self[key] = self.compute(key)
        return value

    def __call__(self, key: Any) -> Any:
        return self[key]

    def cache_clear(self) -> None:
        self.clear()
