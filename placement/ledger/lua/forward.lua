-- forward.lua: the router's hot path when the broker and the ledger are one Redis (one
-- fleet per broker database, tasks/broker/claim.py). pick.lua and move.lua in one step: lease
-- the replica of a call's model pick.lua would (by prefix, then load), and move the
-- call's message, taken into the router's in-flight list, onto that replica's queue with
-- the lease in its headers. One round trip instead of two, and never a lease without its
-- message moved (tasks/serving/forwarding.py).
-- Broker keys carry no fleet hash tag (see redeliver.lua): this script runs only where a
-- single Redis, never a cluster, holds both (kombu's transport has no cluster support).
-- KEYS[1] = the model's replica set
-- KEYS[2..3n+1] = per replica, in ARGV order: deployment hash, leases zset, worker hash
-- KEYS[3n+2] = the model's stats hash, KEYS[3n+3] = its prefix map (pick.lua's)
-- KEYS[3n+4] = the in-flight list the call was taken into
-- KEYS[3n+5..4n+4] = per replica, the list of its queue the message goes to (its priority)
-- With m > 0 (ARGV[9], a tenant's call): KEYS[4n+5..5n+4] = per replica, the list of the
--   worker's own queue for that priority, and KEYS[5n+5..5n+4+nm] = per replica, the m
--   lists where the worker's calls wait (its own queue's, each tenant's of it, at every
--   priority)
-- KEYS[after those..] = the lists the router's consumer takes from (none: not asked)
-- ARGV[1] = lease id, ARGV[2] = lease length (ms), ARGV[3] = how the lease counts the call
--   (pick.lua's ARGV[3]), ARGV[4] = the message as taken,
-- ARGV[5..7] = the message to push, in three parts: the lease header's value (a JSON
--   object: tasks/serving/leases.header's fields) goes between the first two, the queue's
--   name (a JSON string: the message's routing key) between the last two
-- ARGV[8] = what follows the replica's queue in that name: '' for the default tenant,
--   '~<tenant>' for a tenant's queue of the worker (placement/ledger/tenancy/tenants.py), which
--   KEYS[3n+5..4n+4] name too
-- ARGV[9] = m: a tenant's call goes to its tenant's queue of the worker only when calls wait
--   in one of the worker's m lists; when none waits, to the worker's own queue, on which
--   an idle worker waits: fair shares order calls that wait, and this one does not
--   (docs/tasks.md, "Tenants"). 0: always to KEYS[3n+5..4n+4]
-- ARGV[10..12] = k, the spill and the prefix map's bound; ARGV[13..12+k] = the call's
--   prefix chain (pick.lua's ARGV[4..6+k])
-- ARGV[13+k..] = replica ids, then the worker id each had, then the queue each had, in order
-- Returns {1, replica, queue, worker, gpus_json, lease_deadline_ms, epoch, drained}: moved;
--         drained is 1 when the router's lists are given and every one is empty after the
--         move, else 0
--       | {0}                no replica is ready: nothing changed, the call takes the pool's path
--       | {-1, replica ids}  the caller's replica list is stale: here is the current one
--       | {-2}               the message is no longer in flight (a sweep gave it back)
-- Every write comes after the checks and the push first: a push that fails (a key of
-- another type) changes nothing, since Redis does not undo a failing script's writes. The
-- lease's writes that follow fail only on a ledger key of another type (a broken ledger).
local k = tonumber(ARGV[10])
local n = (#ARGV - 12 - k) / 3
local m = tonumber(ARGV[9])
if not redis.call('LPOS', KEYS[3 * n + 4], ARGV[4]) then return {-2} end
local reps, ids, workers, queues = listed_replicas(n, 12 + k, true)
local ttl = tonumber(ARGV[2])
local prefix = read_prefix(KEYS[3 * n + 3], KEYS[3 * n + 2], 12, k, tonumber(ARGV[11]), ids)
local c, reply = choose_replica(reps, ids, workers, queues, ttl, prefix)
if not c then return reply end
local epoch = num(c.row[5])
local lease = string.format('{"id": %s, "replica": %s, "deadline_ms": %d, "epoch": %d, "sent_ms": %d}',
  cjson.encode(ARGV[1]), cjson.encode(ids[c.i]), c.deadline, epoch, c.now)
local list, queue = KEYS[3 * n + 4 + c.i], c.row[3] .. ARGV[8]
local watched = 4 * n + 5  -- the first of the router's lists
if m > 0 then
  watched = 5 * n + 5 + n * m
  local waiting = false
  for j = 1, m do
    if redis.call('LLEN', KEYS[5 * n + 4 + (c.i - 1) * m + j]) > 0 then waiting = true break end
  end
  if not waiting then list, queue = KEYS[4 * n + 4 + c.i], c.row[3] end
end
redis.call('LPUSH', list, ARGV[5] .. lease .. ARGV[6] .. cjson.encode(queue) .. ARGV[7])
redis.call('LREM', KEYS[3 * n + 4], 1, ARGV[4])
lease_replica(reps[c.i], ARGV[1], c.deadline, ttl, ARGV[3], KEYS[3 * n + 2], c.now)
note_prefix(prefix, c, ids[c.i], ARGV[3], tonumber(ARGV[12]))
local drained = #KEYS >= watched and 1 or 0  -- no lists given: not known, so not drained
for i = watched, #KEYS do
  if redis.call('LLEN', KEYS[i]) > 0 then drained = 0 break end
end
return {1, ids[c.i], c.row[3], workers[c.i], c.row[4], c.deadline, epoch, drained}
