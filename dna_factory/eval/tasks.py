"""Eval tasks defined in this repository, as Inspect AI tasks (see docs/checkpoint-eval.md).

The checkpoint-eval harness (:mod:`dna_factory.eval.harness`) loads this file by path
(``dna_factory/eval/tasks.py@arith``), so a task here is addressed by its bare name in
``eval_tasks``. Registry tasks (``mmlu_pro``, ``gpqa_diamond``, ...) come from the
``inspect_evals`` package instead.

Every ``@task`` here must be listed in ``dna_factory.eval.harness.LOCAL_TASKS`` (a test
checks it), so that task names resolve without importing Inspect in the trainer.

* ``arith``: the held-out tiny arithmetic questions (``data/tiny/arith_eval.jsonl``, never
  trained on), fully offline; the tests use it.
* ``largest``: the held-out "Which number is largest: ...?" and "What is one more than the largest:
  ...?" questions (``data/tiny/largest_eval.jsonl``, 100 of each), fully offline; the CPU demo pipeline
  uses it.
* ``tiny_coding``, ``tiny_if``, ``tiny_judge``: the held-out splits of the families recipe
  (``data/families/*_eval.jsonl``, docs/families.md), each scored by its RL stage's own reward
  (:mod:`dna_factory.eval.reward_task`); the metric is ``reward``, the mean reward.
* ``kmmlu_pro``: KMMLU-Pro (Korean professional licensure exams, ``LGAI-EXAONE/KMMLU-Pro``
  on the Hugging Face Hub, gated), which ``inspect_evals`` does not ship; for GPU machines
  with Hub access.

Each task reports ``accuracy`` (fraction of samples scored correct, in [0, 1]), which
becomes ``eval/<task>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from inspect_ai import Task, task
from inspect_ai.dataset import MemoryDataset, Sample, hf_dataset
from inspect_ai.scorer import choice, match
from inspect_ai.solver import generate, multiple_choice

from dna_factory.eval.agent_task import AgentSpec, agent_task
from dna_factory.eval.reward_task import chat_input, reward_task

REPO_ROOT = Path(__file__).resolve().parents[2]  # dna_factory/eval/tasks.py -> the checkout
ARITH_PATH = REPO_ROOT / "data" / "tiny" / "arith_eval.jsonl"
LARGEST_PATH = REPO_ROOT / "data" / "tiny" / "largest_eval.jsonl"
KMMLU_PRO_DATASET = "LGAI-EXAONE/KMMLU-Pro"

FAMILIES_DIR = REPO_ROOT / "data" / "families"


def prompt_solution_sample(record: dict[str, Any], index: int) -> Sample:
    """One ``{"prompt": ..., "solution": "17"}`` row as an Inspect sample, under the training prompt rule
    (:func:`dna_factory.eval.reward_task.chat_input`)."""
    return Sample(id=index, input=chat_input(record["prompt"]), target=str(record["solution"]))


def last_number_task(path: str | Path, name: str) -> Task:
    """A task over ``prompt`` + ``solution`` JSONL rows, correct when the answer's last number is the solution."""
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    dataset = MemoryDataset([prompt_solution_sample(row, i) for i, row in enumerate(rows)], name=name)
    return Task(dataset=dataset, solver=generate(), scorer=match(location="end", numeric=True))


@task
def arith(path: str = str(ARITH_PATH)) -> Task:
    """Two-operand addition; correct when the last number of the answer equals the sum.

    Args:
        path: A JSONL file of ``prompt`` (chat messages) + ``solution`` rows.
    """
    return last_number_task(path, "arith")


@task
def largest(path: str = str(LARGEST_PATH)) -> Task:
    """The largest of four digits (or one more); correct when the last number of the answer is the solution.

    Args:
        path: A JSONL file of ``prompt`` (chat messages) + ``solution`` rows.
    """
    return last_number_task(path, "largest")


