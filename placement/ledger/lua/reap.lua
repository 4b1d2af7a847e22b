-- reap.lua: release everything a worker holds, when its lease expired or it shuts down.
-- KEYS: every key named in ARGV[1].
-- ARGV[1] = JSON {worker, force (bool), maxlen, workers, worker_key, worker_deps, control,
--                 gpus_set, events, own=[{id, key}] (the GPUs it owns),
--                 contexts=[{id, key}] (the GPUs it keeps a CUDA context on, commit.lua),
--                 deps=[{replica, dep, leases, active, changes, host, host_warm,
--                        gpus=[{id, key}]}]}
-- `deps` must be exactly the worker's deployment set and `contexts` its context list.
-- Every deployment goes COLD, whatever its level (pending moves included), and its GPU
-- bytes (`reserved` and `held`), warm-cache bytes and request leases are released, and so
-- are its contexts' bytes; the worker's GPUs lose their owner, and GPU records left with
-- no owner and no bytes are removed, with its control list.
-- Returns {1, deployments released} | {0, 'ALIVE'} | {0, 'GONE'} | {0, 'STALE', detail}
local a = cjson.decode(ARGV[1])
local wkey = K(a.worker_key)
local now = now_ms()
if redis.call('EXISTS', wkey) == 0 then return {0, 'GONE'} end
if not a.force and num(redis.call('HGET', wkey, 'lease_deadline')) > now then
  return {0, 'ALIVE'}
end
local members = redis.call('SMEMBERS', K(a.worker_deps))
if #members ~= #a.deps then return {0, 'STALE', 'deployment set changed'} end
local contexts = contexts_of(wkey)
if #contexts ~= #a.contexts then return {0, 'STALE', 'context list changed'} end
for i, id in ipairs(contexts) do
  if a.contexts[i].id ~= id then return {0, 'STALE', 'context list changed'} end
end
local records = {}
for i, d in ipairs(a.deps) do
  if redis.call('SISMEMBER', K(a.worker_deps), d.replica) == 0 then
    return {0, 'STALE', 'deployment set changed'}
  end
  records[i] = record(K(d.dep))
  if not same_gpus(records[i].gpus, d.gpus) then return {0, 'STALE', d.replica .. ' moved'} end
end
local touched = {}
local events = K(a.events)
for i, d in ipairs(a.deps) do
  local r = records[i]
  d.worker_deps = a.worker_deps
  to_cold(d, r, now)
  for _, ref in ipairs(d.gpus) do touched[ref.id] = ref.key end
  event(events, a.maxlen, now, 'released', d.replica, r.model, 'worker', a.worker, 'was', r.level)
end
for _, c in ipairs(a.contexts) do
  local key = K(c.key)
  local bytes, joined = unpack(redis.call('HMGET', key, 'ctx:' .. a.worker,
    'ctx_held:' .. a.worker))
  if bytes then
    redis.call('HINCRBY', key, 'reserved', -num(bytes))
    if joined then redis.call('HINCRBY', key, 'held', -num(bytes)) end
    redis.call('HDEL', key, 'ctx:' .. a.worker, 'ctx_held:' .. a.worker,
      'ctx_wait:' .. a.worker)
  end
  redis.call('HDEL', key, 'ctx_pending:' .. a.worker)  -- declared while the GPU was gone
  touched[c.id] = c.key
end
for _, g in ipairs(a.own) do
  if redis.call('HGET', K(g.key), 'worker') == a.worker then
    redis.call('HSET', K(g.key), 'worker', '', 'queue', '', 'lease_deadline', 0)
  end
  touched[g.id] = g.key
end
for id, key in pairs(touched) do
  local worker, reserved, held = unpack(redis.call('HMGET', K(key), 'worker', 'reserved', 'held'))
  if (worker or '') == '' and num(reserved) == 0 and num(held) == 0 then
    redis.call('DEL', K(key))
    redis.call('SREM', K(a.gpus_set), id)
  end
end
redis.call('DEL', K(a.worker_deps), wkey, K(a.control))
redis.call('SREM', K(a.workers), a.worker)
local cause = 'expired'
if a.force then cause = 'shutdown' end
event(events, a.maxlen, now, 'reaped', '', '', 'worker', a.worker, 'cause', cause)
return {1, #a.deps}
