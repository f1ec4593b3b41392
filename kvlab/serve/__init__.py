"""Serving: continuous batching over one paged cache.

    engine = kvlab.Engine(cfg.model, cfg.cache, params, max_slots=8)   # kvlab.serve.Engine
    outputs = engine.generate(list_of_token_lists, max_new_tokens=32)

scheduler.py is the host half (plain Python and numpy: which request runs in
which slot, on which pages), engine.py the device half (the thin jitted loop
over each Step). The page allocator and the prefix cache they hand pages out
through are the cache's (kvlab/cache/allocator.py, kvlab/cache/prefix.py).
"""

from kvlab.serve.engine import DEFAULT_MAX_LEN, Engine, EngineStats
from kvlab.serve.scheduler import Request, Scheduler, Step

__all__ = ["DEFAULT_MAX_LEN", "Engine", "EngineStats", "Request", "Scheduler", "Step"]
