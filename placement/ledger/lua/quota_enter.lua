-- quota_enter.lua: a call of a tenant with quotas, as a router takes it: let it run, park it
-- until one of the tenant's running slots frees, or refuse it (placement/ledger/quotas.py).
-- The parked list holds broker messages, so this runs only where one Redis holds the
-- broker and the ledger (as forward.lua; tasks/serving/forwarding.py).
-- KEYS[1] = the tenant's running set (zset: task id -> ms let in)
-- KEYS[2] = the tenant's parked list (messages, oldest last)
-- KEYS[3] = the in-flight list the call's message was taken into
-- ARGV[1] = the call's task id, ARGV[2] = its message as taken
-- ARGV[3] = max running (0: no limit), ARGV[4] = max queued (0: no limit)
-- Returns 1: let in (also when it was before: a redelivery, a call routed again)
--       | 2: parked: moved from the in-flight list to the parked list, in this step
--       | 3: refused: the tenant has max queued calls waiting (with no running limit:
--            max queued calls let in and not answered); the message stays in flight
--       | -2: the message is no longer in flight (a sweep gave it back): nothing changed
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 1 end
if not redis.call('LPOS', KEYS[3], ARGV[2]) then return -2 end
local max_running, max_queued = tonumber(ARGV[3]), tonumber(ARGV[4])
local parked = redis.call('LLEN', KEYS[2])
if max_running > 0 then
  -- behind any call parked before it, so the tenant's calls run in the order they came
  if redis.call('ZCARD', KEYS[1]) >= max_running or parked > 0 then
    if max_queued > 0 and parked >= max_queued then return 3 end
    redis.call('LPUSH', KEYS[2], ARGV[2])
    redis.call('LREM', KEYS[3], 1, ARGV[2])
    return 2
  end
elseif max_queued > 0 and redis.call('ZCARD', KEYS[1]) >= max_queued then
  return 3
end
redis.call('ZADD', KEYS[1], now_ms(), ARGV[1])
return 1
