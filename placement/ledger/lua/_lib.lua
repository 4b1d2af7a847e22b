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

-- Request leases whose deadline is still ahead (pick.lua sweeps the rest).
local function live_leases(leases_key, now)
  return redis.call('ZCOUNT', leases_key, '(' .. now, '+inf')
end

local function event(stream, maxlen, now, kind, replica, model, ...)
  redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*',
    'kind', kind, 'replica', replica, 'model', model, 'at', now, ...)
end

-- Count `value` in histogram `name` of the hash `key` (`placement.ledger.figures.histograms`): one
-- more in the bucket of the first of `bounds` (their labels, as Python writes them) at or
-- above it ('+Inf' past the last), and in the histogram's count and sum.
local function observe(key, name, value, bounds)
  local bucket = '+Inf'
  for _, b in ipairs(bounds) do
    if value <= tonumber(b) then
      bucket = b
      break
    end
  end
  redis.call('HINCRBY', key, name .. ':' .. bucket, 1)
  redis.call('HINCRBY', key, name .. '_count', 1)
  redis.call('HINCRBYFLOAT', key, name .. '_sum', value)
end

-- A replica is evicted (whatever the cause): count its age, in seconds from its placement
-- on its GPUs (`placed_at`, commit.lua) to `now`, in its model's cache figures
-- (`placement.ledger.figures.cache`). `v.cache` is the key index of the model's cache hash and
-- `bounds` the age histogram's bucket labels. A record placed before `placed_at` was
-- written has no age to count.
local function count_eviction(v, dep_key, now, bounds)
  local placed = num(redis.call('HGET', dep_key, 'placed_at'))
  if placed <= 0 then return end
  observe(K(v.cache), 'eviction_age', math.max(0, now - placed) / 1000, bounds)
end

-- A replica's record, read once: the fields scripts and the helpers below use, with
-- `gpus` (GPU id -> bytes it holds) decoded. `level` is nil when there is no record.
-- `cached` is what its copy takes in a host's warm cache: the bytes its worker measured
-- (`copy_bytes`, set only while LOADING, so every charge and credit agree), else `size`.
local function record(dep_key)
  local f = redis.call('HMGET', dep_key, 'level', 'model', 'worker', 'epoch', 'size',
    'dedicated', 'gpus', 'copy_bytes')
  local gpus = {}
  if f[7] and f[7] ~= '' then gpus = cjson.decode(f[7]) end
  local size, copy = num(f[5]), num(f[8])
  local cached = size
  if copy > 0 then cached = copy end
  return {level = f[1], model = f[2], worker = f[3], epoch = num(f[4]), size = size,
    cached = cached, dedicated = f[6], gpus = gpus}
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

-- Tell a worker's keeper to look at a replica now (docs/worker.md): push its id on the
-- worker's control list, which the keeper pops without waiting behind calls.
local function notify(control_key, replica)
  if redis.call('LPUSH', control_key, replica) > 1000 then
    redis.call('LTRIM', control_key, 0, 999)
  end
end

-- Add (sign 1) or take back (-1) a record's bytes on each of its GPUs, in one counter.
-- `refs` = [{id, key}] names the GPUs of the record (same_gpus checked by callers).
local function add_gpus(r, refs, field, sign)
  for _, ref in ipairs(refs) do
    redis.call('HINCRBY', K(ref.key), field, sign * num(r.gpus[ref.id]))
  end
end

-- A model gains (1) or loses (-1) a placed replica: its `active` count follows, and its
-- `changes` count grows, so a scaling decision made before this change is refused.
-- `v` = {active, changes}: the two hashes' key indexes.
local function count_placed(v, model, delta)
  redis.call('HINCRBY', K(v.active), model, delta)
  redis.call('HINCRBY', K(v.changes), model, 1)
end

-- The model's `changes` count is still `seen` (what a scaling decision saw), or seen < 0.
local function unchanged_since(v, model, seen)
  return seen < 0 or num(redis.call('HGET', K(v.changes), model)) == seen
end

local RESERVING = {WAITING = true, LOADING = true, HOT = true, DRAINING = true}
local ON_DEVICE = {LOADING = true, HOT = true, DRAINING = true, OFFLOADING = true, DROPPING = true}

