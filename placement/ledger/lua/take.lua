-- take.lua: the broker's side, not the ledger's. Take a consumer's next message the way
-- kombu's BRPOP would (the first non-empty list, from its right end), but move it into
-- that list's in-flight list for this consumer instead of out of Redis (tasks/broker/transport.py).
-- KEYS[1..n] = the lists to take from, in order (each queue by priority, as BRPOP's keys)
-- KEYS[n+1..2n] = the in-flight list of each, in the same order
-- Returns {list, message}, or nil when every list is empty.
-- LMOVE moves in one step: it checks both keys' types and Redis's memory cap before it
-- pops, so a key of another type or a full Redis fails the take and loses nothing (a pop
-- then a push could fail between the two, and Redis does not undo a script's writes).
local n = #KEYS / 2
for i = 1, n do
  local message = redis.call('LMOVE', KEYS[i], KEYS[n + i], 'RIGHT', 'LEFT')
  if message then
    return {KEYS[i], message}
  end
end
return false
