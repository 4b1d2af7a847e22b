-- hold.lua: lease a replica for a call the router sends it, while it is placed.
-- KEYS[1] = deployment hash, KEYS[2] = the replica's leases zset, KEYS[3] = its worker's hash
-- ARGV[1] = lease id, ARGV[2] = lease length (ms), ARGV[3] = the epoch the router saw,
-- ARGV[4] = the worker the router saw
-- The replica must still be WAITING, LOADING or HOT in that epoch, on that worker, whose
-- lease is live: a lease on it keeps pressure from evicting it before the call runs.
-- Returns {1, lease_deadline_ms, level, source ('WARM' for a restore, or a load that reads
-- another worker's warm copy)} | {0, level}
local level, epoch, source, worker, read_from = unpack(redis.call('HMGET', KEYS[1], 'level',
  'epoch', 'source', 'worker', 'read_from'))
if read_from and read_from ~= '' then source = 'WARM' end
local placed = {WAITING = true, LOADING = true, HOT = true}
if not placed[level] or num(epoch) ~= tonumber(ARGV[3]) or worker ~= ARGV[4] then
  return {0, level or 'COLD'}
end
local now = now_ms()
if num(redis.call('HGET', KEYS[3], 'lease_deadline')) <= now then return {0, 'DEAD'} end
local deadline = now + tonumber(ARGV[2])
redis.call('ZADD', KEYS[2], deadline, ARGV[1])
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
return {1, deadline, level, source or ''}
