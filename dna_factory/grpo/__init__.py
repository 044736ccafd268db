"""GRPO on TRL's GRPOTrainer (``python grpo.py``): the stage (``stage.py``), its keys and the reward
checks both GRPO variants share (``keys.py``), DAPO dynamic sampling (``dynamic_sampling.py``), the
learning alarms and completions log, and the answer-format warning. ``grpo_execution: async`` selects
the variant in :mod:`dna_factory.async_grpo`. See docs/grpo.md.
"""
