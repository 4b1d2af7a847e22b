-- routing.lua: the calls a router holds for a model (a miss being placed, a busy retry).
-- KEYS[1] = the model's routing zset (call id -> deadline, ms)
-- ARGV[1] = call id, ARGV[2] = '1' while the router holds it, '0' once handed on or failed,
-- ARGV[3] = how long the entry lives unless renewed (ms)
-- The count of live entries is part of the model's load (placement/rules/scaling.py); a router
-- that dies leaves entries that expire. Returns the live entries left.
local now = now_ms()
if ARGV[2] == '1' then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
  if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[3]) then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
else
  redis.call('ZREM', KEYS[1], ARGV[1])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
