"""Where samples, weights and tokens live: processes and their groups (``distributed``), the launcher (``launch``),
FSDP2 sharding (``sharding``), the group layout (``layout``) and FlashOverlap (``overlap/``)."""
