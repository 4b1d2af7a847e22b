-- redeliver.lua: the broker's side, not the ledger's. Give back what a Celery consumer
-- held (kombu's unacked hash, its in-flight lists) or what waits on a queue no live worker
-- serves, each message at most once, and only while the consumer's record is still the
-- one the caller planned from (tasks/broker/presence.py). Broker keys carry no fleet hash tag:
-- kombu names them, and one broker database carries one fleet (tasks/broker/claim.py).
-- KEYS[1] = the consumers hash (node name -> record JSON)
-- KEYS[2] = kombu's unacked hash, KEYS[3] = kombu's unacked index (zset)
-- KEYS[4] = the node's set of unacked delivery tags
-- KEYS[5..] = the lists the moves name, by index
-- ARGV[1] = JSON {node, expect = the record read ('' for none),
--   record = {token, role, queues, lease_ms} (the node arrives: a new record)
--          | {gone = true} (the node is silent or left: keep its record, dead)
--          | {delete = true} (forget the node),
--   moves = [{tag (a delivery tag in the unacked hash) | from (a list's key index),
--             old (what must be there), to (a list's key index),
--             new (the message to push; '' drops it: its answer is stored)}],
--   in the order they are to be served,
--   rejoin = true: a node found silent comes back; keep its set of tags (it runs them)}
-- Returns {1, moved, dropped} | {0, 'CHANGED'} (the record changed: plan again)
local a = cjson.decode(ARGV[1])
local current = redis.call('HGET', KEYS[1], a.node) or ''
if current ~= a.expect then return {0, 'CHANGED'} end
local now = now_ms()
local pushes, moved, dropped = {}, 0, 0
for _, m in ipairs(a.moves) do
  local present = false
  if m.tag then
    if redis.call('HGET', KEYS[2], m.tag) == m.old then
      redis.call('HDEL', KEYS[2], m.tag)
      redis.call('ZREM', KEYS[3], m.tag)
      present = true
    end
  else
    present = redis.call('LREM', K(m.from), -1, m.old) == 1  -- oldest at the right end
  end
  if present then
    if m.new == '' then
      dropped = dropped + 1
    else
      pushes[#pushes + 1] = m
      moved = moved + 1
    end
  end
end
-- Consumers take from the right: the first to serve is pushed last, to be first in line.
for i = #pushes, 1, -1 do redis.call('RPUSH', K(pushes[i].to), pushes[i].new) end
if not a.rejoin then
  redis.call('DEL', KEYS[4])  -- every tag it named is given back, acknowledged or stale
end
local r = a.record
if r.delete then
  redis.call('HDEL', KEYS[1], a.node)
elseif r.gone then
  local rec = cjson.decode(current)
  if num(rec.gone_ms) == 0 then
    rec.gone_ms = now
    redis.call('HSET', KEYS[1], a.node, cjson.encode(rec))
  end
else
  redis.call('HSET', KEYS[1], a.node, cjson.encode({token = r.token, role = r.role,
    queues = r.queues, lease_ms = r.lease_ms, deadline = now + r.lease_ms, since = now,
    gone_ms = 0}))
end
return {1, moved, dropped}
