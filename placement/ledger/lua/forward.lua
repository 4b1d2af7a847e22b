-- forward.lua: the router's hot path when the broker and the ledger are one Redis (one
-- fleet per broker database, tasks/broker/claim.py). pick.lua and move.lua in one step: lease
-- the least busy HOT replica of a call's model, exactly as pick.lua does, and move the
-- call's message, taken into the router's in-flight list, onto that replica's queue with
-- the lease in its headers. One round trip instead of two, and never a lease without its
-- message moved (tasks/serving/forwarding.py).
-- Broker keys carry no fleet hash tag (see redeliver.lua): this script runs only where a
-- single Redis, never a cluster, holds both (kombu's transport has no cluster support).
-- KEYS[1] = the model's replica set
-- KEYS[2..3n+1] = per replica, in ARGV order: deployment hash, leases zset, worker hash
-- KEYS[3n+2] = the model's stats hash, KEYS[3n+3] = the in-flight list the call was taken into
-- KEYS[3n+4..4n+3] = per replica, the list of its queue the message goes to (its priority)
-- ARGV[1] = lease id, ARGV[2] = lease length (ms), ARGV[3] = how the lease counts the call
--   (pick.lua's ARGV[3]), ARGV[4] = the message as taken,
-- ARGV[5..7] = the message to push, in three parts: the lease header's value (a JSON
--   object: tasks/serving/leases.header's fields) goes between the first two, the queue's
--   name (a JSON string: the message's routing key) between the last two
-- ARGV[8..] = replica ids, then the worker id each had, then the queue each had, in order
-- Returns {1, replica, queue, worker, gpus_json, lease_deadline_ms, epoch}: moved
--       | {0}                no replica is ready: nothing changed, the call takes the pool's path
--       | {-1, replica ids}  the caller's replica list is stale: here is the current one
--       | {-2}               the message is no longer in flight (a sweep gave it back)
-- Every write comes after the checks and the push first: a push that fails (a key of
-- another type) changes nothing, since Redis does not undo a failing script's writes. The
-- lease's writes that follow fail only on a ledger key of another type (a broken ledger).
local n = (#ARGV - 7) / 3
if not redis.call('LPOS', KEYS[3 * n + 3], ARGV[4]) then return {-2} end
local reps, ids, workers, queues = {}, {}, {}, {}
for i = 1, n do
  local base = 1 + (i - 1) * 3
  reps[i] = {dep = KEYS[base + 1], leases = KEYS[base + 2], worker = KEYS[base + 3]}
  ids[i], workers[i], queues[i] = ARGV[7 + i], ARGV[7 + n + i], ARGV[7 + 2 * n + i]
end
local now = now_ms()
local best, row = least_busy(KEYS[1], reps, ids, workers, queues, now)
if best == -1 then return {-1, unpack(redis.call('SMEMBERS', KEYS[1]))} end
if best == 0 then return {0} end
local ttl = tonumber(ARGV[2])
local deadline = now + ttl
local epoch = num(row[5])
local lease = string.format('{"id": %s, "replica": %s, "deadline_ms": %d, "epoch": %d, "sent_ms": %d}',
  cjson.encode(ARGV[1]), cjson.encode(ids[best]), deadline, epoch, now)
redis.call('LPUSH', KEYS[3 * n + 3 + best], ARGV[5] .. lease .. ARGV[6] .. cjson.encode(row[3]) .. ARGV[7])
redis.call('LREM', KEYS[3 * n + 3], 1, ARGV[4])
lease_replica(reps[best], ARGV[1], deadline, ttl, ARGV[3], KEYS[3 * n + 2], now)
return {1, ids[best], row[3], workers[best], row[4], deadline, epoch}
