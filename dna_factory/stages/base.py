"""What a stage declares: its config dataclasses, dataset format, validators and trainer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dna_factory.configuration.config import ResolvedConfig, RunArguments
from dna_factory.eval.keys import CheckpointEvalArguments
from dna_factory.inputs.prompts import PromptArguments


@dataclass
class StageContext:
    """Everything a stage's trainer factory needs, loaded by the runner."""

    config: ResolvedConfig
    training_args: Any
    model_args: Any
    run_args: Any
    tokenizer: Any
    train_dataset: Any
    eval_dataset: Any = None
    peft_config: Any = None
    quantization_config: Any = None
    callbacks: list = field(default_factory=list)

    def trainer_kwargs(self, quantization: bool = True) -> dict[str, Any]:
        """The keyword arguments every TRL trainer takes, from this context (the model is loaded by TRL)."""
        kwargs = dict(
            model=self.model_args.model_name_or_path,
            args=self.training_args,
            train_dataset=self.train_dataset,
            eval_dataset=self.eval_dataset,
            processing_class=self.tokenizer,
            peft_config=self.peft_config,
            callbacks=self.callbacks,
        )
        if quantization:
            kwargs["quantization_config"] = self.quantization_config
        return kwargs


@dataclass(frozen=True)
class Stage:
    """A training stage.

    Attributes:
        name: entry name (``sft``), also the ``outputs/<name>-...`` prefix.
        defaults: ``configs/_defaults-<defaults>.yaml`` is the lowest config layer.
        config_class: the TRL config dataclass (or a project subclass of it).
        data_format: the dataset format rows are normalised to (see ``dna_factory.inputs.data.FORMATS``).
        build_trainer: returns a ready TRL trainer for a StageContext.
        validators: pure checks over the resolved config, run before anything heavy loads
            and by ``--dry_run``; each raises DnaConfigError.
        extra_dataclasses: further config dataclasses whose keys this stage accepts.
        foreign_keys: keys this stage rejects with a reason of its own, beyond the keys only a sibling variant
            accepts (:func:`dna_factory.stages.variant_foreign_keys`).
        wait_for_services: waits, bounded and logged, for the external services a run needs (a vLLM
            server) and checks them; run after validation and before data, tokenizer and model
            load, not by ``--dry_run``. Raises DnaServiceError.
    """

    name: str
    defaults: str
    config_class: type
    data_format: str
    build_trainer: Callable[[StageContext], Any]
    validators: Sequence[Callable[[ResolvedConfig], None]] = ()
    extra_dataclasses: Sequence[type] = ()
    foreign_keys: Callable[[], dict[str, str]] | None = None
    wait_for_services: Callable[[ResolvedConfig], None] | None = None


def dataclass_types(stage: Stage) -> list[type]:
    """The dataclasses whose fields are the stage's keys: its TRL config, TRL's ModelConfig and ours."""
    from trl import ModelConfig

    return [
        stage.config_class,
        ModelConfig,
        RunArguments,
        PromptArguments,
        CheckpointEvalArguments,
        *stage.extra_dataclasses,
    ]


def stage_keys(stage: Stage) -> set[str]:
    """Every key the stage accepts: the init fields of :func:`dataclass_types`."""

    return {f.name for cls in dataclass_types(stage) for f in dataclasses.fields(cls) if f.init}
