"""Async GRPO (S-ASYNC): mode switch, fail-fast validators, server checks, portable attention, train/stop/resume."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from dna_factory.errors import DnaConfigError
from dna_factory.run.runner import prepare
from dna_factory.trl_pin import TRL_VERSION
from tests.conftest import REPO, cli_env, restore_shared_weights, run_cli, server_paused
from tests.lazy import lazy

torch = lazy("torch")
trl = lazy("trl")


SYNC = "configs/grpo/tiny-cpu.yaml"
ASYNC = "configs/grpo/tiny-cpu-async.yaml"
DOWN = "http://127.0.0.1:9"  # nothing listens on the discard port


def test_trl_async_canary():
    """The TRL 1.16.0 private API dna_factory/async_grpo/trainer.py relies on; a failure means TRL changed shape."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer
    from trl.experimental.async_grpo import async_grpo_trainer as module
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow, tree_attention

    assert trl.__version__ == TRL_VERSION
    assert TREE_ATTENTION == "tree_fa3" and hasattr(module, "get_peak_flops_per_device")
    for name in (
        "_save_checkpoint",
        "_inner_training_loop",
        "get_train_dataloader",
        "_log_step_metrics",
        "_sync_weight",
    ):
        assert callable(getattr(AsyncGRPOTrainer, name)), name
    # the watchdog's busy marks: the weight sync is this one method, called with no arguments after a step
    assert "StepIntervalCallback(self._sync_weight," in inspect.getsource(
        AsyncGRPOTrainer.__init__
    ) + inspect.getsource(AsyncGRPOTrainer)
    save_src = inspect.getsource(AsyncGRPOTrainer._save_checkpoint)
    assert "rollout_state.json" in save_src and "_trained_groups" in save_src
    loop_src = inspect.getsource(AsyncGRPOTrainer._inner_training_loop)
    assert '_loop_kwargs["dataset_start_index"]' in loop_src and "_groups_before_resume" in loop_src
    assert "RolloutQueueDataset(" in inspect.getsource(AsyncGRPOTrainer.get_train_dataloader)
    assert "self.rollout_queue" in inspect.getsource(AsyncGRPOTrainer.get_train_dataloader)
    assert "rollout_worker.start()" in inspect.getsource(module._TrainBeginCallback.on_train_begin)
    assert "weight_transfer" in inspect.signature(AsyncGRPOTrainer.__init__).parameters
    assert "dataset_start_index" in inspect.getsource(AsyncRolloutWorker.__init__)
    assert {"tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k"} <= set(
        inspect.signature(tree_attention).parameters
    )
    assert callable(TreeRow.pack)


def test_trl_rollout_worker_watchdog_canary():
    """The TRL 1.16.0 private API dna_factory/async_grpo/rollout_watchdog.py relies on, and the two defects it works around
    (docs/async-grpo.md): stop() sets the Event a (possibly dead) child waits on; check_health never looks at the
    child's liveness. When TRL fixes them, this fails: the watchdog's work-arounds can then go."""
    from trl.experimental.async_grpo import AsyncGRPOConfig
    from trl.experimental.async_grpo import async_grpo_trainer as module
    from trl.experimental.async_grpo import async_rollout_worker as worker

    init = inspect.getsource(worker.AsyncRolloutWorker.__init__)
    for name in ("self._process", "self._failed_event", "self._exception_info_queue", "self._loop_kwargs"):
        assert name in init, name
    assert "vllm_server_url=self.args.vllm_server_base_url" in inspect.getsource(
        module.AsyncGRPOTrainer.__init__
    )
    assert "(type(e).__name__, str(e), traceback.format_exc())" in inspect.getsource(
        worker._AsyncRolloutLoop.run
    )
    # TRL reads the worker's methods through the instance, so instance attributes replace them
    assert "check_health_fn=self.rollout_worker.check_health" in inspect.getsource(
        module.AsyncGRPOTrainer.get_train_dataloader
    )
    assert "self.check_health_fn(self.stale_after_s)" in inspect.getsource(
        module.RolloutQueueDataset.__iter__
    )
    assert "self.rollout_worker.stop()" in inspect.getsource(module.AsyncGRPOTrainer._inner_training_loop)
    assert "self._trainer.rollout_worker.start()" in inspect.getsource(
        module._TrainBeginCallback.on_train_begin
    )
    assert AsyncGRPOConfig.__dataclass_fields__["heartbeat_stale_after_s"].default == 300.0
    # the defects
    assert "self._stop_event_mp.set()" in inspect.getsource(worker.AsyncRolloutWorker.stop)
    assert "stop_event.wait()" in inspect.getsource(worker._spawn_stop_watcher)
    assert "is_alive" not in inspect.getsource(worker.AsyncRolloutWorker.check_health)
    assert "AsyncRolloutWorker child exited during init (exitcode={exit_code})" in inspect.getsource(
        worker.AsyncRolloutWorker.start
    )


LOOK_AHEAD = """
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
import torch
from torch.utils.data import DataLoader, IterableDataset

class Counting(IterableDataset):
    def __iter__(self):
        yield from range(5)

collated = []
def collate(batch):
    collated.append(batch[0])
    return torch.tensor(batch)

accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
loader = accelerator.prepare(DataLoader(Counting(), batch_size=1, collate_fn=collate))
assert loader.collate_fn is collate, "the prepared loader hides the collator"
first = next(iter(loader))
print(int(first[0]), len(collated))
"""


