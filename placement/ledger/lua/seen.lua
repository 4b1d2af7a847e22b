-- seen.lua: the broker's side, not the ledger's. Whether a call given back to a router
-- should yield to another message of the same call (tasks/broker/presence.py): one that was
-- never given back (a hand-off or a retry its router published before it died), or one
-- given back too whose delivery tag sorts first, so that of two given-back copies
-- exactly one goes on. Lists are searched whole: for given-back calls, not for every one.
-- KEYS[1] = kombu's unacked hash; KEYS[2..] = the lists to look in
-- ARGV[1] = the task id, ARGV[2] = the delivery tag of the message that asks
-- Returns 1 when it should yield, else 0
local function yields_to(payload)
  local headers = payload.headers or {}
  if headers.id ~= ARGV[1] then return false end  -- it only mentions the call
  local tag = (payload.properties or {}).delivery_tag or ''
  if tag == ARGV[2] then return false end  -- itself
  if headers.redelivered ~= true then return true end
  return tag < ARGV[2]
end

local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  local record = fields[i + 1]
  if fields[i] ~= ARGV[2] and string.find(record, ARGV[1], 1, true) then
    local ok, decoded = pcall(cjson.decode, record)
    if ok and type(decoded) == 'table' and yields_to(decoded[1] or {}) then return 1 end
  end
end
for k = 2, #KEYS do
  for _, message in ipairs(redis.call('LRANGE', KEYS[k], 0, -1)) do
    if string.find(message, ARGV[1], 1, true) then
      local ok, decoded = pcall(cjson.decode, message)
      if ok and type(decoded) == 'table' and yields_to(decoded) then return 1 end
    end
  end
end
return 0
