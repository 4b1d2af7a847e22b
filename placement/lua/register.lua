-- register.lua: a worker takes ownership of its GPUs and sets its host's warm-cache budget.
-- KEYS: every key named in ARGV[1].
-- ARGV[1] = JSON {worker, host, queue, lease_ms, warm_budget, maxlen,
--                 workers, worker_key, gpus_set, hosts, host_key, events,
--                 gpus=[{id, key, index, name, total}]}
-- Returns {1, lease_deadline_ms}
--       | {0, 'OWNED', gpu_id, worker}  another live worker owns the GPU
--       | {0, 'REAP', gpu_id, worker}   a dead worker still owns it: reap that worker first
local a = cjson.decode(ARGV[1])
local now = now_ms()
for _, g in ipairs(a.gpus) do
  local owner = redis.call('HGET', K(g.key), 'worker')
  if owner and owner ~= '' and owner ~= a.worker then
    if num(redis.call('HGET', K(g.key), 'lease_deadline')) > now then
      return {0, 'OWNED', g.id, owner}
    end
    return {0, 'REAP', g.id, owner}
  end
end
local deadline = now + a.lease_ms
local ids = {}
for _, g in ipairs(a.gpus) do
  local key = K(g.key)
  redis.call('HSET', key, 'id', g.id, 'host', a.host, 'index', g.index, 'name', g.name,
    'total', g.total, 'worker', a.worker, 'queue', a.queue, 'lease_deadline', deadline)
  redis.call('HSETNX', key, 'reserved', 0)
  redis.call('SADD', K(a.gpus_set), g.id)
  table.insert(ids, g.id)
end
redis.call('HSET', K(a.worker_key), 'id', a.worker, 'host', a.host, 'queue', a.queue,
  'lease_deadline', deadline, 'gpus', cjson.encode(ids))
redis.call('SADD', K(a.workers), a.worker)
redis.call('HSET', K(a.host_key), 'name', a.host, 'warm_budget', a.warm_budget)
redis.call('HSETNX', K(a.host_key), 'warm_used', 0)
redis.call('SADD', K(a.hosts), a.host)
event(K(a.events), a.maxlen, now, 'registered', '', '', 'worker', a.worker, 'gpus', cjson.encode(ids))
return {1, deadline}
