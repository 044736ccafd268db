"""The stage registry: which module declares each stage (:data:`STAGE_MODULES`), the execution modes that swap
a stage's trainer (:data:`VARIANTS`), and the lookups (:func:`get_stage`, :func:`select_stage`).
"""

from __future__ import annotations

import importlib

from dna_factory.configuration.config import peek_value
from dna_factory.stages.base import Stage, stage_keys

STAGE_MODULES = {
    "sft": "dna_factory.stages.sft",
    "dpo": "dna_factory.stages.dpo",
    "grpo": "dna_factory.grpo.stage",
    "distill": "dna_factory.distill.stage",
}


VARIANTS: dict[str, tuple[str, str, dict[str, str]]] = {
    "grpo": ("grpo_execution", "sync", {"async": "dna_factory.async_grpo.stage"}),
}
"""Execution modes that swap a stage's trainer: ``stage -> (the key that picks one, the value of the stage in
:data:`STAGE_MODULES`, {other value: module declaring that variant's Stage})``. A variant module may define
``check_environment()``, run when it is picked (before parsing)."""


def get_stage(name: str) -> Stage:
    """The Stage object declared by the module :data:`STAGE_MODULES` names for ``name``."""
    if name not in STAGE_MODULES:
        raise KeyError(f"Unknown stage {name!r}; known: {', '.join(STAGE_MODULES)}")
    return importlib.import_module(STAGE_MODULES[name]).STAGE


def _variant_modules(name: str) -> dict[str, str]:
    key, base, others = VARIANTS.get(name, (None, None, {}))
    return {base: STAGE_MODULES[name], **others} if key else {}


def select_stage(name: str, argv: list[str]) -> Stage:
    """The Stage ``argv`` picks for entry ``name``: a variant of :data:`VARIANTS` when its key (recipe or CLI; the
    CLI wins) names one, else the registered stage."""

    modules = _variant_modules(name)
    value = peek_value(argv, VARIANTS[name][0]) if modules else None
    if value not in modules or modules[value] == STAGE_MODULES[name]:
        return get_stage(name)
    module = importlib.import_module(modules[value])
    check = getattr(module, "check_environment", None)
    if check is not None:
        check()
    return module.STAGE


def variant_foreign_keys(name: str, stage: Stage) -> dict[str, str]:
    """Keys that only a sibling variant of ``stage`` accepts, each mapped to the reason the user sees."""

    modules = _variant_modules(name)
    if not modules:
        return {}
    key = VARIANTS[name][0]
    own = stage_keys(stage)
    foreign: dict[str, str] = {}
    for value, module in modules.items():
        sibling = importlib.import_module(module).STAGE
        if sibling is stage:
            continue
        others = [v for v, m in modules.items() if m != module]
        reason = f"applies to {key}: {value} only. Set {key}: {value}, or remove it (this run is {key}: {'/'.join(others)})."
        foreign.update({k: reason for k in stage_keys(sibling) - own if k not in foreign})
    return foreign
