-- heartbeat.lua: renew a live worker's lease on itself and on the GPUs it owns, and store
-- what it reports holding.
-- KEYS[1] = worker hash, KEYS[2..n] = hashes of the worker's GPUs
-- ARGV[1] = worker id, ARGV[2] = lease length (ms),
-- ARGV[3] = JSON list of the copies it holds ('' to leave the last report as it is),
-- ARGV[4] = host memory it keeps pinned, bytes ('' to leave the last figure as it is)
-- Returns {1, lease_deadline_ms} | {0} when the lease already expired or the worker is
-- unknown: its reservations are (or will be) reaped, and it must re-register.
local now = now_ms()
if num(redis.call('HGET', KEYS[1], 'lease_deadline')) <= now then
  return {0}
end
local deadline = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'lease_deadline', deadline)
if ARGV[3] and ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'holds', ARGV[3], 'holds_at', now)
end
if ARGV[4] and ARGV[4] ~= '' then
  redis.call('HSET', KEYS[1], 'pinned', ARGV[4])
end
for i = 2, #KEYS do
  if redis.call('HGET', KEYS[i], 'worker') == ARGV[1] then
    redis.call('HSET', KEYS[i], 'lease_deadline', deadline)
  end
end
return {1, deadline}
