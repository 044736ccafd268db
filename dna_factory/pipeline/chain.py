"""Multi-stage pipelines: one recipe chains stages, each in its own process, stage k's model feeding stage k+1.

A pipeline recipe (``configs/recipes/<name>.yaml``)::

    name: tiny-cpu
    output_dir: outputs/pipeline-tiny-cpu
    model_name_or_path: artifacts/tiny/student     # the first stage's model
    overrides: {report_to: wandb}                   # optional: overrides for every stage (a stage's own win)
    launcher: [accelerate, launch, --config_file, configs/accelerate/zero3.yaml]   # optional: every stage's
    eval_server: {model: artifacts/tiny/student, args: "--max-model-len 512"}   # optional: one server, all evals
    stages:
      - name: sft
        entry: sft                                  # sft | dpo | grpo | distill
        config: configs/sft/tiny-cpu.yaml
        overrides: {num_train_epochs: 2}            # CLI-level overrides; "${teacher}" = stage teacher's model
        model: artifacts/tiny/teacher               # optional: start here instead of the previous stage's model
                                                    # (model: ${sft}: that earlier stage's final model)
        merge_adapter: true                         # LoRA stage: hand a merged model to the next stage
        launcher: [torchrun, --nproc_per_node, "8"]   # optional: this stage's own ([] for none)
        gpus: {train: "0,1,2,3", generation: "4,5,6,7"}                               # optional, GPU roles
        env: {OMP_NUM_THREADS: "1"}                 # optional

Each stage runs ``python <entry>.py --config <config> --model_name_or_path <previous output>
--output_dir <output_dir>/<k>-<name> <overrides>`` as a subprocess, so its GPU memory is released
before the next one starts. With ``eval_server`` the pipeline starts one vLLM server (dev mode) before the first
stage that evaluates checkpoints and hands it to each as ``eval_server_url``. A finished stage leaves ``DONE.json`` (its outputs); a rerun skips
finished stages and the interrupted one resumes from its last checkpoint (the runner's
auto-resume). ``--dry_run`` validates every stage's config in this process, before any stage runs;
``--preview [N]`` also prints each stage's first rows as its trainer will tokenize them.
``--rehearse`` runs every stage on CPU for two steps (docs/rehearsal.md): one plain process per
stage (no launcher, no GPU roles), outputs under ``outputs/rehearse/<name>`` unless ``--output_dir``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Set
from pathlib import Path

from dna_factory.errors import CONFIG_ERRORS, DnaConfigError
from dna_factory.inputs.loading import load_data
from dna_factory.inputs.preview import preview
from dna_factory.pipeline.eval_server import (
    check_eval_server_model,
    check_eval_server_spec,
    start_eval_server,
    uses_eval_server,
)
from dna_factory.pipeline.recipe import (
    DONE,
    Pipeline,
    PipelineStage,
    apply_cli_overrides,
    final_model,
    input_model,
    load_pipeline,
    model_reference,
    set_keys,
    stage_argv,
)
from dna_factory.pipeline.report import print_table, write_report
from dna_factory.pipeline.state import (
    dependencies,
    done_record,
    plan,
    record_inputs,
    stage_inputs,
    start_over,
    state_of,
)
from dna_factory.rehearsal import claim_output_dir
from dna_factory.run.cli import EntryFlags, command_line, setup_logging
from dna_factory.run.launch import through_launch
from dna_factory.run.run_files import write_atomic
from dna_factory.run.runner import prepare
from rewards.options import did_you_mean

logger = logging.getLogger(__name__)

REHEARSAL_MARK = "rehearsal-pipeline.json"


def rehearse(
    pipeline: Pipeline, output_dir: str | None, fresh: bool, running: bool, user_keys: Set[str] = frozenset()
) -> None:
    """``--rehearse``: every stage as one CPU process with ``--rehearse``, outputs kept apart from real runs.

    A stage's ``max_steps`` from the recipe is the real run's length and is dropped (the rehearsal's own
    length applies); one in ``user_keys`` (``--set max_steps=N``) is the user's and is kept. With ``fresh`` (no ``--from_stage``/``--only_stage``) an earlier rehearsal of this pipeline is
    removed first, so every stage runs again; a folder holding a real pipeline is refused.
    """

    unchecked = {}
    for stage in pipeline.stages:
        replaced = {"launcher": " ".join(stage.launcher), "gpus": stage.gpus}
        unchecked[stage.name] = {k: v for k, v in replaced.items() if v}
        if unchecked[stage.name]:
            logger.info(
                "rehearse: unchecked: stage %s: %s (every stage runs as one CPU process)",
                stage.name,
                "; ".join(f"{k} {v}" for k, v in unchecked[stage.name].items()),
            )
        stage.launcher = []
        stage.gpus = {}
        stage.flags.append("--rehearse")
        if "max_steps" not in user_keys:
            stage.overrides.pop("max_steps", None)
    pipeline.eval_server = None  # each rehearsed stage decides its own evals (docs/rehearsal.md)
    if not output_dir:
        pipeline.output_dir = Path("outputs") / "rehearse" / pipeline.name
    if not running:  # --dry_run / --preview: nothing is written
        return
    if fresh or not (pipeline.output_dir / REHEARSAL_MARK).is_file():
        claim_output_dir(pipeline.output_dir, mark=REHEARSAL_MARK)  # refuses a real pipeline's folder
    pipeline.output_dir.mkdir(parents=True, exist_ok=True)
    record = {"recipe": pipeline.name, "unchecked": {k: v for k, v in unchecked.items() if v}}
    (pipeline.output_dir / REHEARSAL_MARK).write_text(json.dumps(record, indent=2) + "\n")


def validate(pipeline: Pipeline, selected: list[PipelineStage]) -> list[dict]:
    """Dry-run every selected stage's config in this process; raise on the first error, naming the stage."""

    rows = []
    # Later stages' models do not exist yet: each stage is validated against the model its chain starts from.
    starts: dict[str, str] = {}
    for stage in pipeline.stages:
        chained = (
            starts[pipeline.stages[stage.index - 2].name] if stage.index > 1 else pipeline.model_name_or_path
        )
        reference = model_reference(stage)
        starts[stage.name] = starts[reference] if reference else stage.model or chained
    for stage in selected:
        argv = stage_argv(stage, starts[stage.name], pipeline.output_dir, starts) + ["--dry_run"]
        env_backup = dict(os.environ)
        try:
            os.environ.update(stage.env)
            if stage.gpus.get("train"):
                os.environ["CUDA_VISIBLE_DEVICES"] = stage.gpus["train"]
            entry_stage, cfg = prepare(stage.entry, argv)
        except CONFIG_ERRORS as exc:
            raise DnaConfigError(
                f"Stage {stage.index} ({stage.name}, {stage.entry}.py {stage.config}): {exc}"
            ) from None
        finally:
            os.environ.clear()
            os.environ.update(env_backup)
        gpus = dict(stage.gpus or {"train": os.environ.get("CUDA_VISIBLE_DEVICES", "all visible")})
        shared = uses_eval_server(pipeline, cfg)
        if shared:
            check_eval_server_model(pipeline, stage, cfg, starts[stage.name])
        if cfg.get("eval_on_checkpoint") and "eval" not in gpus:
            url = cfg.get("eval_server_url")
            gpus["eval"] = (
                "the pipeline's eval server"
                if shared
                else (f"the server at {url}" if url else f"vLLM on {cfg.get('eval_devices')}")
            )
        rows.append(
            {
                "index": stage.index,
                "name": stage.name,
                "entry": stage.entry,
                "config": stage.config,
                "execution": cfg.get("grpo_execution", "sync") if stage.entry == "grpo" else "-",
                "gpus": gpus,
                "launcher": " ".join(stage.launcher) or "python",
                "prepared": (entry_stage, cfg),  # for --preview; not printed
                "eval_server": shared,
            }
        )
    if any(r["eval_server"] for r in rows):
        check_eval_server_spec(pipeline, rows)
    return rows


