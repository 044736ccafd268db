"""Learnability filtering: keep the prompts a GRPO run can learn from (S-FILTER-1).

``python -m rewards.filter_tasks --config FILE [--key value ...] [--dry_run]`` draws K rollouts
per prompt, scores them with the recipe's rewards, classes each prompt (see
:mod:`dna_factory.filter.learnability`: ``all_pass``, ``learnable``, ``all_fail``, ``unscored``) and writes,
into ``output_dir``:

- ``scored.jsonl``: one line per prompt as soon as it is scored (class, combined and
  per-function rewards); a rerun skips every prompt already there, so a crash loses at most
  the prompts in flight;
- ``kept.jsonl``: the rows of the classes in ``keep`` (default ``[learnable]``), normalised as
  for GRPO, loadable as a GRPO dataset;
- ``report.json``: counts per class, overall and per dataset label.

It selects training prompts only: no advantage is computed, no parameter is updated. Loading,
normalising and mixing the datasets is :func:`dna_factory.inputs.data.load_mixture` (format ``grpo``);
rewards come from :func:`rewards.registry.resolve_rewards`, exactly as a GRPO recipe gives them.

Example:
    python -m rewards.filter_tasks --config configs/filter_tasks/tiny-cpu.yaml
"""

from dna_factory.filter.recipe import FilterTasksConfig, load_config, validate
from dna_factory.filter.tool import main, run

__all__ = ["FilterTasksConfig", "load_config", "main", "run", "validate"]
