-- take.lua: the broker's side, not the ledger's. Take a consumer's next message the way
-- kombu's BRPOP would (the first non-empty list, from its right end), but move it into
-- that list's in-flight list for this consumer instead of out of Redis (tasks/transport.py).
-- KEYS[1..n] = the lists to take from, in order (each queue by priority, as BRPOP's keys)
-- KEYS[n+1..2n] = the in-flight list of each, in the same order
-- ARGV: none
-- Returns {list, message}, or nil when every list is empty.
local n = #KEYS / 2
for i = 1, n do
  local message = redis.call('RPOP', KEYS[i])
  if message then
    redis.call('LPUSH', KEYS[n + i], message)
    return {KEYS[i], message}
  end
end
return false
