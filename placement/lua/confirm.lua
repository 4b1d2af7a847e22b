-- confirm.lua: a worker reports a replica loaded (or restored); LOADING becomes HOT.
-- KEYS[1] = deployment hash, KEYS[2] = events stream
-- ARGV[1] = replica id, ARGV[2] = worker id, ARGV[3] = events max length
-- Returns 1, or 0 when the replica is no longer LOADING on this worker (it was evicted
-- or reaped meanwhile: the worker must drop what it loaded).
local level, worker, model = unpack(redis.call('HMGET', KEYS[1], 'level', 'worker', 'model'))
if level ~= 'LOADING' or worker ~= ARGV[2] then return 0 end
local now = now_ms()
redis.call('HSET', KEYS[1], 'level', 'HOT', 'last_used', now)
event(KEYS[2], ARGV[3], now, 'ready', ARGV[1], model, 'worker', worker)
return 1
