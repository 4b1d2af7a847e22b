-- pick.lua: the fast path. Lease the least busy ready (HOT) replica of a model; ties go
-- to the first in ARGV order (the registry sorts by id), so a surplus replica idles out.
-- A call whose prompt has a prefix chain goes to the replica its longest prefix was last
-- sent to instead, unless that one has more than ARGV[5] leases above the least busy
-- (docs/placement.md, "Prefix routing").
-- KEYS[1] = the model's replica set
-- KEYS[2..3n+1] = per replica, in ARGV order: deployment hash, leases zset, worker hash
-- KEYS[3n+2] = the model's stats hash
-- KEYS[3n+3] = the model's prefix map (digest -> replica id: `note_prefix`)
-- ARGV[1] = lease id, ARGV[2] = lease length (ms), ARGV[3] = how a lease counts the call
--   in the stats hash (docs/metrics.md: a call is counted once, by the first routing that
--   pins or refuses it): 'fast' ('hit' and 'fast': the client's route), 'router' ('hit'
--   and 'routed': the router's routing of a call not counted yet) or '' (nothing: a call
--   counted already, or no caller's call). A miss counts nothing: the router counts the
--   outcome of the call's placement with its path (Registry.count)
-- ARGV[4] = k, the digests in the call's prefix chain (0: route by load alone)
-- ARGV[5] = the spill: leases the prefix's replica may have above the least busy one's
-- ARGV[6] = the most entries the prefix map keeps before it is cleared
-- ARGV[7..6+k] = the call's prefix chain, shortest prefix first
-- ARGV[7+k..] = replica ids, then after them the worker id each replica had, in order
-- Returns {1, replica, queue, worker, gpus_json, lease_deadline_ms, epoch}
--       | {0}                no replica is ready: take the router path
--       | {-1, replica ids}  the caller's replica list is stale: here is the current one
local k = tonumber(ARGV[4])
local n = (#ARGV - 6 - k) / 2
local reps, ids, workers = listed_replicas(n, 6 + k, false)
local ttl = tonumber(ARGV[2])
local prefix = read_prefix(KEYS[3 * n + 3], KEYS[3 * n + 2], 6, k, tonumber(ARGV[5]), ids)
local c, reply = choose_replica(reps, ids, workers, nil, ttl, prefix)
if not c then return reply end
lease_replica(reps[c.i], ARGV[1], c.deadline, ttl, ARGV[3], KEYS[3 * n + 2], c.now)
note_prefix(prefix, c, ids[c.i], ARGV[3], tonumber(ARGV[6]))
return {1, ids[c.i], c.row[3], workers[c.i], c.row[4], c.deadline, num(c.row[5])}
