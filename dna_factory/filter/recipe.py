"""A learnability-filter recipe: its keys (:class:`FilterTasksConfig`), their layering and their checks.

:func:`load_config` layers the dataclass defaults < ``--config`` recipe < ``--key value`` flags, and
:func:`validate` checks a recipe without loading a model or a dataset ("what is wrong. what to do.").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dna_factory.configuration.config import resolve
from dna_factory.configuration.config_types import describe_keys
from dna_factory.configuration.validation import mixture_columns
from dna_factory.errors import DnaConfigError
from dna_factory.filter.learnability import CLASSES
from dna_factory.inputs.data import looks_local, parse_specs
from dna_factory.inputs.prompts import PromptArguments, decide_prompt_rule, local_chat_template
from dna_factory.inputs.row_lengths import PromptLengthArguments
from rewards.options import did_you_mean
from rewards.registry import check_reward_columns, resolve_rewards

BACKENDS = ("server", "vllm", "hf")


OUTPUT_FILES = {"scored": "scored.jsonl", "kept": "kept.jsonl", "report": "report.json"}


SERVED_NAME = "filter-tasks"
"""The name a server started by the ``vllm`` backend serves the model under."""


@dataclass
class FilterTasksConfig(PromptArguments, PromptLengthArguments):
    """Every key of a filter_tasks recipe (``--help`` prints this list). The prompt keys are the training stages'
    own (:class:`~dna_factory.inputs.prompts.PromptArguments`, ``max_prompt_length``), so rows are scored as trained."""

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
            "`model` (dna_factory.serving.vllm_server); 'hf': transformers generate on a local model."
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

    specs = parse_specs(cfg.datasets)
    if not cfg.reward_funcs:
        _fail(
            "No reward_funcs configured. Add `reward_funcs:` with at least one reward, as in a GRPO recipe."
        )
    funcs, weights = resolve_rewards(cfg.reward_funcs)
    columns = mixture_columns(specs)
    if columns is not None:
        check_reward_columns(cfg.reward_funcs, columns)
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
            _fail(
                f"keep lists {name!r}, which is not a class.{did_you_mean(name, CLASSES)} Use: {', '.join(CLASSES)}."
            )
    if not cfg.output_dir:
        _fail(
            "No output_dir configured. Set `output_dir:` (scored.jsonl, kept.jsonl and report.json go there)."
        )
    prompt_rule_of(cfg)  # prompt_format / system_prompt, under --dry_run too
    return specs, funcs, weights


def load_config(argv: list[str]):
    """Layer the dataclass defaults < ``--config`` recipe < ``--key value`` flags; returns (resolved, cfg)."""

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


def prompt_rule_of(cfg: FilterTasksConfig, load_tokenizer: bool = False):
    """The training stages' prompt rule (dna_factory.inputs.prompts), so rows are scored as they will be trained.

    A local model folder's chat template is read from its files; a hub id's tokenizer is loaded when
    ``load_tokenizer`` (the run; the dry run assumes chat). A server is asked for chat.
    """

    model = cfg.model if cfg.backend != "server" else None  # a served name says nothing about templates
    tokenizer = None
    if load_tokenizer and model and cfg.prompt_format != "text" and local_chat_template(model) is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
    return decide_prompt_rule(cfg.prompt_format, cfg.system_prompt, model, tokenizer)


def _print_help() -> None:
    print(
        "usage: python -m rewards.filter_tasks --config RECIPE.yaml [--key value ...] [--dry_run] [--preview [N]] "
        "[--debug]\n"
    )
    print(
        "Draws num_generations rollouts per prompt, scores them with reward_funcs and classes each prompt\n"
        "all_pass / learnable / all_fail / unscored; writes scored.jsonl (resumable), kept.jsonl and\n"
        "report.json into output_dir. See docs/rewards.md, 'Learnability filtering'.\n\n"
        "--preview [N]  print N prompts per dataset label as the model will see them, then exit (default 2)\n"
        "--debug        print the traceback above an error: line"
    )

    print()
    print(describe_keys([FilterTasksConfig]))
