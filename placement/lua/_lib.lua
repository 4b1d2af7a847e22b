-- _lib.lua: helpers prepended to every gpufleet script; not a script by itself.
-- Scripts whose key set depends on the plan take ARGV[1] as JSON that refers to
-- keys by their index in KEYS (K(i)); no script builds a key name.

local function K(i)
  local name = KEYS[tonumber(i)]
  if not name then error('gpufleet: key index ' .. tostring(i) .. ' not in KEYS') end
  return name
end

local function num(v)
  return tonumber(v) or 0
end

-- The registry's single clock, in milliseconds.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Request leases whose deadline has passed are dropped before counting.
local function live_leases(leases_key, now)
  redis.call('ZREMRANGEBYSCORE', leases_key, '-inf', now)
  return redis.call('ZCARD', leases_key)
end

local function event(stream, maxlen, now, kind, replica, model, ...)
  redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*',
    'kind', kind, 'replica', replica, 'model', model, 'at', now, ...)
end

-- GPU id -> bytes a deployment holds, from its record.
local function dep_gpus(dep_key)
  local raw = redis.call('HGET', dep_key, 'gpus')
  if not raw or raw == '' then return {} end
  return cjson.decode(raw)
end

-- True when the record's GPU ids are exactly the ids in `refs` ({id=..., key=...}).
local function same_gpus(held, refs)
  local n = 0
  for _ in pairs(held) do n = n + 1 end
  if n ~= #refs then return false end
  for _, ref in ipairs(refs) do
    if held[ref.id] == nil then return false end
  end
  return true
end

-- Move a deployment off its GPUs to WARM (kept by its worker, counted in its host's
-- warm cache) or COLD (dropped), releasing its bytes. `v` is a JSON reference:
-- {replica, dep, active, worker_deps, host, host_warm, gpus=[{id,key}]}.
local function move_off_gpu(v, to)
  local dep_key = K(v.dep)
  local held = dep_gpus(dep_key)
  for _, ref in ipairs(v.gpus) do
    redis.call('HINCRBY', K(ref.key), 'reserved', -held[ref.id])
  end
  redis.call('HINCRBY', K(v.active), redis.call('HGET', dep_key, 'model'), -1)
  if to == 'WARM' then
    redis.call('HINCRBY', K(v.host), 'warm_used', num(redis.call('HGET', dep_key, 'size')))
    redis.call('SADD', K(v.host_warm), v.replica)
    redis.call('HSET', dep_key, 'level', 'WARM', 'gpus', '{}', 'fraction', 0, 'limit', 0)
  else
    redis.call('HSET', dep_key, 'level', 'COLD', 'gpus', '{}', 'fraction', 0, 'limit', 0,
      'worker', '', 'queue', '', 'host', '')
    redis.call('SREM', K(v.worker_deps), v.replica)
  end
end

-- Drop a WARM copy to COLD and give its bytes back to the host's warm cache.
-- `w` is a JSON reference: {replica, dep, worker_deps, host, host_warm}.
local function drop_warm(w)
  local dep_key = K(w.dep)
  redis.call('HINCRBY', K(w.host), 'warm_used', -num(redis.call('HGET', dep_key, 'size')))
  redis.call('SREM', K(w.host_warm), w.replica)
  redis.call('HSET', dep_key, 'level', 'COLD', 'worker', '', 'queue', '', 'host', '')
  redis.call('SREM', K(w.worker_deps), w.replica)
end
