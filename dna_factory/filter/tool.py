"""The learnability filter's run: draw K rollouts per prompt, score them, class the prompt, write the files.

:func:`run` scores a validated :class:`~dna_factory.filter.recipe.FilterTasksConfig` (resuming from
``output_dir/scored.jsonl``); :func:`main` is the command (``python -m rewards.filter_tasks``). The package
docstring (:mod:`dna_factory.filter`) says what the tool does and writes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

from dna_factory.errors import DnaConfigError
from dna_factory.filter.learnability import CLASSES, ScoreLog, classify, combine, fingerprint, prompt_key
from dna_factory.filter.recipe import (
    OUTPUT_FILES,
    SERVED_NAME,
    FilterTasksConfig,
    _print_help,
    load_config,
    prompt_rule_of,
    settings_of,
    validate,
)
from dna_factory.inputs.data import load_mixture
from dna_factory.inputs.preview import RULE, first_rows_per_label, generation_prompt_ids
from dna_factory.inputs.row_lengths import RowCheck, stage_limit
from dna_factory.run.cli import EntryFlags, command_line, setup_logging
from dna_factory.run.run_files import write_atomic
from dna_factory.serving.vllm_server import VLLMServer, VLLMServerError
from rewards.options import shorten
from rewards.registry import reward_name

# Heavy imports (datasets, torch, trl, aiohttp) happen inside the functions that need them, so
# --help and recipe errors answer in a fraction of a second.

logger = logging.getLogger(__name__)


class _Metrics:
    """``log_metric`` for rewards (e.g. the judge's parse-failure rate) and per-prompt phase times
    (``time/generate_s``, ``time/score_s``, seconds per prompt): averaged into the report."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = defaultdict(list)

    def __call__(self, name: str, value: float) -> None:
        self.values[name].append(float(value))

    def means(self) -> dict[str, float]:
        return {name: sum(v) / len(v) for name, v in sorted(self.values.items()) if v}


async def score(
    row: dict[str, Any], rollouts, funcs: list, metrics: _Metrics
) -> tuple[list[list[float | None]], list[str]]:
    """Call every reward on the K completions of one row, as TRL's GRPOTrainer calls them.

    Returns one list of K values per reward function, and the functions' names.
    """
    from trl.trainer.utils import is_async_callable

    k = len(rollouts.completions)
    columns = {key: [value] * k for key, value in row.items() if key not in ("prompt", "completion")}
    per_func, names = [], []
    for func in funcs:
        values = func(
            prompts=[row["prompt"]] * k,
            completions=rollouts.completions,
            completion_ids=rollouts.completion_ids,
            log_metric=metrics,
            **columns,
        )
        if is_async_callable(func):
            values = await values
        values = list(values)
        if len(values) != k:
            raise RuntimeError(
                f"Reward {reward_name(func)} returned {len(values)} values for {k} completions."
            )
        per_func.append([None if v is None else float(v) for v in values])
        names.append(reward_name(func))
    return per_func, names


async def _score_all(cfg, dataset, todo, funcs, weights, log, backend) -> _Metrics:
    """Generate and score every row of ``todo`` through ``backend``, appending each to ``log``."""
    from tqdm.auto import tqdm

    metrics = _Metrics()
    queue: asyncio.Queue = asyncio.Queue()
    for item in todo:
        queue.put_nowait(item)
    progress = tqdm(total=len(dataset), initial=len(log), desc="filter_tasks", unit="prompt")

    async def worker() -> None:
        while not queue.empty():
            index, key = queue.get_nowait()
            row = dataset[index]
            start = time.perf_counter()
            rollouts = await backend.generate(row["prompt"], index)
            generated = time.perf_counter()
            per_func, names = await score(row, rollouts, funcs, metrics)
            metrics("time/generate_s", generated - start)
            metrics("time/score_s", time.perf_counter() - generated)
            rewards = combine(per_func, weights)
            record = {
                "key": key,
                "index": index,
                "label": row.get("label"),
                "class": classify(rewards, cfg.pass_threshold),
                "rewards": rewards,
                "per_func": dict(zip(names, per_func, strict=True)),
            }
            if cfg.save_completions:
                record["completions"] = rollouts.completions
            log.append(record)
            progress.update(1)

    workers = 1 if cfg.backend == "hf" else cfg.concurrency
    tasks = [asyncio.create_task(worker()) for _ in range(min(workers, max(1, len(todo))))]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        progress.close()
    return metrics


def _backend(cfg: FilterTasksConfig, base_url: str | None, model: str | None):
    from dna_factory.filter.rollouts import (  # aiohttp: not for --help
        LocalRollouts,
        SamplingParams,
        ServerRollouts,
    )

    sampling = SamplingParams(
        n=cfg.num_generations,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_tokens=cfg.max_tokens,
        seed=cfg.seed,
        chat_template_kwargs=cfg.chat_template_kwargs,
    )
    if cfg.backend == "hf":
        return LocalRollouts(cfg.model, sampling)
    api_key = os.environ.get("OPENAI_API_KEY") or "EMPTY"
    return ServerRollouts(base_url, model, sampling, api_key, cfg.concurrency, cfg.request_timeout_s)


def run(cfg: FilterTasksConfig) -> dict[str, Any]:
    """Score the mixture (resuming from ``output_dir/scored.jsonl``), write kept rows and the report.

    Returns:
        The report (also written to ``output_dir/report.json``).
    """

    specs, funcs, weights = validate(cfg)
    out = Path(cfg.output_dir)
    # Generation sees the prompts as training will (templates, chat, system turn); kept.jsonl gets the rows
    # as the datasets hold them, so training on it with the same recipe renders them once, not twice.
    dataset, source = load_prompts(cfg, specs)
    keys = [prompt_key(i, prompt) for i, prompt in enumerate(dataset["prompt"])]
    with ScoreLog(out / OUTPUT_FILES["scored"], fingerprint(settings_of(cfg))) as log:
        todo = [(i, key) for i, key in enumerate(keys) if key not in log]
        if cfg.limit is not None:
            todo = todo[: cfg.limit]
        logger.info("%d prompts, %d already scored, %d to score now.", len(keys), len(log), len(todo))
        metrics = _Metrics()
        if todo:
            if cfg.backend == "vllm":
                server = VLLMServer(
                    cfg.model,
                    served_model_name=SERVED_NAME,
                    devices=cfg.devices,
                    extra_args=cfg.server_args,
                    log_path=out / "vllm-server.log",
                )
                with server:
                    backend = _backend(cfg, server.base_url, SERVED_NAME)
                    metrics = asyncio.run(_run_backend(cfg, dataset, todo, funcs, weights, log, backend))
            else:
                backend = _backend(cfg, cfg.base_url, cfg.model)
                metrics = asyncio.run(_run_backend(cfg, dataset, todo, funcs, weights, log, backend))
        records = {key: log.records[key] for key in keys if key in log}

    keep = {name.replace("-", "_") for name in cfg.keep}
    kept = [i for i, key in enumerate(keys) if key in records and records[key]["class"] in keep]
    write_atomic(
        out / OUTPUT_FILES["kept"],
        (json.dumps(source[i], ensure_ascii=False, default=str) + "\n" for i in kept),
    )
    counts = Counter(record["class"] for record in records.values())
    by_label: dict[str, Counter] = defaultdict(Counter)
    samples = Counter()
    for record in records.values():
        by_label[str(record["label"])][record["class"]] += 1
        samples["total"] += len(record["rewards"])
        samples["unscored"] += sum(r is None for r in record["rewards"])
    report = {
        "total_prompts": len(keys),
        "scored_prompts": len(records),
        "complete": len(records) == len(keys),
        "counts": {name: counts.get(name, 0) for name in CLASSES},
        "by_label": {label: {n: c.get(n, 0) for n in CLASSES} for label, c in sorted(by_label.items())},
        "keep": sorted(keep),
        "kept_rows": len(kept),
        "samples": {"total": samples["total"], "unscored": samples["unscored"]},
        "num_generations": cfg.num_generations,
        "rewards": {reward_name(f): w for f, w in zip(funcs, weights, strict=True)},
        "metrics": metrics.means(),
        "files": {name: str(out / file) for name, file in OUTPUT_FILES.items()},
    }
    write_atomic(out / OUTPUT_FILES["report"], [json.dumps(report, indent=2) + "\n"])
    logger.info(
        "Scored %d of %d prompts: %s. Kept %d rows in %s.",
        len(records),
        len(keys),
        ", ".join(f"{n} {report['counts'][n]}" for n in CLASSES),
        len(kept),
        out / OUTPUT_FILES["kept"],
    )
    return report


def load_prompts(cfg: FilterTasksConfig, specs) -> tuple[Any, Any]:
    """``(dataset, source)``: the mixture as generation sees it (templates, chat, system turn) and as the datasets
    hold it, both without the prompts over the length limit (:func:`measured`)."""

    # Prompts with no text are found before templates render, so both loads drop the same rows and stay aligned.
    empty = RowCheck(None, drop=cfg.drop_overlong_prompts)
    rule = prompt_rule_of(cfg, load_tokenizer=True)
    dataset = load_mixture(specs, "grpo", seed=cfg.seed, prompt_rule=rule, check=empty)
    source = load_mixture(
        [replace(spec, prompt_template=None) for spec in specs], "grpo", seed=cfg.seed, check=empty
    )
    return measured(cfg, dataset, source)


def measured(cfg: FilterTasksConfig, dataset, source):
    """``(dataset, source)`` without the prompts over the limit (dna_factory.inputs.row_lengths), or an error naming the
    first (``drop_overlong_prompts: false``). backend server: not measured (no tokenizer here)."""
    model = cfg.model if cfg.backend != "server" else None
    if model is None:
        logger.info("Prompt lengths not measured: backend server (its tokenizer is not here).")
        return dataset, source
    view = {
        "model_name_or_path": model,
        "max_prompt_length": cfg.max_prompt_length,
        "max_tokens": cfg.max_tokens,
    }

    def tokenizer():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model)

    check = RowCheck(
        stage_limit("prompt", view, completion_key="max_tokens"),
        drop=cfg.drop_overlong_prompts,
        load_tokenizer=tokenizer,
        chat_template_kwargs=dict(cfg.chat_template_kwargs or {}),
    )
    dataset, kept = check.keep(
        dataset, "mixture", "after the datasets are mixed: rows count from 0 across them"
    )
    return dataset, source.select(kept) if len(kept) < len(source) else source


