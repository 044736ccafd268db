"""Prompts reach every stage in the model's chat format (issue 14, item 1): one rule, in dna_factory.inputs.prompts.

Each test goes through the runner's own loading path (``prepare`` + ``load_context``) on the tiny
Qwen3, whose tokenizer carries TRL's ``qwen3.jinja`` verbatim, and asserts on what the trainer
would receive and on the text the chat template renders from it.
"""

from __future__ import annotations

import pytest

from dna_factory.errors import DnaConfigError
from dna_factory.inputs.loading import load_context
from dna_factory.run.runner import prepare

QUESTION = "Natalia sold clips to 48 of her friends in April. How many clips did she sell?"


@pytest.fixture
def gsm8k_file(write_jsonl):
    """Rows in GSM8K's Hub schema: a plain-string question, the answer after ####."""
    return write_jsonl(
        "gsm8k.jsonl",
        [
            {"question": QUESTION, "answer": "She sold 48.\n#### 48"},
            {"question": "What is 2 + 3?", "answer": "#### 5"},
        ],
    )


def _grpo_recipe(write_yaml, data, **extra):
    return write_yaml(
        "grpo.yaml",
        {
            "model_name_or_path": "artifacts/tiny/student",
            "datasets": [
                {"path": str(data), "label": "gsm8k", "columns": {"question": "prompt", "answer": "answer"}}
            ],
            "reward_funcs": [{"factory": "string_match", "extractor": "gsm8k", "answer_column": "answer"}],
            "use_cpu": True,
            "report_to": "none",
            **extra,
        },
    )


def _context(stage_name, recipe, *flags):
    stage, cfg = prepare(stage_name, ["--config", str(recipe), *flags])
    return load_context(stage, cfg)


def _rendered(ctx, messages) -> str:
    return ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_string_prompts_reach_sync_grpo_as_the_user_turn_of_the_chat_template(
    gsm8k_file, write_yaml, tiny_model
):
    ctx = _context("grpo", _grpo_recipe(write_yaml, gsm8k_file))
    prompts = {str(p) for p in ctx.train_dataset["prompt"]}
    assert str([{"role": "user", "content": QUESTION}]) in prompts
    row = next(r for r in ctx.train_dataset if r["prompt"][0]["content"] == QUESTION)
    assert f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n" in _rendered(ctx, row["prompt"])
    assert row["answer"] == "She sold 48.\n#### 48"  # other columns untouched


def test_async_grpo_never_receives_a_bare_string(gsm8k_file, write_yaml, tiny_model):
    recipe = _grpo_recipe(
        write_yaml, gsm8k_file, grpo_execution="async", tree_attention="sdpa", weight_sync="file",
        vllm_server_base_url="http://127.0.0.1:9",  # nothing listens: the length check is skipped
    )  # fmt: skip
    ctx = _context("grpo", recipe)
    assert all(isinstance(p, list) and p[-1]["role"] == "user" for p in ctx.train_dataset["prompt"])
    with pytest.raises(DnaConfigError, match="Async GRPO .* needs chat prompts"):
        prepare("grpo", ["--config", str(recipe), "--prompt_format", "text", "--dry_run"])


def test_system_prompt_and_prompt_template_render_into_the_chat(gsm8k_file, write_yaml, tiny_model):
    data = {
        "path": str(gsm8k_file),
        "label": "gsm8k",
        "columns": {"question": "prompt", "answer": "answer"},
        "prompt_template": "{{ prompt }}\nPut the final answer within \\boxed{}.",
    }
    recipe = _grpo_recipe(write_yaml, gsm8k_file, datasets=[data], system_prompt="You are a careful solver.")
    ctx = _context("grpo", recipe)
    row = next(r for r in ctx.train_dataset if QUESTION in r["prompt"][-1]["content"])
    assert row["prompt"] == [
        {"role": "system", "content": "You are a careful solver."},
        {"role": "user", "content": f"{QUESTION}\nPut the final answer within \\boxed{{}}."},
    ]
    text = _rendered(ctx, row["prompt"])
    assert text.startswith("<|im_start|>system\nYou are a careful solver.<|im_end|>\n<|im_start|>user\n")


