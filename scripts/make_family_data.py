"""Generate the tasks of the families recipe (``configs/recipes/tiny-cpu-families.yaml``, docs/families.md).

Writes JSONL files under ``data/families/`` (committed; rerun to regenerate, output is deterministic). Every
family asks about a few digits, the world the families student (205k parameters) learns in a minute (the demo's
``largest`` task), and each has a skill its RL stage can teach, scored by the real reward code of the GPU
recipes:

* **coding** (reward ``code_execution``, the sandbox): "Write a Python program that prints the largest of 5,
  7, 0, 2." or "... the smallest of ...". The test is the program's stdout (a stdin/stdout case, like
  CodeContests). Careful demonstrations call ``max``/``min`` on the list; careless ones (60%) print the list's
  last element.
* **if** (reward ``instruction_following``, the IFEval checkers): "Which number is largest: 5, 7, 0, 2?" plus one
  IFEval instruction (quotation marks, a ``<<title>>``, an end phrase, a postscript). Careless demonstrations
  (60%) answer without following the instruction.
* **rlhf** (reward ``judge``, over HTTP, against ``scripts/tiny_judge.py``): "Which number is smallest: 5, 7,
  0, 2?". The judge grades with the default rubric: a right answer in a full sentence ("The smallest number is
  0.") scores 9, a bare right number 6 (under the threshold 7), a wrong one 1. Careless demonstrations (90%, so
  that every SFT start answers with the bare number) give the bare number.

The three agent families (not yet in the recipe, docs/families.md) run the real environments
(``dna_factory/agents/``) with one tool each and at most one round of tool calls; every prompt carries its system
message, and the demonstrations carry the tool schemas (``tools``, as TRL renders them) and the tool results the
environment really returns:

* **general** (``general`` environment, ``calculator``; reward ``string_match`` on ``\\boxed{}``): 'Calculate
  "7 * 3 * 4 % 10".'. Careful: call the calculator, then box its result. Careless (60%): box the expression.
* **search** (``search`` environment over ``search_corpus.jsonl``, one passage per search): 'Which floor is robot
  "C4" on?'. Careful: search "C4", then box the floor in the passage. Careless (60%): box the robot's digit. The
  held-out questions ask about robots no training question names.
* **coding_agent** (``coding`` environment, ``run_python``; reward ``code_execution``): the coding family's
  programs, where the first draft calls ``max[...]`` without parentheses half of the time (a TypeError). Careful:
  run the draft, then answer with the right program. Careless (60%): answer with the draft, untested.

What the student copies is single digits, or text quoted alike where it is read and where it is written: the
tokenizer spells " 347" (after a space) and "347" (after a quote) with different ids, and a two-layer model
learns to copy the ten digits it sees thousands of times, not hundreds of numbers or words it sees a few times.

Each family gets ``<family>_prompts.jsonl`` (RL prompts with the reward's
columns) and ``<family>_eval.jsonl`` (held-out prompts with the same columns: their digit lists appear in no
training file of any family). ``sft.jsonl`` holds the single-turn families' demonstrations, shuffled, and
``sft_agents.jsonl`` the agent families' (``tools`` is the schemas' JSON text): the two SFT starts.

Usage::

    python scripts/make_family_data.py [--out data/families] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

from dna_factory.agents.environment import build_environment
from dna_factory.run.run_files import write_atomic

LIST_LENGTH = 4
TRAIN_PER_FAMILY = 1500
EVAL_PER_FAMILY = 100
CARELESS_FRACTION = 0.6
"""The share of careless demonstrations in a family's SFT rows (the agents' and most families')."""
CARELESS_RLHF = 0.9
"""The rlhf family's: with 60%, whether the SFT start's greedy answer was the bare number or the full sentence
depended on the seed (its first token "The" competes with ten digits), so the "before" ranged from 0.03 to 0.59."""

IF_INSTRUCTIONS = (
    ("startend:quotation", {}, "Wrap your entire response with double quotation marks."),
    ("detectable_format:title", {}, "Your answer must contain a title, wrapped in double angular brackets, such as <<poem of joy>>."),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, "Finish your response with this exact phrase Any other questions?. No other words should follow this phrase."),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "At the end of your response, please explicitly add a postscript starting with P.S."),
)  # fmt: skip
"""(IFEval instruction id, its kwargs, IFEval's own wording of it)."""


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def _listed(digits: tuple[int, ...]) -> str:
    return ", ".join(map(str, digits))


