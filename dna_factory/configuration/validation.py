"""Validators every stage runs before anything heavy loads (and under ``--dry_run``).

Each is a pure function of the resolved config that raises DnaConfigError with "what is
wrong. what to do."; stage modules add their own to ``Stage.validators``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

from dna_factory.configuration.config import ResolvedConfig
from dna_factory.errors import DnaConfigError
from dna_factory.eval.keys import validate_checkpoint_eval
from dna_factory.inputs.data import SOURCE_LABEL, check_format_columns, config_specs, looks_local
from dna_factory.inputs.data_files import peek_columns
from dna_factory.inputs.prompts import validate_prompt_settings
from rewards.options import did_you_mean, nearest, shorten
from rewards.registry import add_recipe_dir

logger = logging.getLogger(__name__)

TINY_MODEL_HINT = "python scripts/make_tiny_model.py --out {path}"


def validate_model(cfg: ResolvedConfig) -> None:
    path = cfg.get("model_name_or_path")
    if not path:
        raise DnaConfigError(
            "No model configured. Set `model_name_or_path:` in the recipe or pass --model_name_or_path."
        )
    if looks_local(path) and not Path(path).expanduser().exists():
        hint = ""
        near = _near_folder(Path(path))
        if near is not None:
            hint = f" Did you mean '{near}'? Fix the path."
        elif "tiny" in Path(path).as_posix():
            hint = f" Build the tiny offline model first: {TINY_MODEL_HINT.format(path=path)} (or `make tiny-models`)."
        raise DnaConfigError(
            f"Model path '{path}' does not exist.{hint or ' Check the path or use a hub id.'}"
        )


def _near_folder(path: Path) -> str | None:
    """The existing sibling folder whose name is close to ``path``'s (a typo), as the path to write; else None."""
    parent = path.expanduser().parent
    if not parent.is_dir():
        return None
    names = sorted(child.name for child in parent.iterdir() if child.is_dir())
    match = nearest(path.name, names)
    return (path.parent / match).as_posix() if match else None


def validate_datasets(cfg: ResolvedConfig, data_format: str) -> None:
    """Dataset specs are well formed, local paths exist and local schemas fit the stage's format."""
    for key in ("datasets", "eval_datasets"):
        raw = cfg.get(key)
        if raw is None and key == "eval_datasets":
            continue
        for spec in config_specs(cfg, key):
            columns = peek_columns(spec) if spec.is_local else None
            if columns is not None:
                check_format_columns(spec, columns, data_format)
    validate_only_labels(cfg)


def validate_only_labels(cfg: ResolvedConfig) -> None:
    """A reward's ``only_label`` names the ``label`` of a dataset in the mixture (else it scores no row)."""
    labels = sorted({spec.label for spec in config_specs(cfg) if spec.weight > 0})
    for entry in cfg.get("reward_funcs") or []:
        wanted = entry.get("only_label") if isinstance(entry, dict) else None
        if wanted is not None and str(wanted) not in labels:
            shown = shorten(repr(entry))
            raise DnaConfigError(
                f"Reward {shown} has only_label {wanted!r}, but no dataset in the mixture has that label, so it "
                f"would score no row.{did_you_mean(str(wanted), labels)} Set only_label to one of the datasets' "
                f"labels ({', '.join(labels)}) or fix the dataset's `label:`."
            )


def dataset_columns(cfg: ResolvedConfig) -> set[str] | None:
    """Union of the training mixture's columns (plus ``label``), or None if a dataset's schema is unknown."""
    return mixture_columns(config_specs(cfg))


def mixture_columns(specs) -> set[str] | None:
    """Union of the columns the datasets ``specs`` have once loaded (``columns:`` renames applied, ``label``
    included), or None if a dataset's schema is unknown. Training's and the learnability filter's reward-column
    checks both read it."""
    columns: set[str] = {"label"}
    for spec in specs:
        peeked = peek_columns(spec) if spec.is_local else None
        if peeked is None:
            return None
        own = {new for _, new in spec.columns} if spec.columns else peeked
        columns |= own | ({SOURCE_LABEL} if "label" in own else set())  # load_mixture keeps it so
        if "messages" in columns:
            columns |= {"prompt", "expected_output"}
    return columns


def validate_model_folder(cfg: ResolvedConfig) -> None:
    """A local folder that holds no model (no config.json, no adapter_config.json) fails now, by name."""
    path = cfg.get("model_name_or_path")
    folder = Path(str(path)).expanduser() if path else None
    markers = ("config.json", "adapter_config.json")
    if folder is not None and folder.is_dir() and not any((folder / name).is_file() for name in markers):
        raise DnaConfigError(
            f"Model path '{path}' is a folder without config.json, so it holds no transformers model. Point "
            "model_name_or_path at a folder written by save_pretrained (a stage's output_dir or checkpoint-N), "
            "or at a hub id."
        )


