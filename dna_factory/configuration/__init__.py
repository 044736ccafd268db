"""A stage's configuration, read and checked before anything heavy loads.

``config``       layered, typed configuration: ``_defaults-<stage>.yaml`` < ``--config`` recipe < CLI flags
``config_types`` each key's type from the dataclasses, YAML-aware coercion, unknown-key errors
``validation``   the validators every stage runs before anything heavy loads (and under ``--dry_run``)
``provenance``   where a run came from, for ``run_summary.json``
"""
