"""S-CFG-1..3: layering, unknown keys, wrong types, dry run, resolved config."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from dna_factory.configuration.config import RunArguments
from dna_factory.errors import DnaConfigError
from dna_factory.run.runner import RESOLVED_CONFIG_NAME, main, prepare
from tests.conftest import REPO, run_cli

SFT_RECIPE = "configs/sft/tiny-cpu.yaml"


def test_layering_cli_beats_recipe_beats_defaults(tiny_model):
    # defaults: learning_rate 2e-5, save_total_limit 3; recipe: lr 3e-3, save_total_limit 2
    _, cfg = prepare("sft", ["--config", SFT_RECIPE, "--learning_rate", "1e-4"])
    assert cfg.values["learning_rate"] == pytest.approx(1e-4)
    assert cfg.sources["learning_rate"] == "the command line"
    assert cfg.values["save_total_limit"] == 2
    assert cfg.sources["save_total_limit"] == SFT_RECIPE
    assert cfg.sources["lr_scheduler_type"] == SFT_RECIPE
    assert cfg.sources["save_strategy"] == "configs/_defaults-sft.yaml"
    from trl import SFTConfig

    args = cfg.of(SFTConfig)
    assert args.learning_rate == pytest.approx(1e-4)
    assert args.save_total_limit == 2


def test_dry_run_prints_layers_without_loading(tiny_model):
    proc = run_cli(
        "sft.py", "--config", SFT_RECIPE, "--dry_run", "--learning_rate", "1e-4", "--save_total_limit=5"
    )
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed["learning_rate"] == pytest.approx(1e-4)
    assert printed["save_total_limit"] == 5
    assert printed["save_strategy"] == "steps"  # from the defaults file
    assert "learning_rate: 0.0001  # the command line" in proc.stdout
    assert "Loading weights" not in proc.stderr and "Generating train split" not in proc.stderr


def test_yaml_float_forms_are_accepted(tmp_path, write_yaml, tiny_model):
    recipe = write_yaml(
        "r.yaml",
        {
            "model_name_or_path": str(tiny_model),
            "datasets": ["data/tiny/arith_sft.jsonl"],
            "learning_rate": "1e-5",
            "output_dir": str(tmp_path / "o"),
        },
    )
    _, cfg = prepare("sft", ["--config", str(recipe)])
    assert cfg.values["learning_rate"] == pytest.approx(1e-5)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--lerning_rate", "1e-4"], ["Unknown config key 'lerning_rate'", "Did you mean 'learning_rate'?"]),
        (["--learning_rate", "fast"], ["'learning_rate'", "'fast'", "must be float"]),
        (["--per_device_train_batch_size", "2.5"], ["'per_device_train_batch_size'", "must be int"]),
        (["--bf16", "maybe"], ["'bf16'", "must be bool"]),
        (["--learning_rate"], ["--learning_rate needs a value"]),
    ],
)
def test_cli_errors(argv, expected, tiny_model):
    with pytest.raises(DnaConfigError) as info:
        prepare("sft", ["--config", SFT_RECIPE, *argv])
    for fragment in expected:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["stray", "--config", SFT_RECIPE], ["Unexpected argument 'stray'"]),
        (["--config", SFT_RECIPE, "extra.yaml"], ["--config takes exactly one path"]),
    ],
)
def test_cli_shape_errors(argv, expected, tiny_model):
    with pytest.raises(DnaConfigError) as info:
        prepare("sft", argv)
    for fragment in expected:
        assert fragment in str(info.value)


def test_unknown_key_in_yaml_names_file(write_yaml, tiny_model):
    recipe = write_yaml(
        "r.yaml",
        {"model_name_or_path": str(tiny_model), "datasets": ["data/tiny/arith_sft.jsonl"], "warmup_step": 3},
    )
    with pytest.raises(
        DnaConfigError, match=r"Unknown config key 'warmup_step' in .*r.yaml\. Did you mean 'warmup_steps'"
    ):
        prepare("sft", ["--config", str(recipe)])


def test_output_dir_auto_is_readable_and_stable(write_yaml, tiny_model):
    recipe = write_yaml(
        "my-run.yaml", {"model_name_or_path": str(tiny_model), "datasets": ["data/tiny/arith_sft.jsonl"]}
    )
    _, cfg = prepare("sft", ["--config", str(recipe)])
    assert cfg.values["output_dir"] == "outputs/sft-my-run-student"
    _, again = prepare("sft", ["--config", str(recipe)])
    assert again.values["output_dir"] == cfg.values["output_dir"]


def test_run_arguments_defaults():
    args = RunArguments()
    assert args.auto_resume is True and args.dry_run is False


def test_help_lists_keys(capsys):
    assert main("sft", ["--help"]) == 0
    out = capsys.readouterr().out
    assert "--learning_rate" in out and "--datasets" in out and "--config" in out


def _help_line(out: str, key: str) -> str:
    return next(line for line in out.splitlines() if line.strip().startswith(f"--{key} "))


@pytest.mark.parametrize("stage", ["sft", "grpo", "distill", "dpo"])
def test_help_shows_the_default_a_run_gets_and_its_layer(stage, capsys):
    """#16 item 4: every key's default as a run resolves it: the stage's defaults file where it sets the key
    (named), else the dataclass's, with default_factory called (never a bare None for a list)."""
    from dna_factory.configuration.config import CONFIGS_DIR, load_yaml
    from dna_factory.stages import get_stage

    assert main(stage, ["--help"]) == 0
    out = capsys.readouterr().out
    name = f"_defaults-{get_stage(stage).defaults}.yaml"
    layer = load_yaml(CONFIGS_DIR / name, "Defaults file")
    shown = 0
    for key, value in layer.items():
        if not isinstance(value, (dict, list)):
            assert f"default {value!r} from configs/{name}" in _help_line(out, key), (key, value)
            shown += 1
    assert shown >= 5
    assert "default ['mmlu_pro', 'gpqa_diamond', 'kmmlu_pro']" in _help_line(out, "eval_tasks")


