-- pick.lua: the fast path. Lease the least busy ready (HOT) replica of a model.
-- KEYS[1] = the model's replica set
-- KEYS[2..] = per replica, in ARGV order: deployment hash, leases zset, worker hash
-- KEYS[#KEYS] = the model's stats hash (a lease counts one 'hit')
-- ARGV[1] = lease id, ARGV[2] = lease length (ms), ARGV[3] = tie-break offset (integer)
-- ARGV[4..] = replica ids, then after them the worker id each replica had, in order
-- Returns {1, replica, queue, worker, gpus_json, lease_deadline_ms, epoch}
--       | {0}                no replica is ready: take the router path
--       | {-1, replica ids}  the caller's replica list is stale: here is the current one
local n = (#ARGV - 3) / 2
local members = redis.call('SMEMBERS', KEYS[1])
if #members ~= n then return {-1, unpack(members)} end
for i = 1, n do
  if redis.call('SISMEMBER', KEYS[1], ARGV[3 + i]) == 0 then return {-1, unpack(members)} end
end
local now = now_ms()
local best, best_load = nil, nil
local offset = tonumber(ARGV[3])
for j = 0, n - 1 do
  local i = (j + offset) % n + 1
  local base = 1 + (i - 1) * 3
  local dep, leases, worker_key = KEYS[base + 1], KEYS[base + 2], KEYS[base + 3]
  local level, worker = unpack(redis.call('HMGET', dep, 'level', 'worker'))
  if worker ~= ARGV[3 + n + i] then return {-1, unpack(members)} end
  if level == 'HOT' and num(redis.call('HGET', worker_key, 'lease_deadline')) > now then
    local load = live_leases(leases, now)
    if best == nil or load < best_load then best, best_load = i, load end
  end
end
if best == nil then return {0} end
local base = 1 + (best - 1) * 3
local deadline = now + tonumber(ARGV[2])
redis.call('ZADD', KEYS[base + 2], deadline, ARGV[1])
if redis.call('PTTL', KEYS[base + 2]) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[base + 2], ARGV[2])  -- lost clients leak nothing
end
redis.call('HSET', KEYS[base + 1], 'last_used', now)
redis.call('HINCRBY', KEYS[#KEYS], 'hit', 1)
local queue, gpus, epoch = unpack(redis.call('HMGET', KEYS[base + 1], 'queue', 'gpus', 'epoch'))
return {1, ARGV[3 + best], queue, ARGV[3 + n + best], gpus, deadline, num(epoch)}
