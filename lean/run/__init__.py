"""One training iteration and what it steps: the phases (``iteration``), the optimizer step (``optimizer``), the
scoring worker (``scoring``) and preemption."""
