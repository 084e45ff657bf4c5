"""The DVC workbench's logic (``dvc.yaml``, ``pipelines/``): what a stage needs beyond the library.

``data``          the synthetic task: coloured shapes and the captions that name them
``pretrain``      the offline base model GRPO starts from (``prepare`` stage)
``stage``         a stage's process set-up and run config (``params.yaml``'s run sections + the stage's ``run:``)
``method``        one GRPO iteration taken apart into the rollout -> advantage -> update stages, and their certificate
``side_by_side``  the ``train`` stage's runs, one process each, at once
``notebook``      a notebook's MLflow run, figures and metrics
``reproduction``  the report's check: this run's headline figures against the committed reference, within bands
"""