def coding_row(digits: tuple[int, ...], kind: str) -> dict:
    """A coding prompt, its stdin/stdout test and the careful program."""
    value = max(digits) if kind == "largest" else min(digits)
    function = "max" if kind == "largest" else "min"
    return {
        "prompt": _user(f"Write a Python program that prints the {kind} of {_listed(digits)}."),
        "tests": [{"input": "", "output": f"{value}\n"}],
        "careful": f"```python\nprint({function}([{_listed(digits)}]))\n```",
        "careless": f"```python\nprint([{_listed(digits)}][-1])\n```",
    }


def if_row(digits: tuple[int, ...], which: int) -> dict:
    """A question with one IFEval instruction, and the answers that follow it or not."""
    instruction, kwargs, wording = IF_INSTRUCTIONS[which]
    plain = f"The answer is {max(digits)}."
    followed = {
        "startend:quotation": f'"{plain}"',
        "detectable_format:title": f"<<Answer>>\n{plain}",
        "startend:end_checker": f"{plain} Any other questions?",
        "detectable_content:postscript": f"{plain}\nP.S. I hope this helps.",
    }[instruction]
    return {
        "prompt": _user(f"Which number is largest: {_listed(digits)}? {wording}"),
        "instruction_id_list": [instruction],
        "kwargs": [kwargs],
        "careful": followed,
        "careless": plain,
    }


def rlhf_row(digits: tuple[int, ...]) -> dict:
    """A question the judge grades, with the answer in a full sentence and the bare number."""
    return {
        "prompt": _user(f"Which number is smallest: {_listed(digits)}?"),
        "solution": str(min(digits)),
        "careful": f"The smallest number is {min(digits)}.",
        "careless": f"{min(digits)}",
    }


AGENT_SYSTEM = {
    "general": "Use the calculator, then put the final answer in \\boxed{}.",
    "search": "Search the collection, then put the final answer in \\boxed{}.",
    "coding_agent": "Test your program with run_python, then answer with the program in one ```python block.",
}
"""Each agent family's system message, in every prompt of its files."""
AGENT_TOOL = {"general": "calculator", "search": "search", "coding_agent": "run_python"}
AGENT_ENVIRONMENT = {"general": "general", "search": "search", "coding_agent": "coding"}
AGENT_SFT_PER_FAMILY = 600
AGENT_CARELESS_FRACTION = 0.8
"""The share of careless demonstrations among an agent family's rows in the RL task's own wording: the SFT start's
greedy answer there is the careless one, so the stage has a habit to change."""
PRACTICE_PER_FAMILY = 600
"""Careful episodes per agent family in a practice wording (``practice`` below): where the student learns to copy a
call's argument and the tool's result into its answer, without that habit becoming its greedy answer to the RL
task's wording."""
"""Demonstrations per agent family: each is ~800 tokens (the tool schemas), so fewer than the others' 1,500."""
ROBOTS = 90
"""The search corpus: 90 robots numbered 10 to 99, each on one of ten floors; 40 are held out (no training question
names them), so a held-out robot's floor can only be found by searching. Numbers, not letters: the student copies
the ten digits it sees thousands of times, not letters it sees a few hundred times; and the query starts with the
word "robot", so its first digit follows the same tokens as in the question (the student does not copy a value's
first token after a quote)."""
SEARCH_HELD_OUT = 40


class Agents:
    """The real environments, to run the careful demonstrations' tool calls and render their schemas."""

    def __init__(self, corpus: Path) -> None:
        from transformers.utils import get_json_schema

        options = {"search": {"corpus": str(corpus), "top_k": 1}, "coding_agent": {"isolation": "auto"}}
        self.tools = {}
        self.schemas = {}
        for family, environment in AGENT_ENVIRONMENT.items():
            built = build_environment(environment, options.get(family))
            (self.tools[family],) = built.tools([AGENT_TOOL[family]])
            self.schemas[family] = json.dumps([get_json_schema(self.tools[family])])

    def call(self, family: str, arguments: dict) -> str:
        import asyncio
        import inspect

        result = self.tools[family](**arguments)
        return str(asyncio.run(result) if inspect.iscoroutine(result) else result)

    def demonstration(self, family: str, row: dict, careful: bool) -> dict:
        """The row's careful episode (a tool call, its real result, the answer) or its careless answer."""
        if not careful:
            return {"messages": row["prompt"] + _assistant(row["careless"]), "tools": self.schemas[family]}
        arguments = row["call"]
        # arguments as JSON text: one JSONL file holds every family's calls, and datasets would unify their
        # argument objects into one struct (each call gaining the others' keys as nulls); the chat template
        # writes a string as it is and an object as its JSON, the same text here
        call = {
            "type": "function",
            "function": {"name": AGENT_TOOL[family], "arguments": json.dumps(arguments)},
        }
        episode = [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": AGENT_TOOL[family], "content": self.call(family, arguments)},
        ]
        answer = row["careful"](episode[1]["content"]) if callable(row["careful"]) else row["careful"]
        return {"messages": row["prompt"] + episode + _assistant(answer), "tools": self.schemas[family]}


