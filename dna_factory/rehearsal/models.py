"""The rehearsal's stand-in for a model: a small local model as it is, else the real config scaled down
(real tokenizer and chat template) when the Hub answers or the folder is local, else the offline twin
of :data:`~dna_factory.rehearsal.twins.MODEL_TWINS`."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from dna_factory.errors import DnaConfigError
from dna_factory.rehearsal.twins import MODEL_TWINS, REPO

SCALED_ROOT = REPO / "artifacts" / "rehearsal" / "models"
SMALL = {"hidden_size": 256, "num_hidden_layers": 4}
"""A local model folder at most this size is used as it is (a tiny twin, a previous rehearsed stage)."""

SHRINK = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "max_window_layers": 2,
    "num_nextn_predict_layers": 0,
}
"""Config keys a scaled-down twin sets, where the real config has them (the rest is the real config)."""


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _hub_reachable(repo_id: str, repo_type: str = "model", timeout_s: float = 5.0) -> bool:
    """Whether the Hub answers for ``repo_id`` now (huggingface_hub's own offline flag, token and endpoint)."""
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE or (repo_type == "dataset" and _truthy("HF_DATASETS_OFFLINE")):
        return False
    try:
        HfApi().repo_info(repo_id, repo_type=repo_type, timeout=timeout_s)
        return True
    except Exception:  # noqa: BLE001 - any failure (offline, DNS, 401, 404) means: use the offline table
        return False


def _is_small(folder: Path) -> bool:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return True  # an adapter folder or something transformers will explain; leave it alone
    config = config.get("text_config", config)
    return all(int(config.get(k) or 0) <= limit for k, limit in SMALL.items())


def scaled_down_model(source: str, out_root: Path = SCALED_ROOT) -> Path:
    """A randomly initialised model of ``source``'s architecture at toy scale, with ``source``'s own tokenizer.

    ``source`` is a Hub id or a local folder; its config is read (not its weights), the keys of
    :data:`SHRINK` it has are set small, and the result is saved with the real tokenizer and chat
    template into ``out_root/<source>``. Rebuilt whenever the scaled config or the tokenizer changes.
    """

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(source)
    data = config.to_dict()
    text = data.get("text_config") or data
    for key, value in SHRINK.items():
        if text.get(key) is not None:
            text[key] = value
    if text.get("layer_types"):
        text["layer_types"] = list(text["layer_types"])[: text["num_hidden_layers"]]
    if text.get("mlp_only_layers"):
        text["mlp_only_layers"] = []
    config = type(config).from_dict(data)
    tokenizer = AutoTokenizer.from_pretrained(source)
    fingerprint = hashlib.sha256(
        json.dumps(
            [config.to_dict(), tokenizer.chat_template, sorted(tokenizer.get_vocab().items())],
            sort_keys=True,
            default=str,
        ).encode()
    ).hexdigest()
    local = Path(source).expanduser()
    key = str(local.resolve()) if local.is_dir() else f"hub/{source}"
    out = Path(out_root) / key.strip("/").replace("/", "__")
    stamp = out / "rehearsal_twin.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("fingerprint") == fingerprint:
        return out
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    stamp.write_text(json.dumps({"source": str(source), "fingerprint": fingerprint}) + "\n")
    return out


def rehearsal_model(name: str) -> tuple[str, str] | None:
    """The stand-in for model ``name`` and why, or None to keep ``name`` (already a small local model)."""
    local = Path(name)
    if local.is_dir():
        if _is_small(local):
            return None
        return str(scaled_down_model(name)), "local full-size model, config scaled down (real tokenizer)"
    if _hub_reachable(name):
        return str(scaled_down_model(name)), "Hub config scaled down, real tokenizer and chat template"
    twin = MODEL_TWINS.get(name)
    if twin is None:
        raise DnaConfigError(
            f"--rehearse: the Hub cannot be reached and {name} has no offline twin. Add one to MODEL_TWINS in "
            "dna_factory/rehearsal/twins.py, or rehearse with Hub access (its config is scaled down)."
        )
    if not (twin.path / "config.json").is_file():
        raise DnaConfigError(
            f"--rehearse: the offline twin of {name} ({twin.path}) is not built. Run `{twin.build_command}`."
        )
    return str(twin.path), f"offline tiny {twin.family} twin (same chat template)"