def test_prompt_format_text_keeps_raw_strings_and_refuses_a_system_prompt(gsm8k_file, write_yaml, tiny_model):
    ctx = _context("grpo", _grpo_recipe(write_yaml, gsm8k_file, prompt_format="text"))
    assert QUESTION in ctx.train_dataset["prompt"]
    with pytest.raises(DnaConfigError, match="system_prompt is set but prompt_format is text"):
        prepare("grpo", ["--config", str(_grpo_recipe(write_yaml, gsm8k_file, prompt_format="text")),
                         "--system_prompt", "Be brief.", "--dry_run"])  # fmt: skip


def test_prompt_format_chat_needs_a_chat_template(gsm8k_file, write_yaml, tmp_path, tiny_model):
    import shutil

    bare = tmp_path / "no-template"
    shutil.copytree(tiny_model, bare)
    (bare / "chat_template.jinja").unlink()
    recipe = _grpo_recipe(write_yaml, gsm8k_file, model_name_or_path=str(bare))
    with pytest.raises(
        DnaConfigError, match="prompt_format: chat, but the tokenizer .* has no chat template"
    ):
        prepare("grpo", ["--config", str(recipe), "--prompt_format", "chat", "--dry_run"])
    ctx = _context("grpo", recipe)  # auto: no template, so raw text
    assert QUESTION in ctx.train_dataset["prompt"]


def test_string_and_chat_datasets_mix(gsm8k_file, write_yaml, tiny_model):
    """Both become chats before mixing, so their `prompt` columns have one type."""
    chat = {"path": "data/tiny/arith_prompts.jsonl", "label": "arith", "max_samples": 4}
    gsm8k = {
        "path": str(gsm8k_file),
        "label": "gsm8k",
        "columns": {"question": "prompt", "answer": "solution"},
    }
    recipe = _grpo_recipe(write_yaml, gsm8k_file, datasets=[chat, gsm8k])
    recipe_text = recipe.read_text().replace("answer_column: answer", "answer_column: solution")
    recipe.write_text(recipe_text)
    ctx = _context("grpo", recipe)
    assert len(ctx.train_dataset) == 6
    assert all(isinstance(p, list) for p in ctx.train_dataset["prompt"])


def test_distillation_prompts_are_chats(gsm8k_file, write_yaml, tiny_model, tiny_teacher):
    recipe = write_yaml(
        "distill.yaml",
        {
            "model_name_or_path": "artifacts/tiny/student",
            "teacher_model_name_or_path": "artifacts/tiny/teacher",
            "datasets": [{"path": str(gsm8k_file), "columns": {"question": "prompt"}}],
            "use_cpu": True,
            "report_to": "none",
        },
    )
    ctx = _context("distill", recipe)
    assert ctx.train_dataset[0]["prompt"] == [{"role": "user", "content": QUESTION}]


def test_sft_prompt_completion_and_dpo_string_pairs_become_turns(write_jsonl, write_yaml, tiny_model):
    sft_data = write_jsonl("sft.jsonl", [{"prompt": "What is 2 + 3?", "completion": "5"}])
    sft = write_yaml(
        "sft.yaml",
        {"model_name_or_path": "artifacts/tiny/student", "datasets": [str(sft_data)], "use_cpu": True,
         "report_to": "none", "system_prompt": "Answer briefly."},
    )  # fmt: skip
    row = _context("sft", sft).train_dataset[0]
    assert row["prompt"] == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    assert row["completion"] == [{"role": "assistant", "content": "5"}]

    dpo_data = write_jsonl("dpo.jsonl", [{"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"}])
    dpo = write_yaml(
        "dpo.yaml",
        {"model_name_or_path": "artifacts/tiny/student", "datasets": [str(dpo_data)], "use_cpu": True,
         "report_to": "none"},
    )  # fmt: skip
    row = _context("dpo", dpo).train_dataset[0]
    assert row["prompt"] == [{"role": "user", "content": "What is 2 + 3?"}]
    assert row["chosen"] == [{"role": "assistant", "content": "5"}]
    assert row["rejected"] == [{"role": "assistant", "content": "6"}]


def test_prompt_template_errors_name_the_dataset_before_anything_loads(gsm8k_file, write_yaml, tiny_model):
    def recipe(template):
        data = {"path": str(gsm8k_file), "label": "gsm8k", "columns": {"question": "prompt", "answer": "answer"},
                "prompt_template": template}  # fmt: skip
        return _grpo_recipe(write_yaml, gsm8k_file, datasets=[data])

    with pytest.raises(DnaConfigError, match="reads column 'tests', which the dataset does not have"):
        prepare("grpo", ["--config", str(recipe("{{ prompt }} {{ tests[0] }}")), "--dry_run"])
    with pytest.raises(DnaConfigError, match="is not a valid Jinja2 template"):
        prepare("grpo", ["--config", str(recipe("{{ prompt }")), "--dry_run"])


