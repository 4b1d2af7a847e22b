"""How a call is served: `routing` (the fast path), `forwarding` (the router's hot path),
`routed` (a given-back call), `calls` and `leases` (a call and its request lease as they
travel), `consumer` and `batching` (a worker's consumer, and calls sharing passes), `gpu`
(the GPU worker's Celery side), `scaling` (replicas follow load), `checked` (the tasks'
base class) and `status` (the status object).

Imports `tasks.app`, `tasks.broker`, `tasks.config`, `tasks.context`, `worker` and
`placement`.
"""
