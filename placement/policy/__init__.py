"""The placement policy: pure and deterministic planning over a snapshot of the fleet.

`state` (the frozen values: GPUs, deployments, hosts, plans), `room` (free room by host and
GPU type), `planning` and `fitting` (what a plan weighs, where a replica fits), `sizing`
(a replica's bytes per GPU), `settings` (the policy's knobs), `place` (`plan_replica`:
where one more replica goes and what moves out), `mirror` (a plan applied in memory, as
the ledger's scripts apply it) and `live` (a view kept current as plans commit).

Imports `placement.units` and `placement.errors` only: no Redis, no catalog.
"""