def test_async_trainer_factory_refuses_string_prompts(gsm8k_file, write_yaml, tiny_model):
    """The last guard (a hub model whose missing template shows only once loaded): before the worker starts."""
    import datasets

    recipe = _grpo_recipe(
        write_yaml, gsm8k_file, grpo_execution="async", tree_attention="sdpa", weight_sync="file",
        vllm_server_base_url="http://127.0.0.1:9",
    )  # fmt: skip
    stage, cfg = prepare("grpo", ["--config", str(recipe)])
    ctx = load_context(stage, cfg)
    ctx.train_dataset = datasets.Dataset.from_list(
        [{"prompt": QUESTION, "answer": "#### 48", "label": "gsm8k"}]
    )
    with pytest.raises(DnaConfigError, match="the prompts are plain strings"):
        stage.build_trainer(ctx)


def test_sft_messages_get_the_system_turn_and_mixed_row_kinds_keep_one_type(
    write_jsonl, write_yaml, tiny_model
):
    """1,001 rows: the first writer batch holds only `messages` rows, the last row is a prompt-completion pair."""
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    data = write_jsonl("mixed.jsonl", [chat] * 1000 + [{"prompt": "What is 2 + 3?", "completion": "5"}])
    recipe = write_yaml(
        "sft.yaml",
        {"model_name_or_path": "artifacts/tiny/student", "datasets": [str(data)], "use_cpu": True,
         "report_to": "none", "system_prompt": "Answer briefly."},
    )  # fmt: skip
    rows = _context("sft", recipe).train_dataset.to_list()
    assert rows[0]["messages"][0] == {"role": "system", "content": "Answer briefly."}
    assert rows[0]["prompt"] is None
    assert rows[-1]["messages"] is None
    assert rows[-1]["prompt"][0]["content"] == "Answer briefly."
    assert rows[-1]["prompt"][1] == {"role": "user", "content": "What is 2 + 3?"}
    assert rows[-1]["completion"] == [{"role": "assistant", "content": "5"}]


def test_dpo_implicit_prompts_get_the_system_turn_and_ultrafeedback_rows_stay_as_trl_reads_them(
    write_jsonl, write_yaml, tiny_model
):
    def dpo(rows, **extra):
        recipe = write_yaml(
            "dpo.yaml",
            {"model_name_or_path": "artifacts/tiny/student", "datasets": [str(write_jsonl("dpo.jsonl", rows))],
             "use_cpu": True, "report_to": "none", **extra},
        )  # fmt: skip
        return _context("dpo", recipe).train_dataset[0]

    user = {"role": "user", "content": "2 + 3?"}
    implicit = {"chosen": [user, {"role": "assistant", "content": "5"}], "rejected": [user, {"role": "assistant", "content": "6"}]}  # fmt: skip
    row = dpo([implicit], system_prompt="Be brief.")
    assert row["chosen"][0] == row["rejected"][0] == {"role": "system", "content": "Be brief."}
    assert row["chosen"][1:] == implicit["chosen"]
    h4 = {"prompt": "2 + 3?", **implicit}  # HuggingFaceH4/ultrafeedback_binarized: the prompt is repeated
    row = dpo([h4])
    assert row["prompt"] == "2 + 3?" and row["chosen"] == implicit["chosen"]


def test_a_template_reading_an_empty_cell_is_a_row_error(write_jsonl, write_yaml, tiny_model):
    data = write_jsonl(
        "rows.jsonl", [{"question": "2 + 3?", "hint": "add"}, {"question": "4 + 4?", "hint": None}]
    )
    spec = {"path": str(data), "columns": {"question": "prompt", "hint": "hint"}, "prompt_template": "{{ prompt }} ({{ hint }})"}  # fmt: skip
    recipe = _grpo_recipe(write_yaml, data, datasets=[spec])
    recipe.write_text(recipe.read_text().replace("answer_column: answer", "answer_column: hint"))
    with pytest.raises(DnaConfigError, match=r"row 1: column 'hint' is empty \(None\)"):
        _context("grpo", recipe)
