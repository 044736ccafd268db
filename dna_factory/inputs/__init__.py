"""What a stage trains on: its datasets, prompts and row lengths, and the tokenizer, loaded and checked in order.

``data``              dataset mixtures: one loader and one normaliser for every stage (S-DATA-1..5)
``data_files``        local dataset files read without ``datasets``, for ``--dry_run``
``prompts``           how prompts reach the model: one rule for every stage that renders them
``row_lengths``       rows measured against the stage's length limit before anything heavy loads
``loading``           a run's parts, in order: the datasets (checked row by row), the tokenizer, the model settings
``preview``           ``--preview [N]``: what the trainer will tokenize, before any model loads
``input_fingerprint`` what a run was trained from beyond its keys: dataset files' contents, the world size
"""
