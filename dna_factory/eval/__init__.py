"""Checkpoint evaluation (``eval_on_checkpoint: true``, any stage): the keys and start-up checks
(``keys.py``, torch-free), checkpoint staging (``staging.py``), the TrainerCallback (``callback.py``),
the Inspect AI harness process (``harness.py``) and our offline tasks (``tasks.py``).
See docs/checkpoint-eval.md.
"""
