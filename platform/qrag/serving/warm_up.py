"""What a serving replica does before it answers: load the stored corpora into its shards and run
each corpus's scoring step once per shape, so that no query pays for a load or a CUDA-graph
capture (the state encoder's graphs are captured where the model loads)."""

from __future__ import annotations

import logging
import time

from qrag.index.holder import ShardHolder
from qrag.serving.service_config import ServeConfig

log = logging.getLogger("qrag.serving")

# Q values a request asks for by default (its pick and 3 alternatives): the k warmed.
DEFAULT_K = 4


def warm_holder(holder: ShardHolder, cfg: ServeConfig, fingerprint: str | None = None) -> dict:
    """Preload (``cfg.preload``) and warm (``cfg.warm_up``, GPU shards) ``holder``; what was done."""
    t0 = time.perf_counter()
    corpora = holder.preload(fingerprint) if cfg.preload else []
    shapes = 0
    if cfg.warm_up and holder.device.type == "cuda":
        for name in corpora:
            shapes += holder.warm_scoring(name, cfg.state_batch_size, max(0, cfg.warm_steps - 1), DEFAULT_K)
    out = {"corpora": corpora, "shapes": shapes, "seconds": round(time.perf_counter() - t0, 2)}
    log.info("shard holder %d ready: %s", holder.slot, out)
    return out