def test_help_of_the_async_variant_shows_its_own_defaults(capsys):
    assert main("grpo", ["--grpo_execution", "async", "--help"]) == 0
    out = capsys.readouterr().out
    assert "default 'nccl' from configs/_defaults-async_grpo.yaml" in _help_line(out, "weight_sync")


HELP_VARIANTS = {"sft": [], "dpo": [], "grpo": [], "distill": [], "grpo-async": ["--grpo_execution", "async"]}


@pytest.mark.parametrize("name", sorted(HELP_VARIANTS))
def test_the_shipped_help_is_the_built_help(name):
    """The shipped --help text fits the installed TRL, transformers and defaults files, and says what the keys
    say now. When this fails: python scripts/make_help.py."""
    from dna_factory.stages.help import build_help, help_name, live_stage, shipped_help

    argv = HELP_VARIANTS[name]
    assert help_name(name.split("-")[0], argv) == name
    shipped = shipped_help(name)
    assert shipped is not None, (
        f"dna_factory/stages/help/{name}.txt was built for other versions: make_help.py"
    )
    built = build_help(live_stage(name.split("-")[0], argv))
    assert shipped.rstrip("\n") == built.rstrip("\n"), "run scripts/make_help.py"


def test_help_answers_without_importing_trl_and_builds_it_when_the_shipped_text_is_stale(
    tmp_path, monkeypatch
):
    """#35: --help took 11-17 s of CPU (it imported TRL to list the keys); the shipped text needs no TRL."""
    code = (
        "import sys\nfrom dna_factory.run.runner import main\nmain('grpo', ['--help'])\n"
        "print('TRL IMPORTED' if 'trl' in sys.modules else 'NO TRL')"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("NO TRL") and "dynamic_sampling" in proc.stdout, proc.stdout[-500:]

    from dna_factory.stages import help as stage_help

    stale = tmp_path / "help"
    stale.mkdir()
    text = (stage_help.HELP_DIR / "sft.txt").read_text()
    (stale / "sft.txt").write_text(text.replace("trl==", "trl==0.0.1.", 1))
    monkeypatch.setattr(stage_help, "HELP_DIR", stale)
    assert stage_help.shipped_help("sft") is None  # built for another TRL: --help builds the text instead
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        "grpo_execution: async\ngrpo_execution: sync\n"
    )  # a key twice: the recipe does not load
    assert stage_help.help_name("grpo", ["--config", str(broken), "--help"]) == "grpo"  # still answers


