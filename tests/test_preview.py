"""``--preview [N]`` (issue 14, item 2): the rows as the trainer tokenizes them, before any model loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from dna_factory.inputs.loading import load_context
from dna_factory.inputs.preview import MASK_CLOSE, MASK_OPEN, sft_tokenized
from dna_factory.run.cli import EntryFlags, entry_flags
from dna_factory.run.runner import main, prepare


def _sft_recipe(write_jsonl, write_yaml, rows, **extra):
    data = write_jsonl("sft.jsonl", rows)
    return write_yaml(
        "sft.yaml",
        {
            "model_name_or_path": "artifacts/tiny/student",
            "datasets": [{"path": str(data), "label": "pairs"}],
            "output_dir": str(Path(data).parent / "never-created"),
            "use_cpu": True,
            "report_to": "none",
            "max_length": 64,
            **extra,
        },
    )


PAIRS = [{"prompt": f"What is {a} + 1?", "completion": f"It is {a + 1}."} for a in range(3)]


@pytest.mark.parametrize(
    "rows",
    [
        PAIRS,
        [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}] * 2,
    ],
    ids=["prompt-completion", "messages"],
)
def test_canary_sft_preview_tokenizes_exactly_as_a_real_sft_trainer(
    rows, write_jsonl, write_yaml, tiny_model
):
    """Pins TRL 1.16's SFTTrainer._prepare_dataset on our stand-in: same ids, same loss mask as the trainer's."""
    stage, cfg = prepare("sft", ["--config", str(_sft_recipe(write_jsonl, write_yaml, rows))])
    ctx = load_context(stage, cfg)
    previewed = sft_tokenized(ctx.train_dataset, ctx.tokenizer, ctx.training_args)
    trainer = stage.build_trainer(ctx)
    expected = trainer.train_dataset
    assert previewed["input_ids"] == expected["input_ids"]
    assert previewed["labels"] == expected["labels"]


def test_sft_preview_marks_the_prompt_as_loss_free_and_exits_before_any_output(
    write_jsonl, write_yaml, tiny_model, capsys
):
    recipe = _sft_recipe(write_jsonl, write_yaml, PAIRS)
    assert main("sft", ["--config", str(recipe), "--preview", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("[pairs] row") == 2  # N rows per label
    assert f"{MASK_OPEN}<|im_start|>user\nWhat is 0 + 1?<|im_end|>\n<|im_start|>assistant\n" in out
    assert "It is 1.<|im_end|>\n" in out.split(MASK_CLOSE, 1)[1]  # the completion carries the loss
    assert not (recipe.parent / "never-created").exists()


def test_grpo_preview_shows_the_generation_prompt_with_the_tools_rendered(capsys, tiny_model):
    assert main("grpo", ["--config", "configs/grpo/agent-search-tiny-cpu.yaml", "--preview", "1"]) == 0
    out = capsys.readouterr().out
    assert "# tools rendered into the prompts: search" in out
    assert "<tools>" in out and '"name": "search"' in out
    assert "<|im_start|>system\nUse the search tool" in out
    assert out.rstrip().endswith("─") and "generation prompt (" in out


def test_dpo_preview_shows_prompt_chosen_and_rejected(capsys, tiny_model):
    assert main("dpo", ["--config", "configs/dpo/tiny-cpu.yaml", "--preview", "1"]) == 0
    out = capsys.readouterr().out
    for section in ("── prompt (", "── chosen (", "── rejected ("):
        assert section in out
    assert "17 + 18 = 35. The answer is 35." in out and "17 + 18 = 34. The answer is 34." in out


def test_preview_flag_forms():
    assert entry_flags(["--preview"]) == ([], EntryFlags(preview=2))
    assert entry_flags(["--preview=5", "--x", "1"]) == (["--x", "1"], EntryFlags(preview=5))
    assert entry_flags(["--x", "1"]) == (["--x", "1"], EntryFlags())
    assert entry_flags(["--rehearse", "--help", "--debug"]) == (
        ["--help"], EntryFlags(help=True, debug=True, rehearse=True)
    )  # fmt: skip
    assert main("sft", ["--config", "configs/sft/tiny-cpu.yaml", "--preview=0"]) == 2


def test_pipeline_preview_prints_every_stage(tiny_model, tiny_teacher, tmp_path):
    from tests.conftest import run_cli

    out = tmp_path / "pipeline"
    result = run_cli(
        "pipeline.py", "--recipe", "configs/recipes/tiny-cpu.yaml", "--preview", "1", "--output_dir", str(out)
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for k, name in enumerate(("teacher", "sft", "grpo", "distill"), start=1):
        assert f"## Stage {k} ({name}," in result.stdout
    assert result.stdout.count("[largest] row") == 4
    assert not out.exists()  # nothing ran, nothing was written


def test_dry_run_names_a_missing_gpu_package_and_the_install_line(monkeypatch, tiny_model):
    """CI has every package installed, so the lookup of one package is made to miss (stdlib, not our code)."""
    import importlib.util

    from dna_factory.errors import DnaConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "kernels" else real(name, *a)
    )
    argv = ["--config", "configs/grpo/qwen3-0.6B-async.yaml", "--vllm_server_base_url", "http://127.0.0.1:9"]
    with pytest.raises(DnaConfigError, match=r"tree_attention: fa3 .* needs the `kernels` package.*\[gpu\]"):
        prepare("grpo", [*argv, "--dry_run"])
    prepare(
        "grpo", [*argv, "--tree_attention", "sdpa", "--dry_run"]
    )  # the portable kernel needs nothing more
