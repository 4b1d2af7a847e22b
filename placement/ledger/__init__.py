"""The ledger: the fleet's state in Redis, changed only by the Lua scripts in `lua/`.

`endpoint` (where the fleet's Redis is: one server or Sentinels, and its clients), `keys`
(every key, under one hash tag per fleet), `scripts` (the Lua scripts, registered once
per client), `store` (one client, plain reads), `records` (Redis records as the
policy's values), `membership` (workers and their leases), `registry` (placements,
evictions, request leases), `hot` (the fast path's leases, and the router's one-step
forward), `follow` (the router's view, kept current from the events
stream), `load` (each model's load), `figures/` (what generating calls and the model
cache measured, kept as counters beside the ledger), `audit` (the ledger's invariants)
and `report` (the status object).

Imports `placement.rules`, `placement.policy` and `placement.errors` (the layers allow
`placement.catalog` and `placement.units` too).
"""
