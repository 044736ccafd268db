"""pipeline.py: chaining, done-markers and resume, --dry_run across stages, the report."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml

from tests.conftest import REPO, cli_env, run_cli


def _recipe(tmp_path, stages, name="r.yaml"):
    path = tmp_path / name
    path.write_text(
        yaml.safe_dump(
            {
                "name": "t",
                "output_dir": str(tmp_path / "out"),
                "model_name_or_path": "artifacts/tiny/student",
                "stages": stages,
            }
        )
    )
    return path


SMALL = [
    {
        "name": "sft",
        "entry": "sft",
        "config": "configs/sft/tiny-cpu.yaml",
        "overrides": {"max_steps": 4, "save_steps": 2},
    },
    {
        "name": "grpo",
        "entry": "grpo",
        "config": "configs/grpo/tiny-cpu.yaml",
        "overrides": {"max_steps": 6, "save_steps": 2, "save_total_limit": 5},
    },
    {
        "name": "distill",
        "entry": "distill",
        "config": "configs/distill/tiny-cpu.yaml",
        "overrides": {"max_steps": 2, "save_steps": 2},
    },
]


def test_dry_run_reports_an_error_in_stage_five_before_anything_runs(tmp_path, tiny_model):
    stages = [dict(SMALL[0], name=f"sft{i}") for i in range(4)] + [
        dict(SMALL[0], name="bad", overrides={"lerning_rate": 1})
    ]
    proc = run_cli(
        "pipeline.py", "--recipe", str(_recipe(tmp_path, stages))
    )  # not even --dry_run: validation comes first
    assert proc.returncode == 2
    assert "Stage 5 (bad" in proc.stderr and "Did you mean 'learning_rate'" in proc.stderr
    assert not (tmp_path / "out" / "1-sft0").exists(), (
        "no stage may run when a later stage's config is broken"
    )


def test_recipe_errors_are_named(tmp_path, tiny_model):
    proc = run_cli(
        "pipeline.py", "--recipe", str(_recipe(tmp_path, [dict(SMALL[0], entry="stf")])), "--dry_run"
    )
    assert proc.returncode == 2 and "Did you mean 'sft'" in proc.stderr
    proc = run_cli(
        "pipeline.py", "--recipe", str(_recipe(tmp_path, SMALL)), "--only_stage", "grpoo", "--dry_run"
    )
    assert proc.returncode == 2 and "No stage named 'grpoo'. Did you mean 'grpo'?" in proc.stderr


@pytest.mark.parametrize(("recipe", "stages"), [("rufus-air", 8), ("tiny-cpu", 4)])
def test_shipped_recipes_pass_dry_run(recipe, stages, tiny_model):
    proc = run_cli("pipeline.py", "--recipe", f"configs/recipes/{recipe}.yaml", "--dry_run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{stages} stage(s)" in proc.stdout
    if recipe == "rufus-air":
        for name in (
            "sft",
            "reasoning-rl",
            "coding-rl",
            "if-rl",
            "general-agent",
            "coding-agent",
            "search-agent",
            "rlhf",
        ):
            assert name in proc.stdout
        assert "generation=vLLM TP 8 x DP 4" in proc.stdout
    if recipe == "tiny-cpu":  # the demo as users run it: one server of the pipeline's own for every eval
        assert proc.stdout.count("eval=the pipeline's eval server") == 4


def test_a_short_chain_runs_end_to_end(tmp_path, tiny_model):
    """The fast tier's run of pipeline.py: two stages of two steps, each from the last, with its report."""
    stages = [dict(SMALL[0], overrides={"max_steps": 2, "save_steps": 2}),
              dict(SMALL[1], overrides={"max_steps": 2, "save_steps": 2})]  # fmt: skip
    proc = run_cli("pipeline.py", "--recipe", str(_recipe(tmp_path, stages)), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "out"
    done = [json.loads((out / d / "DONE.json").read_text()) for d in ("1-sft", "2-grpo")]
    assert done[1]["input_model"] == done[0]["model"] == str(out / "1-sft")
    report = json.loads((out / "pipeline_report.json").read_text())
    assert [(s["name"], s["status"], s["steps"]) for s in report["stages"]] == [
        ("sft", "done", 2),
        ("grpo", "done", 2),
    ]


@pytest.mark.timeout(900)  # a long test: about a third of this here
@pytest.mark.slow
def test_chain_kill_resume_and_report(tmp_path, tiny_model, tiny_teacher):
    recipe = _recipe(tmp_path, SMALL)
    out = tmp_path / "out"
    child = subprocess.Popen([sys.executable, "pipeline.py", "--recipe", str(recipe)], cwd=REPO, env=cli_env(),
                             start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.time() + 400
    while not (out / "2-grpo" / "checkpoint-2" / "trainer_state.json").is_file():
        assert child.poll() is None and time.time() < deadline, (
            "pipeline ended before stage 2 wrote checkpoint-2"
        )
        time.sleep(0.1)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    # However far it got, leave stage 2 interrupted right after its checkpoint-2.
    for later in ["DONE.json", "model.safetensors", "run_summary.json", "checkpoint-4", "checkpoint-6"]:
        target = out / "2-grpo" / later
        shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    shutil.rmtree(out / "3-distill", ignore_errors=True)

    proc = run_cli("pipeline.py", "--recipe", str(recipe), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Stage 1 (sft) is done" in proc.stderr
    assert "checkpoint-2: resuming from it" in proc.stderr
    done = [json.loads((out / d / "DONE.json").read_text()) for d in ("1-sft", "2-grpo", "3-distill")]
    assert done[0]["input_model"] == "artifacts/tiny/student"
    assert done[1]["input_model"] == done[0]["model"] == str(out / "1-sft")
    assert done[2]["input_model"] == done[1]["model"] == str(out / "2-grpo")
    assert json.loads((out / "2-grpo" / "run_summary.json").read_text())["global_step"] == 6
    report = json.loads((out / "pipeline_report.json").read_text())
    assert [s["status"] for s in report["stages"]] == ["done", "done", "done"]
    assert (out / "pipeline_report.md").is_file() and (out / "pipeline_report.png").stat().st_size > 0
    assert "| 2 | grpo | grpo | done | 6 |" in proc.stdout  # a rerun skipping all: the shipped-recipe test


def _plan_lines(recipe) -> list[str]:
    proc = run_cli("pipeline.py", "--recipe", str(recipe), "--dry_run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if line.startswith("Stage ")]


@pytest.mark.timeout(600)  # about 2 min here
@pytest.mark.slow
def test_a_stage_is_done_only_while_what_it_was_trained_from_is_upstream(tmp_path, tiny_model):
    """#35 item 3: deleting an upstream stage's output, a changed setting and an edited data file each rerun the
    stage and every stage after it from scratch; --dry_run says so and why."""
    data = tmp_path / "arith.jsonl"
    shutil.copy(REPO / "data/tiny/arith_sft.jsonl", data)
    short = {"max_steps": 2, "save_steps": 2}
    stages = [
        {"name": "sft", "entry": "sft", "config": "configs/sft/tiny-cpu.yaml",
         "overrides": {**short, "datasets": [{"path": str(data), "label": "arith"}]}},
        {"name": "polish", "entry": "sft", "config": "configs/sft/tiny-cpu.yaml", "overrides": dict(short)},
    ]  # fmt: skip
    recipe, out = _recipe(tmp_path, stages), tmp_path / "out"
    assert (first := run_cli("pipeline.py", "--recipe", str(recipe), timeout=600)).returncode == 0, (
        first.stderr[-3000:]
    )
    assert _plan_lines(recipe) == ["Stage 1 (sft) done: skipped.", "Stage 2 (polish) done: skipped."]
    polish_id = json.loads((out / "2-polish" / "DONE.json").read_text())["run_id"]

    shutil.rmtree(out / "1-sft")  # the case: the upstream model is gone, the stage after it was done
    assert _plan_lines(recipe) == [
        "Stage 1 (sft) runs.",
        "Stage 2 (polish) reruns from scratch: stage 1 (sft) trains again first.",
    ]
    rerun = run_cli("pipeline.py", "--recipe", str(recipe), timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "Stage 2 (polish) reruns from scratch: stage 1 (sft) trains again first" in rerun.stderr
    sft, polish = (json.loads((out / d / "DONE.json").read_text()) for d in ("1-sft", "2-polish"))
    assert polish["run_id"] != polish_id and polish["inputs"]["upstream"] == {"sft": sft["run_id"]}
    assert len(list((out / "2-polish").glob("previous-*/checkpoint-2"))) == 1  # the stale run moved aside
    assert json.loads((out / "2-polish" / "run_summary.json").read_text())["resumed_from"] is None

    stages[1]["overrides"]["learning_rate"] = 1e-4  # the later stage's own setting: it alone reruns
    recipe = _recipe(tmp_path, stages)
    assert _plan_lines(recipe) == [
        "Stage 1 (sft) done: skipped.",
        "Stage 2 (polish) reruns from scratch: its settings changed: learning_rate: 0.003 -> 0.0001.",
    ]
    rows = data.read_text().splitlines()
    data.write_text("\n".join([rows[1], rows[0], *rows[2:]]) + "\n")  # the first stage's data, edited
    assert _plan_lines(recipe) == [
        f"Stage 1 (sft) reruns from scratch: its settings changed: dataset file {data.resolve()}: its contents "
        "changed.",
        "Stage 2 (polish) reruns from scratch: stage 1 (sft) trains again first; its settings changed: "
        "learning_rate: 0.003 -> 0.0001.",
    ]


STUDENT_GAIN = 0.05  # #32: every student stage, every seed (bench/pipeline_demo.py checks three)


@pytest.mark.timeout(900)  # about 5 min here
@pytest.mark.slow
def test_demo_recipe_gains_in_every_student_stage(tmp_path, tiny_model, shared_server_weights):
    """`make demo`'s recipe as shipped, full length: every student stage raises the held-out accuracy of the model it
    started from by at least 0.05, the teacher is evaluated once, distillation lowers its held-out reverse KL. The
    evals load each model into the shared server: a server the user names wins over the recipe's eval_server."""
    out = tmp_path / "demo"
    command = ["pipeline.py", "--recipe", "configs/recipes/tiny-cpu.yaml", "--output_dir", str(out),
               "--set", f"eval_server_url={shared_server_weights.base_url}"]  # fmt: skip
    proc = run_cli(*command, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Starting the pipeline's eval server" not in proc.stderr

    report = json.loads((out / "pipeline_report.json").read_text())
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == ["teacher", "sft", "grpo", "distill"]
    assert all(s["status"] == "done" and s["eval_metric"] == "eval/largest" for s in stages.values())
    gains = {
        name: stages[name]["eval_after"] - stages[name]["eval_before"] for name in ("sft", "grpo", "distill")
    }
    assert min(gains.values()) >= STUDENT_GAIN, gains
    assert [s["eval_before_from"] for s in stages.values()] == [None, "baseline", "sft", "grpo"]
    teacher = stages["teacher"]
    assert [e["step"] for e in teacher["eval_history"]] == [teacher["steps"]]  # once, its final model
    assert teacher["eval_after"] >= stages["grpo"]["eval_after"] + STUDENT_GAIN  # something left to distill
    assert stages["distill"]["eval_loss_after"] < stages["distill"]["eval_loss_before"]
    for name in ("grpo", "distill"):  # stage ends only: one eval per stage after the baseline
        assert [e["step"] for e in stages[name]["eval_history"]] == [stages[name]["steps"]]
    done = {n: json.loads((out / f"{i}-{n}" / "DONE.json").read_text()) for i, n in enumerate(stages, 1)}
    assert done["grpo"]["input_model"] == done["sft"]["model"]
    assert done["distill"]["input_model"] == done["grpo"]["model"]
    resolved = yaml.safe_load((out / "4-distill" / "resolved_config.yaml").read_text())
    assert resolved["teacher_model_name_or_path"] == done["teacher"]["model"]
    sft = yaml.safe_load((out / "2-sft" / "resolved_config.yaml").read_text())
    assert sft["assistant_only_loss"] is True
    assert (
        f"largest {_fmt(stages['sft']['eval_after'])} → {_fmt(stages['grpo']['eval_after'])}" in proc.stdout
    )

    again = run_cli(*command)
    assert again.returncode == 0 and again.stderr.count("is done") == 4


def _fmt(value: float) -> str:
    return f"{value:.4g}"


RECORDED = REPO / "tests" / "recorded" / "pipeline-tiny-cpu"
"""The report inputs of a real `make demo` run (seed 42, at the commit that added it): each stage's DONE.json,
run_summary.json, eval_results.jsonl and log_history.json (only the keys the report reads), paths made relative."""


def _recorded(tmp_path):
    from dna_factory.pipeline.recipe import load_pipeline

    out = tmp_path / "outputs" / "pipeline-tiny-cpu"
    shutil.copytree(RECORDED, out)
    pipeline = load_pipeline(REPO / "configs" / "recipes" / "tiny-cpu.yaml")
    pipeline.output_dir = out
    return pipeline, out


def test_report_reads_each_stage_before_and_after_on_a_recorded_demo_run(tmp_path):
    """Before is the model the stage started from: the previous stage's final eval, or the stage's own baseline;
    after is its final model; the teacher is evaluated once. The Markdown and the PNG say the same."""
    from dna_factory.pipeline.report import write_report

    pipeline, out = _recorded(tmp_path)
    stages = {s["name"]: s for s in write_report(pipeline)["stages"]}
    assert {n: (s["eval_metric"], s["eval_before"], s["eval_after"]) for n, s in stages.items()} == {
        "teacher": ("eval/largest", None, 0.995),
        "sft": ("eval/largest", 0.0, 0.12),
        "grpo": ("eval/largest", 0.12, 0.445),
        "distill": ("eval/largest", 0.445, 0.795),
    }
    assert [s["eval_before_from"] for s in stages.values()] == [None, "baseline", "sft", "grpo"]
    assert stages["distill"]["eval_loss_before"] == pytest.approx(1.6023, abs=1e-4)
    assert stages["distill"]["eval_loss_after"] == pytest.approx(0.1031, abs=1e-4)
    assert stages["sft"]["eval_loss_before"] is None
    text = (out / "pipeline_report.md").read_text()
    assert "| 3 | grpo | grpo | done | 150 |" in text and "largest 0.12 → 0.445 (+0.325)" in text
    assert "| largest 0.995 |" in text  # the teacher: no "before", not a regression from anything
    assert "largest 0.445 → 0.795 (+0.35); reverse KL to teacher 1.602 → 0.1031" in text
    assert (out / "pipeline_report.png").stat().st_size > 0


def test_a_final_model_without_an_eval_has_no_after_and_is_no_later_stage_before(tmp_path):
    """GRPO's final checkpoint was not evaluated (its eval failed): no number stands in for it, neither as GRPO's
    after (an earlier checkpoint's value would read as the final one) nor as distillation's before."""
    from dna_factory.pipeline.report import write_report

    pipeline, out = _recorded(tmp_path)
    results = out / "3-grpo" / "eval_results.jsonl"
    results.write_text('{"eval/step": 75, "eval/largest": 0.9}\n{"eval/step": 150, "error": "server gone"}\n')
    stages = {s["name"]: s for s in write_report(pipeline)["stages"]}
    assert (stages["grpo"]["eval_before"], stages["grpo"]["eval_after"]) == (0.12, None)
    assert (stages["distill"]["eval_before"], stages["distill"]["eval_after"]) == (None, 0.795)
    assert "largest 0.12 → ?" in (out / "pipeline_report.md").read_text()


def test_a_tasks_other_metrics_read_before_and_after_beside_its_headline(tmp_path):
    """An agent task's behaviour (``eval/<task>/tool_call_rate``, ``/turns``) rides beside its headline: the report
    reads each from the stage's baseline and its last eval, and the headline stays the task's own metric."""
    from dna_factory.pipeline.report import write_report

    pipeline, out = _recorded(tmp_path)
    rows = [
        {"eval/step": 0, "eval/largest": 0.1, "eval/largest/tool_call_rate": 0.0, "eval/largest/turns": 1.0,
         "eval/largest/abstained": 0.0},
        {"eval/step": 150, "eval/largest": 0.9, "eval/largest/tool_call_rate": 0.97, "eval/largest/turns": 1.97,
         "eval/largest/abstained": 0.0},
    ]  # fmt: skip
    (out / "3-grpo" / "eval_results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    grpo = {s["name"]: s for s in write_report(pipeline)["stages"]}["grpo"]
    assert (grpo["eval_metric"], grpo["eval_before"], grpo["eval_after"]) == ("eval/largest", 0.1, 0.9)
    assert grpo["eval_also"]["tool_call_rate"] == {"before": 0.0, "after": 0.97}
    assert grpo["eval_also"]["turns"] == {"before": 1.0, "after": 1.97}
    text = (out / "pipeline_report.md").read_text()
    assert "largest 0.1 → 0.9 (+0.8); tool_call_rate 0 → 0.97 (+0.97); turns 1 → 1.97 (+0.97)" in text
    assert "abstained" not in text  # shown only when the judge did abstain


def _eval_server_recipe(tmp_path, eval_server, stage_model="artifacts/tiny/student", **overrides):
    path = tmp_path / "r.yaml"
    stage = {"name": "sft", "entry": "sft", "config": "configs/sft/tiny-cpu.yaml", "model": stage_model,
             "overrides": {"eval_on_checkpoint": True, "eval_tasks": ["largest"], "max_steps": 2, **overrides}}  # fmt: skip
    recipe = {"name": "t", "output_dir": str(tmp_path / "out"), "model_name_or_path": "artifacts/tiny/student",
              "eval_server": eval_server, "stages": [stage]}  # fmt: skip
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_eval_server_mistakes_exit_2_under_dry_run_naming_the_stage(tmp_path, tiny_model, tiny_teacher):
    proc = run_cli("pipeline.py", "--recipe", str(_eval_server_recipe(tmp_path, {"modle": "x"})), "--dry_run")
    assert (
        proc.returncode == 2
        and "Unknown key 'modle'" in proc.stderr
        and "Did you mean 'model'" in proc.stderr
    )

    recipe = _eval_server_recipe(
        tmp_path, {"model": "artifacts/tiny/student"}, stage_model="artifacts/tiny/teacher"
    )
    proc = run_cli("pipeline.py", "--recipe", str(recipe), "--dry_run")
    assert proc.returncode == 2 and "Stage 1 (sft) starts from artifacts/tiny/teacher" in proc.stderr
    assert "hidden_size 128 vs 64" in proc.stderr and "Traceback" not in proc.stderr

    recipe_port = _eval_server_recipe(tmp_path, {"args": "--max-model-len 512 --port=8000"})
    proc = run_cli("pipeline.py", "--recipe", str(recipe_port), "--dry_run")
    assert proc.returncode == 2 and "eval_server.args sets --port" in proc.stderr

    proc = run_cli(
        "pipeline.py", "--recipe", str(_eval_server_recipe(tmp_path, {}, use_peft=True)), "--dry_run"
    )
    assert proc.returncode == 2 and "Stage 1 (sft) trains LoRA adapters" in proc.stderr

    proc = run_cli("pipeline.py", "--recipe", str(_eval_server_recipe(tmp_path, {})), "--dry_run")
    assert proc.returncode == 0 and "eval=the pipeline's eval server" in proc.stdout
    own = run_cli(
        "pipeline.py", "--recipe", str(recipe), "--dry_run", "--set", "eval_server_url=http://127.0.0.1:9"
    )
    assert (
        own.returncode == 0 and "eval=the server at http://127.0.0.1:9" in own.stdout
    )  # the user's own wins


@pytest.mark.slow  # a server lifecycle: a real vLLM start that fails
def test_an_eval_server_that_cannot_start_stops_the_pipeline_before_its_stage(tmp_path, tiny_model):
    """A real vLLM start that fails (no model there): exit 1 with the server's log named, and no stage ran."""
    recipe = _eval_server_recipe(
        tmp_path, {"model": str(tmp_path / "no-model"), "args": "--max-model-len 512"}
    )
    proc = run_cli("pipeline.py", "--recipe", str(recipe), timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Starting the pipeline's eval server" in proc.stderr and "eval_server.log" in proc.stderr
    assert not (tmp_path / "out" / "1-sft").exists()


def test_cli_set_overrides_every_stage_and_rejects_malformed_pairs(tmp_path, tiny_model):
    recipe = _recipe(tmp_path, SMALL)
    proc = run_cli("pipeline.py", "--recipe", str(recipe), "--set", "max_steps", "--dry_run")
    assert proc.returncode == 2 and "write it as KEY=VALUE" in proc.stderr
    proc = run_cli("pipeline.py", "--recipe", str(recipe), "--set", "max_stepz=2", "--dry_run")
    assert (
        proc.returncode == 2 and "Stage 1 (sft" in proc.stderr and "Did you mean 'max_steps'" in proc.stderr
    )


def test_cli_set_references_and_output_dir(tmp_path):
    from dna_factory.errors import DnaConfigError
    from dna_factory.pipeline.recipe import apply_cli_overrides, load_pipeline

    pipeline = load_pipeline(_recipe(tmp_path, SMALL))
    apply_cli_overrides(pipeline, ["max_steps=2", "report_to=[wandb]"], str(tmp_path / "elsewhere"))
    assert all(
        s.overrides["max_steps"] == 2 and s.overrides["report_to"] == ["wandb"] for s in pipeline.stages
    )
    assert pipeline.output_dir == tmp_path / "elsewhere"
    with pytest.raises(
        DnaConfigError, match=r"stage 1 \(sft\) refers to \$\{grpo\}, which is not an earlier"
    ):
        apply_cli_overrides(
            load_pipeline(_recipe(tmp_path, SMALL)), ["teacher_model_name_or_path=${grpo}"], None
        )


def test_a_recipe_wide_launcher_serves_every_stage_that_names_none(tmp_path):
    """#16 item 6: rufus-air.yaml repeated one launcher eight times; a recipe now states it once."""
    from dna_factory.pipeline.recipe import load_pipeline

    launcher = ["accelerate", "launch", "--config_file", "configs/accelerate/zero3.yaml"]
    own = ["torchrun", "--nproc_per_node", "2"]
    stages = [dict(SMALL[0]), dict(SMALL[1], launcher=own), dict(SMALL[2], launcher=[])]
    path = tmp_path / "r.yaml"
    path.write_text(
        yaml.safe_dump({"name": "t", "model_name_or_path": "m", "launcher": launcher, "stages": stages})
    )
    sft, grpo, distill = load_pipeline(path).stages
    assert sft.launcher == launcher and grpo.launcher == own and distill.launcher == []
    path.write_text(yaml.safe_dump({"name": "t", "model_name_or_path": "m", "launcher": 3, "stages": stages}))
    from dna_factory.errors import DnaConfigError

    with pytest.raises(DnaConfigError, match="launcher"):
        load_pipeline(path)


def test_the_shipped_recipes_state_a_shared_launcher_once():
    for recipe in sorted((REPO / "configs" / "recipes").glob("*.yaml")):
        raw = yaml.safe_load(recipe.read_text())
        launchers = [s["launcher"] for s in raw["stages"] if "launcher" in s]
        repeated = [x for x in launchers if launchers.count(x) > 1]
        assert not repeated, (
            f"{recipe.name}: the same launcher in {len(repeated)} stages; state it once at the top"
        )


def test_demo_held_out_digit_lists_appear_in_no_training_file():
    """The demo's held-out questions: no training file holds their digit lists, under either kind (a training
    "Which number is largest: 5, 7, 0, 2?" would give away half of a held-out "one more" question)."""
    import re

    def lists(name):
        rows = [json.loads(line) for line in (REPO / "data" / "tiny" / name).read_text().splitlines()]
        return [
            tuple(re.findall(r"\d", (r.get("messages") or r["prompt"])[0]["content"].split(":")[1]))
            for r in rows
        ]

    held_out = lists("largest_eval.jsonl")
    assert len(held_out) == 200
    for name in ("largest_sft.jsonl", "largest_prompts.jsonl", "largest_teacher_sft.jsonl",
                 "largest_distill_prompts.jsonl"):  # fmt: skip
        assert not set(held_out) & set(lists(name)), name


def test_a_stage_that_never_evaluated_has_no_before_and_after(tmp_path):
    """Distillation ran without checkpoint evals: it borrows no "before" from grpo (a "0.445 → ?" would read as a
    failed eval of a stage that was never asked to evaluate)."""
    from dna_factory.pipeline.report import write_report

    pipeline, out = _recorded(tmp_path)
    (out / "4-distill" / "eval_results.jsonl").unlink()
    distill = write_report(pipeline)["stages"][3]
    assert (distill["eval_metric"], distill["eval_before"], distill["eval_after"]) == (None, None, None)