-- Start taking a replica off its GPUs: it leaves the plan (`reserved`, the model's
-- active count) at once and goes OFFLOADING (its host's warm cache is charged now) or
-- DROPPING; its copy stays in `held` until its worker settles (settle.lua). `v` is a JSON
-- reference: {replica, dep, active, changes, host, gpus=[{id, key}]}; `r` its record.
local function leave(v, r, to, now)
  local dep_key = K(v.dep)
  add_gpus(r, v.gpus, 'reserved', -1)
  count_placed(v, r.model, -1)
  if to == 'WARM' then
    redis.call('HINCRBY', K(v.host), 'warm_used', r.cached)
    redis.call('HSET', dep_key, 'level', 'OFFLOADING', 'since', now)
  else
    redis.call('HSET', dep_key, 'level', 'DROPPING', 'since', now)
  end
end

-- Drop a WARM copy to COLD and give its bytes back to the host's warm cache.
-- `w` is a JSON reference: {replica, dep, worker_deps, host, host_warm}; `r` its record.
local function drop_warm(w, r, now)
  redis.call('HINCRBY', K(w.host), 'warm_used', -r.cached)
  redis.call('SREM', K(w.host_warm), w.replica)
  redis.call('HSET', K(w.dep), 'level', 'COLD', 'worker', '', 'queue', '', 'host', '',
    'since', now)
  redis.call('SREM', K(w.worker_deps), w.replica)
end

-- The GPU ids of the CUDA contexts a worker keeps on GPUs it does not own: its
-- `contexts` list, which commit.lua and register.lua extend and reap.lua releases.
local function contexts_of(worker_key)
  local listed = redis.call('HGET', worker_key, 'contexts')
  if listed and listed ~= '' then return cjson.decode(listed) end
  return {}
end

-- Add the GPU ids `ids` to a worker's `contexts` list, each once.
local function list_contexts(worker_key, ids)
  if #ids == 0 then return end
  local contexts, known = contexts_of(worker_key), {}
  for _, id in ipairs(contexts) do known[id] = true end
  for _, id in ipairs(ids) do
    if not known[id] then
      table.insert(contexts, id)
      known[id] = true
    end
  end
  redis.call('HSET', worker_key, 'contexts', cjson.encode(contexts))
end

-- The bytes of the CUDA context `worker` keeps on the GPU at `key` (a GPU it does not own,
-- charged by commit.lua as `ctx:<worker>`) that are not in `held` yet: they join it with
-- the first of the worker's placements there that may be on the device (LOADING).
local function unheld_context(key, worker)
  local bytes, joined = unpack(redis.call('HMGET', key, 'ctx:' .. worker, 'ctx_held:' .. worker))
  if not bytes or joined then return 0 end
  return num(bytes)
end

-- Count `bytes` of `worker`'s context on the GPU at `key` in `held` (see unheld_context):
-- the context is open now, so no WAITING placement keeps the charge any more (wait_context).
local function hold_context(key, worker, bytes)
  if bytes > 0 then
    redis.call('HINCRBY', key, 'held', bytes)
    redis.call('HSET', key, 'ctx_held:' .. worker, 1)
    redis.call('HDEL', key, 'ctx_wait:' .. worker)
  end
end

-- One more WAITING placement of `worker` relies on its context charge at `key`, which no
-- load has opened yet: `ctx_wait:<worker>` counts them, so the last to go COLD without a
-- load gives the charge back (forget_context).
local function wait_context(key, worker)
  redis.call('HINCRBY', key, 'ctx_wait:' .. worker, 1)
end

-- A WAITING placement of `worker` on the GPU at `key` went COLD. If it was the last one
-- relying on a context charge that no load opened, the context was never opened: the
-- charge leaves `reserved`. (The GPU stays in the worker's `contexts` list; reap.lua
-- finds no charge there.)
local function forget_context(key, worker)
  local bytes, joined, waiting = unpack(redis.call('HMGET', key, 'ctx:' .. worker,
    'ctx_held:' .. worker, 'ctx_wait:' .. worker))
  if not bytes or joined or not waiting then return end
  if num(waiting) > 1 then
    redis.call('HINCRBY', key, 'ctx_wait:' .. worker, -1)
  else
    redis.call('HINCRBY', key, 'reserved', -num(bytes))
    redis.call('HDEL', key, 'ctx:' .. worker, 'ctx_wait:' .. worker)
  end
end

-- Forget a replica wherever it is: every counter its level contributes to is given
-- back, its request leases end (their calls are routed again) and it goes COLD with no
-- holder; a WAITING one gives back a CUDA context charge no load opened (forget_context).
-- `v` is a JSON reference:
-- {replica, dep, leases, active, changes, worker_deps, host, host_warm, gpus=[{id, key}]};
-- `r` its record.
local function to_cold(v, r, now)
  local level = r.level
  if RESERVING[level] then
    add_gpus(r, v.gpus, 'reserved', -1)
    count_placed(v, r.model, -1)
  end
  if level == 'WAITING' then
    for _, g in ipairs(v.gpus) do forget_context(K(g.key), r.worker) end
  end
  if ON_DEVICE[level] then add_gpus(r, v.gpus, 'held', -1) end
  if level == 'OFFLOADING' or level == 'WARM' then
    redis.call('HINCRBY', K(v.host), 'warm_used', -r.cached)
    redis.call('SREM', K(v.host_warm), v.replica)
  end
  redis.call('HSET', K(v.dep), 'level', 'COLD', 'gpus', '{}', 'fraction', 0, 'limit', 0,
    'worker', '', 'queue', '', 'host', '', 'since', now)
  redis.call('SREM', K(v.worker_deps), v.replica)
  redis.call('DEL', K(v.leases))
end

-- True when a placement is admitted on the device now: every GPU's `held` bytes plus the
-- replica's admission need (its limit on one GPU, its bytes per shard) fit its total.
local function fits_device(gpus)
  for _, g in ipairs(gpus) do
    local total, held = unpack(redis.call('HMGET', K(g.key), 'total', 'held'))
    if num(held) + math.max(num(g.limit), num(g.bytes)) > num(total) then return false end
  end
  return true
end

-- The replica list pick.lua and forward.lua are called with: per replica i of `n`, its
-- keys {dep, leases, worker} at KEYS[3i - 1 .. 3i + 1], its id ARGV[a + i], the worker
-- it had ARGV[a + n + i] and, when `with_queues`, the queue it had ARGV[a + 2n + i].
local function listed_replicas(n, a, with_queues)
  local reps, ids, workers, queues = {}, {}, {}, nil
  if with_queues then queues = {} end
  for i = 1, n do
    local base = 1 + (i - 1) * 3
    reps[i] = {dep = KEYS[base + 1], leases = KEYS[base + 2], worker = KEYS[base + 3]}
    ids[i], workers[i] = ARGV[a + i], ARGV[a + n + i]
    if queues then queues[i] = ARGV[a + 2 * n + i] end
  end
  return reps, ids, workers, queues
end

-- The replica for a prefix no ready replica was sent (`best` is the least busy, first by
-- id, with `best_load` leases). It goes by the load prefixes bring where they bring any
-- (the model's calls hit a prefix at least as often as they start a new one) and its
-- calls in flight could keep every ready replica busy (at least as many): of the replicas
-- within the spill of the least busy, the one sent the fewest new prefixes (then the less
-- busy, then the first by id), so new prefixes spread evenly, a new replica first.
-- Otherwise it stays `best`, as without a prefix: calls that share nothing are routed by
-- load alone, and a surplus replica under light load stays idle and is scaled in.
local function choose_new(prefix, ids, loads, best, best_load)
  local near, fields, busy, ready = {}, {}, 0, 0
  for i = 1, #ids do
    local load = loads[i]
    if load ~= nil then
      busy, ready = busy + load, ready + 1
      if load <= best_load + prefix.spill then
        near[#near + 1] = i
        fields[#fields + 1] = '#' .. ids[i]
      end
    end
  end
  if busy < ready then return best end
  local seen = redis.call('HMGET', prefix.stats, 'prefix_hit', 'prefix_new')
  if num(seen[1]) < math.max(1, num(seen[2])) then return best end
  local sent = redis.call('HMGET', prefix.map, unpack(fields))
  local fewest = nil
  for j, i in ipairs(near) do
    local n = num(sent[j])
    if fewest == nil or n < fewest or (n == fewest and loads[i] < loads[best]) then
      best, fewest = i, n
    end
  end
  return best
end

-- pick.lua's rule, shared with forward.lua. Of the replicas `listed_replicas` read (and,
-- when `queues` is given, whose queue is still the one listed), the least busy HOT one
-- whose worker's lease is live; ties to the first. Returns {i, row = {level, worker,
-- queue, gpus, epoch}, now, deadline = now + `ttl`}, or nil and the script's reply: {0}
-- when none is ready, {-1, the current ids} when the caller's list is stale (the model's
-- set KEYS[1] holds other ids, or a replica's worker or queue changed).
-- With a `prefix` (`read_prefix`'s), the ready replica its call's longest prefix was
-- last sent to is chosen instead while it has at most `prefix.spill` more live leases
-- than the least busy one; a prefix no ready replica was sent, by `choose_new`.
-- `c.reason` says which rule chose: 'hit' (the prefix's replica), 'spill' (it was too
-- busy), 'new' (no ready replica had been sent the prefix) or '' (no prefix).
-- `c.loads` holds the ready replicas' live leases, by index.
local function choose_replica(reps, ids, workers, queues, ttl, prefix)
  local members = redis.call('SMEMBERS', KEYS[1])
  local stale = {-1, unpack(members)}
  if #members ~= #ids then return nil, stale end
  local listed = {}
  for _, id in ipairs(ids) do listed[id] = true end
  for _, m in ipairs(members) do
    if not listed[m] then return nil, stale end
  end
  local now = now_ms()
  local best, best_load = nil, nil
  local loads, rows = {}, {}
  for i, rep in ipairs(reps) do
    local row = redis.call('HMGET', rep.dep, 'level', 'worker', 'queue', 'gpus', 'epoch')
    if (row[2] or '') ~= workers[i] then return nil, stale end  -- '' lists no worker
    if queues and row[1] == 'HOT' and row[3] ~= queues[i] then return nil, stale end
    if row[1] == 'HOT' and num(redis.call('HGET', rep.worker, 'lease_deadline')) > now then
      local load = live_leases(rep.leases, now)
      loads[i], rows[i] = load, row
      if best_load == nil or load < best_load then best, best_load = i, load end
    end
  end
  if best == nil then return nil, {0} end
  local reason = ''
  if prefix and prefix.hashes[1] then
    local owner = nil
    for d = #prefix.hashes, 1, -1 do  -- the longest prefix a ready replica was sent
      local o = prefix.owners[d]
      local at = o and prefix.at[o]
      if at and loads[at] ~= nil then owner = at break end
    end
    if owner == nil then
      best, reason = choose_new(prefix, ids, loads, best, best_load), 'new'
    elseif loads[owner] <= best_load + prefix.spill then
      best, reason = owner, 'hit'
    else
      reason = 'spill'
    end
  end
  return {i = best, row = rows[best], now = now, deadline = now + ttl, reason = reason,
          loads = loads}
end

-- A call's prefix chain (ARGV[a + 1 .. a + k], shortest first: `placement.rules.prefixes`)
-- read against the model's prefix map `map` (digest -> the replica that prefix was last
-- sent to): the replica each digest names (`owners`, false for none), and each listed
-- replica's index by id (`at`); `stats` is the model's stats hash (its prefix counts).
local function read_prefix(map, stats, a, k, spill, ids)
  local p = {hashes = {}, owners = {}, at = {}, spill = spill, map = map, stats = stats}
  if k == 0 then return p end
  for d = 1, k do p.hashes[d] = ARGV[a + d] end
  for i, id in ipairs(ids) do p.at[id] = i end
  p.owners = redis.call('HMGET', map, unpack(p.hashes))
  return p
end

-- Note that the call's prefixes no ready replica was sent went to replica `id` (those a
-- ready replica was sent stay with it: a spill does not move a prefix; those of a replica
-- evicted, draining or without its worker move), and, for a new prefix, that `id` owns
-- one more (under '#' .. id: digests are hex); count the rule that chose in the model's
-- stats as a counted call; and clear the map past `limit` (UNLINK: freed off the script's
-- time).
local function note_prefix(p, c, id, path, limit)
  local reason = c.reason
  if not p.hashes[1] then return end
  if path == 'fast' or path == 'router' then
    redis.call('HINCRBY', p.stats, 'prefix_' .. reason, 1)
  end
  local owners = p.owners
  if redis.call('HLEN', p.map) > limit then
    redis.call('UNLINK', p.map)
    owners = {}
  end
  local pairs_ = {}
  for d, h in ipairs(p.hashes) do
    local o = owners[d]
    if not (o and p.at[o] and c.loads[p.at[o]] ~= nil) then
      pairs_[#pairs_ + 1] = h
      pairs_[#pairs_ + 1] = id
    end
  end
  if pairs_[1] then
    redis.call('HSET', p.map, unpack(pairs_))
  end
  if reason == 'new' then
    redis.call('HINCRBY', p.map, '#' .. id, 1)
  end
end

-- Lease replica `rep` (keys as `listed_replicas` reads them) until `deadline` under `lease_id`, and
-- count the call in the model's stats hash `stats_key` as `path` says (pick.lua's ARGV[3]).
local function lease_replica(rep, lease_id, deadline, ttl, path, stats_key, now)
  redis.call('ZREMRANGEBYSCORE', rep.leases, '-inf', now)
  redis.call('ZADD', rep.leases, deadline, lease_id)
  if redis.call('PTTL', rep.leases) < ttl then
    redis.call('PEXPIRE', rep.leases, ttl)  -- lost clients leak nothing
  end
  redis.call('HSET', rep.dep, 'last_used', now)
  if path == 'fast' or path == 'router' then
    redis.call('HINCRBY', stats_key, 'hit', 1)
    redis.call('HINCRBY', stats_key, path == 'fast' and 'fast' or 'routed', 1)
  end
end
