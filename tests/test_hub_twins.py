"""The offline Hub twins: every Hub dataset a shipped recipe names has one (or a stated reason), and the
SFT, DPO and RLHF recipes load their twins through the project's own data path in the format their
trainer expects. (The RL recipes' twins are checked against their rewards in test_recipe_answers.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dna_factory.rehearsal.twins import CORPUS_TWINS, HUB_TWINS, NO_OFFLINE_TWIN, substitute_twins
from tests.conftest import REPO

STAGES = {"sft": "sft", "dpo": "dpo", "grpo": "grpo", "distill": "distill"}  # configs/<entry>/
LOADED = {
    "configs/sft/qwen3-0.6B-sft.yaml": "messages",
    "configs/sft/glm-4.5-air-sft.yaml": "messages",
    "configs/dpo/qwen3-0.6B-dpo.yaml": "chosen",
    "configs/grpo/glm-4.5-air-rlhf.yaml": "prompt",
}


def _hub_paths(recipe: Path) -> list[str]:
    data = yaml.safe_load(recipe.read_text()) or {}
    paths = [d["path"] for d in data.get("datasets") or [] if isinstance(d, dict)]
    return [p for p in paths if not (REPO / p).exists() and not p.startswith(("data/", "artifacts/", "/"))]


def test_every_hub_dataset_a_shipped_recipe_names_has_a_twin_or_a_reason():
    recipes = [p for d in STAGES for p in (REPO / "configs" / d).glob("*.yaml") if "tiny" not in p.name]
    named = {path for recipe in recipes for path in _hub_paths(recipe)}
    assert named, "no recipe names a Hub dataset"
    assert named <= set(HUB_TWINS) | set(NO_OFFLINE_TWIN), named - set(HUB_TWINS) - set(NO_OFFLINE_TWIN)


def test_every_hub_search_corpus_a_shipped_recipe_names_has_a_twin():
    recipes = [p for d in STAGES for p in (REPO / "configs" / d).glob("*.yaml") if "tiny" not in p.name]
    options = [(yaml.safe_load(r.read_text()) or {}).get("environment_options") or {} for r in recipes]
    named = {o["corpus"] for o in options if o.get("corpus") and not (REPO / o["corpus"]).exists()}
    assert named, "no recipe names a Hub corpus"
    assert named <= set(CORPUS_TWINS), named - set(CORPUS_TWINS)


@pytest.mark.parametrize("recipe", sorted(LOADED))
def test_the_recipes_twins_load_in_the_format_its_trainer_expects(recipe, tmp_path):
    from dna_factory.inputs.data import load_mixture, parse_specs
    from dna_factory.inputs.loading import prompt_rule
    from dna_factory.run.runner import prepare

    path = REPO / recipe
    twin, _ = substitute_twins(path, tmp_path, rows={p: 40 for p in HUB_TWINS})
    stage, cfg = prepare(STAGES[path.parent.name], ["--config", str(twin), "--dry_run"])
    for spec in parse_specs(cfg.get("datasets")):
        ds = load_mixture([spec], stage.data_format, seed=0, prompt_rule=prompt_rule(cfg))
        rows = ds.to_list()
        assert len(rows) == 40, (spec.label, len(rows))
        column = LOADED[recipe]
        assert all(isinstance(r[column], list) and r[column] for r in rows), (column, rows[0])
        if column == "chosen":
            assert all(r["chosen"] != r["rejected"] for r in rows)
