-- admit.lua: a WAITING replica's victims have left the device: WAITING -> LOADING.
-- KEYS: every key named in ARGV[1].
-- ARGV[1] = JSON {replica, worker, epoch, maxlen, dep, events, limit,
--                 gpus=[{id, key, bytes, limit}]}
-- Admitted when every GPU's `held` bytes plus the replica's admission need (and its
-- worker's CUDA context there, when not held yet: unheld_context in _lib.lua) fit its
-- total; they then join `held`. The worker that will load it calls this before loading.
-- Returns {1, 'LOADING'} (also when already admitted) | {0, 'FULL', gpu id}
--       | {0, 'STALE', level} when the record is not this worker's WAITING placement.
local a = cjson.decode(ARGV[1])
local dep = K(a.dep)
local r = record(dep)
local level = r.level
if r.worker ~= a.worker or r.epoch ~= a.epoch then return {0, 'STALE', level or 'COLD'} end
if level == 'LOADING' then return {1, 'LOADING'} end
if level ~= 'WAITING' then return {0, 'STALE', level} end
if not same_gpus(r.gpus, a.gpus) then return {0, 'STALE', 'moved'} end
local unheld = {}
for _, g in ipairs(a.gpus) do
  local c = unheld_context(K(g.key), r.worker)
  unheld[g.id] = c
  if not fits_device({{key = g.key, limit = g.limit + c, bytes = g.bytes + c}}) then
    return {0, 'FULL', g.id}
  end
end
local now = now_ms()
for _, g in ipairs(a.gpus) do
  redis.call('HINCRBY', K(g.key), 'held', g.bytes)
  hold_context(K(g.key), r.worker, unheld[g.id])
end
redis.call('HSET', dep, 'level', 'LOADING', 'since', now)
event(K(a.events), a.maxlen, now, 'admitted', a.replica, r.model, 'worker', r.worker)
return {1, 'LOADING'}