BOXED = {"factory": "string_match", "extractor": "boxed", "answer_column": "answer"}
FAMILY_TASKS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny_coding": ("coding_eval.jsonl", {"factory": "code_execution"}),
    "tiny_if": ("if_eval.jsonl", {"factory": "instruction_following"}),
    "tiny_judge": ("rlhf_eval.jsonl", {"factory": "judge", "rubric": "rewards/prompts/default.md"}),
    "tiny_general": ("general_eval.jsonl", BOXED),
    "tiny_search": ("search_eval.jsonl", BOXED),
    "tiny_coding_agent": (
        "coding_agent_eval.jsonl",
        {"factory": "code_execution", "timeout_s": 5, "concurrency": 2},
    ),
}
"""The families recipe's tasks: task -> (its held-out file in ``data/families/``, the reward its RL stage trains on,
as the stage's ``reward_funcs`` entry; a test keeps the two alike)."""

FAMILY_AGENTS: dict[str, AgentSpec] = {
    "tiny_general": AgentSpec("general", ("calculator",), 1, 96),
    "tiny_search": AgentSpec(
        "search", ("search",), 1, 96, {"corpus": str(FAMILIES_DIR / "search_corpus.jsonl"), "top_k": 1}
    ),
    "tiny_coding_agent": AgentSpec(
        "coding",
        ("run_python",),
        1,
        160,
        {"timeout_s": 5, "cpu_s": 2, "memory_mb": 512, "max_output_chars": 500},
    ),
}
"""The agent families' tasks: each plays its prompts as episodes of its stage's environment, tools and bounds
(:mod:`dna_factory.eval.agent_task`; a test keeps them alike with the recipe's stage)."""


def family_task(name: str, path: str | None) -> Task:
    held_out, spec = FAMILY_TASKS[name]
    if name in FAMILY_AGENTS:
        return agent_task(path or FAMILIES_DIR / held_out, name, spec, FAMILY_AGENTS[name])
    return reward_task(path or FAMILIES_DIR / held_out, name, spec)


@task
def tiny_coding(path: str | None = None) -> Task:
    """The families recipe's coding task: 100 held-out "Write a Python program that prints the largest of ..."
    prompts, scored by the coding stage's reward (``code_execution``, the sandbox, stdin/stdout tests)."""
    return family_task("tiny_coding", path)


@task
def tiny_if(path: str | None = None) -> Task:
    """The families recipe's instruction-following task: 100 held-out questions with one IFEval instruction,
    scored by the IF stage's reward (``instruction_following``, the IFEval checkers)."""
    return family_task("tiny_if", path)


@task
def tiny_general(path: str | None = None) -> Task:
    """The families recipe's General Agent task: 100 held-out 'Calculate "7 * 3 * 4 % 10".' prompts, each played
    as one episode with the calculator, scored by the stage's reward (the boxed answer against ``answer``)."""
    return family_task("tiny_general", path)


@task
def tiny_search(path: str | None = None) -> Task:
    """The families recipe's Search Agent task: 100 held-out 'Which floor is robot "C4" on?' prompts about robots
    no training prompt names, each played as one episode with BM25 search, scored by the boxed answer."""
    return family_task("tiny_search", path)


@task
def tiny_coding_agent(path: str | None = None) -> Task:
    """The families recipe's Coding Agent task: 100 held-out coding prompts, each played as one episode with
    run_python, scored by the stage's reward (``code_execution`` on the final program)."""
    return family_task("tiny_coding_agent", path)


@task
def tiny_judge(path: str | None = None) -> Task:
    """The families recipe's RLHF task: 100 held-out questions, scored by the RLHF stage's reward (``judge``
    with the default rubric, at ``JUDGE_BASE_URL``: the share of answers the judge scores 7 or more)."""
    return family_task("tiny_judge", path)


def kmmlu_pro_sample(record: dict[str, Any]) -> Sample:
    """A KMMLU-Pro row (``question``, ``options``, 1-based ``solution``) as a multiple-choice sample."""
    options = list(record["options"])
    answer = int(record["solution"]) - 1
    if not 0 <= answer < len(options):
        raise ValueError(f"KMMLU-Pro row has solution {record['solution']!r} for {len(options)} options.")
    return Sample(
        input=record["question"],
        choices=options,
        target=chr(ord("A") + answer),
        metadata={k: record.get(k) for k in ("license_name", "subject", "year")},
    )


@task
def kmmlu_pro() -> Task:
    """KMMLU-Pro, zero-shot multiple choice (accuracy over its ``test`` split)."""
    dataset = hf_dataset(KMMLU_PRO_DATASET, split="test", sample_fields=kmmlu_pro_sample)
    return Task(dataset=dataset, solver=multiple_choice(), scorer=choice())
