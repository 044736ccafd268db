"""Shipped recipes ask for what their rewards read (issue 20), proven on the datasets' own gold answers.

For every shipped RL and distillation recipe with a string-match, code or IFEval reward, read the
YAML as shipped, swap each Hub dataset for its offline twin (``scripts/make_hub_twins.py``: real
rows, the Hub schema — the only change made to a recipe), render the prompts exactly as the run
does (``runner.prompt_rule`` + ``data.load_mixture``), then:

* find which answer form the rendered prompt (system turn included) asks for: a ```python block,
  ``\\boxed{}``, ``####``, or nothing;
* write each row's gold answer that way, from the gold its *source* states (GSM8K's
  ``short_answer``, MATH's ``answer``, MBPP's reference program), not re-extracted from the column
  the reward reads;
* score it with the recipe's own reward stack: at least 99% of rows must get 1.0 from every reward
  that applies, and a deliberately wrong answer written the same way must get 0.0.

A recipe whose prompt asks for ``\\boxed{}`` while its extractor reads ``####`` (or asks for nothing
while its extractor needs a marker) scores its gold answers 0 and fails. IFEval has no reference
responses: its recipes are checked for the reward applying to every row (known instructions, the
columns it reads present after the recipe's ``columns:``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path

import pytest
import yaml

from dna_factory.rehearsal.twins import NO_OFFLINE_TWIN, build_twin, substitute_twins
from tests.conftest import REPO

STAGE_DIRS = {"grpo": "grpo", "distill": "distill"}  # configs/<entry>/
CHECKED_FACTORIES = {"string_match", "code_execution", "instruction_following"}
ROWS = {
    "google-research-datasets/mbpp": 60,
    "deepmind/code_contests": 40,
}  # sandboxed runs are the slow part; 300 rows elsewhere
LOCAL_GOLD_COLUMNS = (
    "canonical_solution",
    "solution",
    "answer",
)  # project files state their gold in one of these


def _recipes() -> list[Path]:
    return sorted(p for d in STAGE_DIRS for p in (REPO / "configs" / d).glob("*.yaml"))


def _factories(recipe: dict) -> set[str]:
    return {e.get("factory") for e in recipe.get("reward_funcs") or [] if isinstance(e, dict)}


REWARD_RECIPES = [p for p in _recipes() if _factories(yaml.safe_load(p.read_text())) & CHECKED_FACTORIES]
DISTILL_RECIPES = [p for p in _recipes() if p.parent.name == "distill" and "tiny" not in p.name]


# --------------------------------------------------------------------------- answers, as the prompt asks


def asked_format(messages: list[dict]) -> str:
    """The answer form a rendered chat prompt asks for: ``code``, ``boxed``, ``gsm8k`` or ``none``."""
    text = "\n".join(str(m.get("content") or "") for m in messages)
    if "```python" in text or "code block" in text:
        return "code"
    if "\\boxed" in text:
        return "boxed"
    if "####" in text:
        return "gsm8k"
    return "none"


def write_answer(form: str, value: str) -> str:
    """A completion giving ``value`` the way the prompt asked."""
    if form == "code":
        return f"Here is the program.\n```python\n{value}\n```"
    if form == "boxed":
        return f"Let me work through it step by step.\nSo the final answer is $\\boxed{{{value}}}$."
    if form == "gsm8k":
        return f"Let me work through it step by step.\n#### {value}"
    return f"The answer is {value}."


def wrong_value(value: str) -> str:
    try:
        return str(Decimal(value.replace(",", "")) + 1)
    except InvalidOperation:
        return f"{value} + 1"


@dataclass
class Report:
    """What the check found for one recipe."""

    rows: int = 0
    ifeval_rows: int = 0
    gold_full: int = 0
    wrong_zero: int = 0
    applies: int = 0
    forms: set[str] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)

    @property
    def gold_rate(self) -> float:
        return self.gold_full / self.rows if self.rows else 0.0


def _score(funcs, prompts, completions, columns) -> list[list[float]]:
    """Per row, the scores of the rewards that apply (None dropped), as TRL would compute them."""
    per_row: list[list[float]] = [[] for _ in completions]
    for func in funcs:
        scores = func(prompts=prompts, completions=completions, **columns)
        if inspect.isawaitable(scores):
            scores = asyncio.run(scores)
        for i, score in enumerate(scores):
            if score is not None:
                per_row[i].append(score)
    return per_row


def twin_recipe(recipe_path: Path, out_dir: Path) -> tuple[Path, dict[str, list]]:
    """The recipe with its Hub datasets swapped for offline twins, every row kept in file order."""
    return substitute_twins(recipe_path, out_dir, rows=ROWS, keep_order=True)


def check_recipe(recipe_path: Path, out_dir: Path) -> Report:
    """Run the gold-answer check on one recipe file (see the module docstring)."""
    from dna_factory.inputs.data import load_mixture, parse_specs
    from dna_factory.inputs.loading import prompt_rule
    from dna_factory.run.runner import prepare
    from rewards.registry import resolve_rewards

    twin, gold = twin_recipe(recipe_path, out_dir)
    stage, cfg = prepare(
        STAGE_DIRS[recipe_path.parent.name], ["--config", str(twin), "--dry_run"]
    )  # GPU keys on CPU
    rule = prompt_rule(cfg)
    funcs, _ = resolve_rewards(cfg.get("reward_funcs"))
    only_ifeval = _factories(cfg.values) == {"instruction_following"}
    report = Report()
    for spec in parse_specs(cfg.get("datasets")):
        if gold.get(spec.label, ()) is None:
            continue  # no offline rows in this schema (NO_OFFLINE_TWIN): checked on instructions below
        ds = load_mixture([spec], stage.data_format, seed=0, prompt_rule=rule)
        rows = ds.to_list()
        answers = gold.get(spec.label)
        if answers is None:  # a project file: its gold column
            answers = [next((r[c] for c in LOCAL_GOLD_COLUMNS if r.get(c) is not None), None) for r in rows]
        columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
        prompts = [r["prompt"] for r in rows]
        assert all(isinstance(p, list) for p in prompts), "prompts must reach the trainer as chats"
        forms = [asked_format(p) for p in prompts]
        report.forms |= set(forms)
        if only_ifeval:  # no reference responses: the reward must apply (known instructions, its columns)
            scored = _score(funcs, prompts, [[{"role": "assistant", "content": "ok"}]] * len(rows), columns)
            report.ifeval_rows += len(rows)
            report.applies += sum(bool(s) for s in scored)
            continue
        values = [str(a) for a in answers]
        wrong = values[1:] + values[:1] if forms[0] == "code" else [wrong_value(v) for v in values]
        completions = [
            [{"role": "assistant", "content": write_answer(f, v)}] for f, v in zip(forms, values, strict=True)
        ]
        wrongs = [
            [{"role": "assistant", "content": write_answer(f, v)}] for f, v in zip(forms, wrong, strict=True)
        ]
        gold_scores = _score(funcs, prompts, completions, columns)
        wrong_scores = _score(funcs, prompts, wrongs, columns)
        for i, (g, w) in enumerate(zip(gold_scores, wrong_scores, strict=True)):
            report.rows += 1
            report.applies += bool(g)
            if g and all(s == 1.0 for s in g):
                report.gold_full += 1
            elif len(report.failures) < 3:
                report.failures.append(f"{spec.label} row {i}: asked {forms[i]}, gold scored {g}")
            if w and all(s == 0.0 for s in w):
                report.wrong_zero += 1
            elif len(report.failures) < 6:
                report.failures.append(f"{spec.label} row {i}: wrong answer scored {w}")
    return report


@pytest.mark.parametrize("recipe", REWARD_RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_recipe_scores_gold_answers_written_as_its_prompt_asks(recipe, tmp_path, tiny_model):
    report = check_recipe(recipe, tmp_path)
    data = yaml.safe_load(recipe.read_text())
    if report.ifeval_rows:  # IFEval states its constraints in its prompts; no reference responses exist
        assert report.applies >= 0.99 * report.ifeval_rows, (report.applies, report.ifeval_rows)
        return
    if not report.rows:  # only datasets without offline rows (CodeContests): the instruction must ask
        assert all(d["path"] in NO_OFFLINE_TWIN for d in data["datasets"]), "no row was checked"
        instruction = data.get("agent_system_prompt") or data.get("system_prompt")
        assert _factories(data) == {"code_execution"} and asked_format([{"content": instruction}]) == "code"
        return
    assert report.gold_rate >= 0.99, (report.gold_rate, report.forms, report.failures)
    assert report.wrong_zero == report.rows, (report.wrong_zero, report.rows, report.failures)


def test_check_fails_for_a_recipe_whose_prompt_asks_boxed_while_its_extractor_reads_hashes(
    tmp_path, tiny_model
):
    recipe = yaml.safe_load((REPO / "configs/grpo/qwen3-0.6B-grpo.yaml").read_text())
    recipe["datasets"][0]["prompt_template"] = "{{ prompt }}\nPut the final answer within \\boxed{}."
    recipe["reward_funcs"] = [{"factory": "string_match", "extractor": "gsm8k", "answer_column": "answer"}]
    bad = tmp_path / "grpo" / "boxed-vs-hashes.yaml"
    bad.parent.mkdir()
    bad.write_text(yaml.safe_dump(recipe, sort_keys=False))
    report = check_recipe(bad, tmp_path)
    assert report.forms == {"boxed"} and report.rows == 300
    assert report.gold_rate == 0.0


def test_shipped_distillation_recipes_ask_for_the_answer_form_of_the_rl_that_follows(tmp_path, tiny_model):
    from dna_factory.inputs.data import load_mixture, parse_specs
    from dna_factory.inputs.loading import prompt_rule
    from dna_factory.run.runner import prepare

    for recipe in DISTILL_RECIPES:
        twin, _ = twin_recipe(recipe, tmp_path)
        stage, cfg = prepare("distill", ["--config", str(twin), "--dry_run"])
        ds = load_mixture(parse_specs(cfg.get("datasets")), stage.data_format, prompt_rule=prompt_rule(cfg))
        assert {asked_format(p) for p in ds["prompt"]} == {"boxed"}, recipe


# --------------------------------------------------------------------------- the --dry_run warning


def _grpo_recipe(tmp_path, twin_path: Path, **dataset) -> Path:
    recipe = {
        "model_name_or_path": "artifacts/tiny/student",
        "datasets": [
            {
                "path": str(twin_path),
                "label": "gsm8k",
                "columns": {"question": "prompt", "answer": "answer"},
                **dataset,
            }
        ],
        "reward_funcs": [
            {
                "factory": "string_match",
                "extractor": "boxed",
                "gold_extractor": "gsm8k",
                "answer_column": "answer",
            }
        ],
        "use_cpu": True,
        "report_to": "none",
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def test_dry_run_warns_when_no_prompt_asks_for_the_extractors_marker(tmp_path, caplog, tiny_model):
    from dna_factory.run.runner import prepare

    twin, _ = build_twin("openai/gsm8k", 20, tmp_path / "twins")
    with caplog.at_level(logging.WARNING):
        prepare("grpo", ["--config", str(_grpo_recipe(tmp_path, twin)), "--dry_run"])
    warned = [
        r.getMessage() for r in caplog.records if "scores only completions that write" in r.getMessage()
    ]
    assert len(warned) == 1 and "extractor: boxed" in warned[0] and "gsm8k" in warned[0], warned

    caplog.clear()
    asked = _grpo_recipe(
        tmp_path, twin, prompt_template="{{ prompt }}\nPut the final answer within \\boxed{}."
    )
    with caplog.at_level(logging.WARNING):
        prepare("grpo", ["--config", str(asked), "--dry_run"])
    assert not [r for r in caplog.records if "scores only completions that write" in r.getMessage()]
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # a system prompt that asks counts too
        prepare(
            "grpo", ["--config", str(_grpo_recipe(tmp_path, twin)), "--system_prompt", "Answer in \\boxed{}."]
        )
    assert not [r for r in caplog.records if "scores only completions that write" in r.getMessage()]


def test_dry_run_warning_reads_only_what_the_prompt_asks(tmp_path, caplog, write_jsonl, tiny_model):
    """A `\\boxed` in the gold reply of a `messages` row is not an instruction; a bare `- string_match` counts."""
    from dna_factory.run.runner import prepare

    rows = [{"messages": [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "\\boxed{5}"}],
             "solution": "5"}]  # fmt: skip
    recipe = {
        "model_name_or_path": "artifacts/tiny/student",
        "datasets": [{"path": str(write_jsonl("chat.jsonl", rows)), "label": "chat"}],
        "reward_funcs": ["string_match"],
        "use_cpu": True,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with caplog.at_level(logging.WARNING):
        prepare("grpo", ["--config", str(path), "--dry_run"])
    warned = [
        r.getMessage() for r in caplog.records if "scores only completions that write" in r.getMessage()
    ]
    assert len(warned) == 1 and "dataset(s) chat" in warned[0], warned
