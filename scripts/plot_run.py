"""Draw the train and eval curves of one run to a PNG, without W&B.

Train curves come from ``<run>/log_history.json`` (written at the end of a run) or, while
the run is still going, from the newest ``checkpoint-N/trainer_state.json``; eval curves
from ``<run>/eval_results.jsonl`` (checkpoint evaluation, docs/checkpoint-eval.md), one
line per ``eval/<task>`` against ``eval/step``. Both share the optimizer-step x axis.

Usage::

    python scripts/plot_run.py outputs/sft-tiny-cpu-eval [--out curves.png] [--train loss reward]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dna_factory.run.run_files import eval_rows, train_history  # noqa: E402 - after the path

DEFAULT_TRAIN_KEYS = ("loss", "reward", "opd/reverse_kl_mean", "rewards/chosen")


def curves(run: Path, train_keys: tuple[str, ...]) -> dict[str, list[tuple[float, float]]]:
    """``{name: [(step, value), ...]}`` for every train key present and every ``eval/<task>``."""
    found: dict[str, list[tuple[float, float]]] = {}
    for row in train_history(run):
        for key in train_keys:
            if key in row and "step" in row and isinstance(row[key], int | float):
                found.setdefault(f"train/{key}", []).append((row["step"], row[key]))
    for row in eval_rows(run):
        for key, value in row.items():
            if key.startswith("eval/") and key != "eval/step" and isinstance(value, int | float):
                found.setdefault(key, []).append((row["eval/step"], value))
    return found


def plot(run: Path, target: Path, train_keys: tuple[str, ...] = DEFAULT_TRAIN_KEYS) -> Path:
    """Write ``target``: one panel per train metric, one panel with every eval task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = curves(run, train_keys)
    train = [k for k in found if k.startswith("train/")]
    evals = [k for k in found if k.startswith("eval/")]
    if not found:
        raise SystemExit(f"{run} has neither log_history.json, a checkpoint-N nor eval_results.jsonl.")
    panels = len(train) + (1 if evals else 0)
    fig, axes = plt.subplots(panels, 1, figsize=(8, 2.6 * panels), squeeze=False, sharex=True)
    for ax, key in zip(axes[:, 0], train, strict=False):
        ax.plot(*zip(*found[key], strict=True), lw=1.2)
        ax.set_ylabel(key)
    if evals:
        ax = axes[-1, 0]
        for key in evals:
            ax.plot(*zip(*found[key], strict=True), marker="o", label=key)
        ax.set_ylabel("eval score")
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("optimizer step (train/global_step = eval/step)")
    fig.suptitle(run.name)
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="the run's output_dir")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default <run>/curves.png)")
    parser.add_argument("--train", nargs="+", default=list(DEFAULT_TRAIN_KEYS), help="train metrics to draw")
    args = parser.parse_args(argv)
    target = plot(args.run, args.out or args.run / "curves.png", tuple(args.train))
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