def preview_stages(rows: list[dict], n: int) -> None:
    """``--preview N`` per stage: each stage's first rows as its trainer will tokenize them (no model loads)."""

    for r in rows:
        entry_stage, cfg = r["prepared"]
        print(f"\n## Stage {r['index']} ({r['name']}, {r['entry']}.py {r['config']})")
        try:
            tokenizer, train_dataset, _ = load_data(entry_stage, cfg)
        except CONFIG_ERRORS as exc:
            raise DnaConfigError(f"Stage {r['index']} ({r['name']}): {exc}") from None
        preview(entry_stage, cfg, tokenizer, train_dataset, n)


def merge_adapter(out: Path) -> Path:
    """Merge a LoRA adapter saved in ``out`` into its base model (``out/merged``) with peft."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    merged = out / "merged"
    if (merged / "config.json").is_file():
        return merged
    model = AutoPeftModelForCausalLM.from_pretrained(out).merge_and_unload()
    model.save_pretrained(merged)
    AutoTokenizer.from_pretrained(out).save_pretrained(merged)
    return merged


class StageInterrupted(Exception):
    """A stage stopped on Ctrl-C or SIGTERM (it saved a checkpoint first, unless signalled twice)."""

    def __init__(self, stage: PipelineStage, returncode: int):
        self.stage, self.status = stage, returncode
        name = signal.Signals(returncode - 128).name
        super().__init__(f"stage {stage.index} ({stage.name}) stopped on {name}")


def _wait_through_signals(proc: subprocess.Popen) -> int:
    """Wait for a stage. A terminal's Ctrl-C (or SLURM's SIGTERM) reaches the stage too, which finishes its step
    and saves a checkpoint: the pipeline waits for that instead of killing it (``subprocess.run`` would, 0.25 s
    later). The stage's own handling of a second signal stops it at once."""
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            logger.warning("Waiting for the stage to save its checkpoint and stop (pid %d).", proc.pid)


