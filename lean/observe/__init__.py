"""What a run reports: timers, FLOPs and memory (``metrics``), MLflow (``tracking``), provenance, output files."""
