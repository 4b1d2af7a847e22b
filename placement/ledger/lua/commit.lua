-- commit.lua: validate a placement plan against the live ledger and apply it atomically.
-- KEYS: every key named in ARGV[1].
-- ARGV[1] = JSON plan:
--   {replica, model, reuse ('' | 'WARM' | 'COLD'), expect_worker, max_active, maxlen,
--    changes_seen (-1, or the model's `changes` count a scale-out was decided at), dep,
--    active, changes, replicas_key, deps_key, worker_deps, worker_key, control, old_worker_deps,
--    host_key, host_warm_key, events, leases, lease ('' or a request lease id), lease_ms,
--    limit, fraction, size, dedicated, accelerator ('' or the GPU types allowed, a JSON
--    list), host, worker, queue, why ('' or the reason), read_from ('' or where a warm
--    copy of another worker lies that the load reads its weights from),
--    gpus=[{id, key, bytes, limit, worker}],
--    evictions=[{replica, dep, leases, active, changes, worker_deps, host, host_warm,
--                control, expect_worker, to, cache (its model's cache hash), gpus=[{id, key}]}],
--    ages (the bucket labels of the eviction-age histogram: `placement.ledger.figures.cache`),
--    drops=[{replica, dep, worker_deps, host, host_warm, control, expect_worker}]}
-- Checks: the replica record is as the plan saw it; a scale-out's model has not changed
-- its placed replicas since the decision (SCALED); the model has fewer than max_active
-- replicas placed; the worker that will load it and every target GPU's owner are the ones
-- the plan saw, with live leases; every victim is still HOT, idle, not dedicated and on
-- the GPUs the plan saw; after the victims leave each target GPU admits its `limit`
-- (limit + sum of reserved bytes <= total); every warm cache stays in budget.
-- CUDA contexts: a worker that loads onto a GPU it does not own opens a CUDA context
-- there, which it keeps until it exits. The first such plan charges the GPU's `context`
-- bytes to `reserved` under `ctx:<worker>` and lists the GPU in the worker's `contexts`;
-- the charge joins `held` with the first of the worker's placements there that is LOADING
-- (now, or when admit.lua admits it). It stands until reap.lua gives it back, or until the
-- last WAITING placement relying on it goes COLD unloaded (`ctx_wait:<worker>` counts them).
-- Effects: victims go OFFLOADING (to WARM) or DROPPING (to COLD) and leave `reserved`;
-- their copies stay in `held` until their workers settle; each one's age since its
-- placement is counted in its model's cache figures (count_eviction). The replica is
-- LOADING when the device has room for it now (`held` + limit <= total on every GPU), else
-- WAITING until its worker admits it (admit.lua); `placed_at` says when it was placed (an
-- eviction counts its age from then). Its epoch grows by one; `lease` pins it for the call
-- that caused the placement. Every worker concerned is notified on its control list.
-- Returns {1, replica, epoch, level} | {0, reason, detail} and then changes nothing.
-- Run again with a plan already applied (the store re-sends a step whose reply was lost),
-- it changes nothing and answers as it did: the replica is placed for the plan's worker,
-- pinned by the plan's lease, which only this plan's commit gives it.
local p = cjson.decode(ARGV[1])
local now = now_ms()
local dep = K(p.dep)

if p.lease ~= '' and redis.call('ZSCORE', K(p.leases), p.lease) then
  local made = record(dep)
  if made.worker == p.worker and made.level ~= 'WARM' and made.level ~= 'COLD' then
    return {1, p.replica, num(made.epoch), made.level}
  end
end

-- The replica record.
local mine
if p.reuse == '' then
  if redis.call('EXISTS', dep) == 1 then return {0, 'STALE', 'replica id already exists'} end
else
  mine = record(dep)
  if mine.level ~= p.reuse or (mine.worker or '') ~= p.expect_worker then
    return {0, 'STALE', 'replica ' .. p.replica .. ' is no longer ' .. p.reuse}
  end
end
if num(redis.call('HGET', K(p.worker_key), 'lease_deadline')) <= now then
  return {0, 'DEAD', 'worker ' .. p.worker .. ' lease expired'}
end
if not unchanged_since(p, p.model, p.changes_seen) then
  return {0, 'SCALED', p.model .. "'s replicas changed since the scale-out was decided"}
end
local active = num(redis.call('HGET', K(p.active), p.model))
if active >= p.max_active then
  return {0, 'ENOUGH', p.model .. ' already has ' .. active .. ' replicas placed'}
end

-- Victims, and the bytes they free on each GPU.
local freed = {}
local warm_delta = {}  -- host key index -> bytes added to its warm cache
local victims, copies = {}, {}  -- their records, read once
for i, v in ipairs(p.evictions) do
  local r = record(K(v.dep))
  victims[i] = r
  if r.level ~= 'HOT' then
    return {0, 'STALE', 'victim ' .. v.replica .. ' is ' .. tostring(r.level)}
  end
  if r.dedicated == '1' then return {0, 'PINNED', 'victim ' .. v.replica .. ' is dedicated'} end
  if r.worker ~= v.expect_worker then return {0, 'STALE', 'victim ' .. v.replica .. ' moved'} end
  if live_leases(K(v.leases), now) > 0 then
    return {0, 'BUSY', 'victim ' .. v.replica .. ' has requests in flight'}
  end
  if not same_gpus(r.gpus, v.gpus) then return {0, 'STALE', 'victim ' .. v.replica .. ' moved'} end
  for id, bytes in pairs(r.gpus) do freed[id] = (freed[id] or 0) + bytes end
  if v.to == 'WARM' then warm_delta[v.host] = (warm_delta[v.host] or 0) + r.cached end
end
for i, w in ipairs(p.drops) do
  local r = record(K(w.dep))
  copies[i] = r
  if r.level ~= 'WARM' or r.worker ~= w.expect_worker then
    return {0, 'STALE', 'warm copy ' .. w.replica .. ' changed'}
  end
  warm_delta[w.host] = (warm_delta[w.host] or 0) - r.cached
end
if p.reuse == 'WARM' then
  warm_delta[p.host_key] = (warm_delta[p.host_key] or 0) - mine.cached
end

-- Target GPUs: owner, lease and admission; whether the device has room now (victims
-- stay in `held` until their workers settle).
local on_device = true
local context_field = 'ctx:' .. p.worker
local charge = {}  -- GPU id -> bytes of the loader's new CUDA context there
local unheld = {}  -- GPU id -> bytes of its context there not in `held` yet
for _, g in ipairs(p.gpus) do
  local total, reserved, held, worker, deadline, context, opened, joined = unpack(
    redis.call('HMGET', K(g.key), 'total', 'reserved', 'held', 'worker', 'lease_deadline',
      'context', context_field, 'ctx_held:' .. p.worker))
  if not total then return {0, 'STALE', 'GPU ' .. g.id .. ' is not registered'} end
  if worker ~= g.worker then return {0, 'STALE', 'GPU ' .. g.id .. ' changed owner'} end
  if num(deadline) <= now then return {0, 'DEAD', 'GPU ' .. g.id .. ' lease expired'} end
  charge[g.id], unheld[g.id] = 0, 0
  if not opened then
    if worker ~= p.worker then charge[g.id], unheld[g.id] = num(context), num(context) end
  elseif not joined then
    unheld[g.id] = num(opened)  -- charged by an earlier plan, not on the device yet
  end
  local need = math.max(g.limit, g.bytes) + charge[g.id]
  local after = num(reserved) - (freed[g.id] or 0)
  if after + need > num(total) then
    return {0, 'FULL', 'GPU ' .. g.id .. ' cannot admit ' .. need ..
      ' bytes: ' .. after .. ' of ' .. total .. ' stay reserved'}
  end
  if num(held) + math.max(g.limit, g.bytes) + unheld[g.id] > num(total) then
    on_device = false
  end
end
for host, delta in pairs(warm_delta) do
  local budget, used = unpack(redis.call('HMGET', K(host), 'warm_budget', 'warm_used'))
  if delta > 0 and num(used) + delta > num(budget) then
    return {0, 'FULL', 'warm cache of ' .. K(host) .. ' is full'}
  end
end

-- Apply.
local events = K(p.events)
for i, v in ipairs(p.evictions) do
  count_eviction(v, K(v.dep), now, p.ages)
  leave(v, victims[i], v.to, now)
  notify(K(v.control), v.replica)
  event(events, p.maxlen, now, 'evicted', v.replica, victims[i].model, 'cause', 'pressure',
    'to', v.to, 'for', p.replica)
end
for i, w in ipairs(p.drops) do
  drop_warm(w, copies[i], now)
  notify(K(w.control), w.replica)
  event(events, p.maxlen, now, 'dropped', w.replica, copies[i].model)
end
if p.reuse == 'WARM' then
  redis.call('HINCRBY', K(p.host_key), 'warm_used', -mine.cached)
  redis.call('SREM', K(p.host_warm_key), p.replica)
  redis.call('SREM', K(p.old_worker_deps), p.replica)
end
local level = 'WAITING'
if on_device then level = 'LOADING' end
local placed = {}
local new_contexts = {}
for _, g in ipairs(p.gpus) do
  local c = charge[g.id]
  redis.call('HINCRBY', K(g.key), 'reserved', g.bytes + c)
  if c > 0 then
    redis.call('HSET', K(g.key), context_field, c)
    table.insert(new_contexts, g.id)
  end
  if level == 'LOADING' then
    redis.call('HINCRBY', K(g.key), 'held', g.bytes)
    hold_context(K(g.key), p.worker, unheld[g.id])
  elseif unheld[g.id] > 0 then
    wait_context(K(g.key), p.worker)
  end
  placed[g.id] = g.bytes
end
list_contexts(K(p.worker_key), new_contexts)
local epoch = redis.call('HINCRBY', dep, 'epoch', 1)
redis.call('HSET', dep, 'replica', p.replica, 'model', p.model, 'level', level,
  'gpus', cjson.encode(placed), 'limit', p.limit, 'fraction', p.fraction, 'size', p.size,
  'dedicated', p.dedicated and 1 or 0, 'accelerator', p.accelerator, 'host', p.host,
  'worker', p.worker, 'queue', p.queue, 'last_used', now, 'since', now, 'placed_at', now,
  'source', p.reuse, 'read_from', p.read_from, 'copy_at', '')
if p.reuse == '' then  -- a record, once made, stays in both sets (nothing removes it)
  redis.call('SADD', K(p.deps_key), p.replica)
  redis.call('SADD', K(p.replicas_key), p.replica)
end
redis.call('SADD', K(p.worker_deps), p.replica)
count_placed(p, p.model, 1)
redis.call('DEL', K(p.leases))  -- no lease of an earlier placement carries over
if p.lease ~= '' then
  redis.call('ZADD', K(p.leases), now + p.lease_ms, p.lease)
  if redis.call('PTTL', K(p.leases)) < p.lease_ms then redis.call('PEXPIRE', K(p.leases), p.lease_ms) end
end
notify(K(p.control), p.replica)
local kind = 'placed'
if p.reuse == 'WARM' then kind = 'restored' end
event(events, p.maxlen, now, kind, p.replica, p.model, 'gpus', cjson.encode(placed),
  'worker', p.worker, 'level', level, 'epoch', epoch, 'why', p.why)
return {1, p.replica, epoch, level}
