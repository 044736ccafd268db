"""Pipeline report: per-stage summary as Markdown and JSON, and a PNG of the main curves across stages.

Reads what each stage's runner left in its output dir: ``run_summary.json`` (steps, wall time),
``log_history.json`` (the trainer's logged metrics), ``DONE.json`` (its input and final models) and,
with checkpoint evaluation on, ``eval_results.jsonl``. Plots with matplotlib (Agg backend: no display
needed).

Each stage's held-out metric reads before -> after, both on the same held-out set (:func:`before_after`):

* ``eval_metric``: the stage's first ``eval/<task>`` key;
* ``eval_after``: its value for the stage's final model (the eval of the last step), else None;
* ``eval_before``: its value for the model the stage started from: the stage's own baseline (step 0)
  when it evaluated one, else the ``eval_after`` of the earlier stage whose final model it started
  from (``eval_before_from`` names which), else None;
* ``eval_also``: the same task's other metrics (``eval/<task>/<metric>``, e.g. an agent task's
  ``tool_call_rate`` and ``turns``: the behaviour that changed), each ``{"before": ..., "after": ...}`` from the
  stage's own baseline and last eval;
* ``eval_loss_before`` / ``eval_loss_after``: the trainer's own ``eval_loss`` on ``eval_datasets`` at
  step 0 (``eval_on_start``) and at the last step, when it logged them: for distillation, the quantity
  it optimises (per-token reverse KL to the teacher with ``beta: 1``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from dna_factory.pipeline.recipe import input_model
from dna_factory.run.run_files import DONE, RUN_SUMMARY, eval_rows, read_json, train_history, write_atomic

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
        "done_input_model": (done or {}).get("input_model"),
        "history": history,
    }


def before_after(rows: list[dict]) -> list[dict]:
    """Fill each row's ``eval_metric``, ``eval_before(_from)``, ``eval_after`` and ``eval_loss_before/after``.

    ``rows`` are :func:`stage_summary` rows in stage order, each with ``input_model`` (the model it started
    from) and ``model`` (its final one, once done). A row's "before" comes from its own step-0 eval, else
    from the earlier row whose final model is its input model.
    """
    by_model = {}
    for row in rows:
        history, steps = row["eval_history"], row["steps"]
        key = next((k for e in history for k in e if k != "step" and k.count("/") == 1), None)
        after = next((e[key] for e in history if key in e and e["step"] == steps), None) if key else None
        own = next((e[key] for e in history if key in e and e["step"] == 0), None) if key else None
        source = "baseline" if own is not None else None
        if own is None and row.get("input_model") in by_model:
            earlier = by_model[row["input_model"]]
            # Only for a stage evaluated on the same metric: one that never evaluated has no before -> after.
            if key is not None and earlier["eval_after"] is not None and earlier["eval_metric"] == key:
                own, source = earlier["eval_after"], earlier["name"]
        losses = [(h.get("step"), h["eval_loss"]) for h in row.get("history", []) if "eval_loss" in h]
        also = {
            k.removeprefix(f"{key}/"): {
                "before": next((e[k] for e in history if k in e and e["step"] == 0), None),
                "after": next((e[k] for e in history if k in e and e["step"] == steps), None),
            }
            for k in dict.fromkeys(k for e in history for k in e if key and k.startswith(f"{key}/"))
        }
        row.update(
            eval_also=also,
            eval_metric=key,
            eval_before=own,
            eval_before_from=source,
            eval_after=after,
            eval_loss_before=next((v for s, v in losses if s == 0), None),
            eval_loss_after=next((v for s, v in reversed(losses) if s == steps and s), None),
        )
        if row.get("model"):
            by_model[row["model"]] = row
    return rows


def collect(pipeline) -> list[dict]:
    rows = []
    for stage in pipeline.stages:
        row = stage_summary(stage, pipeline.output_dir)
        row["input_model"] = row.pop("done_input_model") or input_model(pipeline, stage)
        rows.append(row)
    return before_after(rows)


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else ("-" if value is None else str(value))


def _change(before, after) -> str:
    """``0.46 → 0.705 (+0.245)``; one side missing: the other alone."""
    if before is None or after is None:
        return _fmt(after if before is None else before) + ("" if after is not None else " → ?")
    return f"{_fmt(before)} → {_fmt(after)} ({after - before:+.3g})"


def _eval_cell(row: dict) -> str:
    """The held-out column: ``largest 0.46 → 0.705 (+0.245)``, and the stage's eval_loss when it logged one."""
    parts = []
    if row["eval_metric"]:
        parts.append(
            f"{row['eval_metric'].removeprefix('eval/')} {_change(row['eval_before'], row['eval_after'])}"
        )
        for name, values in row.get("eval_also", {}).items():
            if name != "abstained" or values["after"]:
                parts.append(f"{name} {_change(values['before'], values['after'])}")
    if row["eval_loss_before"] is not None or row["eval_loss_after"] is not None:
        name = "reverse KL to teacher" if row["entry"] == "distill" else "eval_loss"
        parts.append(f"{name} {_change(row['eval_loss_before'], row['eval_loss_after'])}")
    return "; ".join(parts) or "-"


