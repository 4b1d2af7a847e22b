-- pick.lua: the fast path. Lease the least busy ready (HOT) replica of a model; ties go
-- to the first in ARGV order (the registry sorts by id), so a surplus replica idles out.
-- KEYS[1] = the model's replica set
-- KEYS[2..] = per replica, in ARGV order: deployment hash, leases zset, worker hash
-- KEYS[#KEYS] = the model's stats hash
-- ARGV[1] = lease id, ARGV[2] = lease length (ms), ARGV[3] = how a lease counts the call
--   in the stats hash (docs/metrics.md: a call is counted once, by the first routing that
--   pins or refuses it): 'fast' ('hit' and 'fast': the client's route), 'router' ('hit'
--   and 'routed': the router's routing of a call not counted yet) or '' (nothing: a call
--   counted already, or no caller's call). A miss counts nothing: the router counts the
--   outcome of the call's placement with its path (Registry.count)
-- ARGV[4..] = replica ids, then after them the worker id each replica had, in order
-- Returns {1, replica, queue, worker, gpus_json, lease_deadline_ms, epoch}
--       | {0}                no replica is ready: take the router path
--       | {-1, replica ids}  the caller's replica list is stale: here is the current one
local n = (#ARGV - 3) / 2
local reps, ids, workers = {}, {}, {}
for i = 1, n do
  local base = 1 + (i - 1) * 3
  reps[i] = {dep = KEYS[base + 1], leases = KEYS[base + 2], worker = KEYS[base + 3]}
  ids[i], workers[i] = ARGV[3 + i], ARGV[3 + n + i]
end
local now = now_ms()
local best, row = least_busy(KEYS[1], reps, ids, workers, nil, now)
if best == -1 then return {-1, unpack(redis.call('SMEMBERS', KEYS[1]))} end
if best == 0 then return {0} end
local ttl = tonumber(ARGV[2])
local deadline = now + ttl
lease_replica(reps[best], ARGV[1], deadline, ttl, ARGV[3], KEYS[#KEYS], now)
return {1, ids[best], row[3], workers[best], row[4], deadline, num(row[5])}
