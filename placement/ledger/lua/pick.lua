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
local reps, ids, workers = listed_replicas((#ARGV - 3) / 2, 3, false)
local ttl = tonumber(ARGV[2])
local c, reply = choose_replica(reps, ids, workers, nil, ttl)
if not c then return reply end
lease_replica(reps[c.i], ARGV[1], c.deadline, ttl, ARGV[3], KEYS[#KEYS], c.now)
return {1, ids[c.i], c.row[3], workers[c.i], c.row[4], c.deadline, num(c.row[5])}
