-- finish.lua: a request ends and gives back its lease on a replica.
-- KEYS[1] = deployment hash, KEYS[2] = the replica's leases zset
-- ARGV[1] = lease id
-- Returns {removed (0|1), live leases left, level}; a DRAINING replica with no live
-- leases left is ready for evict.lua.
local now = now_ms()
local removed = redis.call('ZREM', KEYS[2], ARGV[1])
local left = live_leases(KEYS[2], now)
local level = redis.call('HGET', KEYS[1], 'level') or 'COLD'
if level == 'HOT' or level == 'DRAINING' then
  redis.call('HSET', KEYS[1], 'last_used', now)
end
return {removed, left, level}
