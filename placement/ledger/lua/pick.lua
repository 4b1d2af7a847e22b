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
local members = redis.call('SMEMBERS', KEYS[1])
if #members ~= n then return {-1, unpack(members)} end
local listed = {}
for i = 1, n do listed[ARGV[3 + i]] = true end
for _, m in ipairs(members) do
  if not listed[m] then return {-1, unpack(members)} end
end
local now = now_ms()
local best, best_load, best_row = nil, nil, nil
for i = 1, n do
  local base = 1 + (i - 1) * 3
  local row = redis.call('HMGET', KEYS[base + 1], 'level', 'worker', 'queue', 'gpus', 'epoch')
  if row[2] ~= ARGV[3 + n + i] then return {-1, unpack(members)} end
  if row[1] == 'HOT' and num(redis.call('HGET', KEYS[base + 3], 'lease_deadline')) > now then
    local load = live_leases(KEYS[base + 2], now)
    if best == nil or load < best_load then best, best_load, best_row = i, load, row end
  end
end
if best == nil then return {0} end
local base = 1 + (best - 1) * 3
local leases = KEYS[base + 2]
local deadline = now + tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', leases, '-inf', now)
redis.call('ZADD', leases, deadline, ARGV[1])
if redis.call('PTTL', leases) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', leases, ARGV[2])  -- lost clients leak nothing
end
redis.call('HSET', KEYS[base + 1], 'last_used', now)
if ARGV[3] == 'fast' or ARGV[3] == 'router' then
  redis.call('HINCRBY', KEYS[#KEYS], 'hit', 1)
  redis.call('HINCRBY', KEYS[#KEYS], ARGV[3] == 'fast' and 'fast' or 'routed', 1)
end
return {1, ARGV[3 + best], best_row[3], ARGV[3 + n + best], best_row[4], deadline, num(best_row[5])}