def _agent_prompt(family: str, text: str) -> list[dict]:
    return [{"role": "system", "content": AGENT_SYSTEM[family]}] + _user(text)


def general_row(digits: tuple[int, ...], practice: bool = False) -> dict:
    """``100 - 2 - 6 - 4``: every digit to copy into the call follows the same token there as in the prompt (a space;
    the student does not copy a value's first token after a quote, which the call's JSON puts before it)."""
    expression = " - ".join(map(str, (100, *digits)))
    return {
        "prompt": _agent_prompt(
            "general", f"Compute {expression}." if practice else f"What is {expression}?"
        ),
        "answer": str(100 - sum(digits)),
        "call": {"expression": expression},
        "careful": lambda result: f"\\boxed{{{result}}}",
        "careless": f"\\boxed{{{expression}}}",
    }


def search_row(robot: str, floors: dict[str, int], practice: bool = False) -> dict:
    question = f"Find the floor of robot {robot}." if practice else f"Which floor is robot {robot} on?"
    return {
        "prompt": _agent_prompt("search", question),
        "answer": str(floors[robot]),
        "call": {"query": f"robot {robot}"},
        "careful": f"\\boxed{{{floors[robot]}}}",
        "careless": f"\\boxed{{{robot[-1]}}}",
    }


def coding_agent_row(digits: tuple[int, ...], broken: bool) -> dict:
    """A sum the single-turn families never ask for: the draft indexes ``sum`` (a TypeError) half of the time, and
    only running it tells the two drafts apart by their outcome."""
    good = f"print(sum([{_listed(digits)}]))"
    draft = f"print(sum[{_listed(digits)}])" if broken else good
    return {
        "prompt": _agent_prompt(
            "coding_agent", f"Write a Python program that prints the sum of {_listed(digits)}."
        ),
        "tests": [{"input": "", "output": f"{sum(digits)}\n"}],
        "call": {"code": draft},
        "careful": f"```python\n{good}\n```",
        "careless": f"```python\n{draft}\n```",
    }


def _digit_lists(rng: random.Random, count: int, taken: set) -> list[tuple[int, ...]]:
    """``count`` distinct lists of distinct digits outside ``taken``, which they join."""
    lists: list[tuple[int, ...]] = []
    while len(lists) < count:
        digits = tuple(rng.sample(range(10), LIST_LENGTH))
        if digits not in taken:
            taken.add(digits)
            lists.append(digits)
    return lists


FAMILIES: dict[str, Callable[[tuple[int, ...], int], dict]] = {
    "coding": lambda d, i: coding_row(d, ("largest", "smallest")[i % 2]),
    "if": lambda d, i: if_row(d, i % len(IF_INSTRUCTIONS)),
    "rlhf": lambda d, i: rlhf_row(d),
}


def _task_row(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("careful", "careless", "call")}


def search_corpus(rng: random.Random) -> dict[str, int]:
    """Robot ("47") -> the floor it is on (0-9)."""
    return {str(code): rng.randrange(10) for code in range(100 - ROBOTS, 100)}


