"""Which modules the tests' process may take as its own copies of what the program imported (standard library
only: :mod:`rewards.sandbox.boot` loads this file by path, beside :mod:`rewards.sandbox.channel`).

The program's globals reach the tests through :mod:`rewards.sandbox.channel`; a module among them (``import math``,
``import numpy as np``) is never sent: the tests get their own copy, imported from the standard library's own
directory or the interpreter's ``site-packages`` (:func:`trusted_module`), never from a path the program could
write to. A program value under a module's name (a fake ``math``, a fake ``np`` whose ``allclose`` says yes) is a
shadow (:func:`shadows_a_module`): the tests get the real module under that name.

Example:
    >>> trusted_module("math").__name__, trusted_module("no_such_module_here")
    ('math', None)
    >>> shadows_a_module("np"), real_module("np") is trusted_module("numpy")
    (True, True)
"""

from __future__ import annotations

import builtins
import importlib
import importlib.util
import os
import sys
import sysconfig
import types
from typing import Any

_STDLIB = sysconfig.get_paths()["stdlib"]


def _stdlib_module(name: Any) -> types.ModuleType | None:
    """``name`` imported on the test side when it is a standard-library module found in the standard library's
    own directory (or built in), never from ``site-packages`` or a path the program could write to."""
    if not isinstance(name, str) or name.split(".")[0] not in sys.stdlib_module_names:
        return None
    if name in sys.modules:
        return sys.modules[name]
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    origin = getattr(spec, "origin", None) if spec is not None else None
    if origin not in ("built-in", "frozen") and not (
        isinstance(origin, str) and os.path.realpath(origin).startswith(os.path.realpath(_STDLIB) + os.sep)
    ):
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


THIRD_PARTY_ALIASES = {
    "np": "numpy",
    "pd": "pandas",
    "plt": "matplotlib.pyplot",
    "sp": "scipy",
    "nx": "networkx",
    "sns": "seaborn",
    "tf": "tensorflow",
}
"""The conventional names of third-party modules: a program value under one of them is a shadow (like a fake
``math``), and the tests get the installed module."""


def _site_dirs() -> list[str]:
    return [
        os.path.realpath(path)
        for path in sys.path
        if isinstance(path, str) and ("site-packages" in path or "dist-packages" in path)
    ]


def _installed_module(name: Any) -> types.ModuleType | None:
    """``name`` imported on the test side when it is installed in the interpreter's own ``site-packages`` (the
    tests' own copy of what the program imported, as for the standard library), never from a path the program
    could write to."""
    if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
        return None
    if name in sys.modules:
        return sys.modules[name]
    try:
        spec = importlib.util.find_spec(name.split(".")[0])
    except (ImportError, ValueError):
        return None
    locations = [getattr(spec, "origin", None), *(getattr(spec, "submodule_search_locations", None) or ())]
    sites = _site_dirs()
    if spec is None or not any(
        isinstance(where, str) and any(os.path.realpath(where).startswith(site + os.sep) for site in sites)
        for where in locations
    ):
        return None
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a module that does not import here is not given to the tests
        return None


def trusted_module(name: Any) -> types.ModuleType | None:
    """The test side's own copy of module ``name``: from the standard library or ``site-packages``, else None."""
    return _stdlib_module(name) or _installed_module(name)


def shadows_a_module(name: str) -> bool:
    """Whether a program value named ``name`` stands where a built-in, a standard-library module or a third-party
    module's usual name (:data:`THIRD_PARTY_ALIASES`) would."""
    return hasattr(builtins, name) or name in sys.stdlib_module_names or name in THIRD_PARTY_ALIASES


def real_module(name: str) -> types.ModuleType | None:
    """The trusted module a shadowing name stands for (``np`` -> numpy), or None."""
    return trusted_module(THIRD_PARTY_ALIASES.get(name, name))
