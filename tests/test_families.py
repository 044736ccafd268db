"""The families recipe (configs/recipes/tiny-cpu-families.yaml, docs/families.md): every RL family raises its own
held-out metric, scored by its own reward; the tiny judge, the reward-scored eval tasks and ``model: ${stage}``."""

from __future__ import annotations

import asyncio
import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, run_cli

RECIPE = "configs/recipes/tiny-cpu-families.yaml"
FAMILIES = {  # RL stage -> its held-out metric
    "coding-rl": "eval/tiny_coding",
    "if-rl": "eval/tiny_if",
    "rlhf": "eval/tiny_judge",
    "general-agent": "eval/tiny_general",
    "search-agent": "eval/tiny_search",
}
AGENTS = {"general-agent", "search-agent"}  # these start from sft-agents, the others from sft
MARGIN = 0.3
"""The least rise of every family's held-out metric. The issue's bar is 0.1 or twice the seed-to-seed spread,
whichever is larger; over three seeds the rises were +0.69 to +1.00, the spread at most 0.09 (docs/families.md),
so 0.3 leaves room for a noisy machine and still fails a family that learns little."""


def start_judge(*flags: str) -> tuple[subprocess.Popen, str]:
    """scripts/tiny_judge.py on a free port (with ``flags``); returns the process and its JUDGE_BASE_URL."""
    proc = subprocess.Popen(
        [sys.executable, "scripts/tiny_judge.py", "--port", "0", *flags],
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()  # "tiny judge on http://127.0.0.1:PORT/v1"
    assert line.startswith("tiny judge on "), line
    return proc, line.split()[-1]


@pytest.fixture(scope="module")
def judge():
    proc, url = start_judge()
    yield url
    proc.terminate()
    proc.wait(timeout=10)


# ---------------------------------------------------------------------- the tiny judge


def test_tiny_judge_grades_the_rubric_for_the_smallest_question():
    from tiny_judge import grade

    question = "Which number is smallest: 1, 0, 4, 6?"
    assert grade(question, "The smallest of 1, 0, 4, 6 is 0.") == 9
    assert grade(question, "\n\nthe smallest of 1, 0, 4, 6 is 0") == 9  # case, spacing, final period
    assert (
        grade(question, "The smallest number is 0.") == 9
        and grade(question, "The smallest number is 1.") == 1
    )
    assert grade(question, "0") == grade(question, "The answer is 0.") == 6  # right, but bare
    # what a policy found when the full answer only had to appear somewhere: right last number, junk around it
    assert grade(question, "The smallest of 1, 0, 4, 6 is 0, 1, 0") == 3
    assert grade(question, "The smallest of 1, 0, 4, 6 is 1.") == 1
    assert grade("What is 2 + 2?", "4") == 1


def test_tiny_judge_serves_the_judge_reward_over_http(judge, monkeypatch):
    """The real judge reward, over HTTP: only the full right answer passes the threshold."""
    from rewards.generative import make_judge_reward

    monkeypatch.setenv("JUDGE_BASE_URL", judge)
    reward = make_judge_reward("rewards/prompts/default.md")
    prompt = [{"role": "user", "content": "Which number is smallest: 8, 3, 5, 9?"}]
    answers = ["The smallest of 8, 3, 5, 9 is 3.", "3", "The smallest of 8, 3, 5, 9 is 5."]
    scores = asyncio.run(
        reward(prompts=[prompt] * 3, completions=[[{"role": "assistant", "content": a}] for a in answers])
    )
    assert scores == [1.0, 0.0, 0.0]


# ---------------------------------------------------------------------- reward-scored eval tasks


def test_a_reward_task_scores_with_the_stage_reward_and_leaves_abstentions_out():
    """An abstention (None, a judge that did not answer) is left out of the mean, never scored 0."""
    from inspect_ai.scorer import SampleScore, Score

    from dna_factory.eval.reward_task import abstained, reward, reward_samples, score_completion
    from rewards.registry import resolve_reward

    [sample] = reward_samples(REPO / "data" / "families" / "coding_eval.jsonl")[:1]
    code_reward, _ = resolve_reward({"factory": "code_execution"})
    digits = sample.metadata["prompt"][0]["content"].removesuffix(".").split(" of ")[1]
    function = "max" if "largest" in sample.metadata["prompt"][0]["content"] else "min"
    right = f"```python\nprint({function}([{digits}]))\n```"
    wrong = f"```python\nprint([{digits}][-1] + 10)\n```"
    values = [
        asyncio.run(score_completion(code_reward, sample.metadata["prompt"], [{"role": "assistant", "content": a}],
                                     sample.metadata["columns"]))
        for a in (right, wrong)
    ]  # fmt: skip
    assert values == [1.0, 0.0]

    scores = [SampleScore(score=Score(value=v)) for v in (1.0, 0.0, float("nan"), 1.0)]
    assert reward()(scores) == pytest.approx(2 / 3)
    assert abstained()(scores) == 1.0
    assert math.isnan(reward()([SampleScore(score=Score(value=float("nan")))]))


def test_family_eval_tasks_score_with_the_reward_their_stage_trains_on():
    """Each family's eval task reads its stage's held-out split and scores with the reward the stage trains on."""
    import yaml

    from dna_factory.eval.tasks import FAMILY_TASKS

    recipe = yaml.safe_load((REPO / RECIPE).read_text())
    stages = {s["name"]: s for s in recipe["stages"] if s["name"] in FAMILIES}
    assert set(stages) == set(FAMILIES)
    for name, stage in stages.items():
        [task_name] = stage["overrides"]["eval_tasks"]
        assert f"eval/{task_name}" == FAMILIES[name]
        held_out, spec = FAMILY_TASKS[task_name]
        [train_file] = [d["path"] for d in stage["overrides"]["datasets"]]
        assert train_file == f"data/families/{held_out.replace('_eval', '_prompts')}"
        config = yaml.safe_load((REPO / stage["config"]).read_text())
        assert config["reward_funcs"] == [spec]


def test_held_out_prompts_appear_in_no_training_file():
    folder = REPO / "data" / "families"
    training = set()
    for path in folder.glob("*.jsonl"):
        if not path.name.endswith("_eval.jsonl"):
            for line in path.read_text().splitlines():
                row = json.loads(line)
                for message in row.get("prompt") or row.get("messages") or []:
                    if isinstance(message, dict) and message.get("role") == "user":
                        training.add(message["content"])
    # the item a question asks about, whatever its wording (the agents' practice questions word it otherwise)
    items = {re.search(r"robot \d+|100( - \d)+", text) for text in training}
    items = {match.group() for match in items if match}
    for path in folder.glob("*_eval.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        held = {m["content"] for row in rows for m in row["prompt"] if m["role"] == "user"}
        assert held and not held & training, path.name
        held_items = {re.search(r"robot \d+|100( - \d)+", text) for text in held}
        assert not {match.group() for match in held_items if match} & items, path.name


# ---------------------------------------------------------------------- the recipe learns


@pytest.fixture(scope="module")
def families_run(tmp_path_factory, families_model, judge):
    out = tmp_path_factory.mktemp("families") / "run"
    proc = run_cli(
        "pipeline.py", "--recipe", RECIPE, "--output_dir", str(out), timeout=2700, JUDGE_BASE_URL=judge
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, out, json.loads((out / "pipeline_report.json").read_text())


@pytest.mark.timeout(2700)  # the first test runs the recipe: about 18 min here
@pytest.mark.slow
@pytest.mark.parametrize("stage", sorted(FAMILIES))
def test_every_family_raises_its_own_held_out_metric(families_run, stage):
    proc, out, report = families_run
    row = {s["name"]: s for s in report["stages"]}[stage]
    assert row["status"] == "done" and row["eval_metric"] == FAMILIES[stage]
    assert row["eval_before_from"] == "baseline"  # its SFT start, evaluated on its own task
    done = json.loads((out / f"{row['index']}-{stage}" / "DONE.json").read_text())
    start = "5-sft-agents" if stage in AGENTS else "1-sft"
    assert done["input_model"] == str(out / start)
    assert row["eval_after"] - row["eval_before"] >= MARGIN, (row["eval_before"], row["eval_after"])
    metric = FAMILIES[stage].removeprefix("eval/")
    assert f"{metric} {row['eval_before']:.4g} → {row['eval_after']:.4g}" in proc.stdout
    if (
        stage in AGENTS
    ):  # the behaviour that changed: the start answers without its tool, the final model with it
        rate = row["eval_also"]["tool_call_rate"]
        assert rate["after"] - rate["before"] >= MARGIN, rate
        assert f"tool_call_rate {rate['before']:.4g} → {rate['after']:.4g}" in proc.stdout


@pytest.mark.timeout(2700)  # after the families run (module fixture): about 1 min more
@pytest.mark.slow
def test_a_judge_that_abstains_gives_none_never_zero_in_the_rlhf_stage(families_run, tmp_path):
    """#34 item 4, on the families recipe's real RLHF stage: its config, its SFT start, the judge over HTTP. A judge
    that cannot decide (every third reply has no score) makes the reward None, never 0: the completion's reward is
    logged as null, its advantage is exactly 0, and its group's baseline is the mean and spread of the scored
    completions only (a None counted as 0 would pull every scored completion's advantage up)."""
    _, out, _ = families_run
    judge_proc, url = start_judge("--abstain-every", "3")
    run = tmp_path / "rlhf"
    try:
        proc = run_cli(
            "grpo.py", "--config", "configs/grpo/tiny-cpu-rlhf.yaml", "--model_name_or_path", str(out / "1-sft"),
            "--datasets", "[{path: data/families/rlhf_prompts.jsonl, label: rlhf}]", "--num_generations", "8",
            "--per_device_train_batch_size", "32", "--max_completion_length", "48", "--max_steps", "2",
            "--save_steps", "2", "--log_completions", "true", "--output_dir", str(run),
            timeout=900, JUDGE_BASE_URL=url,
        )  # fmt: skip
    finally:
        judge_proc.terminate()
        judge_proc.wait(timeout=10)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    column = "judge_reward"  # and its raw 0-10 score, logged beside it
    assert all((row[column] is None) == (row[f"{column}_score"] is None) for row in rows)
    abstained = [row for row in rows if row[column] is None]
    assert len(rows) == 64 and 0 < len(abstained) < len(rows), (len(rows), len(abstained))
    assert all(row["advantage"] == 0 for row in abstained)
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["step"], json.dumps(row["prompt"])), []).append(row)
    mixed = 0
    for group in groups.values():
        scored = [row[column] for row in group if row[column] is not None]
        if len(scored) < 2 or len(set(scored)) < 2:
            continue
        mixed += len(scored) < len(group)
        mean, spread = statistics.mean(scored), statistics.stdev(scored)
        for row in group:
            if row[column] is not None:
                assert math.isclose(row["advantage"], (row[column] - mean) / (spread + 1e-4), abs_tol=1e-3), (
                    group
                )
    assert mixed, "no group held both abstentions and different scores: nothing was checked"


# ---------------------------------------------------------------------- model: ${stage}


def test_a_stage_model_may_name_an_earlier_stage(tmp_path):
    """``model: ${sft}``: the stage starts from that stage's final model and depends on it, not on the previous one."""
    from dna_factory.pipeline.recipe import input_model, load_pipeline
    from dna_factory.pipeline.state import dependencies

    pipeline = load_pipeline(REPO / RECIPE)
    pipeline.output_dir = tmp_path
    stages = {s.name: s for s in pipeline.stages}
    for name in FAMILIES:
        start = "sft-agents" if name in AGENTS else "sft"
        assert input_model(pipeline, stages[name]) == str(tmp_path / f"{stages[start].index}-{start}")
        assert [s.name for s in dependencies(pipeline, stages[name])] == [start]
    assert [s.name for s in dependencies(pipeline, stages["sft-agents"])] == ["sft"]
    (tmp_path / "1-sft").mkdir()
    (tmp_path / "1-sft" / "DONE.json").write_text(json.dumps({"model": "elsewhere/merged"}))
    assert input_model(pipeline, stages["rlhf"]) == "elsewhere/merged"  # what sft recorded as its final model


@pytest.mark.parametrize(
    ("model", "error"),
    [
        ("${rlhf}", "refers to ${rlhf}, which is not an earlier stage"),
        ("${sft}/x", "write a path, or one reference to an earlier stage"),
    ],
)
def test_a_stage_model_reference_must_name_an_earlier_stage(tmp_path, model, error):
    import yaml

    recipe = yaml.safe_load((REPO / RECIPE).read_text())
    recipe["stages"][1]["model"] = model
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = run_cli("pipeline.py", "--recipe", str(path), "--dry_run")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert error in proc.stderr


def test_the_families_recipe_passes_dry_run(families_model, judge):
    proc = run_cli("pipeline.py", "--recipe", RECIPE, "--dry_run", JUDGE_BASE_URL=judge)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "7 stage(s)" in proc.stdout
    assert proc.stdout.count("eval=the pipeline's eval server") == 5
    assert "The judge server at" in proc.stderr and "answers /health" in proc.stderr


def test_the_families_model_keeps_qwen3s_template_and_knows_the_families_text(families_model):
    """The families student: TRL's qwen3.jinja verbatim (TRL recognises templates by exact string), Qwen3's own
    pre-tokenizer split (every digit its own token, so a number in a tool call is the same tokens as in the
    question), and every demonstration under 450 tokens (an agent's, tool schema included, ~700 with the student's
    tokenizer)."""
    import trl
    from make_tiny_model import FAMILIES_VOCAB_SIZE
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(families_model)
    assert 1000 < len(tokenizer) <= FAMILIES_VOCAB_SIZE
    trl_templates = Path(trl.__file__).parent / "chat_templates"
    assert tokenizer.chat_template == (trl_templates / "qwen3.jinja").read_text(encoding="utf-8")
    for text in ("What is 100 - 9 - 3 - 6?", '{"query": "robot 37"}', "print(sum([4, 9, 5, 3]))"):
        pieces = [tokenizer.decode([i]) for i in tokenizer(text)["input_ids"]]
        assert "".join(pieces) == text
        assert all(not any(c.isdigit() for c in p) or p.isdigit() and len(p) == 1 for p in pieces), pieces
    lengths = []
    for name in ("sft.jsonl", "sft_agents.jsonl"):
        for line in (REPO / "data" / "families" / name).read_text().splitlines()[:200]:
            row = json.loads(line)
            tools = json.loads(row["tools"]) if row.get("tools") else None
            lengths.append(len(tokenizer.apply_chat_template(row["messages"], tools=tools, tokenize=True)))
    assert max(lengths) < 450, max(lengths)


@pytest.mark.timeout(2700)  # after the families run (module fixture): about 1 min more
@pytest.mark.slow
def test_an_agent_episode_is_scored_once_and_its_tool_results_get_no_gradient(families_run, tmp_path):
    """#34 item 4, on the families recipe's real General Agent stage: its command line (recipe overrides
    included), its SFT start (sft-agents), episodes the model samples itself. Each episode (a call, the tool's
    result, the answer) reaches the reward once, as a whole, and is scored by its final answer; the loss's gradient
    reaches the model's own tokens and never the rendered tool results."""
    from dna_factory.inputs.loading import load_context
    from dna_factory.pipeline.recipe import load_pipeline, stage_argv
    from dna_factory.run.runner import prepare
    from rewards.interface import completion_text
    from rewards.verifiable import make_string_match_reward
    from tests import agent_fixtures

    torch = pytest.importorskip("torch")
    _, out, _ = families_run
    pipeline = load_pipeline(REPO / RECIPE)
    stage = next(s for s in pipeline.stages if s.name == "general-agent")
    argv = stage_argv(stage, str(out / "5-sft-agents"), tmp_path)
    reward = {"factory": "string_match", "extractor": "boxed", "answer_column": "answer"}
    argv += [
        "--eval_on_checkpoint=false", "--save_strategy=no",
        f"--reward_funcs={json.dumps([reward, 'tests.agent_fixtures:record_completions'])}",
    ]  # fmt: skip
    entry, cfg = prepare("grpo", argv)
    trainer = entry.build_trainer(load_context(entry, cfg))
    trainer.model.train()
    agent_fixtures.RECORDED.clear()
    inputs = [trainer.train_dataset[i] for i in range(4) for _ in range(trainer.num_generations)]
    torch.manual_seed(0)
    batch = trainer._generate_and_score_completions(inputs)  # TRL 1.16 private: generate, run tools, score
    (seen,) = agent_fixtures.RECORDED  # the rewards were called once for the whole batch
    episodes = seen["completions"]
    assert len(episodes) == len(inputs)  # one score per episode, not per turn
    roles = [[m["role"] for m in episode] for episode in episodes]
    assert ["assistant", "tool", "assistant"] in roles, roles  # the start calls the calculator
    scores = list(trainer._logs["rewards"]["string_match_boxed"])[-len(inputs) :]  # TRL 1.16 private
    expected = make_string_match_reward("boxed", answer_column="answer")(
        prompts=seen["prompts"], completions=episodes, answer=seen["answer"]
    )
    assert scores == expected
    for episode, score in zip(episodes, scores, strict=True):  # scored by what the model said last
        if score == 1.0:
            assert "\\boxed{" in completion_text(episode[-1:])
    # the loss's gradient: as tests/test_agents.py::test_tool_result_tokens_get_no_gradient, on sampled episodes
    hidden = []

    def keep(module, args, output):
        output.retain_grad()
        hidden.append(output)

    handle = trainer.model.model.norm.register_forward_hook(keep)
    trainer.current_gradient_accumulation_steps = 1
    try:
        trainer.compute_loss(trainer.model, batch).backward()
    finally:
        handle.remove()
    prompt_len, completion_len = batch["prompt_ids"].size(1), batch["completion_ids"].size(1)
    grad = hidden[0].grad[:, prompt_len - 1 : prompt_len - 1 + completion_len].abs().sum(-1)
    tool_mask, completion_mask = batch["tool_mask"].bool(), batch["completion_mask"].bool()
    assert (~tool_mask & completion_mask).any()  # tool results are in the completions
    assert torch.all(grad[~tool_mask] == 0)
    if batch["advantages"].abs().sum() > 0:
        assert (grad[tool_mask & completion_mask] > 0).any()
