"""Tasks: the Celery side, which wires `placement` and `worker` together.

Its parts, each importing only the parts below it (pyproject.toml's import contracts,
docs/architecture.md):

- `operator`: `gpufleet up` (the launcher), the `gpufleet` CLI, the Prometheus exporter;
- `api`: the public tasks (`gpufleet.infer`, `deploy`, `evict`, `status`) and the router's
  half of a call;
- `serving`: how a call is served: routed (the fast path, the router's forwarding), carried
  (calls, leases), batched and run on a GPU worker, scaled, and reported (status);
- `app`: the Celery app;
- `broker`: the transport and what a worker checks and keeps in the broker: intake,
  quarantine, worker presence, the broker's claim, the result backend;
- `config` (Celery's configuration and the queue names) and `context` (per-process
  singletons).
"""
