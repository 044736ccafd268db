"""Learnability filtering: keep the prompts a GRPO run can learn from (S-FILTER-1).

``python -m rewards.filter_tasks --config FILE [--key value ...] [--dry_run]`` draws K rollouts
per prompt, scores them with the recipe's rewards, classes each prompt (see
:mod:`rewards.learnability`: ``all_pass``, ``learnable``, ``all_fail``, ``unscored``) and writes,
into ``output_dir``:

- ``scored.jsonl``: one line per prompt as soon as it is scored (class, combined and
  per-function rewards); a rerun skips every prompt already there, so a crash loses at most
  the prompts in flight;
- ``kept.jsonl``: the rows of the classes in ``keep`` (default ``[learnable]``), normalised as
  for GRPO, loadable as a GRPO dataset;
- ``report.json``: counts per class, overall and per dataset label.

It selects training prompts only: no advantage is computed, no parameter is updated. Loading,
normalising and mixing the datasets is :func:`dna_factory.data.load_mixture` (format ``grpo``);
rewards come from :func:`rewards.registry.resolve_rewards`, exactly as a GRPO recipe gives them.

Example:
    python -m rewards.filter_tasks --config configs/filter_tasks/tiny-cpu.yaml
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dna_factory.errors import DnaConfigError

# Heavy imports (datasets, torch, trl, aiohttp) happen inside the functions that need them, so
# --help and recipe errors answer in a fraction of a second.

logger = logging.getLogger(__name__)

BACKENDS = ("server", "vllm", "hf")
OUTPUT_FILES = {"scored": "scored.jsonl", "kept": "kept.jsonl", "report": "report.json"}
SERVED_NAME = "filter-tasks"
"""The name a server started by the ``vllm`` backend serves the model under."""


@dataclass
class FilterTasksConfig:
    """Every key of a filter_tasks recipe (``--help`` prints this list)."""

    datasets: list[dict | str] | None = field(
        default=None,
        metadata={
            "help": "Prompt mixture, as in a GRPO recipe: a list of {path, label, split, weight, ...}."
        },
    )
    reward_funcs: list[dict | str] | None = field(
        default=None,
        metadata={"help": "Rewards, as in a GRPO recipe (names, 'module:function' or {factory: ...})."},
    )
    num_generations: int = field(default=8, metadata={"help": "K: rollouts per prompt (at least 2)."})
    backend: str = field(
        default="server",
        metadata={
            "help": "'server': an OpenAI-compatible server at base_url; 'vllm': start a vLLM server for "
            "`model` (dna_factory.vllm_server); 'hf': transformers generate on a local model."
        },
    )
    model: str | None = field(
        default=None,
        metadata={
            "help": "backend hf/vllm: model directory or hub id. backend server: the served model name "
            "(default: the first the server lists)."
        },
    )
    base_url: str | None = field(
        default=None,
        metadata={"help": "backend server: OpenAI-compatible base URL, e.g. http://host:8000/v1."},
    )
    devices: str | None = field(
        default=None, metadata={"help": "backend vllm: CUDA_VISIBLE_DEVICES for the server (physical ids)."}
    )
    server_args: list[str] = field(
        default_factory=list,
        metadata={"help": "backend vllm: extra server flags, e.g. [--max-model-len, '4096']."},
    )
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (> 0)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass in (0, 1]."})
    max_tokens: int = field(default=512, metadata={"help": "Most generated tokens per completion."})
    seed: int = field(
        default=42,
        metadata={"help": "Seed of the dataset mixture, and base sampling seed (row i: seed + i)."},
    )
    chat_template_kwargs: dict | None = field(
        default=None, metadata={"help": "Extra chat-template variables, e.g. {enable_thinking: false}."}
    )
    prompt_format: str = field(
        default="auto",
        metadata={
            "help": "auto | chat | text: string prompts become a user turn of the chat template (as in training; "
            "docs/datasets.md). auto: chat unless a local model has no template; a server is asked for chat."
        },
    )
    system_prompt: str | None = field(
        default=None,
        metadata={"help": "System turn before every chat prompt that has none (as in training)."},
    )
    concurrency: int = field(default=16, metadata={"help": "backend server/vllm: prompts in flight at once."})
    request_timeout_s: float = field(
        default=600.0, metadata={"help": "backend server/vllm: seconds allowed for one prompt's request."}
    )
    keep: list[str] = field(
        default_factory=lambda: ["learnable"],
        metadata={"help": "Classes whose rows go to kept.jsonl: all_pass, learnable, all_fail, unscored."},
    )
    pass_threshold: float = field(
        default=1.0,
        metadata={"help": "A group whose samples all have the same reward is all_pass at or above this."},
    )
    output_dir: str | None = field(
        default=None, metadata={"help": "Where scored.jsonl, kept.jsonl and report.json go (required)."}
    )
    limit: int | None = field(
        default=None,
        metadata={"help": "Score at most this many new prompts in this run (a rerun continues)."},
    )
    save_completions: bool = field(
        default=False, metadata={"help": "Also store the K completion texts in scored.jsonl."}
    )
    dry_run: bool = field(default=False, metadata={"help": "Validate the recipe, print it and exit."})


def _fail(message: str) -> None:
    raise DnaConfigError(message)


def validate(cfg: FilterTasksConfig) -> tuple[list, list, list]:
    """Check the recipe without loading a model or a dataset; return (specs, reward funcs, weights).

    Raises:
        DnaConfigError: "what is wrong. what to do." for the first problem found.
    """
    from dna_factory.data import looks_local, parse_specs
    from dna_factory.validation import mixture_columns
    from rewards.learnability import CLASSES
    from rewards.registry import check_reward_columns, resolve_rewards

    specs = parse_specs(cfg.datasets)
    if not cfg.reward_funcs:
        _fail(
            "No reward_funcs configured. Add `reward_funcs:` with at least one reward, as in a GRPO recipe."
        )
    funcs, weights = resolve_rewards(cfg.reward_funcs)
    columns = mixture_columns(specs)
    if columns is not None:
        check_reward_columns(cfg.reward_funcs, columns | {"prompt"})
    if cfg.num_generations < 2:
        _fail(
            f"num_generations is {cfg.num_generations}, but one rollout cannot show whether a prompt is "
            "learnable. Set num_generations to 2 or more (8 is typical)."
        )
    if cfg.backend not in BACKENDS:
        _fail(f"backend is {cfg.backend!r}. Use one of: {', '.join(BACKENDS)}.")
    if cfg.backend == "server" and not cfg.base_url:
        _fail(
            "backend 'server' needs `base_url:` (e.g. http://127.0.0.1:8000/v1). Set it, or use backend hf."
        )
    if cfg.backend in ("hf", "vllm"):
        if not cfg.model:
            _fail(f"backend {cfg.backend!r} needs `model:`, a model directory or hub id. Set it.")
        if looks_local(cfg.model) and not Path(cfg.model).expanduser().exists():
            _fail(f"Model path '{cfg.model}' does not exist. Check the path (relative to {Path.cwd()}).")
    if cfg.temperature <= 0:
        _fail(
            f"temperature is {cfg.temperature}: greedy decoding makes the K rollouts identical, so no prompt "
            "could be learnable. Use a sampling temperature such as 1.0."
        )
    if not 0 < cfg.top_p <= 1:
        _fail(f"top_p is {cfg.top_p}. Use a value in (0, 1], e.g. 1.0.")
    for key in ("max_tokens", "concurrency"):
        if getattr(cfg, key) < 1:
            _fail(f"{key} is {getattr(cfg, key)}. Use a positive integer.")
    if cfg.request_timeout_s <= 0:
        _fail(f"request_timeout_s is {cfg.request_timeout_s}. Use a positive number of seconds.")
    if cfg.limit is not None and cfg.limit < 1:
        _fail(f"limit is {cfg.limit}. Use a positive number of prompts, or remove it to score them all.")
    if not cfg.keep:
        _fail(f"keep is empty, so kept.jsonl would be empty. List classes to keep: {', '.join(CLASSES)}.")
    for name in cfg.keep:
        if name.replace("-", "_") not in CLASSES:
            from dna_factory.config_types import suggest

            _fail(
                f"keep lists {name!r}, which is not a class.{suggest(name, CLASSES)} Use: {', '.join(CLASSES)}."
            )
    if not cfg.output_dir:
        _fail(
            "No output_dir configured. Set `output_dir:` (scored.jsonl, kept.jsonl and report.json go there)."
        )
    prompt_rule_of(cfg)  # prompt_format / system_prompt, under --dry_run too
    return specs, funcs, weights


def load_config(argv: list[str]):
    """Layer the dataclass defaults < ``--config`` recipe < ``--key value`` flags; returns (resolved, cfg)."""
    from dna_factory.config import resolve

    resolved = resolve("filter_tasks", "FilterTasks", [FilterTasksConfig], argv)
    if resolved.recipe_path is None:
        _fail("No recipe given. Run python -m rewards.filter_tasks --config FILE (see --help).")
    return resolved, resolved.args[FilterTasksConfig]


def settings_of(cfg: FilterTasksConfig) -> dict[str, Any]:
    """What decides a prompt's class: a results file written with other settings is not reused."""
    return {
        "model": cfg.model,  # a path, or a served name (a server may move to another port)
        "reward_funcs": cfg.reward_funcs,
        "num_generations": cfg.num_generations,
        "sampling": [cfg.temperature, cfg.top_p, cfg.max_tokens, cfg.seed, cfg.chat_template_kwargs],
        "prompts": [cfg.prompt_format, cfg.system_prompt],
        "pass_threshold": cfg.pass_threshold,
    }


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

    from rewards.registry import reward_name

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

    from rewards.learnability import classify, combine

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


