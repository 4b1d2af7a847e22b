"""Placement: where models live on the fleet's GPUs, and the Redis ledger that says so.

Its parts, each importing only the parts below it (pyproject.toml's import contracts,
docs/architecture.md):

- `simulator`: replays traces through the same policy, against the seeds' policies;
- `config` (every `GPUFLEET_*` setting) and `server` (the bundled redis-server, its users);
- `ledger`: everything that touches Redis: keys, the Lua scripts, the registry, workers'
  membership, the router's followed view, loads, the audit and the status report;
- `catalog`: the model catalog and size estimates;
- `rules`: the fleet's decision rules besides placement: batching and scaling;
- `policy`: the pure placement policy and the state it plans on;
- `units`: memory sizes, durations, GPU types;
- `errors`: the one error hierarchy.

Imports neither `tasks` nor `worker`, and nothing heavy (torch, Celery) at import time.
"""