def markdown(pipeline, rows: list[dict]) -> str:
    lines = [
        f"# Pipeline {pipeline.name}",
        "",
        "| # | stage | entry | status | steps | seconds | final | held-out: before → after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        final = ", ".join(f"{k} {_fmt(v)}" for k, v in r["final"].items()) or "-"
        lines.append(
            f"| {r['index']} | {r['name']} | {r['entry']} | {r['status']} | {_fmt(r['steps'])} | {_fmt(r['seconds'])} "
            f"| {final} | {_eval_cell(r)} |"
        )
    metrics = {r["eval_metric"] for r in rows if r["eval_metric"]}
    if metrics:
        lines += [
            "",
            "Before: the held-out metric of the model the stage started from (the earlier stage's final eval, or the",
            "stage's own baseline); after: of its final model."
            + (" Every stage is evaluated on the same held-out set." if len(metrics) == 1 else ""),
        ]
    return "\n".join(lines) + "\n"


def _plot_before_after(ax, rows: list[dict]) -> None:
    """The table's held-out column as bars: per stage, before (light) and after (full), the change written above."""
    shown = [r for r in rows if r["eval_metric"]]
    for i, r in enumerate(shown):
        color = f"C{r['index'] - 1}"
        for offset, value, alpha in ((-0.2, r["eval_before"], 0.35), (0.2, r["eval_after"], 1.0)):
            if value is not None:
                ax.bar(i + offset, value, width=0.38, color=color, alpha=alpha)
        if r["eval_before"] is not None and r["eval_after"] is not None:
            top = max(r["eval_before"], r["eval_after"])
            ax.annotate(
                f"{r['eval_after'] - r['eval_before']:+.3g}", (i, top), ha="center", va="bottom", fontsize=8
            )
    ax.set_xticks(range(len(shown)), [f"{r['name']}\n(before | after)" for r in shown], fontsize=8)
    metrics = sorted({r["eval_metric"] for r in shown})
    ax.set_ylabel(metrics[0] if len(metrics) == 1 else "held-out metric (first task of each stage)")
    ax.set_title("held-out metric of each stage: the model it started from | its final model", fontsize=9)


def plot(rows: list[dict], target: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eval_keys = sorted({k for r in rows for e in r["eval_history"] for k in e if k != "step"})
    keys = eval_keys + [k for k in CURVES if any(k in h for r in rows for h in r["history"])]
    if not keys:
        return None
    bars = any(r["eval_metric"] for r in rows)
    fig = plt.figure(figsize=(9, 2.8 * (len(keys) + bars)))
    grid = fig.add_gridspec(len(keys) + bars, 1)
    if bars:
        _plot_before_after(fig.add_subplot(grid[0, 0]), rows)
    first = fig.add_subplot(grid[bars, 0])
    axes = [first] + [fig.add_subplot(grid[bars + i, 0], sharex=first) for i in range(1, len(keys))]
    offset = 0
    for r in rows:
        steps = [h.get("step", 0) for h in r["history"]]
        for ax, key in zip(axes, keys, strict=True):
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
            for ax in axes:
                ax.axvline(offset, color="grey", lw=0.5, ls="--")
    for ax, key in zip(axes, keys, strict=True):
        ax.set_ylabel(key)
        ax.legend(fontsize=7)
    axes[-1].set_xlabel("optimizer step (stages back to back)")
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
