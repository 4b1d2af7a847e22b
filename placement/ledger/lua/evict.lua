-- evict.lua: take one replica off its GPUs on request: drain it, then offload or drop it.
-- KEYS: every key named in ARGV[1].
-- ARGV[1] = JSON {replica, dep, leases, active, changes, worker_deps, host, host_warm,
--                 control, events, maxlen, expect_worker, to ('WARM' | 'COLD'), gpus=[{id, key}],
--                 drops=[{replica, dep, worker_deps, host, host_warm, control, expect_worker}],
--                 floor (-1: none), epoch, changes_seen (-1, or the model's `changes` count
--                 the scale-in was decided at), why ('' or the reason, for the event),
--                 cache (its model's cache hash), ages (the eviction-age histogram's
--                 bucket labels: `placement.ledger.figures.cache`)}
-- A scale-in (floor >= 0) takes only the HOT, idle replica of placement `epoch`, and only
-- while its model keeps `floor` others placed: it never drains, two routers never take a
-- model below its floor, and a late or repeated decision changes nothing.
-- A replica with requests in flight turns DRAINING (it takes no new ones) and stays
-- until the last lease ends; call again then. An idle one goes OFFLOADING (to WARM,
-- dropping colder warm copies to make room) or DROPPING, and its worker is notified; the
-- worker settles the move (settle.lua). A WARM copy that no longer fits its host's cache
-- goes DROPPING instead. WAITING (nothing on the device yet) goes COLD at once; LOADING
-- goes DROPPING. A WARM replica asked to go COLD is dropped; an OFFLOADING one asked to go
-- COLD turns DROPPING. Each eviction off the GPUs (not a WARM copy's drop, nor an
-- OFFLOADING copy's turn to DROPPING: it left them already) counts the replica's age since
-- its placement in its model's cache figures (count_eviction).
-- Returns {1, level now} | {2, 'DRAINING', live leases} | {0, reason, detail}; reasons:
-- NOT_FOUND, STALE (the record is not as the caller saw it); for a scale-in also MOVED
-- (not that HOT placement any more), SCALED (the model's placed replicas changed since the
-- decision), BUSY (calls in flight) and FLOOR.
local a = cjson.decode(ARGV[1])
local dep = K(a.dep)
local now = now_ms()
local r = record(dep)
local level, model = r.level, r.model
if not level then return {0, 'NOT_FOUND', 'no replica ' .. a.replica} end
local events = K(a.events)
if a.floor >= 0 then
  if level ~= 'HOT' or r.epoch ~= a.epoch then
    return {0, 'MOVED', a.replica .. ' is ' .. level .. ' in placement ' .. r.epoch}
  end
  if not unchanged_since(a, model, a.changes_seen) then
    return {0, 'SCALED', model .. "'s replicas changed since the scale-in was decided"}
  end
  local calls = live_leases(K(a.leases), now)
  if calls > 0 then return {0, 'BUSY', a.replica .. ' has ' .. calls .. ' calls in flight'} end
  local active = num(redis.call('HGET', K(a.active), model))
  if active - 1 < a.floor then
    return {0, 'FLOOR', model .. ' has ' .. active .. ' replicas placed; its floor is ' .. a.floor}
  end
end
if level == 'COLD' or (level == 'WARM' and a.to == 'WARM') or level == 'DROPPING'
    or (level == 'OFFLOADING' and a.to == 'WARM') then
  return {1, level}
end
-- The holder, its worker set and its host are the ones the caller saw, or nothing changes.
if (r.worker or '') ~= a.expect_worker then return {0, 'STALE', a.replica .. ' moved'} end
if not same_gpus(r.gpus, a.gpus) then return {0, 'STALE', a.replica .. ' moved'} end
local cause = 'explicit'
if a.floor >= 0 then cause = 'scale-in' end
if level == 'WARM' then
  drop_warm(a, r, now)
  notify(K(a.control), a.replica)
  event(events, a.maxlen, now, 'dropped', a.replica, model, 'cause', cause, 'why', a.why)
  return {1, 'COLD'}
end
if level == 'OFFLOADING' then  -- asked to go COLD: the warm charge goes back at once
  redis.call('HINCRBY', K(a.host), 'warm_used', -r.cached)
  redis.call('HSET', dep, 'level', 'DROPPING', 'since', now)
  notify(K(a.control), a.replica)
  event(events, a.maxlen, now, 'evicted', a.replica, model, 'cause', cause, 'why', a.why, 'to', 'COLD')
  return {1, 'DROPPING'}
end
if level == 'WAITING' then
  count_eviction(a, dep, now, a.ages)
  to_cold(a, r, now)
  notify(K(a.control), a.replica)
  event(events, a.maxlen, now, 'evicted', a.replica, model, 'cause', cause, 'why', a.why, 'to', 'COLD')
  return {1, 'COLD'}
end
if level == 'LOADING' then
  count_eviction(a, dep, now, a.ages)
  leave(a, r, 'COLD', now)
  notify(K(a.control), a.replica)
  event(events, a.maxlen, now, 'evicted', a.replica, model, 'cause', cause, 'why', a.why, 'to', 'COLD')
  return {1, 'DROPPING'}
end
local inflight = live_leases(K(a.leases), now)
if inflight > 0 then
  if level ~= 'DRAINING' then
    redis.call('HSET', dep, 'level', 'DRAINING', 'since', now)
    event(events, a.maxlen, now, 'draining', a.replica, model, 'inflight', inflight)
  end
  return {2, 'DRAINING', inflight}
end
local to = a.to
if to == 'WARM' then
  local size = r.cached
  local budget, used = unpack(redis.call('HMGET', K(a.host), 'warm_budget', 'warm_used'))
  local room = num(budget) - num(used)
  local usable = {}
  for _, w in ipairs(a.drops) do
    if room >= size then break end
    local wr = record(K(w.dep))
    if wr.level == 'WARM' and wr.worker == w.expect_worker then
      table.insert(usable, {w, wr})
      room = room + wr.cached
    end
  end
  if room >= size and size > 0 then
    for _, use in ipairs(usable) do
      local w, wr = use[1], use[2]
      drop_warm(w, wr, now)
      notify(K(w.control), w.replica)
      event(events, a.maxlen, now, 'dropped', w.replica, wr.model)
    end
  else
    to = 'COLD'
  end
end
count_eviction(a, dep, now, a.ages)
leave(a, r, to, now)
notify(K(a.control), a.replica)
event(events, a.maxlen, now, 'evicted', a.replica, model, 'cause', cause, 'why', a.why, 'to', to)
if to == 'WARM' then return {1, 'OFFLOADING'} end
return {1, 'DROPPING'}
