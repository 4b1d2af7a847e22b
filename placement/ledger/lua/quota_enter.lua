-- quota_enter.lua: a call of a tenant with quotas, as a router takes it from the tenant's
-- public queue: let it take a running slot, park it until a slot frees, or refuse it
-- (placement/ledger/tenancy/quotas.py). The parked list holds broker messages, so this runs only
-- where one Redis holds the broker and the ledger (as forward.lua).
-- KEYS[1] = the tenant's running slots (zset: '<slot>:<task id>' -> ms taken; a call handed
--           back from the parked list holds 'handed:<its caller's task id>' until a router
--           takes it)
-- KEYS[2] = the tenant's parked list (messages, oldest last)
-- KEYS[3] = the in-flight list the call's message was taken into
-- KEYS[4] = the fleet's tenants hash (placement/ledger/tenancy/tenants.py): the quotas, read here
-- ARGV[1] = the tenant, ARGV[2] = the fleet's id of the call, ARGV[3] = its message as taken
-- ARGV[4] = the slot to take (a token the fleet made, which the call carries on)
-- ARGV[5] = the task id its caller gave it (its message says it: quota_leave.lua)
-- Returns 1: it takes the slot ARGV[4] (also a call handed back, whose slot was kept; a
--            step run again, its reply lost, whose first run took it; and any call of a
--            tenant with no record or no quota now: no slot is taken)
--       | 2: parked: moved from the in-flight list to the parked list, in this step
--       | 3: refused: the tenant has max_queued calls parked (with no running limit:
--            max_queued calls holding slots); the message stays in flight
--       | -2: the message is no longer in flight (a sweep gave it back): nothing changed
if not redis.call('LPOS', KEYS[3], ARGV[3]) then return -2 end
local now = now_ms()
local slot = ARGV[4] .. ':' .. ARGV[2]
local handed = 'handed:' .. ARGV[5]
if redis.call('ZSCORE', KEYS[1], slot) then return 1 end  -- run again: it holds the slot
if redis.call('ZSCORE', KEYS[1], handed) then
  redis.call('ZREM', KEYS[1], handed)
  redis.call('ZADD', KEYS[1], now, slot)
  return 1
end
local record = redis.call('HGET', KEYS[4], ARGV[1])
local ok, quotas = pcall(cjson.decode, record or '')
if not ok or type(quotas) ~= 'table' then return 1 end
local max_running, max_queued = num(quotas.max_running), num(quotas.max_queued)
local parked = redis.call('LLEN', KEYS[2])
if max_running > 0 then
  -- behind any call parked before it, so the tenant's calls run in the order they came
  if redis.call('ZCARD', KEYS[1]) >= max_running or parked > 0 then
    if max_queued > 0 and parked >= max_queued then return 3 end
    redis.call('LPUSH', KEYS[2], ARGV[3])
    redis.call('LREM', KEYS[3], 1, ARGV[3])
    return 2
  end
elseif max_queued > 0 then
  if redis.call('ZCARD', KEYS[1]) >= max_queued then return 3 end
else
  return 1
end
redis.call('ZADD', KEYS[1], now, slot)
return 1