def _sigterm_as_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run_stage(stage: PipelineStage, model: str, root: Path, models: dict[str, str], inputs: dict) -> dict:
    out = stage.output_dir(root)
    record_inputs(stage, root, inputs)
    command = [
        *through_launch(stage.launcher),
        *([] if stage.launcher else [sys.executable]),
        f"{stage.entry}.py",
    ]
    command += stage_argv(stage, model, root, models)
    env = dict(os.environ, **stage.env)
    if stage.gpus.get("train"):
        env["CUDA_VISIBLE_DEVICES"] = stage.gpus["train"]
    logger.info("Stage %d (%s): %s", stage.index, stage.name, " ".join(command))
    started = time.time()
    returncode = _wait_through_signals(subprocess.Popen(command, env=env))
    seconds = time.time() - started
    if returncode in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        raise StageInterrupted(stage, returncode)
    if returncode != 0:
        raise RuntimeError(
            f"Stage {stage.index} ({stage.name}) failed with exit status {returncode}. Fix the cause and rerun "
            "the same command: finished stages are skipped and this one resumes from its last checkpoint."
        )
    final = out
    if (out / "adapter_config.json").is_file() and stage.merge_adapter:
        final = merge_adapter(out)
    done = {
        "stage": stage.name,
        "entry": stage.entry,
        "model": str(final),
        "input_model": model,
        "seconds": seconds,
        **done_record(inputs),
    }
    write_atomic(out / DONE, json.dumps(done, indent=2) + "\n")
    return done


def select(pipeline: Pipeline, from_stage: str | None, only_stage: str | None) -> list[PipelineStage]:
    names = [s.name for s in pipeline.stages]
    for wanted in (from_stage, only_stage):
        if wanted is not None and wanted not in names:
            raise DnaConfigError(
                f"No stage named '{wanted}'.{did_you_mean(wanted, names)} Stages: {', '.join(names)}."
            )
    if only_stage:
        return [s for s in pipeline.stages if s.name == only_stage]
    if from_stage:
        start = names.index(from_stage)
        return pipeline.stages[start:]
    return list(pipeline.stages)


def run(
    pipeline: Pipeline, selected: list[PipelineStage], cfgs: dict, shared_eval: Set[str] = frozenset()
) -> list[dict]:
    """Run the selected stages in order, skipping finished ones whose inputs are still what is upstream
    (:mod:`dna_factory.pipeline.state`; ``cfgs``: each stage's resolved config); the report is refreshed after
    each.

    ``shared_eval`` names the stages that evaluate on the recipe's ``eval_server``: it is started before the first
    of them that runs, handed to each as ``eval_server_url``, and stopped when the pipeline ends.
    """

    root = pipeline.output_dir
    root.mkdir(parents=True, exist_ok=True)
    results = []
    server = None
    retrained: set[str] = set()
    try:
        for stage in selected:
            for dependency in dependencies(pipeline, stage):
                if not (dependency.output_dir(root) / DONE).is_file():
                    raise DnaConfigError(
                        f"Stage {stage.index} ({stage.name}) needs stage {dependency.index} ({dependency.name}) "
                        f"finished first. Run with --from_stage {dependency.name}."
                    )
            model = input_model(pipeline, stage)
            models = {s.name: final_model(s, root) for s in pipeline.stages if s.index < stage.index}
            done_file = stage.output_dir(root) / DONE
            state = state_of(pipeline, stage, cfgs[stage.name], retrained)
            if state.state == "done":
                logger.info(
                    "Stage %d (%s) is done (%s): skipped. Delete %s to run it again.",
                    stage.index, stage.name, done_file, done_file.parent,
                )  # fmt: skip
                results.append(json.loads(done_file.read_text()))
                continue
            retrained.add(stage.name)
            if state.state == "rerun":
                logger.warning("Stage %d (%s) %s.", stage.index, stage.name, state.describe())
                start_over(stage, root)
            if stage.name in shared_eval:
                if server is None:
                    pending = [
                        s.name
                        for s in selected
                        if s.name in shared_eval and not (s.output_dir(root) / DONE).is_file()
                    ]
                    server = start_eval_server(pipeline, pending)
                stage.overrides["eval_server_url"] = server.url
            inputs = stage_inputs(pipeline, stage, cfgs[stage.name])
            results.append(run_stage(stage, model, root, models, inputs))
            write_report(pipeline)
    finally:
        if server is not None:
            server.stop(keep_log=True)
    write_report(pipeline)
    return results


