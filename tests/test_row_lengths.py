"""#35 item 1: every stage measures its rows against its length limit under --dry_run and at start; an
over-long row (a 100,000-character prompt) or a prompt with no text is dropped with a count and the first
row's index, or refused with one error line (drop_overlong_prompts: false); memory stays bounded."""

from __future__ import annotations

import logging

import pytest

from dna_factory.errors import DnaConfigError
from dna_factory.inputs.loading import dry_run_rows, load_data
from dna_factory.inputs.row_lengths import RowCheck, stage_limit, token_counts
from dna_factory.run.runner import prepare
from tests.conftest import run_cli

LONG = "word " * 20_000  # 100,000 characters: tens of thousands of tokens, far over the tiny model's 4,096


def _rows(stage: str, long_row: bool = True, empty_row: bool = False) -> list[dict]:
    """Three rows in the stage's format; row 1 is the long one (or the empty one)."""
    text = LONG if long_row else ""

    def make(q: str, a: str) -> dict:
        if stage == "sft":
            return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        if stage == "dpo":
            return {"prompt": q, "chosen": a, "rejected": a + " no"}
        return {"prompt": [{"role": "user", "content": q}], "solution": a}

    rows = [make("What is 1 + 1?", "2"), make(text, "3"), make("What is 2 + 2?", "4")]
    if empty_row:
        rows[1] = make("", "3")
    return rows


STAGES = {
    "grpo": ("grpo", "configs/grpo/tiny-cpu.yaml", "prompts"),
    "grpo-async": ("grpo", "configs/grpo/tiny-cpu-async.yaml", "prompts"),
    "sft": ("sft", "configs/sft/tiny-cpu.yaml", "rows"),
    "dpo": ("dpo", "configs/dpo/tiny-cpu.yaml", "rows"),
    "distill": ("distill", "configs/distill/tiny-cpu.yaml", "prompts"),
}


def _prepare(case: str, data, *extra: str):
    stage_name, recipe, _ = STAGES[case]
    return prepare(stage_name, ["--config", recipe, "--datasets", f"[{{path: {data}, label: long}}]", *extra])


@pytest.mark.parametrize("case", list(STAGES))
def test_a_100k_character_row_is_dropped_or_refused_under_dry_run(case, write_jsonl, caplog, tiny_model):
    stage_name = STAGES[case][0]
    data = write_jsonl("long.jsonl", _rows(stage_name))
    stage, cfg = _prepare(case, data, "--dry_run")
    with caplog.at_level(logging.INFO, logger="dna_factory"):
        dry_run_rows(stage, cfg)
    what = STAGES[case][2]
    assert f"Dropped 1 of 3 {what} longer than" in caplog.text, caplog.text[-2000:]
    assert "the first: row 1" in caplog.text and "drop_overlong_prompts: false" in caplog.text

    stage, cfg = _prepare(case, data, "--dry_run", "--drop_overlong_prompts", "false")
    with pytest.raises(
        DnaConfigError, match=r"Dataset 'long' \(.*long.jsonl\), row 1 is over the limit of \d+ tokens"
    ):
        dry_run_rows(stage, cfg)


