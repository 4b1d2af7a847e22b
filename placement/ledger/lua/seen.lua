-- seen.lua: the broker's side, not the ledger's. Whether a call given back to a router
-- should yield to another message of the same call (tasks/broker/presence.py): one that was
-- never given back (a hand-off or a retry its router published before it died), or one
-- given back too whose delivery tag sorts first, so that of two given-back copies
-- exactly one goes on. Lists are searched whole: for given-back calls, not for every one.
-- A public queue's messages (its lists, and the unacked records of messages taken from
-- it) are as their callers sent them, under the caller's own task id: the call's
-- tenant's are searched for that id, and no other tenant's at all.
-- KEYS[1] = kombu's unacked hash; KEYS[2..] = the lists to look in: the fleet's, then
--   from KEYS[ARGV[4]] on, its tenant's public queue's (with theirs in flight)
-- ARGV[1] = the fleet's id of the call, ARGV[2] = the delivery tag of the message that
--   asks, ARGV[3] = the task id its caller gave it, ARGV[4] = the index of its first
--   public list, ARGV[5] = its tenant's public queue
-- Returns 1 when it should yield, else 0
local function yields_to(payload, id)
  local headers = payload.headers or {}
  if headers.id ~= id then return false end  -- it only mentions the call
  local tag = (payload.properties or {}).delivery_tag or ''
  if tag == ARGV[2] then return false end  -- itself
  if headers.redelivered ~= true then return true end
  return tag < ARGV[2]
end

-- a public queue: the router's `celery`, or a tenant's `t.<name>.celery`
-- (tasks/config.py is_public, placement/ledger/tenancy/tenants.py)
local function public(queue)
  return queue == 'celery' or string.match(queue, '^t%.[^.]+%.celery$') ~= nil
end

local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  local record = fields[i + 1]
  if fields[i] ~= ARGV[2] and string.find(record, ARGV[3], 1, true) then
    local ok, decoded = pcall(cjson.decode, record)
    if ok and type(decoded) == 'table' then
      local queue = type(decoded[3]) == 'string' and decoded[3] or ''
      local id = ARGV[1]
      if queue == ARGV[5] then id = ARGV[3] elseif public(queue) then id = nil end
      if id and yields_to(decoded[1] or {}, id) then return 1 end
    end
  end
end
local first_public = tonumber(ARGV[4])
for k = 2, #KEYS do
  local id = k < first_public and ARGV[1] or ARGV[3]
  for _, message in ipairs(redis.call('LRANGE', KEYS[k], 0, -1)) do
    if string.find(message, id, 1, true) then
      local ok, decoded = pcall(cjson.decode, message)
      if ok and type(decoded) == 'table' and yields_to(decoded, id) then return 1 end
    end
  end
end
return 0