def prompt_rule_of(cfg: FilterTasksConfig, load_tokenizer: bool = False):
    """The training stages' prompt rule (dna_factory.prompts), so rows are scored as they will be trained.

    A local model folder's chat template is read from its files; a hub id's tokenizer is loaded when
    ``load_tokenizer`` (the run; the dry run assumes chat). A server is asked for chat.
    """
    from dna_factory.prompts import PromptRule, local_chat_template, resolve_prompt_format

    if cfg.prompt_format not in ("auto", "chat", "text"):
        _fail(f"prompt_format is {cfg.prompt_format!r}. Use auto, chat or text.")
    model = cfg.model if cfg.backend != "server" else None  # a served name says nothing about templates
    tokenizer = None
    if load_tokenizer and model and cfg.prompt_format != "text" and local_chat_template(model) is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
    chat = resolve_prompt_format(cfg.prompt_format, model, tokenizer) == "chat"
    if cfg.system_prompt and not chat:
        _fail("system_prompt is set but prompts are raw text (prompt_format: text, or a model without a chat "
              "template). Remove system_prompt or use a chat model.")  # fmt: skip
    return PromptRule(chat=chat, system_prompt=cfg.system_prompt)


def _backend(cfg: FilterTasksConfig, base_url: str | None, model: str | None):
    from rewards.rollouts import LocalRollouts, SamplingParams, ServerRollouts

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
    from dna_factory.data import load_mixture
    from dna_factory.vllm_server import VLLMServer
    from rewards.learnability import CLASSES, ScoreLog, fingerprint, prompt_key, write_atomic
    from rewards.registry import reward_name

    specs, funcs, weights = validate(cfg)
    out = Path(cfg.output_dir)
    # Generation sees the prompts as training will (templates, chat, system turn); kept.jsonl gets the rows
    # as the datasets hold them, so training on it with the same recipe renders them once, not twice.
    dataset = load_mixture(specs, "grpo", seed=cfg.seed, prompt_rule=prompt_rule_of(cfg, load_tokenizer=True))
    source = load_mixture([replace(spec, prompt_template=None) for spec in specs], "grpo", seed=cfg.seed)
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


