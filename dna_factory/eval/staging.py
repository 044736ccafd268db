"""Checkpoint staging for evaluation (S-EVAL-5).

``on_save`` hard-links the files a server needs (weights, tokenizer, configs, adapter) into
``<output_dir>/_eval_staging/checkpoint-<N>``. A hard link is a second name of the same inode,
so the trainer's checkpoint rotation (``shutil.rmtree``) removes its own name only and the eval
keeps reading; the link costs no data blocks until then. Where linking fails (another
filesystem) the files are copied, with a warning. ``bench/eval_staging.py`` measures both.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

STAGING_DIR = "_eval_staging"
STAGED_SUFFIXES = (".safetensors", ".json", ".txt", ".model", ".jinja", ".tiktoken", ".py")
"""Files a server needs: weights, configs, tokenizer (vocab, merges, sentencepiece), chat template, code."""
TRAINING_STATE = {"trainer_state.json", "rollout_state.json", "zero_to_fp32.py"}
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "adapter_model.bin")


def staged_files(checkpoint: Path) -> list[Path]:
    """The top-level files of ``checkpoint`` a server needs; optimizer, scheduler and RNG state are left out."""
    chosen = []
    for path in sorted(checkpoint.iterdir()):
        if not path.is_file() or path.name in TRAINING_STATE:
            continue
        is_weights_bin = path.suffix == ".bin" and path.name.startswith(("pytorch_model", "adapter_model"))
        if path.suffix in STAGED_SUFFIXES or is_weights_bin:
            chosen.append(path)
    return chosen


def stage_checkpoint(checkpoint: str | os.PathLike[str], staged: str | os.PathLike[str]) -> str:
    """Hard-link (or copy, with a warning) the server's files of ``checkpoint`` into ``staged``.

    Returns ``"link"`` or ``"copy"``. Raises FileNotFoundError when the checkpoint holds no
    model weights (e.g. ZeRO-3 without ``stage3_gather_16bit_weights_on_model_save``).
    """
    checkpoint, staged = Path(checkpoint), Path(staged)
    files = staged_files(checkpoint)
    if not any(p.match(pattern) for p in files for pattern in WEIGHT_PATTERNS):
        raise FileNotFoundError(
            f"{checkpoint} has no model weights to serve (*.safetensors or pytorch_model*.bin). With DeepSpeed "
            "ZeRO-3 set stage3_gather_16bit_weights_on_model_save: true."
        )
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir(parents=True)
    mode = "link"
    for path in files:
        target = staged / path.name
        if mode == "link":
            try:
                os.link(path, target)
                continue
            except OSError as exc:
                mode = "copy"
                logger.warning(
                    "Cannot hard-link %s into %s (%s): copying the checkpoint instead, which takes time and "
                    "disk. Keep %s/ on the filesystem of output_dir.",
                    path,
                    staged,
                    exc.strerror or exc,
                    STAGING_DIR,
                )
        shutil.copy2(path, target)
    return mode


TIED_HEAD_FILE = "lm_head.safetensors"


def write_tied_head(staged: str | os.PathLike[str]) -> bool:
    """Give a staged model with tied embeddings an explicit ``lm_head.weight`` (for an in-place reload).

    ``save_pretrained`` leaves ``lm_head.weight`` out of a tied model's files; a server that loads them
    *in place* (vLLM's ``reload_weights``, :func:`dna_factory.serving.vllm_server.reload_weights`) then keeps its
    old head. This writes the input embeddings again as ``lm_head.weight`` into ``staged/lm_head.safetensors``
    (and into a sharded model's index, which is copied, never edited through its link). Returns whether it
    wrote one: not for untied models, models whose files already hold the head, or ``.bin`` weights.
    """
    # here, not at the top: safetensors.torch imports torch, and the tests import this module to collect
    from safetensors import safe_open
    from safetensors.torch import save_file

    staged = Path(staged)
    config = json.loads((staged / "config.json").read_text()) if (staged / "config.json").is_file() else {}
    tied = config.get(
        "tie_word_embeddings", (config.get("text_config") or {}).get("tie_word_embeddings", False)
    )
    files = sorted(p for p in staged.glob("*.safetensors") if p.name != TIED_HEAD_FILE)
    if not tied or not files:
        return False
    embed = None
    for path in files:
        with safe_open(str(path), framework="pt") as weights:
            names = list(weights.keys())
            if any(n.endswith("lm_head.weight") for n in names):
                return False
            name = next((n for n in names if n.endswith("embed_tokens.weight")), None)
            if name is not None and embed is None:
                embed = weights.get_tensor(name)
    if embed is None:
        return False
    save_file({"lm_head.weight": embed.contiguous()}, str(staged / TIED_HEAD_FILE))
    index = staged / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data.setdefault("weight_map", {})["lm_head.weight"] = TIED_HEAD_FILE
        index.unlink()  # a hard link to the checkpoint's own index: replace it, never write through it
        index.write_text(json.dumps(data, indent=2) + "\n")
    return True
