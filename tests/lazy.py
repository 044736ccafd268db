"""Heavy libraries for the test modules, imported on first use (#31: collecting the suite takes seconds).

``torch = lazy("torch")`` at the top of a test module reads like ``import torch``: the first attribute
looked up (``torch.tensor``) imports the module. Collection imports every test module, and torch, TRL
and transformers take 8-12 s here; a run of one fast test should not pay for them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

MODULE_NAMES = frozenset({"__version__", "__file__", "__path__", "__name__", "__spec__"})
"""The private names a test may read from a module; they import it like any public one."""


class LazyModule:
    """A stand-in for the module ``name`` that imports it when an attribute is first read."""

    def __init__(self, name: str) -> None:
        self._name = name

    def _module(self) -> ModuleType:
        return importlib.import_module(self._name)

    def __getattr__(self, attribute: str):
        # pytest's collection probes every module-level object for its own private names (__test__,
        # _pytestfixturefunction, pytestmark, __wrapped__): answering those would import the module
        if attribute == "pytestmark" or (attribute.startswith("_") and attribute not in MODULE_NAMES):
            raise AttributeError(attribute)
        return getattr(self._module(), attribute)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


def lazy(name: str) -> LazyModule:
    """``name`` (a dotted module path), imported on first attribute access."""
    return LazyModule(name)