async def _run_backend(cfg, dataset, todo, funcs, weights, log, backend) -> _Metrics:
    async with backend:
        return await _score_all(cfg, dataset, todo, funcs, weights, log, backend)


def preview_prompts(cfg: FilterTasksConfig, specs, n: int, out=None) -> int:
    """``--preview [N]``: the first N prompts per dataset label as the model will see them (after the templates,
    the chat turn and the length check), with the columns the rewards receive; nothing is generated.
    Returns the number of prompts shown."""

    out = out or sys.stdout
    dataset, _ = load_prompts(cfg, specs)
    tokenizer = None
    if cfg.backend != "server":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    how = "as the model sees them" if tokenizer else "as sent to the server (it applies its chat template)"
    print(f"# preview: filter_tasks, {len(dataset)} prompts, {n} per dataset label, {how}", file=out)
    shown = 0
    for label, indices in first_rows_per_label(dataset, n).items():
        for index in indices:
            row = dataset[index]
            print(f"{RULE}\n[{label}] row {index}", file=out)
            if tokenizer is None:
                print(f"── prompt:\n{json.dumps(row['prompt'], ensure_ascii=False, indent=1)}", file=out)
            else:
                ids = generation_prompt_ids(
                    tokenizer, row["prompt"], None, dict(cfg.chat_template_kwargs or {})
                )
                print(f"── generation prompt ({len(ids)} tokens):\n{tokenizer.decode(ids)}", file=out)
            extra = {k: v for k, v in row.items() if k not in ("prompt", "label")}
            if extra:
                shown_columns = ", ".join(f"{k}={shorten(repr(v))}" for k, v in extra.items())
                print(f"── columns the rewards receive:\n{shown_columns}", file=out)
            shown += 1
    print(RULE, file=out)
    return shown


