-- seen.lua: the broker's side, not the ledger's. Whether a call is on its way elsewhere:
-- a message that names its task id in any of the lists, or in kombu's unacked hash under
-- another delivery tag (tasks/presence.py). Lists are searched whole: for calls given
-- back after a worker died, not for every call.
-- KEYS[1] = kombu's unacked hash; KEYS[2..] = the lists to look in
-- ARGV[1] = the task id, ARGV[2] = the delivery tag of the message that asks (skipped)
-- Returns 1 when a message names the task id, else 0
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  if fields[i] ~= ARGV[2] and string.find(fields[i + 1], ARGV[1], 1, true) then return 1 end
end
for k = 2, #KEYS do
  for _, message in ipairs(redis.call('LRANGE', KEYS[k], 0, -1)) do
    if string.find(message, ARGV[1], 1, true) then return 1 end
  end
end
return 0
