"""Agentic GRPO (docs/agents.md): environments, tool-call parsing and errors, TRL's tool loop on the tiny model.

Trainer tests run TRL 1.16's real GRPOTrainer on CPU. Where a valid tool call is needed, the
sampled tokens come from ``tests.agent_fixtures.ScriptedPolicy`` (a random tiny model rarely
writes one); the loop, parser, tools, tool messages, tool_mask, rewards and loss are real.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from pathlib import Path

import pytest

from dna_factory.agents import build_environment, check_environment
from dna_factory.agents.general import evaluate
from dna_factory.agents.tool_calls import (
    INVALID_TOOL_NAME,
    TOOL_CALL_ERROR_KEY,
    TRL_VERSION,
    ToolError,
    guard_tool,
    prepare_tokenizer,
)
from dna_factory.errors import DnaConfigError
from dna_factory.inputs.loading import load_context
from dna_factory.run.runner import prepare
from tests import agent_fixtures
from tests.agent_fixtures import FaultyEnvironment, ScriptedPolicy, tool_responses
from tests.conftest import run_cli
from tests.lazy import lazy

torch = lazy("torch")
trl = lazy("trl")


RECIPES = {env: f"configs/grpo/agent-{env}-tiny-cpu.yaml" for env in ("general", "coding", "search")}
RECORD = "tests.agent_fixtures:record_completions"
END = "<|im_end|>"


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>{END}"


# ----------------------------------------------------------------------------- tools


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("347 * 29", "10063"),
        ("(1250 - 387) / 4", "215.75"),
        ("2^10", "1024"),
        ("0.1 + 0.2", "0.3"),
        ("sqrt(16)", "4"),
    ],
)
def test_calculator_evaluates_arithmetic(expression, expected):
    assert evaluate(expression) == expected


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("9**9**9", "too large"),
        ("__import__('os').system('true')", "is not allowed"),
        ("(lambda: 1)()", "is not allowed"),
        ("1/0", "division by zero"),
        ("2 +", "invalid expression"),
    ],
)
def test_calculator_refuses_what_is_not_arithmetic(expression, message):
    with pytest.raises(ValueError, match=message):
        evaluate(expression)


def test_general_environment_tools():
    calculator, convert_units, lookup_fact = build_environment("general").tools()
    assert [t.__name__ for t in (calculator, convert_units, lookup_fact)] == [
        "calculator",
        "convert_units",
        "lookup_fact",
    ]
    assert convert_units(value=3.5, from_unit="miles", to_unit="m") == "5632.704 m"
    assert convert_units(value=98.6, from_unit="F", to_unit="C") == "37 C"
    assert lookup_fact(key="  Capital of VELORIA ") == "Marrowgate"
    assert "Close keys: capital of veloria" in lookup_fact(key="capitol of veloria")
    with pytest.raises(ToolError, match="ValueError: cannot convert 'kg'"):
        convert_units(value=1, from_unit="kg", to_unit="m")


def test_run_python_runs_in_the_sandbox():
    (run_python,) = build_environment("coding", {"timeout_s": 10}).tools()
    assert (
        asyncio.run(run_python(code="print(input()[::-1])", stdin="abc"))
        == "status: ok (exit code 0)\nstdout:\ncba\n"
    )
    failed = asyncio.run(run_python(code="import socket\nsocket.socket()"))
    assert failed.startswith("status: error (exit code 1)") and "PermissionError" in failed
    assert "boot.py" not in failed  # the sandbox's own frames are not shown to the model


def test_search_finds_the_answer_of_every_shipped_question():
    (search,) = build_environment("search", {"top_k": 3}).tools()
    questions = [
        json.loads(line) for line in Path("data/agents/search_questions.jsonl").read_text().splitlines()
    ]
    assert questions and all(q["answer"].lower() in search(query=q["prompt"]).lower() for q in questions)
    first = search(query="Who cast the Brenmoor bell?").split("\n\n")[0]
    assert first.startswith("[1] Brenmoor bell") and "Osric Hale" in first
    assert search(query="the of and").startswith("No passage matches")


# ----------------------------------------------------------------------------- parsing and tool errors


def test_trl_canary():
    """The TRL 1.16.0 behaviour dna_factory/agents relies on. If this fails, re-check tool_calls.py."""
    from trl import chat_template_utils

    assert trl.__version__ == TRL_VERSION
    parse_src = inspect.getsource(chat_template_utils.parse_response)
    assert "tokenizer.parse_response(ids, prefix=prefix, tools=tools)" in parse_src
    assert "except (ValueError, TypeError):" in parse_src
    loop_src = inspect.getsource(trl.GRPOTrainer._tool_call_loop)
    for fragment in (
        'sync_tool_dict[name](**function["arguments"])',
        'raise ValueError(f"Tool {name} not found.")',
        'result = {"error": str(e)}',
        "tool_mask[idx_with_tool] += [0] * tool_length",
    ):
        assert fragment in loop_src, fragment
    assert 'completion_mask * inputs["tool_mask"]' in inspect.getsource(trl.GRPOTrainer._compute_loss)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    prepare_tokenizer(tok)
    return tok


@pytest.mark.parametrize(
    ("text", "name", "reason"),
    [
        (
            '<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}\n</tool_call>',
            "echo",
            "could not be parsed",
        ),
        ("<think>\nplan\n</think>\n\n<tool_call>\necho(hi)\n</tool_call>", "echo", "could not be parsed"),
        ('<tool_call>\n{"name": "echo", "argu', "echo", "could not be parsed"),  # cut off
        ('<tool_call>\n{"tool": "echo"}\n</tool_call>', INVALID_TOOL_NAME, "no tool name"),
        ('<tool_call>\n{"name": "echo", "arguments": [1]}\n</tool_call>', "echo", "must be a JSON object"),
        (
            '<tool_call>\n{"nme": "echo", "arguments": {"text": 1}\n</tool_call>',
            INVALID_TOOL_NAME,
            "could not be parsed",
        ),
    ],
)
def test_malformed_tool_calls_become_error_calls(tokenizer, text, name, reason):
    from trl.chat_template_utils import parse_response

    tools = FaultyEnvironment().tools()
    prefix = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    message = parse_response(tokenizer, tokenizer.encode(text + END), prefix=prefix, tools=tools)
    (tool_call,) = message["tool_calls"]
    assert tool_call["function"]["name"] == name
    assert reason in tool_call["function"]["arguments"][TOOL_CALL_ERROR_KEY]


def test_valid_calls_parse_into_content_reasoning_and_tool_calls(tokenizer):
    from trl.chat_template_utils import parse_response

    text = '<think>\nneed echo\n</think>\n\nLet me check.\n<tool_call>\n{"name": "echo", "arguments": "{\\"text\\": \\"x\\"}"}\n</tool_call>'
    prefix = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    message = parse_response(
        tokenizer, tokenizer.encode(text + END), prefix=prefix, tools=FaultyEnvironment().tools()
    )
    assert message["reasoning_content"] == "need echo" and message["content"] == "Let me check."
    assert message["tool_calls"] == [
        {"type": "function", "function": {"name": "echo", "arguments": {"text": "x"}}}
    ]


def test_guarded_tools_raise_readable_tool_errors():
    echo, explode = (guard_tool(t) for t in (FaultyEnvironment().echo, FaultyEnvironment().explode))
    with pytest.raises(ToolError, match="^RuntimeError: boom$"):
        explode()
    with pytest.raises(ToolError, match="^TypeError: .*unexpected keyword argument 'txt'"):
        echo(txt="x")
    with pytest.raises(ToolError, match="^bad JSON$"):
        echo(**{TOOL_CALL_ERROR_KEY: "bad JSON"})


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--environment", "serch"], "Unknown environment 'serch'. Did you mean 'search'?"),
        (["--tools", "calculator"], "Unknown tool 'calculator' for environment 'search'"),
        (
            ["--environment_options", "{corpus: data/agents/nope.jsonl}"],
            "Search corpus 'data/agents/nope.jsonl' does not exist",
        ),
        (
            ["--environment_options", "{top_k: three}"],
            r"Option 'top_k' of environment 'search' \(environment_options\) is 'three'",
        ),
        (
            ["--environment_options", "{topk: 3}"],
            r"Unknown option 'topk' for environment 'search' \(environment_options\)\. Did you mean 'top_k'",
        ),
        (
            ["--environment", "tests.agent_fixtures:ScriptedPolicy"],
            "has no Environment subclass 'ScriptedPolicy'",
        ),
        (["--max_tool_calling_iterations", "null"], "max_tool_calling_iterations is not set"),
        (["--max_tool_calling_iterations", "0"], "no tool would ever run"),
        (["--environment", "null"], "environment_options is set but no environment is"),
        (["--grpo_execution", "async"], "Key 'environment' in .* is an agent RL key.*--grpo_execution sync"),
    ],
)
def test_dry_run_rejects_bad_agent_config(flags, message, tiny_model):
    with pytest.raises(DnaConfigError, match=message):
        prepare("grpo", ["--config", RECIPES["search"], "--dry_run", *flags])


def test_dry_run_cli_names_the_bad_tool_and_the_fix(tiny_model):
    proc = run_cli(
        "grpo.py", "--config", RECIPES["general"], "--dry_run", "--tools", "calculator", "lookup_facts"
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        "error: Unknown tool 'lookup_facts' for environment 'general'. Did you mean 'lookup_fact'? "
        "Its tools are: calculator, convert_units, lookup_fact." in proc.stderr
    )


def test_check_environment_accepts_a_custom_class():
    assert check_environment("tests.agent_fixtures:FaultyEnvironment", tools=["echo"]) is FaultyEnvironment


# ----------------------------------------------------------------------------- TRL's tool loop


def _trainer(recipe: str, tmp_path, *flags: str):
    argv = ["--config", recipe, "--output_dir", str(tmp_path / "out"), "--save_strategy", "no", *flags]
    stage, cfg = prepare("grpo", argv)
    return stage.build_trainer(load_context(stage, cfg))


@pytest.mark.parametrize(
    ("env", "dynamic_sampling"),
    [("general", "off"), ("coding", "off"), ("search", "off"), ("general", "resample")],
)
def test_two_grpo_steps_per_environment(env, dynamic_sampling, tmp_path, tiny_model):
    trainer = _trainer(
        RECIPES[env], tmp_path, "--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "2",
        "--max_completion_length", "24", "--dynamic_sampling", dynamic_sampling, "--dynamic_sampling_max_rounds", "1",
    )  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert trainer.state.global_step == 2 and len(logs) == 2
    assert all("tools/call_frequency" in h for h in logs)
    if dynamic_sampling == "resample":  # refilled batches carry TRL's tool_mask through the join
        assert all("dyn/dead_frac" in h and "dyn/rounds" in h for h in logs)


def test_search_recipe_trains_from_the_command_line(tmp_path, tiny_model):
    out = tmp_path / "run"
    proc = run_cli("grpo.py", "--config", RECIPES["search"], "--max_steps", "2", "--output_dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "run_summary.json").read_text())["global_step"] == 2
    assert (out / "tokenizer_config.json").is_file()  # the tokenizer with its parser installed still saves


def _scripted_batch(trainer, script, rows):
    """Generate and score the rows (each repeated num_generations times) with the scripted policy."""
    policy = ScriptedPolicy(trainer.processing_class, script)
    trainer.model.generate = policy
    trainer.model.train()
    agent_fixtures.RECORDED.clear()
    inputs = [trainer.train_dataset[i] for i in rows for _ in range(trainer.num_generations)]
    batch = trainer._generate_and_score_completions(inputs)  # TRL 1.16 private: generate, run tools, score
    return batch, (agent_fixtures.RECORDED[-1] if agent_fixtures.RECORDED else None), policy


def _tool_then_answer(tool_call: str, answer_from_result, wrong: str):
    """Even rows call the tool and answer from its result; odd rows answer at once (wrongly)."""

    def script(context: str, row: int) -> str:
        results = tool_responses(context)
        if results:
            return answer_from_result(results[-1]) + END
        return tool_call if row % 2 == 0 else wrong + END

    return script


CODE_TASK = json.loads(Path("data/tiny/code_tasks.jsonl").read_text().splitlines()[0])  # add(a, b), 3 asserts
SCRIPTS = {
    "general": (
        [{"prompt": "What is 347 * 29?", "answer": "10063"}],
        call("calculator", expression="347 * 29"),
        lambda result: f"The product is \\boxed{{{result}}}.",
        "\\boxed{0}",
        "10063",
    ),
    "coding": (
        [CODE_TASK],
        call("run_python", code="def add(a, b):\n    return a + b\nprint(add(2, 3))"),
        lambda result: "```python\ndef add(a, b):\n    return a + b\n```" if "stdout:\n5" in result else "no",
        "```python\ndef add(a, b):\n    return a - b\n```",
        "stdout:\n5",
    ),
    "search": (
        [{"prompt": "Who cast the Brenmoor bell?", "answer": "Osric Hale"}],
        call("search", query="Brenmoor bell cast"),
        lambda result: "It was \\boxed{Osric Hale}." if "Osric Hale" in result else "\\boxed{unknown}",
        "\\boxed{Tomas Brell}",
        "Osric Hale",
    ),
}


@pytest.mark.parametrize("env", sorted(SCRIPTS))
def test_scripted_tool_call_runs_the_tool_and_the_reward_sees_the_final_answer(
    env, tmp_path, write_jsonl, tiny_model
):
    rows, tool_call, answer, wrong, result_text = SCRIPTS[env]
    recipe_reward = prepare("grpo", ["--config", RECIPES[env]])[1].values["reward_funcs"]
    trainer = _trainer(
        RECIPES[env], tmp_path, "--datasets", json.dumps([{"path": str(write_jsonl("rows.jsonl", rows))}]),
        "--reward_funcs", json.dumps([*recipe_reward, RECORD]), "--max_completion_length", "1024",
    )  # fmt: skip
    batch, seen, _ = _scripted_batch(trainer, _tool_then_answer(tool_call, answer, wrong), [0])
    tool_name = json.loads(tool_call.split("\n")[1])["name"]
    for row, completion in enumerate(seen["completions"]):
        if row % 2:  # answered at once: one assistant turn, no tool
            assert [m["role"] for m in completion] == ["assistant"]
            continue
        assert [m["role"] for m in completion] == ["assistant", "tool", "assistant"]
        assert completion[0]["tool_calls"][0]["function"]["name"] == tool_name  # parsed, not plain text
        assert completion[1]["name"] == tool_name and result_text in completion[1]["content"]  # the tool ran
        assert completion[2]["content"] == answer(completion[1]["content"])  # answered from the result
    # the recipe's reward saw the final answers: tool rows scored 1, the others 0, so advantages split
    (reward_name,) = [name for name in trainer._logs["rewards"] if name != "record_completions"]
    advantages = batch["advantages"].tolist()
    scores = list(trainer._logs["rewards"][reward_name])  # TRL 1.16 private: the scores of this batch
    assert scores == [1.0, 0.0] * (len(advantages) // 2)
    assert all(a > 0 for a in advantages[0::2]) and all(a < 0 for a in advantages[1::2]), advantages
    # the rendered tool results are in the completion but masked out of the loss
    for row in range(0, len(advantages), 2):
        ids, mask = batch["completion_ids"][row], batch["tool_mask"][row] * batch["completion_mask"][row]
        tool_part = trainer.processing_class.decode(ids[(batch["tool_mask"][row] == 0)])
        assert tool_part.lstrip("\n").startswith("<|im_start|>user\n<tool_response>")
        assert result_text in tool_part
        assert "<tool_response>" not in trainer.processing_class.decode(ids[mask.bool()])


def test_tool_result_tokens_get_no_gradient(tmp_path, write_jsonl, tiny_model):
    """The loss's gradient reaches the model's own tokens and never the rendered tool results."""
    rows, tool_call, answer, wrong, _ = SCRIPTS["general"]
    trainer = _trainer(
        RECIPES["general"], tmp_path, "--datasets", json.dumps([{"path": str(write_jsonl("rows.jsonl", rows))}]),
        "--max_completion_length", "1024", "--tools", "calculator",
    )  # fmt: skip
    batch, _, _ = _scripted_batch(trainer, _tool_then_answer(tool_call, answer, wrong), [0])
    # TRL 1.16 scores tokens with a fused LM head, so watch the last hidden states: the one at position t
    # feeds only the log-probability of token t + 1.
    hidden = []

    def keep(module, args, out):  # returns None: the output is left unchanged
        out.retain_grad()
        hidden.append(out)

    handle = trainer.model.model.norm.register_forward_hook(keep)
    trainer.current_gradient_accumulation_steps = 1  # set by transformers' training loop, not running here
    try:
        trainer.compute_loss(trainer.model, batch).backward()
    finally:
        handle.remove()
    prompt_len, completion_len = batch["prompt_ids"].size(1), batch["completion_ids"].size(1)
    grad = (
        hidden[0].grad[:, prompt_len - 1 : prompt_len - 1 + completion_len].abs().sum(-1)
    )  # per completion token
    tool_mask, completion_mask = batch["tool_mask"].bool(), batch["completion_mask"].bool()
    assert (~tool_mask).any() and torch.all(grad[~tool_mask] == 0)
    assert torch.all(grad[tool_mask & completion_mask] > 0)
    assert batch["num_items_in_batch"] == (batch["tool_mask"] * batch["completion_mask"]).sum()


def test_malformed_unknown_and_raising_tool_calls_come_back_as_tool_messages(tmp_path, tiny_model):
    turns = [
        f'<tool_call>\n{{"name": "echo", "arguments": {{"text": "hi"}}\n</tool_call>{END}',  # malformed JSON
        call("teleport", to="Pellis"),  # unknown tool
        call("explode"),  # the tool raises
        call("echo", txt="hi"),  # wrong argument name
    ]
    expected = [
        "The tool call could not be parsed (Expecting ',' delimiter",
        "Tool teleport not found.",
        "RuntimeError: boom",
        "TypeError: ",
    ]
    trainer = _trainer(
        RECIPES["general"], tmp_path, "--environment", "tests.agent_fixtures:FaultyEnvironment",
        "--environment_options", "null", "--reward_funcs", json.dumps([RECORD, "think_format_reward"]),
        "--max_completion_length", "512",
    )  # fmt: skip
    batch, seen, _ = _scripted_batch(
        trainer, lambda context, row: "done" + END if tool_responses(context) else turns[row % 4], [0, 1]
    )
    for row, completion in enumerate(seen["completions"]):
        assert [m["role"] for m in completion] == ["assistant", "tool", "assistant"], completion
        assert expected[row % 4] in completion[1]["content"], completion[1]
        assert completion[2]["content"] == "done"
    assert trainer._metrics["train"]["tools/failure_frequency"][-1] == 1.0
    assert batch["completion_ids"].shape[0] == 8


def test_tool_calling_iterations_are_capped(tmp_path, tiny_model):
    FaultyEnvironment.calls = 0
    trainer = _trainer(
        RECIPES["general"], tmp_path, "--environment", "tests.agent_fixtures:FaultyEnvironment",
        "--environment_options", "null", "--tools", "echo", "--max_tool_calling_iterations", "2",
        "--reward_funcs", json.dumps([RECORD, "think_format_reward"]), "--max_completion_length", "1024",
    )  # fmt: skip
    _, seen, policy = _scripted_batch(trainer, lambda context, row: call("echo", text="again"), [0, 1])
    for completion in seen["completions"]:
        assert [m["role"] for m in completion] == ["assistant", "tool", "assistant", "tool", "assistant"]
        assert completion[-1]["tool_calls"]  # the third call is never run
    assert FaultyEnvironment.calls == 2 * len(seen["completions"])
    assert len(policy.contexts) == 3 * len(seen["completions"])  # first turn + one turn per tool round