def test_accelerate_dispatcher_collates_one_micro_batch_ahead():
    """Canary (accelerate 1.15): with dispatch_batches=True the next micro-batch is collated before the current one
    is handed out, and the prepared loader exposes the collator. This is why groups count as trained only in
    training_step (dna_factory/async_grpo/trainer.py); if the look-ahead goes, the bookkeeping must be revisited."""
    proc = subprocess.run([sys.executable, "-c", LOOK_AHEAD], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["0", "2"], proc.stdout


STALENESS = """
import queue
from collections import defaultdict

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader
from trl.experimental.async_grpo.async_grpo_trainer import RolloutQueueDataset
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

MAX_STALENESS = 2
q = queue.Queue()
made_by = {g: 0 for g in range(6)} | {6: 9, 7: 9}  # six samples of policy version 0, then two fresh ones
for g, v in made_by.items():
    q.put(RolloutSample([], [], np.zeros(2, dtype=np.int64), np.ones(2), np.zeros(2), 0.0, v, g, {}))
version = 0


class Drained(Exception):
    pass


def drained(_):
    raise Drained


metrics = defaultdict(list)
data = RolloutQueueDataset(q, lambda: version, drained, 60.0, metrics, max_staleness=MAX_STALENESS, poll_interval_s=0.05)
accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
loader = accelerator.prepare(
    DataLoader(data, batch_size=1, collate_fn=lambda b: {"group_id": torch.tensor([s["group_id"] for s in b])})
)
trained = []
try:
    for batch in loader:  # one micro-batch = one optimizer step = one weight sync (gradient_accumulation_steps 1)
        group = int(batch["group_id"][0])
        if made_by[group] == 0:
            trained.append(version - made_by[group])  # staleness where the sample is trained
        version += 1
except Drained:
    pass
print(max(trained), int(max(metrics["sample/staleness_max"][:4])), len(metrics["sample/dropped_stale_total"]))
"""


def test_staleness_is_checked_one_micro_batch_ahead_of_training():
    """Pins the inherited off-by-one (#35 item 5; docs/async-grpo.md "Staleness"): TRL's RolloutQueueDataset checks
    max_staleness when accelerate's dispatcher collates a sample, one micro-batch before it is trained, so with
    max_staleness 2 a sample is trained at staleness 3 while sample/staleness_max says 2. Real TRL queue dataset,
    real accelerate dispatcher; a change in either fails here and the docs must follow."""
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", STALENESS], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    trained_max, reported_max, dropped = map(int, proc.stdout.split())
    assert (trained_max, reported_max) == (3, 2), proc.stdout  # trained at max_staleness + 1, reported at 2
    assert dropped == 2, proc.stdout


def test_trl_rollout_numbering_and_queue_reads_canary():
    """Canary (TRL 1.16): the contracts exact resume is built on.

    The worker numbers groups 0, 1, 2, ... from its start and keeps counting when it wraps round the dataset
    (so group g is stream position start + g); the start is ``dataset_start_index % len(dataset)``; the queue
    dataset reads the queue through ``get(timeout=...)`` only (plus ``qsize`` for a metric); the collator adds each
    micro-batch's group ids with one ``groups_trained.update``; every completion request goes through ``_post``
    and TRL itself never reads ``finish_reason`` (dna_factory/async_grpo/rollout_child.py resubmits aborted ones).
    """
    from datasets import Dataset
    from trl.experimental.async_grpo import async_grpo_trainer as module
    from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

    loop = object.__new__(_AsyncRolloutLoop)  # only _repeat_iterator's own state
    loop.dataset = Dataset.from_dict({"row": [0, 1, 2]})
    loop._dataset_iter = iter(
        loop.dataset.select(range(1, 3))
    )  # what __init__ builds for dataset_start_index=1
    loop.num_generations = 2
    stream = loop._repeat_iterator()
    seen = [next(stream) for _ in range(2 * 7)]
    assert [(g, r["row"]) for g, r in seen[::2]] == [(g, (1 + g) % 3) for g in range(7)]
    assert all(a == b for a, b in zip(seen[::2], seen[1::2], strict=True)), "num_generations copies per group"
    init_src = inspect.getsource(_AsyncRolloutLoop.__init__)
    assert "start = dataset_start_index % len(dataset)" in init_src
    assert "dataset.select(range(start, len(dataset)))" in init_src

    turn_src = inspect.getsource(_AsyncRolloutLoop._generate_one_turn)
    assert 'self._post("/v1/completions"' in turn_src, "RolloutLoop._post no longer sees the completions"
    assert "finish_reason" not in turn_src, "TRL reads finish_reason now: RolloutLoop._post may be redundant"
    iter_src = inspect.getsource(module.RolloutQueueDataset.__iter__)
    assert set(re.findall(r"self\.queue\.(\w+)", iter_src)) == {"get", "qsize"}
    assert "self.queue.get(timeout=" in iter_src
    collate_src = inspect.getsource(module.DataCollatorForRollout.torch_call)
    assert collate_src.count("self.groups_trained.update(") == 1
    assert "groups_trained=self._trained_groups" in inspect.getsource(
        module.AsyncGRPOTrainer.get_train_dataloader
    )
    assert "self._trained_groups" in inspect.getsource(module.AsyncGRPOTrainer._log_step_metrics)


class _QueueDrained(Exception):
    pass


def test_our_drop_test_agrees_with_trls_queue_dataset_and_token_budget_batcher():
    """Exact resume counts a sample as dropped exactly when TRL's real pipeline drops it (stale or oversize)."""
    import collections
    import queue

    import numpy as np
    from accelerate import PartialState
    from trl.experimental.async_grpo.async_grpo_trainer import RolloutQueueDataset, TokenBudgetBatcher
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    from dna_factory.async_grpo.trainer import dropped_before_training

    version, max_staleness, budget = 5, 1, 12

    def sample(group_id, n_tokens, model_version):
        return RolloutSample(
            prompt=[], completion=[], input_ids=np.arange(n_tokens), completion_mask=np.ones(n_tokens, dtype=bool),
            old_log_probs=np.zeros(n_tokens, dtype=np.float32), advantage=1.0, model_version=model_version,
            group_id=group_id, metrics={},
        )  # fmt: skip

    samples = [
        sample(0, 8, 5),  # fresh, fits
        sample(1, 8, 3),  # stale (staleness 2 > 1)
        sample(2, 20, 5),  # fresh, longer than the budget
        sample(3, 12, 4),  # staleness 1, exactly the budget: kept
        sample(4, 30, 1),  # stale and oversize: dropped once, as stale
        sample(5, 13, 5),  # one token over
    ]
    rollouts: queue.Queue = queue.Queue()
    for s in samples:
        rollouts.put(s)

    def drained(_stale_after_s):
        raise _QueueDrained

    PartialState()  # TRL logs through accelerate's logger, which needs the (single-process) state
    metrics = collections.defaultdict(list)
    dataset = RolloutQueueDataset(
        rollouts, lambda: version, drained, stale_after_s=60.0, metrics=metrics,
        max_staleness=max_staleness, poll_interval_s=0.01,
    )  # fmt: skip
    with pytest.raises(_QueueDrained):
        for _ in TokenBudgetBatcher(dataset, num_processes=1, token_budget=budget, metrics=metrics):
            pass
    trl_drops = len(metrics["sample/dropped_stale_total"]) + len(metrics["batch/dropped_oversize_total"])
    ours = [
        dropped_before_training(s, model_version=version, max_staleness=max_staleness, token_budget=budget)
        for s in samples
    ]
    assert ours == [False, True, True, False, True, True]
    assert trl_drops == sum(ours)
    assert (
        len(metrics["sample/dropped_stale_total"]) == 2 and len(metrics["batch/dropped_oversize_total"]) == 2
    )
    assert not dropped_before_training(samples[2], model_version=version, max_staleness=1, token_budget=0)


# ----------------------------------------------------------------------------------------- mode switch


def test_cli_async_overrides_yaml_and_selects_async_defaults(tiny_model):
    stage, cfg = prepare(
        "grpo", ["--config", SYNC, "--grpo_execution", "async", "--vllm_server_base_url", DOWN, "--dry_run"]
    )
    assert (
        stage.defaults == "async_grpo" and cfg.sources["max_staleness"] == "configs/_defaults-async_grpo.yaml"
    )
    assert cfg.values["token_budget"] is None
    sync_stage, _ = prepare("grpo", ["--config", SYNC, "--dry_run"])
    assert sync_stage.defaults == "grpo"


def test_sync_only_key_in_async_mode_is_named(tiny_model):
    with pytest.raises(
        DnaConfigError, match="Key 'beta' on the command line applies to grpo_execution: sync only"
    ):
        prepare("grpo", ["--config", ASYNC, "--beta", "0.1", "--vllm_server_base_url", DOWN])
    with pytest.raises(DnaConfigError, match="Key 'max_staleness' .* applies to grpo_execution: async only"):
        prepare("grpo", ["--config", SYNC, "--max_staleness", "2"])


REJECTED = {
    "deepspeed": (
        ["--deepspeed", "configs/deepspeed/zero3.json"],
        {},
        "DeepSpeed is configured. AsyncGRPO supports one training GPU only",
    ),
    "fsdp env": (
        [],
        {"ACCELERATE_USE_FSDP": "true"},
        "FSDP is configured (ACCELERATE_USE_FSDP). AsyncGRPO supports one training GPU only",
    ),
    "deepspeed env": (
        [],
        {"ACCELERATE_USE_DEEPSPEED": "true"},
        "DeepSpeed is configured (ACCELERATE_USE_DEEPSPEED). AsyncGRPO supports one training GPU only",
    ),
    "fsdp key": (
        ["--fsdp", "full_shard"],
        {},
        "FSDP is configured. AsyncGRPO supports one training GPU only",
    ),
    "8-bit": (["--load_in_8bit"], {}, "does not train quantised (4/8-bit) models"),
    "attention": (["--attn_implementation", "sdpa"], {}, "Remove attn_implementation"),
    "two processes": ([], {"WORLD_SIZE": "2"}, "WORLD_SIZE=2: more than one training process"),
    "two gpus": ([], {"CUDA_VISIBLE_DEVICES": "0,1"}, "2 GPUs are visible to the trainer"),
    "eval": (["--eval_strategy", "steps"], {}, "AsyncGRPO does not run evaluation"),
    "dynamic sampling": (["--dynamic_sampling", "resample"], {}, "AsyncGRPO rejects dynamic_sampling"),
    "quantised": (["--load_in_4bit"], {}, "does not train quantised (4/8-bit) models"),
    "peft": (["--use_peft"], {}, "does not train PEFT/LoRA adapters here"),
    "reward model": (
        ["--reward_funcs", "[artifacts/tiny/student]"],
        {},
        "is a model that would run on the trainer's GPU",
    ),
    "reward weights": (
        ["--reward_funcs", "[{factory: string_match, answer_column: solution, weight: 2}]"],
        {},
        "sums rewards without weights",
    ),
}


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_rejected_combinations_fail_under_dry_run(case, monkeypatch, tiny_model):
    flags, env, message = REJECTED[case]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(DnaConfigError, match=re.escape(message)):
        prepare("grpo", ["--config", ASYNC, "--vllm_server_base_url", DOWN, "--dry_run", *flags])


def test_a_rejected_combination_exits_2_from_the_command_line_before_loading(tiny_model):
    flags, env, message = REJECTED["two processes"]
    proc = run_cli("grpo.py", "--config", ASYNC, "--vllm_server_base_url", DOWN, "--dry_run", *flags, **env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert "Loading weights" not in proc.stderr


def test_an_already_quantised_checkpoint_is_rejected_like_load_in_4bit(tiny_model, tmp_path):
    quantised = tmp_path / "quantised"
    shutil.copytree(tiny_model, quantised)
    config = json.loads((quantised / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantised / "config.json").write_text(json.dumps(config))
    with pytest.raises(DnaConfigError, match="is already quantised .*bitsandbytes"):
        prepare(
            "grpo",
            [
                "--config",
                ASYNC,
                "--vllm_server_base_url",
                DOWN,
                "--model_name_or_path",
                str(quantised),
                "--dry_run",
            ],
        )


# ----------------------------------------------------------------------------------------- server checks


def test_an_unreachable_server_is_one_error_line_after_a_bounded_visible_wait(tiny_model, tmp_path):
    """#15 item 4: the run never starts unfiltered against a server that did not answer; it waits server_wait_s
    (logged), then stops with one line naming the URL, before any data, tokenizer or model loads."""
    proc = run_cli("grpo.py", "--config", ASYNC, "--vllm_server_base_url", DOWN, "--server_wait_s", "3",
                   "--output_dir", str(tmp_path / "run"), timeout=150)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"Waiting for the vLLM server at {DOWN}" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: The vLLM server at {DOWN} did not answer /health within 3 s"), last
    assert "server_wait_s" in last and "Traceback" not in proc.stderr
    assert "Training mixture" not in proc.stderr, "the wait must come before the data loads"
    # The validators do not probe a server the run is about to wait for (only --dry_run does): the
    # completion-length check runs once, after the wait, in wait_for_server.
    assert "Completion-length check skipped" not in proc.stderr, proc.stderr[-3000:]


def test_server_down_check_is_skipped_and_dry_run_passes(tiny_model):
    proc = run_cli("grpo.py", "--config", ASYNC, "--vllm_server_base_url", DOWN, "--dry_run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Completion-length check skipped" in proc.stderr


@pytest.mark.vllm
def test_overlong_completion_fails_fast_against_real_server(vllm_server, tiny_model):
    url = vllm_server.base_url.removesuffix("/v1")
    started = time.monotonic()
    proc = run_cli(
        "grpo.py", "--config", ASYNC, "--vllm_server_base_url", url, "--max_completion_length", "512"
    )
    assert proc.returncode == 2
    assert "max_completion_length=512 is >= the server's max_model_len=512" in proc.stderr
    assert "Loading weights" not in proc.stderr and time.monotonic() - started < 120


@pytest.mark.vllm
def test_wrong_served_model_name_is_reported(vllm_server, tiny_model, tmp_path):
    url = vllm_server.base_url.removesuffix("/v1")
    elsewhere = tmp_path / "student"  # the same model under a path the server does not serve it as
    elsewhere.symlink_to(tiny_model)
    with pytest.raises(DnaConfigError, match=f"Restart vLLM with --served-model-name {elsewhere}"):
        prepare(
            "grpo",
            [
                "--config",
                ASYNC,
                "--vllm_server_base_url",
                url,
                "--model_name_or_path",
                str(elsewhere),
                "--dry_run",
            ],
        )
    # (the recipe's relative path is served: no error)
    prepare("grpo", ["--config", ASYNC, "--vllm_server_base_url", url, "--dry_run"])


def test_overlong_prompts_are_dropped_with_one_warning(tiny_model, caplog):
    """The server's max_model_len bounds the prompts (S-ASYNC-7): async GRPO's limit in the shared row check."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from dna_factory.inputs.row_lengths import RowCheck, stage_limit

    tok = AutoTokenizer.from_pretrained(tiny_model)
    rows = [
        {"prompt": [{"role": "user", "content": "What is 1 + 1?"}]},
        {"prompt": [{"role": "user", "content": "word " * 400}]},
    ]
    limit = stage_limit("grpo", {"max_completion_length": 64}, server_max_model_len=128)
    check = RowCheck(limit, drop=True, load_tokenizer=lambda: tok)
    kept = check.apply(Dataset.from_list(rows), "arith", "a.jsonl")
    assert len(kept) == 1 and "Dropped 1 of 2 prompts longer than 64 tokens" in caplog.text
    assert "the vLLM server's max_model_len=128 - max_completion_length=64" in caplog.text
    with pytest.raises(DnaConfigError, match="all its 1 prompts are longer than 64 tokens"):
        check.apply(Dataset.from_list(rows[1:]), "arith", "a.jsonl")


# ----------------------------------------------------------------------------------------- portable attention


def _sample(ids, n_prompt, group):
    n = len(ids)
    return {"input_ids": torch.tensor(ids), "completion_mask": torch.tensor([0] * n_prompt + [1] * (n - n_prompt)),
            "old_log_probs": torch.zeros(n), "advantage": 1.0, "group_id": group}  # fmt: skip


def test_tree_sdpa_matches_unpacked_dense_forward(tiny_model):
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo.packing import TreeRow

    from dna_factory.async_grpo.tree_attention import use_tree_sdpa

    gen = torch.Generator().manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa").eval()
    prompt = torch.randint(10, 1000, (7,), generator=gen).tolist()
    samples = [
        _sample(prompt + torch.randint(10, 1000, (n,), generator=gen).tolist(), 7, 0) for n in (5, 3, 6)
    ]
    samples.append(_sample(torch.randint(10, 1000, (9,), generator=gen).tolist(), 4, 1))  # another group
    row = TreeRow()
    for s in samples:
        row.add(s)
    packed = row.pack()
    assert len(packed["input_ids"]) < sum(len(s["input_ids"]) for s in samples)  # the prompt is shared
    targets, dense = [], []
    with torch.no_grad():
        for s in samples:
            ids, mask = s["input_ids"].tolist(), s["completion_mask"].tolist()
            logp = torch.log_softmax(model(s["input_ids"][None]).logits[0].double(), -1)
            for q in range(1, len(ids)):
                if mask[q]:
                    targets.append(ids[q])
                    dense.append(logp[q - 1, ids[q]].item())
        use_tree_sdpa(model)
        out = model(
            input_ids=packed["input_ids"][None], position_ids=packed["position_ids"][None],
            tree_kv_index=packed["tree_kv_index"], tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
            tree_cu_seqlens_k=packed["tree_cu_seqlens_k"], tree_max_seqlen_q=int(packed["tree_max_seqlens"][0]),
            tree_max_seqlen_k=int(packed["tree_max_seqlens"][1]),
        )  # fmt: skip
        logp = torch.log_softmax(out.logits[0].double(), -1)
    got = [logp[i, t].item() for i, t in zip(packed["token_index"].tolist(), targets, strict=True)]
    assert len(got) == len(dense) == 19
    assert max(abs(a - b) for a, b in zip(got, dense, strict=True)) < 1e-5


# ----------------------------------------------------------------------------------------- train, stop, resume


def _restore_server_weights(vllm_server, tiny_model):
    """The shared server as the session started it: the tiny model's weights, and not paused (a test that stops
    the trainer or its server mid-run may have stopped it between a weight sync's /pause and /resume)."""
    restore_shared_weights(vllm_server, tiny_model)


def _positions(out: Path, *, up_to: int | None = None) -> list[int]:
    lines = [json.loads(line) for line in (out / "trained_groups.jsonl").read_text().splitlines()]
    return [p for line in lines if up_to is None or line["step"] <= up_to for p in line["positions"]]


ARITH_ROWS = {
    json.loads(line)["prompt"][0]["content"]: i
    for i, line in enumerate((REPO / "data/tiny/arith_prompts.jsonl").read_text().splitlines())
}


def _observed(path: Path, *, up_to: int) -> set[int]:
    """Rows of data/tiny/arith_prompts.jsonl whose question reached TRL's compute_loss by step ``up_to``."""
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return {ARITH_ROWS[q] for r in records if r["step"] <= up_to for q in r["questions"]}


def _declared_done(checkpoint: Path) -> set[int]:
    state = json.loads((checkpoint / "rollout_state.json").read_text())
    return set(range(state["prompt_index"])) | set(state["done_above"])


def _wait_for_checkpoint(child: subprocess.Popen, checkpoint: Path, log: Path, timeout: float = 400) -> None:
    """Until the checkpoint is whole: dna-factory's rollout_state.json (with done_above) is written last."""
    deadline = time.time() + timeout
    state = checkpoint / "rollout_state.json"
    while not (state.is_file() and "done_above" in state.read_text()):
        assert child.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, (
            f"no complete {checkpoint.name} within {timeout} s: {log.read_text()[-3000:]}"
        )
        time.sleep(0.2)


SKIP_SIGNALS = """
import torch
from accelerate import Accelerator
from dna_factory.async_grpo.trainer import _optimizer_steps

for fused in (True, False):
    accelerator = Accelerator(cpu=True)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=float("inf"))  # every step overflows
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    model, optimizer = accelerator.prepare(model, optimizer)
    before = _optimizer_steps(optimizer)
    accelerator.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()
    print(fused, accelerator.optimizer_step_was_skipped, before, _optimizer_steps(optimizer))
"""


def test_a_skipped_step_is_seen_with_fused_and_plain_adamw():
    """Canary (accelerate 1.15, torch): with a fused AdamW (transformers' default) the scaler hands an overflow to
    the optimizer, which skips inside its step, and accelerate's optimizer_step_was_skipped stays False; the step
    count (Adam's state["step"]) does not advance. With a plain AdamW the flag is True. The trainer reads both."""
    proc = subprocess.run([sys.executable, "-c", SKIP_SIGNALS], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == ["True False 0.0 0.0", "False True 0.0 0.0"], proc.stdout


def test_a_taken_step_is_seen_when_the_first_parameter_gets_no_gradient():
    """A parameter with no gradient (a VLM's vision tower on text prompts) gets no Adam state: the step count is
    read over every parameter, or every step would look skipped (review of 2bcdde0)."""
    import torch

    from dna_factory.async_grpo.trainer import _optimizer_steps

    unused, used = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW([*unused.parameters(), *used.parameters()], lr=0.1)
    assert _optimizer_steps(optimizer) == 0.0
    for expected in (1.0, 2.0):
        optimizer.zero_grad()
        used(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        assert _optimizer_steps(optimizer) == expected


SKIPPED_STEPS = """
import json, sys
import torch
from dna_factory.inputs.loading import load_context
from dna_factory.run.runner import prepare

stage, cfg = prepare("grpo", sys.argv[1:])
stage.wait_for_services(cfg)
trainer = stage.build_trainer(load_context(stage, cfg))
# A real loss scaler whose scale overflows every step: each optimizer step is skipped, as fp16 training skips one
# after an overflow (accelerate has no fp16 scaler on CPU, so the test gives it torch's CPU GradScaler).
trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=float("inf"))
before = [p.detach().clone() for p in trainer.model.parameters()]
trainer.train()
unchanged = all(torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters()))
print(json.dumps({"trained": sorted(trainer._trained_groups), "skipped": getattr(trainer, "_skipped_steps", None),
                  "steps": trainer.state.global_step, "unchanged": unchanged,
                  "abandoned": len(getattr(trainer, "_abandoned", ())),
                  "optimizer_scaler": getattr(trainer.optimizer, "scaler", None) is not None,
                  "log": [{k: h.get(k) for k in ("grad_norm", "learning_rate", "loss")} for h in trainer.state.log_history]},
                 default=str))
"""


@pytest.mark.timeout(600)
@pytest.mark.vllm
@pytest.mark.slow
def test_a_skipped_optimizer_step_does_not_count_its_groups_as_trained(vllm_server, tiny_model, tmp_path):
    """#35 item 5: groups count as trained only when the optimizer step they went into is taken. Every step here
    is skipped by a real loss scaler (the model does not change), so no group may count as trained."""
    url = vllm_server.base_url.removesuffix("/v1")
    args = ["--config", ASYNC, "--vllm_server_base_url", url, "--output_dir", str(tmp_path / "out"),
            "--max_steps", "2", "--save_steps", "100", "--max_staleness", "100"]  # fmt: skip
    try:
        done = subprocess.run(
            [sys.executable, "-c", SKIPPED_STEPS, *args], cwd=REPO, env=cli_env(), capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
    finally:
        _restore_server_weights(vllm_server, tiny_model)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["steps"] == 2 and result["skipped"] == 2 and result["unchanged"], json.dumps(result)
    assert result["trained"] == [], f"groups counted as trained by skipped steps: {result['trained']}"
    assert "Optimizer step 1 was skipped" in done.stderr and "are not trained" in done.stderr
    assert result["abandoned"] > 0, "the skipped groups must be done (untrained), or the resume mark stalls"


@pytest.mark.timeout(600)  # a long test: about a third of this here
@pytest.mark.vllm
@pytest.mark.slow
def test_async_trains_stops_resumes_and_finishes(vllm_server, tiny_model, tmp_path):
    """Kill after checkpoint-2, resume to step 4: what reached the loss (decoded from the model's input_ids by
    tests/loss_observer.py, not from our records) is exactly what each checkpoint calls done, and no group is
    trained twice. max_staleness is raised so that no sample is dropped (a dropped group is done untrained)."""
    url = vllm_server.base_url.removesuffix("/v1")
    out = tmp_path / "async"
    observed_1, observed_2 = tmp_path / "loss-1.jsonl", tmp_path / "loss-2.jsonl"
    args = ["grpo.py", "--config", ASYNC, "--vllm_server_base_url", url, "--output_dir", str(out),
            "--max_staleness", "100", "--save_steps", "2", "--save_total_limit", "5", "--max_steps", "6"]  # fmt: skip
    try:
        log = tmp_path / "run-1.log"  # a file, not a pipe: nobody reads a pipe while the run fills it
        with open(log, "w") as stderr:
            child = subprocess.Popen(
                [sys.executable, "tests/loss_observer.py", str(observed_1), *args], cwd=REPO, env=cli_env(),
                start_new_session=True, stdout=subprocess.DEVNULL, stderr=stderr, text=True,
            )  # fmt: skip
        _wait_for_checkpoint(child, out / "checkpoint-2", log)
        os.killpg(child.pid, signal.SIGKILL)  # the trainer and its rollout-worker child
        child.wait()
        for later in out.glob("checkpoint-*"):
            if later.name != "checkpoint-2":
                shutil.rmtree(later)
        trained_1 = _observed(observed_1, up_to=2)
        done_2 = _declared_done(out / "checkpoint-2")
        assert done_2 == trained_1, (
            f"checkpoint-2 calls done groups that never reached the loss: {sorted(done_2 - trained_1)}; "
            f"trained but not done: {sorted(trained_1 - done_2)}"
        )

        proc = run_cli("tests/loss_observer.py", str(observed_2), *args[:-1], "4", timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "Exact resume from" in proc.stderr
        # next to the busy local server the trainer leaves it the other core (16 s a step here with 2 threads)
        assert "torch runs on 1 thread" in proc.stderr, proc.stderr[-3000:]
        first_sync, worker_start = proc.stderr.find("Weight sync 1:"), proc.stderr.find("spawned child")
        assert 0 <= first_sync < worker_start, (
            "resumed weights must reach the server before generation starts"
        )
        summary = json.loads((out / "run_summary.json").read_text())
        assert summary["global_step"] == 4 and summary["resumed_from"].endswith("checkpoint-2")
        trained_2 = _observed(observed_2, up_to=4)
        assert trained_2 and not trained_1 & trained_2, f"trained twice: {sorted(trained_1 & trained_2)}"
        done_4 = _declared_done(out / "checkpoint-4")
        assert done_4 == trained_1 | trained_2, (
            f"checkpoint-4 calls done groups that never reached the loss: {sorted(done_4 - trained_1 - trained_2)}; "
            f"trained but not done: {sorted((trained_1 | trained_2) - done_4)}"
        )
        positions = _positions(out)
        assert len(positions) == len(set(positions)) and set(positions) == trained_1 | trained_2
        history = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
        assert any("sample/staleness_mean" in h and "perf/rollout_wait_s" in h for h in history)
    finally:
        _restore_server_weights(vllm_server, tiny_model)


@pytest.mark.timeout(600)  # a long test: about a third of this here
@pytest.mark.vllm
@pytest.mark.slow
def test_async_resume_runs_past_four_epochs_of_a_small_prompt_set(vllm_server, tiny_model, tmp_path):
    """Two prompts, resumed after step 1 and trained for more than four passes over them: no IndexError in
    a callback, every stream position trained at most once (the record lists every position trained after the
    resume, repeats included). Then a resume with a max_completion_length that makes the over-long filter drop
    the long prompt (positions would mean other prompts) is refused."""
    url = vllm_server.base_url.removesuffix("/v1")
    # one short prompt and one of about 100 tokens: both fit max_completion_length 16 in the server's 512,
    # only the short one fits 450
    long_question = "Read the question twice before you answer it. " * 10 + "What is 3 + 4?"
    rows = [{"prompt": [{"role": "user", "content": "What is 17 + 18?"}], "solution": "35"},
            {"prompt": [{"role": "user", "content": long_question}], "solution": "7"}]  # fmt: skip
    data = tmp_path / "two.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = tmp_path / "two.yaml"
    recipe.write_text((REPO / ASYNC).read_text().replace("data/tiny/arith_prompts.jsonl", str(data)))
    out = tmp_path / "epochs"
    args = ["grpo.py", "--config", str(recipe), "--vllm_server_base_url", url, "--output_dir", str(out),
            "--max_staleness", "100", "--save_steps", "1", "--max_steps"]  # fmt: skip
    try:
        first = run_cli(*args, "1", timeout=600)
        assert first.returncode == 0, first.stderr[-4000:]
        # the child's samples the trainer never read must not hold its exit (TRL waits 15 s, then terminates it)
        assert "Stopping AsyncRolloutWorker" in first.stderr and "did not exit" not in first.stderr, (
            first.stderr[-3000:]
        )
        resumed = run_cli(*args, "5", timeout=600)
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        assert "Exact resume from" in resumed.stderr
        positions = _positions(out)
        assert len(positions) == len(set(positions)), "a stream position was trained twice"
        assert len(positions) > 4 * 2 + 2, f"the resumed run must go past four epochs: {sorted(positions)}"
        done = _declared_done(out / "checkpoint-5")
        assert set(positions) <= done

        # #15 item 5: positions index the filtered prompt stream; a resume whose stream differs is refused.
        (out / "trained_groups.jsonl").rename(out / "kept.jsonl")
        # --allow_config_change passes the run fingerprint (it would refuse the changed key first); the stream
        # check must still refuse
        changed = run_cli(
            *args, "6", "--max_completion_length", "450", "--resume_from_checkpoint", "last", "--allow_config_change",
            timeout=600,
        )  # fmt: skip
        assert changed.returncode == 2, changed.stderr[-3000:]
        assert "Dropped 1 of 2 prompts" in changed.stderr
        last = changed.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and "max_completion_length was 16, now 450" in last, last
        assert "Traceback" not in changed.stderr
        assert not (out / "trained_groups.jsonl").exists(), "a refused resume trained"
    finally:
        _restore_server_weights(vllm_server, tiny_model)


def _complete(base: str, max_tokens: int) -> dict:
    """One plain completion from the shared server, every token forced (ignore_eos)."""
    body = {"model": "tiny", "prompt": "Count with me: one, two,", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 1.0, "return_token_ids": True}  # fmt: skip
    request = urllib.request.Request(
        base + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())["choices"][0]


def _wait_until_generating(base: str, all_done=lambda: False, bound_s: float = 60) -> bool:
    """Poll the server's Prometheus ``/metrics`` until it runs a request (bounded: a failure guard), so that a
    pause that follows lands mid-generation on a fast machine and a loaded one alike (a fixed sleep did not: CI saw
    every request finished, or not yet admitted, at the pause). False when ``all_done()`` says every request the
    caller sent has finished first (CI saw a whole batch of the tiny model end between two polls)."""
    deadline = time.monotonic() + bound_s
    seen = {}
    while time.monotonic() < deadline:
        with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
            metrics = response.read().decode()
        running = re.findall(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)$", metrics, re.MULTILINE)
        if any(float(value) > 0 for value in running):
            return True
        if all_done():
            return False
        for name in ("num_requests_running", "num_requests_waiting", "num_requests_swapped"):
            seen[name] = re.findall(rf"^vllm:{name}\{{[^}}]*\}} ([0-9.]+)$", metrics, re.MULTILINE)
        time.sleep(0.01)
    # What the server said last (a paused server keeps requests waiting; an idle one shows none at all).
    pytest.fail(
        f"the server ran no request within {bound_s} s; last /metrics: {seen}, paused: {server_paused(base)}"
    )


def _post_server(base: str, path: str) -> str:
    request = urllib.request.Request(base + path, data=b"{}", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read().decode()


@pytest.mark.vllm
def test_file_weight_sync_during_generation_aborts_no_request(vllm_server, tiny_model, tmp_path):
    """#15 item 2: a weight sync while requests are in flight lets every one of them finish whole (vLLM 0.32's
    bare /pause aborts them: HTTP 200, finish_reason "abort", a cut-off completion that TRL would score)."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoModelForCausalLM

    from dna_factory.async_grpo.weight_sync import FileWeightTransfer

    base, length, n = vllm_server.base_url.removesuffix("/v1"), 480, 24
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    transfer = FileWeightTransfer(
        base,
        tmp_path / "weights",
        config_dir=tiny_model,
        tie_word_embeddings=model.config.tie_word_embeddings,
    )
    transfer.init_weight_transfer()
    try:
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(_complete, base, length) for _ in range(n)]
            _wait_until_generating(base)
            in_flight = sum(not f.done() for f in futures)
            transfer.pause()
            transfer.send_weights(iter(model.state_dict().items()))
            transfer.resume()
            choices = [f.result() for f in futures]
        assert in_flight > 0, "no request was in flight during the sync: the test proves nothing, lengthen it"
        assert [c["finish_reason"] for c in choices] == ["length"] * n
        assert [len(c["token_ids"]) for c in choices] == [length] * n
    finally:
        _restore_server_weights(vllm_server, tiny_model)


class _TrainerFailed(Exception):
    pass


@pytest.mark.vllm
@pytest.mark.parametrize("failure", [_TrainerFailed, KeyboardInterrupt, "destroy"])
def test_a_weight_sync_that_fails_after_the_pause_leaves_the_server_resumed(
    vllm_server, tiny_model, tmp_path, failure
):
    """A trainer that stops between TRL's pause() and resume() must not leave the server paused: every later
    request to it would wait for ever (CI at stop 19 hung 40 min on a server a test's trainer left paused).
    TRL 1.16 calls resume() only after send_weights() returned, and destroy() from its training loop's finally."""
    from dna_factory.async_grpo.weight_sync import FileWeightTransfer

    base = vllm_server.base_url.removesuffix("/v1")
    transfer = FileWeightTransfer(base, tmp_path / "weights", config_dir=tiny_model)
    transfer.init_weight_transfer()

    def failing():
        raise failure("the trainer failed while it gathered its weights")
        yield

    try:
        transfer.pause()
        assert server_paused(base)
        if (
            failure == "destroy"
        ):  # an exception between send_weights() and resume(): TRL's finally calls destroy()
            transfer.destroy()
        else:
            with pytest.raises(failure, match="gathered its weights"):
                transfer.send_weights(failing())
        assert not server_paused(base), "the failed weight sync left the server paused"
        assert _complete(base, 4)["finish_reason"] == "length"
    finally:
        _restore_server_weights(vllm_server, tiny_model)


def test_trl_cold_sync_comes_before_the_rollout_worker_canary():
    """A run killed between a weight sync's /pause and /resume leaves its server paused; the next async run is not
    stuck on it because TRL 1.16 makes a cold weight sync (pause, send, resume) at train begin, before the rollout
    worker starts (dna_factory/async_grpo/weight_sync.py relies on it)."""
    from trl.experimental.async_grpo import async_grpo_trainer as module

    source = inspect.getsource(module._TrainBeginCallback.on_train_begin)
    assert 0 <= source.index("self._trainer._sync_weight()") < source.index("rollout_worker.start()")
    for name, client in (("_sync_weight_merged", "weight_transfer"), ("_sync_weight_lora", "vllm_client")):
        sync = inspect.getsource(getattr(module.AsyncGRPOTrainer, name))
        assert 0 <= sync.index(f"{client}.pause()") < sync.index(f"{client}.resume()"), name


@pytest.mark.vllm
def test_rollout_child_resubmits_a_completion_the_server_aborted(vllm_server):
    """#15 item 2: a completion vLLM aborts (here a bare /pause, vLLM's mode=abort) is never handed to scoring:
    the rollout child's request comes back whole after a resubmission, counted in rollout/aborted_total."""
    import asyncio
    from collections import defaultdict

    import aiohttp

    from dna_factory.async_grpo.rollout_child import RolloutLoop

    base, length, n = vllm_server.base_url.removesuffix("/v1"), 480, 16
    body = {"model": "tiny", "prompt": "Count with me: one, two,", "max_tokens": length, "ignore_eos": True,
            "temperature": 1.0, "return_token_ids": True}  # fmt: skip

    async def scenario():
        loop = object.__new__(RolloutLoop)  # only what TRL's _post and _retry use
        loop.vllm_server_url, loop._counters = base, defaultdict(float)
        async with aiohttp.ClientSession() as session:
            loop.session = session
            # A batch the server ends before the pause lands (a fast tiny model, a loaded machine: between two
            # polls, or between the last poll and /pause) proves nothing: it is sent again, larger (a longer queue
            # behind --max-num-seqs 16 keeps the server busy for longer); at most three rounds.
            for count in (n, 2 * n, 4 * n):
                requests = [
                    asyncio.create_task(loop._post("/v1/completions", body, 300)) for _ in range(count)
                ]
                generating = await asyncio.to_thread(
                    _wait_until_generating, base, lambda batch=requests: all(r.done() for r in batch)
                )
                in_flight = sum(not r.done() for r in requests)
                if generating and in_flight:
                    await asyncio.to_thread(_post_server, base, "/pause")  # vLLM's default: mode=abort
                    await asyncio.to_thread(_post_server, base, "/resume")
                contents = await asyncio.gather(*requests)
                if loop._counters.get("rollout/aborted_total", 0) >= 1:
                    break
            return contents, dict(loop._counters), in_flight, count

    contents, counters, in_flight, count = asyncio.run(scenario())
    assert in_flight > 0, "every request finished before the abort: the test proves nothing, lengthen it"
    choices = [content["choices"][0] for content in contents]
    assert [c["finish_reason"] for c in choices] == ["length"] * count
    assert [len(c["token_ids"]) for c in choices] == [length] * count
    assert counters.get("rollout/aborted_total", 0) >= 1, "no request was aborted: the test proves nothing"


# ----------------------------------------------------------------------------------------- no hang, ever (#19 item 3)


def _spawn_async_run(url: str, tmp_path, *extra: str) -> tuple[subprocess.Popen, Path]:
    """``grpo.py`` on the async tiny recipe in its own session, stderr to a file (not a pipe); ``(child, log)``."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    args = ["grpo.py", "--config", ASYNC, "--vllm_server_base_url", url, "--output_dir", str(out), *extra]
    with open(log, "w") as stderr:
        child = subprocess.Popen(
            [sys.executable, *args], cwd=REPO, env=cli_env(OMP_NUM_THREADS="1"), start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=stderr, text=True,
        )  # fmt: skip
    return child, log


def _ended_with_one_error_line(
    child: subprocess.Popen, log: Path, before: int, cause: str, bound_s: float = 120
) -> tuple[int, str]:
    """Wait (bounded: a failure guard, not a speed target) for the trainer to end after ``cause``; its exit status
    and last line, asserting the line is an ``error:`` and that no traceback was printed after ``before``."""
    try:
        code = child.wait(timeout=bound_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the trainer still runs {bound_s} s after {cause}: {log.read_text()[-3000:]}")
    after = log.read_text()[before:]
    last = after.strip().splitlines()[-1]
    assert code != 0 and last.startswith("error: ") and "Traceback" not in after, after[-3000:]
    return code, last


def _kill_session(child: subprocess.Popen) -> None:
    if child.poll() is None:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def _assert_gone_within(pid: int, why: str, bound_s: float = 15) -> None:
    """``pid`` ends within ``bound_s`` (a failure guard, not a speed target)."""
    deadline = time.time() + bound_s
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not _alive(pid), why


def _end_session(child: subprocess.Popen) -> None:
    """SIGKILL the run's whole session: an orphaned child of a failed run too."""
    child.poll()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)


def _rollout_pid_after_first_checkpoint(child, log: Path, tmp_path: Path) -> int:
    """Wait for the run's checkpoint-1; the pid of its rollout child, from the trainer's log."""
    _wait_for_checkpoint(child, tmp_path / "run" / "checkpoint-1", log)
    found = re.search(r"spawned child pid=(\d+)", log.read_text())
    assert found, log.read_text()[-3000:]
    return int(found.group(1))


@pytest.mark.vllm
@pytest.mark.slow
def test_a_dead_rollout_child_stops_the_trainer_with_one_error_line(vllm_server, tiny_model, tmp_path):
    """#19 item 3: the rollout child killed mid-run (after checkpoint-1) ends the trainer, non-zero, within a bound,
    with one error line naming the child and its death. TRL 1.16 alone notices only when the heartbeat is stale
    (heartbeat_stale_after_s, 300 s) and then its stop() can block for ever on the dead child's Event."""
    child, log = _spawn_async_run(
        vllm_server.base_url.removesuffix("/v1"), tmp_path, "--save_steps", "1", "--max_steps", "100"
    )
    try:
        rollout_pid = _rollout_pid_after_first_checkpoint(child, log, tmp_path)
        before = len(log.read_text())
        os.kill(rollout_pid, signal.SIGKILL)
        _, last = _ended_with_one_error_line(child, log, before, "its rollout child died")
        assert f"pid {rollout_pid}" in last and "SIGKILL" in last, last
    finally:
        _kill_session(child)
        _restore_server_weights(vllm_server, tiny_model)


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie, dead but not yet reaped by its new parent, does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.vllm
@pytest.mark.slow
def test_the_rollout_child_dies_with_a_trainer_killed_outright(vllm_server, tiny_model, tmp_path):
    """#35 item 5: SIGKILL to the trainer alone (not its process group; an OOM kill or a native crash looks the
    same) used to leave its rollout child re-parented to PID 1, generating against the server for ever."""
    child, log = _spawn_async_run(
        vllm_server.base_url.removesuffix("/v1"), tmp_path, "--save_steps", "1", "--max_steps", "100"
    )
    try:
        rollout_pid = _rollout_pid_after_first_checkpoint(child, log, tmp_path)
        assert _alive(rollout_pid)
        os.kill(child.pid, signal.SIGKILL)
        _assert_gone_within(rollout_pid, "the rollout child outlived its trainer")
    finally:
        _end_session(child)
        _restore_server_weights(vllm_server, tiny_model)


@pytest.mark.vllm
@pytest.mark.slow
def test_ctrl_c_saves_stops_the_rollout_child_and_prints_one_line(vllm_server, tiny_model, tmp_path):
    """#35 item 6: Ctrl-C (SIGINT to the whole foreground group, as a terminal sends it: the trainer and its
    rollout child) during async training saves a checkpoint, stops the child and ends with one "interrupted:" line
    naming the resume command, exit 130, no traceback."""
    child, log = _spawn_async_run(
        vllm_server.base_url.removesuffix("/v1"), tmp_path, "--save_steps", "1", "--max_steps", "100"
    )
    try:
        rollout_pid = _rollout_pid_after_first_checkpoint(child, log, tmp_path)
        os.killpg(child.pid, signal.SIGINT)
        status = child.wait(timeout=180)
        text = log.read_text()
        last = text.strip().splitlines()[-1]
        assert status == 130, text[-3000:]
        assert last.startswith("interrupted: ") and "To resume, rerun: " in last and "saved " in last, last
        assert "Traceback" not in text, text[-3000:]
        saved = re.search(r"saved (\S+checkpoint-\d+)", last)
        assert saved and (Path(saved.group(1)) / "rollout_state.json").is_file(), last
        _assert_gone_within(rollout_pid, "the rollout child outlived Ctrl-C")
    finally:
        _end_session(child)
        _restore_server_weights(vllm_server, tiny_model)


@pytest.mark.vllm
@pytest.mark.slow
def test_a_rollout_child_killed_during_its_start_up_is_one_error_line(vllm_server, tiny_model, tmp_path):
    """#19 item 3: TRL 1.16 reports a child that died before it was ready as a RuntimeError traceback (exit 1);
    here it is one error line naming the death. The child needs tens of seconds to import torch, transformers,
    TRL and vLLM, so it is killed right after it was spawned."""
    child, log = _spawn_async_run(vllm_server.base_url.removesuffix("/v1"), tmp_path, "--max_steps", "3")
    try:
        deadline = time.time() + 400
        while not (found := re.search(r"spawned child pid=(\d+)", log.read_text())):
            assert child.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        before = len(log.read_text())
        os.kill(int(found.group(1)), signal.SIGKILL)
        code, last = _ended_with_one_error_line(child, log, before, "its rollout child died")
        assert code == 2 and "SIGKILL" in last and "did not start" in last, last
    finally:
        _kill_session(child)


class _TcpProxy:
    """A real TCP relay in front of the shared server; ``down()`` closes it like a crashed server (refused)."""

    def __init__(self, upstream_port: int):
        import socket

        self.socket = socket
        self.upstream_port = upstream_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.connections: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
                upstream = self.socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                return
            self.connections += [client, upstream]
            for source, target in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, target), daemon=True).start()

    def _pipe(self, source, target) -> None:
        try:
            while data := source.recv(65536):
                target.sendall(data)
        except OSError:
            pass
        finally:
            self._close(source, target)

    def _close(self, *sockets) -> None:
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(self.socket.SHUT_RDWR)
            sock.close()

    def down(self) -> None:
        self._close(self.server, *self.connections)
        self.connections = []

    def up(self) -> None:
        """Listen again on the same port: the server is back."""
        self.server = self.socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()


@pytest.mark.vllm
@pytest.mark.slow
def test_a_server_that_goes_down_mid_run_stops_the_trainer_with_one_error_line(
    vllm_server, tiny_model, tmp_path
):
    """#19 item 3: the vLLM server gone mid-run (a crashed engine: every connection refused) ends the trainer,
    non-zero, within a bound, with one error line naming the server. TRL 1.16 alone retries each request 30 times
    (back-off up to 16 s) while the rollout child's heartbeat stays fresh."""
    from urllib.parse import urlparse

    proxy = _TcpProxy(urlparse(vllm_server.base_url).port)
    url = f"http://127.0.0.1:{proxy.port}"
    child, log = _spawn_async_run(
        url, tmp_path, "--save_steps", "1", "--max_steps", "100", "--server_down_after_s", "10",
        "--server_probe_interval_s", "1",
    )  # fmt: skip
    try:
        _wait_for_checkpoint(child, tmp_path / "run" / "checkpoint-1", log)
        before = len(log.read_text())
        proxy.down()
        _, last = _ended_with_one_error_line(child, log, before, "its server went down", bound_s=120)
        assert last.startswith(f"error: The vLLM server at {url}"), last
    finally:
        proxy.down()
        _kill_session(child)
        _restore_server_weights(vllm_server, tiny_model)


WATCHDOG_SCENARIO = """
import http.server, sys, threading, time
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker
from dna_factory.async_grpo import rollout_watchdog
from dna_factory.async_grpo.rollout_watchdog import RolloutWatchdog, WatchdogTimeouts
from dna_factory.errors import DnaServiceError

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass

servers = []
def up(port=0):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    servers.append(server)
    return server.server_address[1]
def down():
    server = servers.pop()
    server.shutdown()
    server.server_close()

port = up()
rollout_watchdog.POLL_S = 0.1
worker = AsyncRolloutWorker(vllm_server_url=f"http://127.0.0.1:{port}")
worker._heartbeat_value.value = time.time() + 3600  # no child here: TRL's own heartbeat check stays quiet
watchdog = RolloutWatchdog(worker, WatchdogTimeouts(grace_s=2.0, server_down_s=1.0, probe_s=0.2, stop_s=5.0))
threading.Thread(target=watchdog._watch, daemon=True).start()

# 1. an outage past its bound during a long step, over before the loop looks again: forgotten, no stop
with watchdog.progress.busy("a training step"):
    down()
    time.sleep(2.0)
    print("noted:", watchdog.cause is not None, flush=True)
    up(port)
    time.sleep(1.0)
watchdog.check_health(300)
print("rode out:", watchdog.cause is None, flush=True)

# 2. an outage that lasts: a busy loop (a step, a save) is never cut, however long it takes
down()
with watchdog.progress.busy("a checkpoint save"):
    time.sleep(4.5)
print("busy loop kept:", watchdog.cause is not None, flush=True)
try:
    watchdog.check_health(300)
except DnaServiceError as exc:
    print("raised:", exc, flush=True)

# 3. the loop shows no progress after the cause: blocked, so the watchdog ends the process (exit 2)
time.sleep(10)
print("still alive after 10 s", flush=True)
"""


@pytest.mark.timeout(120)
def test_the_watchdog_forgets_an_outage_that_ended_and_stops_only_a_blocked_loop():
    """#35 item 5: the watchdog used to end the process heartbeat_stale_after_s after any cause, in the middle of a
    step or a save, and never forgot a server outage once the server was back. Here a real watchdog thread watches
    a real HTTP server taken down and up again, in its own process, with second-scale keys."""
    proc = subprocess.run(
        [sys.executable, "-c", WATCHDOG_SCENARIO], cwd=REPO, env=cli_env(), capture_output=True, text=True,
        timeout=100,
    )  # fmt: skip
    out, err = proc.stdout, proc.stderr
    assert "noted: True" in out and "rode out: True" in out, out + err[-3000:]
    assert "answers /health again" in err, err[-3000:]
    assert "busy loop kept: True" in out, out + err[-3000:]
    raised = next(line for line in out.splitlines() if line.startswith("raised:"))
    assert "stopped answering /health" in raised and "server_down_after_s=1" in raised, raised
    assert "still alive" not in out and proc.returncode == 2, out + err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err[-3000:]
    assert errors[0].startswith("error: The vLLM server at") and "no progress for 2 s" in errors[0], errors[0]


@pytest.mark.timeout(600)
@pytest.mark.vllm
@pytest.mark.slow
def test_a_server_outage_shorter_than_its_bound_is_ridden_out(vllm_server, tiny_model, tmp_path):
    """#35 item 5: the server down for less than server_down_after_s and back up: the run finishes every step.
    (No weight sync falls in the outage: a sync is one request, not retried; docs/async-grpo.md.)"""
    from urllib.parse import urlparse

    proxy = _TcpProxy(urlparse(vllm_server.base_url).port)
    url = f"http://127.0.0.1:{proxy.port}"
    child, log = _spawn_async_run(
        url, tmp_path, "--save_steps", "1", "--max_steps", "5", "--weight_sync_steps", "1000",
        "--server_down_after_s", "30", "--server_probe_interval_s", "1",
    )  # fmt: skip
    try:
        _wait_for_checkpoint(child, tmp_path / "run" / "checkpoint-1", log)
        proxy.down()
        time.sleep(8)
        proxy.up()
        code = child.wait(timeout=400)
        text = log.read_text()
        assert code == 0, text[-4000:]
        assert json.loads((tmp_path / "run" / "run_summary.json").read_text())["global_step"] == 5
        assert "stopped answering" not in text and "Traceback" not in text, text[-4000:]
    finally:
        proxy.down()
        _kill_session(child)
        _restore_server_weights(vllm_server, tiny_model)