def validate_output_dir(cfg: ResolvedConfig) -> None:
    """The output dir is a folder, or can be made one: no file in its place or above it, writable."""
    if not str(cfg.get("output_dir") or "").strip():  # Path("") is ".": the run would write into the cwd
        raise DnaConfigError(
            "output_dir is empty. Give the folder for checkpoints and the final model, e.g. "
            f"--output_dir outputs/{cfg.stage}-run."
        )
    out = Path(str(cfg.get("output_dir"))).expanduser()
    if out.exists() and not out.is_dir():
        raise DnaConfigError(f"output_dir '{out}' is a file, not a folder. Choose another output_dir.")
    parent = out
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise DnaConfigError(
            f"output_dir '{out}' cannot be created: '{parent}' is a file, not a folder. Choose another output_dir."
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DnaConfigError(
            f"output_dir '{out}' cannot be written: '{parent}' is not writable by this user. Choose another "
            "output_dir."
        )


def validate_resume(cfg: ResolvedConfig) -> None:
    resume = cfg.get("resume_from_checkpoint")
    if (
        isinstance(resume, str)
        and resume.lower() not in ("true", "last", "false", "none")
        and not Path(resume).is_dir()
    ):
        raise DnaConfigError(
            f"resume_from_checkpoint '{resume}' is not a directory. Point it at an existing checkpoint-N folder, "
            "or use `last` for the newest checkpoint in output_dir."
        )


def validate_report_to(cfg: ResolvedConfig) -> None:
    report_to = cfg.get("report_to")
    targets = [report_to] if isinstance(report_to, str) else list(report_to or [])
    accepted = ("none", "all", "wandb", "tensorboard", "trackio", "mlflow")
    unknown = [t for t in targets if t not in accepted]
    if unknown:
        raise DnaConfigError(
            f"report_to has unsupported value {unknown[0]!r}.{did_you_mean(unknown[0], accepted)} Use one of: "
            f"{', '.join(accepted)}."
        )


def wandb_login_found() -> bool:
    """A W&B API key in ``WANDB_API_KEY`` or in the netrc file ``wandb login`` writes (``NETRC`` or ~/.netrc)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = (
        (os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
        .split("://")[-1]
        .split("/")[0]
        .split(":")[0]
    )
    netrc = Path(os.environ.get("NETRC") or Path.home() / ".netrc").expanduser()
    return netrc.is_file() and host in netrc.read_text(errors="ignore")


def validate_wandb_login(cfg: ResolvedConfig) -> None:
    """W&B asked for online (``WANDB_MODE=online``) needs a login; without one wandb raises after the model loaded."""
    report_to = cfg.get("report_to")
    targets = [report_to] if isinstance(report_to, str) else list(report_to or [])
    if not {"wandb", "all"} & set(targets) or os.environ.get("WANDB_MODE", "").lower() != "online":
        return
    if not wandb_login_found():
        raise DnaConfigError(
            "WANDB_MODE=online but no W&B login was found (WANDB_API_KEY, or ~/.netrc from `wandb login`). Run "
            "`wandb login` or set WANDB_API_KEY, or unset WANDB_MODE to log offline (wandb sync later)."
        )


def validate_distributed_env(cfg: ResolvedConfig) -> None:
    """accelerate configured for DeepSpeed without deepspeed installed fails now, not after the model loaded (a
    missing ``deepspeed:`` file is refused earlier, by :func:`dna_factory.configuration.config.check_deepspeed_file`)."""
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    if deepspeed and importlib.util.find_spec("deepspeed") is None:
        raise DnaConfigError(
            "accelerate is configured for DeepSpeed but deepspeed is not installed. "
            "pip install -e '.[deepspeed]' or use configs/accelerate/ddp.yaml."
        )


GPU_INSTALL = "pip install -e '.[gpu]'"


def gpu_packages_needed(cfg: ResolvedConfig) -> list[tuple[str, str, str]]:
    """``(package, the key that needs it, the way out)`` for each package the recipe's GPU paths import."""
    needed = []
    if cfg.get("grpo_execution") == "async":
        if cfg.get("tree_attention") == "fa3":
            needed.append(("kernels", "tree_attention: fa3 (TRL loads FlashAttention-3 through it)",
                           "or use tree_attention: sdpa"))  # fmt: skip
        if cfg.get("weight_sync") == "nccl":
            needed.append(("vllm", "weight_sync: nccl (TRL's NCCL weight transfer is vLLM's)",
                           "or use weight_sync: file"))  # fmt: skip
    elif cfg.get("use_vllm"):
        needed.append(("vllm", "use_vllm: true (TRL's vLLM generation)", "or set use_vllm: false"))
    return needed


def validate_gpu_packages(cfg: ResolvedConfig) -> None:
    """A recipe whose attention or weight-sync path needs a package that is not installed fails now, by name."""

    for package, why, alternative in gpu_packages_needed(cfg):
        if importlib.util.find_spec(package) is None:
            raise DnaConfigError(
                f"{why} needs the `{package}` package, which is not installed. {GPU_INSTALL} installs what the "
                f"GPU recipes need ({alternative})."
            )


COMMON_VALIDATORS = (
    validate_model,
    validate_model_folder,
    validate_output_dir,
    validate_wandb_login,
    validate_resume,
    validate_report_to,
    validate_distributed_env,
    validate_checkpoint_eval,
    validate_prompt_settings,
    validate_gpu_packages,
)


def run_validators(cfg: ResolvedConfig, stage) -> None:
    """Run the common validators, the dataset check for the stage's format and the stage's own."""
    if cfg.recipe_path:  # reward_funcs may name a module beside the recipe (my_rewards:brevity)
        add_recipe_dir(Path(cfg.recipe_path).parent)
    for check in COMMON_VALIDATORS:
        check(cfg)
    validate_datasets(cfg, stage.data_format)
    for check in stage.validators:
        check(cfg)