def _short_launcher(launcher: str) -> str:
    """``accelerate launch --config_file configs/accelerate/zero3.yaml ...`` -> ``accelerate zero3.yaml``."""
    words = launcher.split()
    if "--config_file" in words[:-1]:
        return f"{words[0]} {Path(words[words.index('--config_file') + 1]).name}"[:27]
    return launcher[:27]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pipeline.py", description="Run a multi-stage post-training recipe."
    )
    parser.add_argument("--recipe", required=True, help="Pipeline recipe, e.g. configs/recipes/tiny-cpu.yaml")
    parser.add_argument("--from_stage", help="Start at this stage (earlier ones must be done).")
    parser.add_argument("--only_stage", help="Run only this stage.")
    parser.add_argument(
        "--dry_run", action="store_true", help="Validate every stage's config and print the plan."
    )
    parser.add_argument(
        "--preview",
        nargs="?",
        const=2,
        type=int,
        metavar="N",
        help="Print N rows per dataset label of every stage as its trainer will tokenize them, then exit "
        "(each stage's tokenizer is the one of the model its chain starts from).",
    )
    parser.add_argument("--output_dir", help="Write the pipeline here instead of the recipe's output_dir.")
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="Run every stage on CPU for two steps with tiny twins of its models and datasets "
        "(docs/rehearsal.md); outputs under outputs/rehearse/<name>.",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override a config key in every stage, above the recipe (repeatable; VALUE is YAML), e.g. a "
        "smoke test of the whole chain: --set max_steps=2 --set save_steps=2.",
    )
    parser.add_argument("--debug", action="store_true", help="Print the traceback above an error: line.")
    argv = sys.argv[1:] if argv is None else list(argv)

    def body(run_argv: list[str], flags: EntryFlags) -> int:
        args = parser.parse_args(run_argv)  # --debug, --preview and --rehearse are in flags, not here
        setup_logging()
        signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
        pipeline = load_pipeline(args.recipe)
        apply_cli_overrides(pipeline, args.set, args.output_dir)
        if flags.rehearse:
            running = not args.dry_run and flags.preview is None
            rehearse(
                pipeline,
                args.output_dir,
                fresh=not (args.from_stage or args.only_stage),
                running=running,
                user_keys=set_keys(args.set),
            )
        selected = select(pipeline, args.from_stage, args.only_stage)
        rows = validate(pipeline, selected)
        print(f"\nPipeline {pipeline.name}: {len(rows)} stage(s), outputs in {pipeline.output_dir}\n")
        print(f"{'#':<3}{'stage':<22}{'entry':<9}{'mode':<7}{'launcher':<28}GPU roles")
        for r in rows:
            roles = ", ".join(f"{k}={v}" for k, v in r["gpus"].items())
            print(
                f"{r['index']:<3}{r['name']:<22}{r['entry']:<9}{r['execution']:<7}{_short_launcher(r['launcher']):<28}{roles}"
            )
        if flags.preview is not None:
            preview_stages(rows, flags.preview)
            return 0
        cfgs = {r["name"]: r["prepared"][1] for r in rows}
        states = plan(pipeline, selected, cfgs)
        print()
        for r in rows:
            print(f"Stage {r['index']} ({r['name']}) {states[r['name']].describe()}.")
        if args.dry_run:
            print("\n# dry run: every stage's config is valid.")
            return 0
        run(pipeline, selected, cfgs, {r["name"] for r in rows if r["eval_server"]})

        print_table(pipeline)
        return 0

    command = shlex.join(["python", "pipeline.py", *argv])

    def stage_interrupted(exc: BaseException, debug: bool) -> int:
        print(
            f"interrupted: {exc}; finished stages are kept and this one resumes from its last checkpoint. "
            f"To resume, rerun: {command}",
            file=sys.stderr,
        )
        return exc.status

    return command_line(
        body,
        argv,
        interrupted="before any stage ran, or between stages. Rerun the same command to go on.",
        failures=(RuntimeError,),
        handlers=((StageInterrupted, stage_interrupted),),
    )
