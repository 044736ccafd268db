"""Benchmark: informative rows per optimizer step and time per informative row, off vs mask vs resample.

Run from the repository root (CPU, tiny model; about a minute per run, 10 runs by default)::

    python bench/dynamic_sampling.py [--steps 10] [--repeats 3]

The task is built so that about half the groups are dead: the bundled arithmetic prompts are
split into a ``live`` and a ``dead`` dataset, and ``tests.reward_fixtures:group_parity_reward``
gives every generation of a ``dead`` prompt the same reward while alternating 0/1 inside a
``live`` group. A row is *informative* when its group's rewards differ (non-zero advantage).

Per mode: TRL's GRPOTrainer (``off``) or the dynamic-sampling mixin trains ``--steps``
optimizer steps (per_device_train_batch_size 4, gradient_accumulation_steps 2, so 8 rows = 2
groups of 4 per step). Informative rows per step come from the trainer's own metrics:
``(1 - frac_reward_zero_std) × rows`` for off/mask (measured before any filtering) and
``(1 - dyn/dead_frac) × rows`` for resample (after the refill). Time per informative row is the
training wall time divided by all informative rows trained. Each mode runs ``--repeats`` times, the runs
interleaved and rotated (:func:`schedule`); the table gives medians, the min-max of the time per informative
row and the median of the per-round speed ratios to ``off``. Results (and every run) go to
``bench/results/dynamic_sampling.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ROWS_PER_STEP = 8


def _datasets(root: Path) -> list[dict]:
    rows = (REPO / "data" / "tiny" / "arith_prompts.jsonl").read_text().splitlines()
    half = len(rows) // 2
    (root / "live.jsonl").write_text("\n".join(rows[:half]) + "\n")
    (root / "dead.jsonl").write_text("\n".join(rows[half:]) + "\n")
    return [
        {"path": str(root / "live.jsonl"), "label": "live"},
        {"path": str(root / "dead.jsonl"), "label": "dead"},
    ]


def run_mode(mode: str, steps: int, root: Path) -> dict:
    from dna_factory.inputs.loading import load_context
    from dna_factory.run.runner import prepare

    root.mkdir(parents=True, exist_ok=True)
    argv = [
        "--config", "configs/grpo/tiny-cpu.yaml",
        "--datasets", json.dumps(_datasets(root)),
        "--reward_funcs", "[tests.reward_fixtures:group_parity_reward]",
        "--dynamic_sampling", mode, "--dynamic_sampling_max_rounds", "4",
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
        "--num_generations", "4", "--max_completion_length", "16", "--max_steps", str(steps),
        "--save_strategy", "no", "--logging_steps", "1", "--output_dir", str(root / mode), "--beta", "0",
    ]  # fmt: skip
    stage, cfg = prepare("grpo", argv)
    trainer = stage.build_trainer(load_context(stage, cfg))
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    logs = [h for h in trainer.state.log_history if "reward" in h]
    if mode == "resample":
        informative = [(1 - h["dyn/dead_frac"]) * ROWS_PER_STEP for h in logs]
    else:
        informative = [(1 - h["frac_reward_zero_std"]) * ROWS_PER_STEP for h in logs]
    total = sum(informative)
    return {
        "mode": mode,
        "steps": len(logs),
        "informative_rows_per_step": total / len(logs),
        "informative_share": total / (ROWS_PER_STEP * len(logs)),
        "train_seconds": seconds,
        "seconds_per_informative_row": seconds / total if total else float("inf"),
        "extra_generation_rounds_per_step": sum(h.get("dyn/rounds", 0.0) for h in logs) / len(logs),
        "masked_microbatch_share": (
            sum(h.get("dyn/masked_frac", 0.0) for h in logs) / len(logs) if mode == "mask" else None
        ),
    }


MODES = ("off", "mask", "resample")


def schedule(repeats: int) -> list[str]:
    """The modes' runs, interleaved and rotated so each mode runs at each place of a round: a noisy machine's slow
    minute falls on every mode alike.

    Example:
        >>> schedule(2)
        ['off', 'mask', 'resample', 'mask', 'resample', 'off']
    """
    return [MODES[(i + r) % len(MODES)] for r in range(repeats) for i in range(len(MODES))]


def summarise(runs: list[dict]) -> list[dict]:
    """Per mode: the median of each measure over its repeated runs, with the min and max of the time per
    informative row, and its ratio to ``off`` (the median of per-round ratios)."""
    by_mode = {mode: [r for r in runs if r["mode"] == mode] for mode in MODES}
    off = [r["seconds_per_informative_row"] for r in by_mode["off"]]
    rows = []
    for mode, done in by_mode.items():
        times = [r["seconds_per_informative_row"] for r in done]
        rows.append(
            {
                "mode": mode,
                "runs": len(done),
                **{
                    key: statistics.median(r[key] for r in done)
                    for key in (
                        "informative_rows_per_step",
                        "informative_share",
                        "train_seconds",
                        "seconds_per_informative_row",
                        "extra_generation_rounds_per_step",
                    )
                },  # fmt: skip
                "seconds_per_informative_row_range": [min(times), max(times)],
                "speed_vs_off": statistics.median(o / t for o, t in zip(off, times, strict=True)),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each mode, interleaved (medians reported)"
    )
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "dynamic_sampling.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if not (REPO / "artifacts" / "tiny" / "student" / "config.json").is_file():
        print("Build the tiny model first: make tiny-models", file=sys.stderr)
        return 2
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        run_mode(
            "off", 3, Path(tmp) / "warmup"
        )  # first-run costs (imports, allocator) would bias the first run
        order = schedule(args.repeats)
        for i, mode in enumerate(order):
            print(f"run {i + 1}/{len(order)}: {mode}", file=sys.stderr, flush=True)
            runs.append(run_mode(mode, args.steps, Path(tmp) / f"run-{i}"))
    results = summarise(runs)
    print(
        f"\nDynamic sampling, {args.steps} steps x {ROWS_PER_STEP} rows, ~half the groups dead (tiny Qwen3, CPU); "
        f"medians of {args.repeats} interleaved runs per mode\n"
    )
    header = (
        f"{'mode':<9}{'informative rows/step':>23}{'share':>8}{'s/informative row':>19}{'(min-max)':>18}"
        f"{'vs off':>8}{'extra rounds/step':>19}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        low, high = r["seconds_per_informative_row_range"]
        print(
            f"{r['mode']:<9}{r['informative_rows_per_step']:>23.2f}{r['informative_share']:>8.0%}"
            f"{r['seconds_per_informative_row']:>19.4f}{f'({low:.4f}-{high:.4f})':>18}{r['speed_vs_off']:>7.2f}x"
            f"{r['extra_generation_rounds_per_step']:>19.2f}"
        )
    off, resample = results[0], results[2]
    targets = {
        "resample_informative_share_>=_0.95": resample["informative_share"] >= 0.95,
        "resample_time_per_informative_row_<_off": resample["seconds_per_informative_row"]
        < off["seconds_per_informative_row"],
    }
    print("\nTargets: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in targets.items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"steps": args.steps, "rows_per_step": ROWS_PER_STEP, "repeats": args.repeats, "order": order}
    payload.update({"results": results, "runs": runs, "targets": targets})
    payload["machine"] = {"python": platform.python_version(), "platform": platform.platform()}
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"Wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
