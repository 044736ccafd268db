"""``completions.jsonl``: the prompts, completions, rewards and advantages of every logged GRPO step.

TRL's GRPOTrainer, with ``log_completions: true``, writes each logging step's samples to
``<output_dir>/completions/completions_<step>.parquet`` (and prints a sample table). This callback
appends each such file, as JSON lines, to ``<output_dir>/completions.jsonl`` — one line per sample:
``step``, ``prompt``, ``completion``, one column per reward, ``advantage`` — readable with ``jq`` or
``pandas.read_json(lines=True)``. TRL writes a step's file after the callbacks' ``on_log``, so a file
is appended at the next log or at the end of training; ``completions/mirrored.txt`` names the files
already appended; a resumed run first drops the lines of steps after its checkpoint (they are trained
and logged again).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from transformers import TrainerCallback

from dna_factory.run.run_files import read_jsonl

logger = logging.getLogger(__name__)

FILE_NAME = "completions.jsonl"


class CompletionsLog(TrainerCallback):
    """Appends TRL's per-step completion tables to ``completions.jsonl`` (main process only)."""

    def __init__(self, output_dir: str):
        self.out = Path(output_dir)
        self.folder = self.out / "completions"
        self.ledger = self.folder / "mirrored.txt"

    def _append_new(self) -> None:
        import pandas as pd

        done = set(self.ledger.read_text().split()) if self.ledger.is_file() else set()
        for table in sorted(self.folder.glob("completions_*.parquet")):
            if table.name in done:
                continue
            lines = pd.read_parquet(table).to_json(orient="records", lines=True, force_ascii=False)
            with (self.out / FILE_NAME).open("a", encoding="utf-8") as sink:
                sink.write(lines if lines.endswith("\n") else lines + "\n")
            with self.ledger.open("a", encoding="utf-8") as ledger:
                ledger.write(table.name + "\n")

    def on_train_begin(self, args, state, control, **kwargs):
        """On a resume, drop what was logged after the checkpoint: those steps are trained (and logged) again."""
        if not state.is_world_process_zero or not (self.out / FILE_NAME).is_file():
            return

        kept = [row for row in read_jsonl(self.out / FILE_NAME) if row.get("step", 0) <= state.global_step]
        (self.out / FILE_NAME).write_text(
            "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in kept), encoding="utf-8"
        )
        if self.ledger.is_file():
            names = [
                n
                for n in self.ledger.read_text().split()
                if int(n.split("_")[1].split(".")[0]) <= state.global_step
            ]
            self.ledger.write_text("".join(n + "\n" for n in names))

    def on_log(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.folder.is_dir():
            self._append_new()

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.folder.is_dir():
            self._append_new()
