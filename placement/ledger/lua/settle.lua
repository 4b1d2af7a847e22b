-- settle.lua: the worker that holds a replica reports the GPU work a pending move needed.
-- KEYS: every key named in ARGV[1].
-- ARGV[1] = JSON {replica, worker, epoch, outcome, maxlen, dep, leases, active, changes,
--                 worker_deps, host, host_warm, events, copy_at, gpus=[{id, key}]}
-- outcome:
--   'offloaded'  OFFLOADING -> WARM: the copy is in CPU memory, its device bytes are free;
--                `copy_at` says where the host's other workers may read it ('' nowhere)
--   'dropped'    OFFLOADING or DROPPING -> COLD: the copy is gone
--   'failed'     WAITING or LOADING -> COLD: the load failed; nothing is left on the device
--   'lost'       HOT, DRAINING or WARM -> COLD: the worker does not hold the copy it has
-- Every byte the old level counted is given back in this same call. Request leases on a
-- replica that goes COLD are deleted: their calls are routed again.
-- Returns {1, level now} | {0, 'STALE', level} when the record is not this worker's
-- placement in this epoch, or not at a level the outcome settles.
local a = cjson.decode(ARGV[1])
local dep = K(a.dep)
local r = record(dep)
local level = r.level
if not level then return {0, 'STALE', 'COLD'} end
if r.worker ~= a.worker or r.epoch ~= a.epoch then return {0, 'STALE', level} end
local from = {
  offloaded = {OFFLOADING = true},
  dropped = {OFFLOADING = true, DROPPING = true},
  failed = {WAITING = true, LOADING = true},
  lost = {HOT = true, DRAINING = true, WARM = true},
}
if not from[a.outcome] then error('gpufleet: unknown outcome ' .. tostring(a.outcome)) end
if not from[a.outcome][level] then return {0, 'STALE', level} end
if not same_gpus(r.gpus, a.gpus) then return {0, 'STALE', 'moved'} end
local now = now_ms()
local to = 'COLD'
if a.outcome == 'offloaded' then
  add_gpus(r, a.gpus, 'held', -1)
  redis.call('SADD', K(a.host_warm), a.replica)
  redis.call('HSET', dep, 'level', 'WARM', 'gpus', '{}', 'fraction', 0, 'limit', 0, 'since', now,
    'copy_at', a.copy_at or '')
  to = 'WARM'
else
  to_cold(a, r, now)
end
event(K(a.events), a.maxlen, now, 'settled', a.replica, r.model, 'outcome', a.outcome,
  'was', level, 'worker', r.worker)
return {1, to}
