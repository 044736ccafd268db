"""Multi-stage pipelines: ``python pipeline.py --recipe configs/recipes/<name>.yaml``.

``chain``       one recipe chains stages, each in its own process, stage k's model feeding stage k+1
``recipe``      the recipe: its stages, their overrides and ``${stage}`` references, read and checked
``state``       which stages are done, by what they were trained from
``eval_server`` the shared eval server of a recipe's ``eval_server:``
``report``      the per-stage report as Markdown and JSON, and a PNG of the main curves
"""