async def _run_backend(cfg, dataset, todo, funcs, weights, log, backend) -> _Metrics:
    async with backend:
        return await _score_all(cfg, dataset, todo, funcs, weights, log, backend)


def _print_help() -> None:
    print("usage: python -m rewards.filter_tasks --config RECIPE.yaml [--key value ...] [--dry_run]\n")
    print(
        "Draws num_generations rollouts per prompt, scores them with reward_funcs and classes each prompt\n"
        "all_pass / learnable / all_fail / unscored; writes scored.jsonl (resumable), kept.jsonl and\n"
        "report.json into output_dir. See docs/rewards.md, 'Learnability filtering'."
    )
    from dna_factory.config_types import describe_keys

    print()
    print(describe_keys([FilterTasksConfig]))


def main(argv: list[str] | None = None) -> int:
    """The CLI: 0 when done, 2 for a recipe error, 1 when generation fails (a rerun resumes)."""
    from dna_factory.vllm_server import VLLMServerError
    from rewards.rollouts import RolloutError

    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        _print_help()
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        resolved, cfg = load_config(argv)
        if cfg.dry_run:
            validate(cfg)
            print(resolved.render(), end="")
            print("# dry run: recipe valid.", file=sys.stderr)
            return 0
        report = run(cfg)
    except DnaConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (RolloutError, VLLMServerError) as exc:
        print(
            f"error: {exc}\nPrompts scored so far are kept; rerun the same command to resume.",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print(
            "interrupted: prompts scored so far are kept; rerun the same command to resume.", file=sys.stderr
        )
        return 130
    summary = ("total_prompts", "scored_prompts", "complete", "counts", "kept_rows")
    print(json.dumps({key: report[key] for key in summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
