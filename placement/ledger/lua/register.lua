-- register.lua: a worker takes ownership of its GPUs and sets its host's warm-cache budget.
-- KEYS: every key named in ARGV[1].
-- ARGV[1] = JSON {worker, host, queue, lineage, process, domain, lease_ms, warm_budget,
--                 maxlen, workers, worker_key, gpus_set, hosts, host_key, events,
--                 gpus=[{id, key, index, name, total, context}], contexts=[{id, key}]}
-- `context` is the bytes one more process's CUDA context takes on the GPU: what a plan
-- loaded by a worker that does not own it is charged there (commit.lua). `contexts` are
-- GPUs of other workers on which this process still keeps a context (it registers again
-- after its lease was lost and reaped): each is charged now, in `reserved` and `held`,
-- even past the GPU's total, since the context is there. A GPU whose record is gone (its
-- owner was reaped too, and nothing held it) is charged once its owner registers it
-- again: until then its record keeps `ctx_pending:<worker>`.
-- `lineage` names the slot a worker process fills (a pool, or a launcher's worker slot):
-- a live owner of the same lineage is a predecessor this process replaces.
-- `process` is the worker's process identity (JSON, opaque here: `worker.identity`), which a
-- host started again reads to tell a dead predecessor from a live one. `domain` ('' none)
-- goes on each GPU: workers of one domain may read each other's warm copies.
-- Returns {1, lease_deadline_ms}
--       | {0, 'OWNED', gpu_id, worker, lineage}  a live worker of another lineage owns it
--       | {0, 'REAP', gpu_id, worker}   a dead worker still owns it: reap that worker first
--       | {0, 'REPLACE', gpu_id, worker}  a live predecessor of the same lineage: release it
local a = cjson.decode(ARGV[1])
local now = now_ms()
for _, g in ipairs(a.gpus) do
  local owner, deadline, lineage = unpack(redis.call('HMGET', K(g.key), 'worker',
    'lease_deadline', 'lineage'))
  if owner and owner ~= '' and owner ~= a.worker then
    if num(deadline) <= now then return {0, 'REAP', g.id, owner} end
    if a.lineage ~= '' and lineage == a.lineage then return {0, 'REPLACE', g.id, owner} end
    return {0, 'OWNED', g.id, owner, lineage or ''}
  end
end
local deadline = now + a.lease_ms
local ids = {}
for _, g in ipairs(a.gpus) do
  local key = K(g.key)
  redis.call('HSET', key, 'id', g.id, 'host', a.host, 'index', g.index, 'name', g.name,
    'total', g.total, 'worker', a.worker, 'queue', a.queue, 'lease_deadline', deadline,
    'lineage', a.lineage, 'context', g.context, 'domain', a.domain or '')
  redis.call('HSETNX', key, 'reserved', 0)
  redis.call('HSETNX', key, 'held', 0)
  for _, field in ipairs(redis.call('HKEYS', key)) do  -- contexts declared while it was gone
    local other = field:match('^ctx_pending:(.+)$')
    if other then
      redis.call('HDEL', key, field)
      if other ~= a.worker and num(g.context) > 0 then
        redis.call('HINCRBY', key, 'reserved', num(g.context))
        redis.call('HINCRBY', key, 'held', num(g.context))
        redis.call('HSET', key, 'ctx:' .. other, num(g.context), 'ctx_held:' .. other, 1)
      end
    end
  end
  redis.call('SADD', K(a.gpus_set), g.id)
  table.insert(ids, g.id)
end
local new_contexts = {}
for _, c in ipairs(a.contexts) do
  local key, field = K(c.key), 'ctx:' .. a.worker
  local owner, context, charged = unpack(redis.call('HMGET', key, 'worker', 'context', field))
  if owner and owner ~= a.worker and num(context) > 0 and not charged then
    redis.call('HINCRBY', key, 'reserved', num(context))
    redis.call('HINCRBY', key, 'held', num(context))
    redis.call('HSET', key, field, num(context), 'ctx_held:' .. a.worker, 1)
    table.insert(new_contexts, c.id)
  elseif not owner then  -- its record is gone: charged when its owner registers it
    redis.call('HSET', key, 'ctx_pending:' .. a.worker, 1)
    table.insert(new_contexts, c.id)
  end
end
redis.call('HSET', K(a.worker_key), 'id', a.worker, 'host', a.host, 'queue', a.queue,
  'lease_deadline', deadline, 'gpus', cjson.encode(ids), 'lineage', a.lineage,
  'process', a.process or '')
list_contexts(K(a.worker_key), new_contexts)
redis.call('SADD', K(a.workers), a.worker)
redis.call('HSET', K(a.host_key), 'name', a.host, 'warm_budget', a.warm_budget)
redis.call('HSETNX', K(a.host_key), 'warm_used', 0)
redis.call('SADD', K(a.hosts), a.host)
event(K(a.events), a.maxlen, now, 'registered', '', '', 'worker', a.worker, 'gpus', cjson.encode(ids))
return {1, deadline}
