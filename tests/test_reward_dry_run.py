"""#19 item 5: rewards that cannot score anything fail under --dry_run, not at step 1 or silently."""

from __future__ import annotations

import json

import pytest
import yaml

from dna_factory.run.runner import main

DATA = "data/tiny/arith_prompts.jsonl"  # prompt (messages) + solution


def _dry_run(tmp_path, write_yaml, tiny_model, rewards, datasets=None) -> int:
    recipe = write_yaml(
        "recipe.yaml",
        {
            "model_name_or_path": str(tiny_model),
            "datasets": datasets or [{"path": DATA, "label": "arith"}, {"path": DATA, "label": "largest"}],
            "reward_funcs": rewards,
            "output_dir": str(tmp_path / "out"),
            "use_cpu": True,
        },
    )
    return main("grpo", ["--config", str(recipe), "--dry_run"])


def test_only_label_that_no_dataset_has_fails_the_dry_run(tmp_path, write_yaml, tiny_model, capsys):
    """Such a reward scored every row None: no signal, no error."""
    reward = {"factory": "string_match", "extractor": "last_number", "answer_column": "solution"}
    assert _dry_run(tmp_path, write_yaml, tiny_model, [{**reward, "only_label": "arithh"}]) == 2
    err = capsys.readouterr().err
    assert "only_label 'arithh'" in err and "Did you mean 'arith'?" in err and "arith, largest" in err
    assert _dry_run(tmp_path, write_yaml, tiny_model, [{**reward, "only_label": "largest"}]) == 0


@pytest.mark.parametrize(
    "entry",
    [
        {"function": "rewards.verifiable:make_string_match_reward"},
        "rewards.verifiable:make_playground_reward",
    ],
)
def test_a_factory_named_as_a_reward_function_fails_the_dry_run(
    tmp_path, write_yaml, tiny_model, capsys, entry
):
    """It passed --dry_run and crashed at step 1 (TRL called the builder with completions=...)."""
    assert _dry_run(tmp_path, write_yaml, tiny_model, [entry]) == 2
    err = capsys.readouterr().err
    assert "looks like a factory" in err and "{factory: rewards.verifiable:make_" in err
    assert err.count("\n") == 1 and err.startswith("error: ")


# --------------------------------------------------------------------------- #33 item 2: gold checks


def _gsm8k_rows(tmp_path, n=8):
    """GSM8K's layout: the gold cell is a worked solution ending in ``#### <answer>``."""
    path = tmp_path / "gsm8k.jsonl"
    rows = [
        {"question": f"Tom has {i} apples and buys {i + 3} more. How many now?",
         "answer": f"Tom has {i} apples.\nHe buys {i + 3} more: {i} + {i + 3} = <<{i}+{i + 3}={2 * i + 3}>>{2 * i + 3}.\n#### {2 * i + 3}"}
        for i in range(n)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [{"path": str(path), "label": "gsm8k", "columns": {"question": "prompt", "answer": "answer"}}]


def test_a_gold_column_the_extractor_cannot_read_fails_the_dry_run_naming_gold_extractor(
    tmp_path, write_yaml, tiny_model, capsys
):
    """extractor: boxed on GSM8K without gold_extractor: every gold fell back to the raw `... #### 72` text,
    so every completion scored 0 — a silent zero-reward run. Now one line names the fix."""
    reward = {"factory": "string_match", "extractor": "boxed", "answer_column": "answer"}
    datasets = _gsm8k_rows(tmp_path)
    assert _dry_run(tmp_path, write_yaml, tiny_model, [reward], datasets) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "'answer'" in err and "boxed" in err and "#### 3" in err and "gold_extractor: gsm8k" in err

    fixed = {**reward, "gold_extractor": "gsm8k"}
    assert _dry_run(tmp_path, write_yaml, tiny_model, [fixed], datasets) == 0


@pytest.mark.parametrize(
    ("extractor", "golds"),
    [
        ("boxed", [r"\frac{1}{2}", "72", r"\sqrt{3}", "(1, 2)"]),  # bare answers: the raw cell is the gold
        ("boxed", [r"so \boxed{4}", r"thus \boxed{\frac{1}{2}}", r"\boxed{7}", r"\boxed{x}"]),
        ("last_number", ["35", "-2", "1,000", "7"]),
        ("gsm8k", ["a\n#### 3", "b\n#### 4", "#### 5", "c #### 6"]),
    ],
)
def test_gold_cells_the_reward_can_read_pass_the_dry_run(tmp_path, write_yaml, tiny_model, extractor, golds):
    path = tmp_path / "rows.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"q{i}", "solution": g}) + "\n" for i, g in enumerate(golds))
    )
    reward = {"factory": "string_match", "extractor": extractor, "answer_column": "solution"}
    assert _dry_run(tmp_path, write_yaml, tiny_model, [reward], [{"path": str(path), "label": "x"}]) == 0


def test_the_column_error_offers_only_the_datas_own_columns(tmp_path, write_yaml, tiny_model, capsys):
    """prompt, completion and label are filled by the trainer: never a gold column to offer."""
    reward = {"factory": "string_match", "extractor": "last_number", "answer_column": "solutoin"}
    assert _dry_run(tmp_path, write_yaml, tiny_model, [reward], [{"path": DATA, "label": "arith"}]) == 2
    err = capsys.readouterr().err
    offered = err.split("Set the reward's column option to one of the data's columns:")[1]
    assert "solution" in offered and "Did you mean 'solution'?" in err
    for filled in ("prompt", "completion", "label"):
        assert filled not in offered.replace("solution", ""), offered


