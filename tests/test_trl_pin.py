"""dna_factory/trl_pin.py: one TRL version, and every private TRL touch named next to its canary test."""

from __future__ import annotations

import re

from dna_factory.trl_pin import TOUCH_POINTS, TRL_VERSION
from tests.conftest import REPO
from tests.lazy import lazy

trl = lazy("trl")


def test_the_installed_trl_is_the_pinned_one():
    assert trl.__version__ == TRL_VERSION, (
        f"dna-factory is written against TRL {TRL_VERSION}; the canaries say where"
    )


def test_every_touch_point_names_a_module_and_a_canary_that_exist():
    for point in TOUCH_POINTS:
        assert (REPO / point.module).is_file(), point.module
        test_file, test_name = point.canary.split("::")
        assert re.search(rf"^def {re.escape(test_name)}\(", (REPO / test_file).read_text(), re.M), (
            point.canary
        )


def test_the_version_is_pinned_once():
    """A module that pins its own TRL version would drift from the others at the next upgrade."""
    pinned = [
        path.relative_to(REPO).as_posix()
        for path in (REPO / "dna_factory").rglob("*.py")
        if re.search(r"^TRL_VERSION\s*=", path.read_text(), re.M)
    ]
    assert pinned == ["dna_factory/trl_pin.py"]


def test_every_module_that_says_it_touches_trl_privates_is_listed():
    """A module whose docstring or comments speak of TRL's private API (``TRL 1.16 private``, ``touch point``,
    a canary) is one of the touch points."""
    listed = {point.module for point in TOUCH_POINTS}
    marker = re.compile(r"TRL [\d.]+ private|TRL [\d.]+ touch points|TRL touch points|canary", re.I)
    found = {
        path.relative_to(REPO).as_posix()
        for path in (REPO / "dna_factory").rglob("*.py")
        if path.name != "trl_pin.py" and marker.search(path.read_text())
    }
    assert found <= listed, (
        f"touch TRL privates but are not in dna_factory/trl_pin.py: {sorted(found - listed)}"
    )


PRIVATE_MODULES = ("trl.trainer.utils", "trl.models.utils", "trl.kernels")
"""TRL modules of internal helpers (not exported by ``trl`` itself): importing from one is a touch point."""


def _private_imports(path) -> list[str]:
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trl":
            names = [alias.name for alias in node.names]
            if node.module.startswith(PRIVATE_MODULES) or any(name.startswith("_") for name in names):
                found.append(f"{node.module}: {', '.join(names)}")
    return found


def test_every_module_that_imports_trl_internals_is_listed():
    """Seen from the code, not only from what a docstring says: filter/tool.py once imported
    trl.trainer.utils.is_async_callable and no canary watched it."""
    listed = {point.module for point in TOUCH_POINTS}
    unlisted = {
        path.relative_to(REPO).as_posix(): imports
        for path in (REPO / "dna_factory").rglob("*.py")
        if (imports := _private_imports(path)) and path.relative_to(REPO).as_posix() not in listed
    }
    assert not unlisted, f"import TRL internals but are not in dna_factory/trl_pin.py: {unlisted}"
