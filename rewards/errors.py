"""The error a bad ``reward_funcs`` entry raises (rewards' own; ``rewards/`` imports nothing from ``dna_factory``).

The entry scripts print it like their own config errors, one ``error:`` line and exit status 2
(:data:`dna_factory.errors.CONFIG_ERRORS`).
"""


class RewardConfigError(ValueError):
    """A ``reward_funcs`` entry (or a reward's options) that cannot be turned into a reward: "what is wrong. what
    to do."."""
