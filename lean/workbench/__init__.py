"""The DVC workbench's stage logic (``dvc.yaml``, ``pipelines/``): what a stage needs beyond the library.

``stage``     a stage's process set-up and run config (``params.yaml``'s run sections + the stage's ``run:``)
``method``    one GRPO iteration taken apart into the rollout -> advantage -> update stages, and their certificate
``notebook``  a notebook's MLflow run, figures and metrics
``reproduction``  the report's check: this run's headline figures against the committed reference, within bands
"""
