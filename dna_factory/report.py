"""Pipeline report: per-stage summary as Markdown and JSON, and a PNG of the main curves across stages.

Reads what each stage's runner left in its output dir: ``run_summary.json`` (steps, wall time),
``log_history.json`` (the trainer's logged metrics) and, with checkpoint evaluation on,
``eval_results.jsonl``. Plots with matplotlib (Agg backend: no display needed).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from dna_factory.run_files import DONE, RUN_SUMMARY, eval_rows, read_json, train_history, write_atomic

logger = logging.getLogger(__name__)

CURVES = ("loss", "reward", "opd/reverse_kl_mean")


def stage_summary(stage, root: Path) -> dict:
    out = stage.output_dir(root)
    summary = read_json(out / RUN_SUMMARY) or {}
    history = train_history(out)
    done = read_json(out / DONE)
    last = {}
    for key in CURVES:
        values = [h[key] for h in history if key in h]
        if values:
            last[key] = values[-1]
    # Checkpoint evals in step order: {"step": N, "eval/<task>": value, ...} per evaluated checkpoint.
    eval_history = []
    for row in eval_rows(out):
        metrics = {k: v for k, v in row.items() if k.startswith("eval/") and k != "eval/step"}
        if metrics:
            eval_history.append({"step": row.get("eval/step", 0), **metrics})
    evals = {}
    for entry in eval_history:
        evals.update({k: v for k, v in entry.items() if k != "step"})
    return {
        "index": stage.index,
        "name": stage.name,
        "entry": stage.entry,
        "status": "done" if done else ("started" if summary or out.exists() else "pending"),
        "steps": summary.get("global_step"),
        "seconds": round(done["seconds"], 1) if done else summary.get("train_seconds"),
        "final": last,
        "eval": evals,
        "eval_history": eval_history,
        "model": (done or {}).get("model"),
        "history": history,
    }


def collect(pipeline) -> list[dict]:
    return [stage_summary(stage, pipeline.output_dir) for stage in pipeline.stages]


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else ("-" if value is None else str(value))


def _eval_cell(key: str, history: list[dict]) -> str:
    """``largest 0 → 0.665``: the stage's first and last evaluated value of one task."""
    values = [e[key] for e in history if key in e]
    shown = [values[0], values[-1]] if len(values) > 1 else values
    return f"{key.removeprefix('eval/')} {' → '.join(_fmt(v) for v in shown)}"


def markdown(pipeline, rows: list[dict]) -> str:
    lines = [
        f"# Pipeline {pipeline.name}",
        "",
        "| # | stage | entry | status | steps | seconds | final | eval |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        final = ", ".join(f"{k} {_fmt(v)}" for k, v in r["final"].items()) or "-"
        evals = ", ".join(_eval_cell(k, r["eval_history"]) for k in r["eval"]) or "-"
        lines.append(
            f"| {r['index']} | {r['name']} | {r['entry']} | {r['status']} | {_fmt(r['steps'])} | {_fmt(r['seconds'])} "
            f"| {final} | {evals} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], target: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eval_keys = sorted({k for r in rows for e in r["eval_history"] for k in e if k != "step"})
    keys = eval_keys + [k for k in CURVES if any(k in h for r in rows for h in r["history"])]
    if not keys:
        return None
    fig, axes = plt.subplots(len(keys), 1, figsize=(9, 2.8 * len(keys)), squeeze=False, sharex=True)
    offset = 0
    for r in rows:
        steps = [h.get("step", 0) for h in r["history"]]
        for ax, key in zip(axes[:, 0], keys, strict=True):
            if key in eval_keys:  # held-out metrics, one marker per evaluated checkpoint
                points = [(offset + e["step"], e[key]) for e in r["eval_history"] if key in e]
                style = {"marker": "o"}
            else:
                points = [(offset + h["step"], h[key]) for h in r["history"] if key in h and "step" in h]
                style = {}
            if points:  # one colour per stage in every panel
                ax.plot(*zip(*points, strict=True), label=r["name"], color=f"C{r['index'] - 1}", **style)
        if steps:
            offset += max(steps)
            for ax in axes[:, 0]:
                ax.axvline(offset, color="grey", lw=0.5, ls="--")
    for ax, key in zip(axes[:, 0], keys, strict=True):
        ax.set_ylabel(key)
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("optimizer step (stages back to back)")
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target


def write_report(pipeline) -> dict:
    """Write pipeline_report.{md,json,png} into the pipeline's output dir (atomically for md/json)."""
    root = Path(pipeline.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    rows = collect(pipeline)
    payload = {
        "pipeline": pipeline.name,
        "stages": [{k: v for k, v in r.items() if k != "history"} for r in rows],
    }
    for name, text in (
        ("pipeline_report.json", json.dumps(payload, indent=2, default=str) + "\n"),
        ("pipeline_report.md", markdown(pipeline, rows)),
    ):
        write_atomic(root / name, text)
    try:
        plot(rows, root / "pipeline_report.png")
    except Exception as exc:  # a plotting problem must not fail a finished pipeline
        logger.warning("Could not draw pipeline_report.png: %s", exc)
    return payload


def print_table(pipeline) -> None:
    print()
    print(markdown(pipeline, collect(pipeline)))
    print(f"Report: {Path(pipeline.output_dir) / 'pipeline_report.md'} (+ .json, .png)")
