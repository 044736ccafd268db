"""Loading a run's parts, in order: the datasets (checked row by row), the tokenizer, the model settings.

The model itself is loaded by TRL inside the trainer; :func:`loading` turns the errors a user causes
there (no such hub id, no network and no cached copy, a folder that is not a model) into one
``error:`` line. :func:`check_hub_model` fails in seconds where ``from_pretrained`` would retry for
about a minute: a hub id that is neither cached nor reachable.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from urllib.parse import urlparse

from dna_factory.configuration.config import ResolvedConfig, RunArguments
from dna_factory.errors import CONFIG_ERRORS, DnaConfigError
from dna_factory.inputs.data import load_mixture, parse_specs
from dna_factory.inputs.data_files import looks_local
from dna_factory.inputs.prompts import PromptArguments, PromptRule, decide_prompt_rule, local_chat_template
from dna_factory.inputs.row_lengths import SERVER_MAX_MODEL_LEN, RowCheck, stage_limit
from dna_factory.stages import Stage, StageContext

logger = logging.getLogger(__name__)


def check_hub_model(
    model: str, revision: str | None = None, timeout: float = 5.0, what: str = "model_name_or_path"
) -> None:
    """A hub id that is not in the local cache needs the Hub (or ``HF_ENDPOINT``): fail at once when it is not
    reachable, instead of after ``from_pretrained``'s retries. A local path, or a cached id, passes untouched."""
    from huggingface_hub import constants, try_to_load_from_cache

    if looks_local(model) or os.path.isdir(model):
        return
    if any(
        isinstance(try_to_load_from_cache(model, name, revision=revision), str)
        for name in ("config.json", "adapter_config.json")
    ):
        return
    endpoint = constants.ENDPOINT
    if constants.HF_HUB_OFFLINE:
        problem = "HF_HUB_OFFLINE is set"
    else:
        url = urlparse(endpoint)
        try:
            socket.create_connection(
                (url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout
            ).close()
            return
        except OSError as exc:
            problem = f"{endpoint} cannot be reached ({exc})"
    raise DnaConfigError(
        f"{what} '{model}' is not a local folder and not in the Hugging Face cache, and {problem}. Download it where "
        f"the Hub is reachable (huggingface-cli download {model}) and copy the cache here, set HF_ENDPOINT to a "
        f"mirror, or point {what} at a local folder."
    )


def load_tokenizer(model_args, training_args):
    from transformers import AutoTokenizer

    with loading("the tokenizer", model_args.model_name_or_path):
        tokenizer = AutoTokenizer.from_pretrained(
            model_args.model_name_or_path,
            revision=model_args.model_revision,
            trust_remote_code=getattr(training_args, "trust_remote_code", False),
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@contextlib.contextmanager
def loading(what: str, model: str):
    """Turn the errors a user causes while a model's files load (no such hub id, offline without a cached copy,
    a folder that is not a model, a gated repo) into one DnaConfigError line; ``--debug`` shows the cause."""
    try:
        yield
    except (OSError, ValueError) as exc:
        if isinstance(exc, CONFIG_ERRORS):
            raise
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        offline = (
            " (HF_HUB_OFFLINE is set: download it first, or point at a local folder)"
            if os.environ.get("HF_HUB_OFFLINE")
            else ""
        )
        raise DnaConfigError(
            f"Could not load {what} of '{model}'{offline}: {first[:300]} Check model_name_or_path: a local folder "
            "saved by save_pretrained, or a hub id this machine can download or has cached."
        ) from exc


@contextlib.contextmanager
def building_trainer(stage: str):
    """Errors raised while TRL builds the trainer (and loads the model) from the user's settings, as one line.

    The message is TRL's or Transformers' own, which names the setting or file (an ``eos_token`` not in the
    vocabulary, a missing weights file); ``--debug`` shows where it was raised.
    """
    try:
        yield
    except (OSError, ValueError) as exc:
        if isinstance(exc, CONFIG_ERRORS):
            raise
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        raise DnaConfigError(
            f"The {stage} trainer could not be built: {type(exc).__name__}: {first[:400]} Fix the setting or file "
            "it names (--debug shows where it was raised)."
        ) from exc


def model_init_kwargs(model_args, training_args) -> dict:
    """What TRL passes to ``from_pretrained`` (TRL loads the model; we do not re-implement it)."""
    kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=getattr(training_args, "trust_remote_code", False),
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    kwargs.update(getattr(training_args, "model_init_kwargs", None) or {})
    return {k: v for k, v in kwargs.items() if v is not None}


def prompt_rule(cfg: ResolvedConfig, tokenizer=None) -> PromptRule:
    """How this run renders prompts (docs/datasets.md): chat or text, and the system turn."""
    args = cfg.of(PromptArguments)
    model = cfg.get("model_name_or_path")
    system_prompt = args.system_prompt or cfg.get("agent_system_prompt")
    rule = decide_prompt_rule(args.prompt_format, system_prompt, model, tokenizer)
    logger.info(
        "Prompts: %s%s.",
        "chat template (string prompts become a user turn)" if rule.chat else "raw text",
        ", with a system turn" if rule.system_prompt else "",
    )
    return rule


def row_check(stage: Stage, cfg: ResolvedConfig, load) -> RowCheck:
    """The stage's length limit and ``drop_overlong_prompts`` (docs/datasets.md); ``load()`` gives the tokenizer."""
    limit = stage_limit(stage.data_format, cfg, cfg.services.get(SERVER_MAX_MODEL_LEN))
    return RowCheck(
        limit,
        drop=bool(cfg.of(PromptArguments).drop_overlong_prompts),
        load_tokenizer=load,
        chat_template_kwargs=dict(cfg.get("chat_template_kwargs") or {}),
    )


def load_data(stage: Stage, cfg: ResolvedConfig):
    """The tokenizer and the checked, prompt-rendered train and eval mixtures (no model): ``(tok, train, eval)``.

    Rows are checked before the tokenizer loads when the model is a local folder (its chat template
    is read from the files); a hub id's tokenizer loads first, since it decides chat or text. Rows
    over the stage's length limit are dropped or refused as they load (:func:`row_check`).
    """
    from trl import ModelConfig

    training_args = cfg.of(stage.config_class)
    model_args = cfg.of(ModelConfig)
    run_args = cfg.of(RunArguments)
    tokenizer = None
    check_hub_model(model_args.model_name_or_path, model_args.model_revision)
    if teacher := cfg.get("teacher_model_name_or_path"):
        check_hub_model(str(teacher), None, what="teacher_model_name_or_path")
    if local_chat_template(model_args.model_name_or_path) is None:
        tokenizer = load_tokenizer(model_args, training_args)
    rule = prompt_rule(cfg, tokenizer)
    check = row_check(stage, cfg, lambda: tokenizer or load_tokenizer(model_args, training_args))
    with training_args.main_process_first(desc="dataset loading"):
        train_dataset = load_mixture(
            parse_specs(run_args.datasets),
            stage.data_format,
            seed=training_args.seed,
            prompt_rule=rule,
            check=check,
        )
        eval_dataset = None
        if run_args.eval_datasets:
            eval_dataset = load_mixture(
                parse_specs(run_args.eval_datasets, "eval_datasets"),
                stage.data_format,
                seed=training_args.seed,
                prompt_rule=rule,
                check=check,
            )
    logger.info("Training mixture: %d rows, columns %s", len(train_dataset), train_dataset.column_names)
    if tokenizer is None:
        tokenizer = (
            check.tokenizer() if check.limit is not None else load_tokenizer(model_args, training_args)
        )
    return tokenizer, train_dataset, eval_dataset


def dry_run_rows(stage: Stage, cfg: ResolvedConfig) -> None:
    """``--dry_run``: the rows of the local datasets checked, lengths measured, as a run would at its start,
    where the model's tokenizer is on this machine (a local folder or the hub cache); else one line says what
    was skipped. A bad row is the run's own error line."""
    from trl import ModelConfig

    model_args = cfg.of(ModelConfig)
    run_args = cfg.of(RunArguments)
    model = str(model_args.model_name_or_path)
    specs = [spec for spec in parse_specs(run_args.datasets) if spec.is_local and spec.weight > 0]
    missing = [spec.path for spec in specs if not os.path.exists(os.path.expanduser(spec.path))]
    if not specs or missing:
        logger.info(
            "dry run: rows not measured (%s).",
            f"{', '.join(missing)} not written yet" if missing else "no local dataset",
        )
        return
    if not (os.path.isdir(os.path.expanduser(model)) or _cached(model, model_args.model_revision)):
        logger.info("dry run: rows not measured: the tokenizer of %s is not on this machine.", model)
        return
    training_args = cfg.of(stage.config_class)
    tokenizer = load_tokenizer(model_args, training_args)
    check = row_check(stage, cfg, lambda: tokenizer)
    if check.limit is None:
        logger.info("dry run: rows not measured: nothing bounds their length (%s).", model)
        return
    rule = prompt_rule(cfg, tokenizer)
    rows = load_mixture(specs, stage.data_format, seed=training_args.seed, prompt_rule=rule, check=check)
    logger.info("dry run: %d rows of the local datasets kept after the row and length checks.", len(rows))


def _cached(model: str, revision: str | None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(model, "tokenizer_config.json", revision=revision), str)


def load_context(stage: Stage, cfg: ResolvedConfig) -> StageContext:
    """Datasets (checked row by row), tokenizer and model settings: everything a trainer factory needs."""
    from trl import ModelConfig, get_peft_config, get_quantization_config

    # Deferred like TRL: the callback module imports transformers, which importing the runner must not.
    from dna_factory.eval.callback import checkpoint_eval_callbacks

    training_args = cfg.of(stage.config_class)
    model_args = cfg.of(ModelConfig)
    tokenizer, train_dataset, eval_dataset = load_data(stage, cfg)
    training_args.model_init_kwargs = model_init_kwargs(model_args, training_args)
    return StageContext(
        config=cfg,
        training_args=training_args,
        model_args=model_args,
        run_args=cfg.of(RunArguments),
        tokenizer=tokenizer,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
        quantization_config=get_quantization_config(model_args),
        callbacks=checkpoint_eval_callbacks(cfg, training_args, model_args),
    )
