"""What a run costs before it runs: the cost model ``auto`` chooses a schedule with (``cost``) and ``lean plan`` at
the published sizes on the meta device (``meta``)."""
