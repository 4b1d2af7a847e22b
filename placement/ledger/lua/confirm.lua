-- confirm.lua: a worker has loaded (or restored) a replica on its planned GPUs: LOADING -> HOT.
-- KEYS[1] = deployment hash, KEYS[2] = events stream
-- ARGV[1] = replica id, ARGV[2] = worker id, ARGV[3] = epoch it loaded,
-- ARGV[4] = events max length, ARGV[5] = bytes its copy measured (0: unknown)
-- The measured bytes become the record's `copy_bytes`, what its copy will take in the
-- host's warm cache; they change only here, while nothing is charged for the copy.
-- Returns {1, 'HOT'}, or {0, level} when the replica is no longer LOADING on this worker
-- in this epoch (it was evicted, reaped or placed again meanwhile): the worker must
-- bring what it holds in line with the ledger instead.
local level, worker, model, epoch = unpack(redis.call('HMGET', KEYS[1], 'level', 'worker',
  'model', 'epoch'))
if level ~= 'LOADING' or worker ~= ARGV[2] or num(epoch) ~= tonumber(ARGV[3]) then
  return {0, level or 'COLD'}
end
local now = now_ms()
redis.call('HSET', KEYS[1], 'level', 'HOT', 'last_used', now, 'since', now)
if num(ARGV[5]) > 0 then redis.call('HSET', KEYS[1], 'copy_bytes', ARGV[5]) end
event(KEYS[2], ARGV[4], now, 'ready', ARGV[1], model, 'worker', worker, 'epoch', epoch)
return {1, 'HOT'}
