-- quota_leave.lua: calls of a tenant with quotas are answered: their running slots free,
-- and the oldest parked calls take them, handed back to the router as the next calls it
-- takes from the tenant's queue, in the order they came (placement/ledger/quotas.py). Also
-- the sweep's step, with no call named: parked calls take any slot free.
-- KEYS[1] = the tenant's running set, KEYS[2] = its parked list
-- KEYS[3] = its public queue (the broker list routers take its calls from, at its right end)
-- KEYS[4] = the message it last handed back (a string), which may still wait in KEYS[3]
-- ARGV[1] = max running (0: no limit, so nothing is parked), ARGV[2..] = task ids answered
-- Returns how many parked calls were let in.
for i = 2, #ARGV do redis.call('ZREM', KEYS[1], ARGV[i]) end
local max_running = tonumber(ARGV[1])
local now, moved = now_ms(), 0
while redis.call('LLEN', KEYS[2]) > 0
    and (max_running == 0 or redis.call('ZCARD', KEYS[1]) < max_running) do
  local message = redis.call('RPOP', KEYS[2])
  local ok, decoded = pcall(cjson.decode, message)
  local id = ok and type(decoded) == 'table' and type(decoded.headers) == 'table'
    and decoded.headers.id
  -- let in as it leaves the list, so no call taken meanwhile takes its slot; a message
  -- with no id (which the router refuses) takes none
  if type(id) == 'string' then redis.call('ZADD', KEYS[1], now, id) end
  -- next in line, but behind a call handed back before that the router has not taken
  local last = redis.call('GET', KEYS[4])
  if not (last and redis.call('LPOS', KEYS[3], last, 'RANK', -1)
      and redis.call('LINSERT', KEYS[3], 'BEFORE', last, message) > 0) then
    redis.call('RPUSH', KEYS[3], message)
  end
  redis.call('SET', KEYS[4], message)
  moved = moved + 1
end
if redis.call('LLEN', KEYS[2]) == 0 and moved == 0 then redis.call('DEL', KEYS[4]) end
return moved