# --------------------------------------------------------------------------- #33 item 3: tests the prompt shows

CODING_AGENT = ("configs/grpo/agent-coding-qwen3-4B.yaml", "configs/grpo/agent-coding-glm-4.5-air.yaml")


@pytest.mark.parametrize("recipe", CODING_AGENT)
def test_the_coding_agent_recipes_reward_hidden_tests_and_shown_tests_warn(tmp_path, recipe):
    """CodeContests' public tests are the examples its description prints: a program printing the shown outputs
    scored 1.0. The shipped recipes reward private + generated tests; the same recipe on public_tests warns."""
    from tests.conftest import REPO, run_cli

    shipped = yaml.safe_load((REPO / recipe).read_text())
    [reward] = shipped["reward_funcs"]
    assert reward["tests_column"] == ["private_tests", "generated_tests"]
    proc = run_cli("grpo.py", "--config", recipe, "--rehearse", "--dry_run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "prompt shows every one of them" not in proc.stderr

    visible = dict(shipped, reward_funcs=[{**reward, "tests_column": "tests"}])
    visible["datasets"] = [
        dict(shipped["datasets"][0], columns={"description": "prompt", "public_tests": "tests"})
    ]
    path = tmp_path / "visible.yaml"
    path.write_text(yaml.safe_dump(visible))
    proc = run_cli("grpo.py", "--config", str(path), "--rehearse", "--dry_run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warning = [line for line in proc.stderr.splitlines() if "prompt shows every one of them" in line]
    assert len(warning) == 1 and "tests_column: [private_tests, generated_tests]" in warning[0], proc.stderr[
        -3000:
    ]


# --------------------------------------------------------------------------- #35 item 6: a user's own reward

USER_REWARDS = {
    "raises": "def score(prompts, completions, solution, **kw):\n    return [float(c[0]['content']) for c in completions]\n",
    "short": "def score(prompts, completions, **kw):\n    return [1.0]\n",
    "strings": "def score(prompts, completions, **kw):\n    return ['good' for _ in completions]\n",
    "not_a_list": "def score(prompts, completions, **kw):\n    return 1.0\n",
    "tensor": "import torch\ndef score(prompts, completions, **kw):\n    return torch.tensor(1.0)\n",
}
FOUND = {
    "raises": ["Your reward score raised ValueError: could not convert string to float", "row 0 of dataset arith",
               "'The answer is 42.'", ".py:2"],
    "short": ["Your reward score returned 1 values for 4 completions"],
    "strings": ["Your reward score returned 'good' (str) for row 0 of dataset arith"],
    "not_a_list": ["Your reward score returned float 1.0"],
    "tensor": ["Your reward score returned Tensor tensor(1.)"],
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(USER_REWARDS))
def test_a_users_reward_that_misbehaves_is_one_error_line_under_dry_run(
    case, tmp_path, write_yaml, tiny_model, capsys
):
    """It was a raw traceback after the model had loaded (#35 item 6): now the dry run calls it on the first rows
    of each dataset, as TRL would, and names the reward, the row and the bad value."""
    module = f"user_reward_{case}"
    (tmp_path / f"{module}.py").write_text(USER_REWARDS[case])
    assert _dry_run(tmp_path, write_yaml, tiny_model, [f"{module}:score"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for part in FOUND[case]:
        assert part in err, (part, err)


def test_a_users_reward_sees_a_string_prompt_as_the_chat_the_trainer_makes(tmp_path, write_yaml, tiny_model):
    """A plain-string prompt becomes a user turn with a chat model (prompt_format: auto), so the completion the
    reward gets is a message list too; an async reward (a service the run has not waited for yet) and a generator
    of values are not refused."""
    data = tmp_path / "plain.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + 1?", "solution": str(i + 1)}) + "\n" for i in range(3))
    )
    (tmp_path / "user_reward_chat.py").write_text(
        "def score(prompts, completions, **kw):\n"
        "    assert prompts[0][-1]['content'].startswith('What is'), prompts[0]\n"
        "    return (1.0 if c[0]['content'] else 0.0 for c in completions)\n"
        "async def judged(prompts, completions, **kw):\n"
        "    raise ConnectionError('the judge is not up yet')\n"
    )  # fmt: skip
    datasets = [{"path": str(data), "label": "plain"}]
    rewards = ["user_reward_chat:score", "user_reward_chat:judged"]
    assert _dry_run(tmp_path, write_yaml, tiny_model, rewards, datasets=datasets) == 0


def test_a_users_reward_gets_the_rows_columns_and_passes_the_dry_run(tmp_path, write_yaml, tiny_model):
    """The probe calls the reward the way TRL does: the dataset's columns, label and trainer_state included."""
    seen = tmp_path / "seen.json"
    (tmp_path / "user_reward_fine.py").write_text(
        "import json\n"
        "def score(prompts, completions, solution, label, trainer_state, completion_ids, **kw):\n"
        f"    json.dump({{'solution': solution, 'label': label, 'step': trainer_state.global_step}}, open({str(seen)!r}, 'w'))\n"
        "    return [None if s is None else 0.5 for s in solution]\n"
    )  # fmt: skip
    assert _dry_run(tmp_path, write_yaml, tiny_model, ["user_reward_fine:score"]) == 0
    record = json.loads(seen.read_text())
    assert record["label"] == ["arith", "arith", "largest", "largest"] and record["step"] == 0
    assert record["solution"][:2] == ["35", "19"]