def test_resolved_config_roundtrips(tmp_path, tiny_model):
    """The file written into the output dir is a valid --config that resolves to the same values."""
    from dna_factory.run.runner import write_resolved_config

    _, cfg = prepare(
        "sft", ["--config", SFT_RECIPE, "--learning_rate", "7e-4", "--output_dir", str(tmp_path / "run")]
    )
    path = write_resolved_config(cfg, cfg.values["output_dir"])
    assert path.name == RESOLVED_CONFIG_NAME
    _, again = prepare("sft", ["--config", str(path)])
    for key, value in cfg.values.items():
        assert again.values[key] == value, key


def test_yaml_off_is_the_string_off_for_choice_keys(tiny_model):
    _, cfg = prepare("grpo", ["--config", "configs/grpo/tiny-cpu.yaml", "--dynamic_sampling", "off"])
    assert cfg.values["dynamic_sampling"] == "off"


def test_yaml_no_is_the_string_no_for_enum_keys(tiny_model):
    _, cfg = prepare("sft", ["--config", SFT_RECIPE, "--save_strategy", "no"])
    assert cfg.values["save_strategy"] == "no"


STAGE_DIRS = {"sft": "sft", "dpo": "dpo", "grpo": "grpo", "distill": "distill"}  # configs/<entry>/
SHIPPED = sorted(p for d in STAGE_DIRS for p in (REPO / "configs" / d).glob("*.yaml"))


@pytest.mark.parametrize("recipe", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_recipe_passes_dry_run(recipe, tiny_model):
    """GPU recipes included: a dry run checks the config, not this machine's hardware."""
    stage, cfg = prepare(
        STAGE_DIRS[recipe.parent.name], ["--config", str(recipe.relative_to(REPO)), "--dry_run"]
    )
    assert cfg.values["model_name_or_path"]
    assert stage.defaults in (recipe.parent.name, f"async_{recipe.parent.name}")


def test_list_keys_take_comma_separated_or_repeated_values(tiny_model):
    args = ["--config", SFT_RECIPE, "--use_peft", "true"]
    for flags in (["--lora_target_modules", "q_proj,v_proj"], ["--lora_target_modules", "q_proj", "v_proj"]):
        _, cfg = prepare("sft", [*args, *flags])
        assert cfg.values["lora_target_modules"] == ["q_proj", "v_proj"]
    _, cfg = prepare("sft", [*args, "--lora_target_modules", '["q_proj", "k_proj"]'])
    assert cfg.values["lora_target_modules"] == ["q_proj", "k_proj"]
    _, cfg = prepare("sft", ["--config", SFT_RECIPE, "--learning_rate", "1e-4"])  # scalars are not split
    assert cfg.values["learning_rate"] == pytest.approx(1e-4)
    _, cfg = prepare(  # a flow mapping with commas stays one list item
        "grpo",
        ["--config", "configs/grpo/tiny-cpu.yaml", "--reward_funcs",
         "{factory: string_match, answer_column: solution, weight: 2}"],
    )  # fmt: skip
    assert cfg.values["reward_funcs"] == [
        {"factory": "string_match", "answer_column": "solution", "weight": 2}
    ]


RECIPE_FOLDERS = STAGE_DIRS
STAGE_RECIPES = sorted(
    path.relative_to(REPO).as_posix()
    for folder in RECIPE_FOLDERS
    for path in (REPO / "configs" / folder).glob("*.yaml")
)


@pytest.mark.parametrize("recipe", STAGE_RECIPES)
def test_a_recipe_says_only_what_differs_from_its_defaults_layer(recipe):
    """#16 item 6: a key that restates the value of the stage's defaults file (``configs/_defaults-*.yaml``, the
    layer under every recipe) is noise in the recipe, and hides what the recipe actually changes."""
    from dna_factory.configuration.config import CONFIGS_DIR, load_yaml
    from dna_factory.stages import select_stage

    stage = select_stage(RECIPE_FOLDERS[recipe.split("/")[1]], ["--config", str(REPO / recipe)])
    defaults = load_yaml(CONFIGS_DIR / f"_defaults-{stage.defaults}.yaml", "Defaults file")
    keys = load_yaml(REPO / recipe, "Config file")
    selects = {
        "grpo_execution"
    }  # read from the recipe before layering, to pick the stage (and its defaults file)
    restated = sorted(k for k, v in keys.items() if k in defaults and defaults[k] == v and k not in selects)
    assert not restated, f"{recipe} restates configs/_defaults-{stage.defaults}.yaml: {restated}"
