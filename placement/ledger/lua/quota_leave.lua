-- quota_leave.lua: running slots of a tenant free (its calls were answered), and its oldest
-- parked calls take them, handed back to the router as the next calls it takes from the
-- tenant's public queue, in the order they came (placement/ledger/tenancy/quotas.py). With no slot
-- named, the sweep's step: parked calls take the slots free (all of them, for a tenant
-- that has no running limit now, or no record).
-- KEYS[1] = the tenant's running slots, KEYS[2] = its parked list
-- KEYS[3] = its public queue (the broker list routers take its calls from, at its right end)
-- KEYS[4] = the message it last handed back (a string), which may still wait in KEYS[3]
-- KEYS[5] = the fleet's tenants hash: the running limit, read here
-- ARGV[1] = the tenant, ARGV[2..] = the slots to free
-- Returns how many parked calls were handed back.
for i = 2, #ARGV do redis.call('ZREM', KEYS[1], ARGV[i]) end
local ok, quotas = pcall(cjson.decode, redis.call('HGET', KEYS[5], ARGV[1]) or '')
local max_running = (ok and type(quotas) == 'table') and num(quotas.max_running) or 0
local now, moved = now_ms(), 0
while redis.call('LLEN', KEYS[2]) > 0
    and (max_running == 0 or redis.call('ZCARD', KEYS[1]) < max_running) do
  local message = redis.call('LINDEX', KEYS[2], -1)
  -- next in line, but behind a call handed back before that the router has not taken;
  -- pushed before it leaves the parked list, so a push that fails leaves it parked
  local last = redis.call('GET', KEYS[4])
  if not (last and redis.call('LPOS', KEYS[3], last, 'RANK', -1)
      and redis.call('LINSERT', KEYS[3], 'BEFORE', last, message) > 0) then
    redis.call('RPUSH', KEYS[3], message)
  end
  redis.call('RPOP', KEYS[2])
  redis.call('SET', KEYS[4], message)
  -- its slot is kept for it, under the task id its caller gave, until a router takes it
  -- (quota_enter.lua); a message with no id, which the router refuses, keeps none
  local decoded_ok, decoded = pcall(cjson.decode, message)
  local id = decoded_ok and type(decoded) == 'table' and type(decoded.headers) == 'table'
    and decoded.headers.id
  if max_running > 0 and type(id) == 'string' then
    redis.call('ZADD', KEYS[1], now, 'handed:' .. id)
  end
  moved = moved + 1
end
return moved