def main(argv: list[str] | None = None) -> int:
    """The CLI: 0 when done, 2 for a recipe error, 1 when generation fails (a rerun resumes); the boundary is
    every entry's (:func:`dna_factory.run.cli.command_line`: ``--debug``, error lines, exit statuses)."""
    from dna_factory.filter.rollouts import RolloutError  # aiohttp: not for --help and recipe errors

    argv = sys.argv[1:] if argv is None else argv

    def body(run_argv: list[str], flags: EntryFlags) -> int:
        if flags.help:
            _print_help()
            return 0
        setup_logging()
        if flags.rehearse:
            raise DnaConfigError("--rehearse is for the stage scripts and pipeline.py; the filter has none.")
        if flags.preview is not None:
            resolved, cfg = load_config([*run_argv, "--dry_run"])
            specs, _, _ = validate(cfg)
            preview_prompts(cfg, specs, flags.preview)
            return 0
        resolved, cfg = load_config(run_argv)
        if cfg.dry_run:
            specs, _, _ = validate(cfg)
            local = all(spec.is_local and Path(spec.path).expanduser().exists() for spec in specs)
            if local and cfg.backend != "server" and cfg.model and Path(cfg.model).expanduser().is_dir():
                kept, _ = load_prompts(cfg, specs)  # rows checked, lengths measured, as the run will
                logger.info("dry run: %d prompts kept after the row and length checks.", len(kept))
            print(resolved.render(), end="")
            print("# dry run: recipe valid.", file=sys.stderr)
            return 0
        report = run(cfg)
        summary = ("total_prompts", "scored_prompts", "complete", "counts", "kept_rows")
        print(json.dumps({key: report[key] for key in summary}))
        return 0

    return command_line(
        body,
        argv,
        interrupted="prompts scored so far are kept; rerun the same command to resume.",
        failures=(RolloutError, VLLMServerError),
        failure_hint="\nPrompts scored so far are kept; rerun the same command to resume.",
    )


if __name__ == "__main__":
    sys.exit(main())