def test_the_run_loads_without_the_long_row_and_the_cli_refuses_in_one_line(write_jsonl, tiny_model):
    data = write_jsonl("long.jsonl", _rows("grpo"))
    stage, cfg = _prepare("grpo", data)
    _, train, _ = load_data(stage, cfg)  # what the trainer gets at start
    assert len(train) == 2 and all(len(str(row["prompt"])) < 1000 for row in train)

    done = run_cli(
        "grpo.py", "--config", STAGES["grpo"][1], "--datasets", f"[{{path: {data}, label: long}}]",
        "--drop_overlong_prompts", "false", "--dry_run", timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: Dataset 'long'") and "row 1 is over the limit of 4080 tokens" in last, last
    assert (
        "max_position_embeddings=4096 - max_completion_length=16" in last and "Traceback" not in done.stderr
    )


@pytest.mark.parametrize("stage_name", ["grpo", "dpo"])
def test_an_empty_prompt_is_dropped_like_a_long_one_or_refused(stage_name, write_jsonl, caplog, tiny_model):
    data = write_jsonl("empty.jsonl", _rows(stage_name, long_row=False, empty_row=True))
    case = stage_name
    stage, cfg = _prepare(case, data, "--dry_run")
    with caplog.at_level(logging.INFO, logger="dna_factory"):
        dry_run_rows(stage, cfg)
    assert "Dropped 1 of 3 prompts holding no text from dataset 'long'" in caplog.text
    assert "the first: row 1" in caplog.text
    stage, cfg = _prepare(case, data, "--dry_run", "--drop_overlong_prompts", "false")
    with pytest.raises(DnaConfigError, match="row 1: `prompt` (is an empty string|has no text)"):
        dry_run_rows(stage, cfg)


def test_every_row_over_the_limit_is_an_error_even_when_dropping(write_jsonl, tiny_model):
    data = write_jsonl("all.jsonl", [{"prompt": LONG, "solution": "1"}] * 2)
    stage, cfg = _prepare("grpo", data, "--dry_run")
    with pytest.raises(DnaConfigError, match="all its 2 prompts are longer than 4080 tokens"):
        dry_run_rows(stage, cfg)


class _Spy:
    """The real tokenizer, recording the longest text it was given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.longest = tokenizer, 0

    def __call__(self, texts, **kwargs):
        self.longest = max(self.longest, *(len(t) for t in ([texts] if isinstance(texts, str) else texts)))
        return self.tokenizer(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_memory_is_bounded_by_the_limit_not_by_the_row(tiny_model):
    from datasets import Dataset
    from transformers import AutoTokenizer

    spy = _Spy(AutoTokenizer.from_pretrained(tiny_model))
    check = RowCheck(stage_limit("grpo", {"max_prompt_length": 64}), drop=True, load_tokenizer=lambda: spy)
    huge = "word " * 2_000_000  # 10 million characters
    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": c}]} for c in ("hi", huge, "ok")])
    counts = check.lengths(rows)
    assert counts[0] <= 64 and counts[2] <= 64 and counts[1] > 64
    assert spy.longest < 64 * 300, f"the tokenizer was given {spy.longest:,} characters"
    # exact up to the limit: a short text is counted whole
    assert token_counts(spy, ["one two three"], 64, 16) == [len(spy.tokenizer("one two three")["input_ids"])]


def test_the_limit_is_the_smallest_of_the_keys_and_the_context(tiny_model):
    limit = stage_limit(
        "grpo", {"model_name_or_path": str(tiny_model), "max_completion_length": 96}, server_max_model_len=512
    )
    assert (limit.tokens, limit.whole_row) == (416, False) and "server's max_model_len=512" in limit.why
    limit = stage_limit("grpo", {"model_name_or_path": str(tiny_model), "max_completion_length": 96})
    assert limit.tokens == 4000 and "max_position_embeddings=4096" in limit.why
    limit = stage_limit("grpo", {"model_name_or_path": str(tiny_model), "max_prompt_length": 300})
    assert limit.tokens == 300 and limit.why == "max_prompt_length=300"
    assert stage_limit("sft", {"max_length": 128}).tokens == 128
    assert stage_limit("dpo", {"model_name_or_path": str(tiny_model), "max_length": None}).tokens == 4096


def test_the_filter_drops_or_refuses_long_prompts_before_generating(write_jsonl, tmp_path, tiny_model):
    data = write_jsonl("long.jsonl", _rows("grpo"))
    args = [
        "-m", "rewards.filter_tasks", "--config", "configs/filter_tasks/tiny-cpu.yaml", "--datasets", f"[{{path: {data}, label: long}}]", "--backend", "hf",
        "--model", str(tiny_model), "--reward_funcs",
        "[{factory: string_match, extractor: last_number, answer_column: solution}]",
        "--num_generations", "2", "--max_tokens", "8", "--output_dir", str(tmp_path / "out"),
        "--drop_overlong_prompts", "false",
    ]  # fmt: skip
    done = run_cli(*args, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: Dataset 'mixture'") and "row 1 is over the limit of 4088 tokens" in last
    assert (
        not (tmp_path / "out" / "scored.jsonl").exists()
        or not (tmp_path / "out" / "scored.jsonl").read_text()
    )


def test_packing_that_splits_rows_has_no_row_limit_and_bfd_keeps_it():
    """Review of 1ace90f: with bfd_split or wrapped packing TRL cuts long rows across packs on purpose."""
    for strategy in ("bfd_split", "wrapped"):
        assert stage_limit("sft", {"max_length": 128, "packing": True, "packing_strategy": strategy}) is None
    assert stage_limit("sft", {"max_length": 128, "packing": True, "packing_strategy": "bfd"}).tokens == 128


def test_a_cut_text_is_over_the_limit_and_the_trainers_special_tokens_count(tiny_model):
    """Review of 1ace90f: a text that had to be cut counts as over the limit whatever its prefix gave; EOS after a
    string completion (TRL's SFT and DPO append it) counts toward the row."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    # a prefix of 'k' characters per token bound: with k=1 every text longer than limit+1 characters is cut
    assert token_counts(tok, ["word " * 50], 8, 1) == [9]
    text = "one two three four"
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    check = RowCheck(stage_limit("sft", {"max_length": 2 * n}), drop=True, load_tokenizer=lambda: tok)
    rows = Dataset.from_list([{"prompt": text, "completion": text}])
    eos = 1
    assert check.lengths(rows) == [2 * n + len(tok("", add_special_tokens=True)["input_ids"]) + eos]