def agent_tasks(
    rng: random.Random, taken: set, coding_held: list[tuple[int, ...]]
) -> tuple[dict[str, list[dict]], dict[str, list[dict]], dict[str, list[dict]], dict[str, int]]:
    """Training, held-out and practice rows of the three agent families (``coding_held``: the Coding Agent's held-out
    digit lists, drawn with the other families' before any training list), and the search corpus."""
    floors = search_corpus(rng)
    items = list(floors)
    rng.shuffle(items)
    held_items, train_items = items[:SEARCH_HELD_OUT], items[SEARCH_HELD_OUT:]
    held_lists = {"coding_agent": coding_held}
    train_lists = {"coding_agent": _digit_lists(rng, TRAIN_PER_FAMILY, set(taken))}
    triples = [tuple(rng.sample(range(10), 3)) for _ in range(4000)]
    triples = list(dict.fromkeys(triples))  # distinct, in drawn order: 720 exist
    held_lists["general"] = triples[:EVAL_PER_FAMILY]
    train_lists["general"] = [
        triples[EVAL_PER_FAMILY + i % (len(triples) - EVAL_PER_FAMILY)] for i in range(TRAIN_PER_FAMILY)
    ]
    held = {
        "general": [general_row(d) for d in held_lists["general"]],
        "search": [search_row(item, floors) for item in held_items],
        "coding_agent": [coding_agent_row(d, i % 2 == 0) for i, d in enumerate(held_lists["coding_agent"])],
    }  # fmt: skip
    train = {
        "general": [general_row(d) for d in train_lists["general"]],
        "search": [search_row(train_items[i % len(train_items)], floors) for i in range(TRAIN_PER_FAMILY)],
        "coding_agent": [coding_agent_row(d, i % 2 == 0) for i, d in enumerate(train_lists["coding_agent"])],
    }  # fmt: skip
    practice = {  # the training items again (never a held-out one), from the other end of the list
        "general": [general_row(d, practice=True) for d in train_lists["general"][::-1][:PRACTICE_PER_FAMILY]],
        "search": [search_row(train_items[-1 - i % len(train_items)], floors, practice=True) for i in range(PRACTICE_PER_FAMILY)],
        "coding_agent": [],
    }  # fmt: skip
    return train, held, practice, floors


def make_family_data(out: str | Path = "data/families", seed: int = 0) -> dict[str, int]:
    rng = random.Random(seed)
    taken: set = set()
    held = {family: _digit_lists(rng, EVAL_PER_FAMILY, taken) for family in FAMILIES}
    coding_agent_held = _digit_lists(rng, EVAL_PER_FAMILY, taken)  # before any training list is drawn
    files: dict[str, list[dict]] = {}
    demonstrations = []
    for family, make in FAMILIES.items():
        train = [make(d, i) for i, d in enumerate(_digit_lists(rng, TRAIN_PER_FAMILY, set(taken)))]
        careless = CARELESS_RLHF if family == "rlhf" else CARELESS_FRACTION
        sft = [
            {
                "messages": row["prompt"]
                + _assistant(row["careless" if rng.random() < careless else "careful"])
            }
            for row in train
        ]
        demonstrations += sft
        files[f"{family}_prompts.jsonl"] = [_task_row(row) for row in train]
        files[f"{family}_eval.jsonl"] = [_task_row(make(d, i)) for i, d in enumerate(held[family])]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train, held_agents, practice, floors = agent_tasks(rng, taken, coding_agent_held)
    corpus = out / "search_corpus.jsonl"
    corpus_rows = [
        {"id": robot, "title": f"Robot {robot}", "text": f"Robot {robot} is on floor {floor}."}
        for robot, floor in floors.items()
    ]
    write_atomic(corpus, (json.dumps(r) + "\n" for r in corpus_rows))
    agents = Agents(corpus)
    agent_demonstrations = []
    for family, rows in train.items():
        careless = AGENT_CARELESS_FRACTION if practice[family] else CARELESS_FRACTION
        sft = [
            agents.demonstration(family, row, rng.random() >= careless) for row in rows[:AGENT_SFT_PER_FAMILY]
        ]
        sft += [agents.demonstration(family, row, careful=True) for row in practice[family]]
        agent_demonstrations += sft
        files[f"{family}_prompts.jsonl"] = [_task_row(row) for row in rows]
        files[f"{family}_eval.jsonl"] = [_task_row(row) for row in held_agents[family]]
    for name, rows in (("sft.jsonl", demonstrations), ("sft_agents.jsonl", agent_demonstrations)):
        rng.shuffle(rows)
        files[name] = rows
    for name, rows in files.items():
        write_atomic(out / name, (json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return {name: len(rows) for name, rows in files.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate the families recipe's tasks (docs/families.md).")
    parser.add_argument("--out", default="data/families")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name, n in make_family_data(args.out, args.seed).items():
        print(f"{args.out}/{name}: {n} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
