-- renew.lua: the broker's side, not the ledger's. A Celery consumer's heartbeat: push its
-- record's deadline on while the record is still its own (tasks/broker/presence.py).
-- KEYS[1] = the consumers hash (node name -> record JSON)
-- ARGV[1] = node name, ARGV[2] = its token, ARGV[3] = '1' when it leaves (its deadline
--   becomes now, so the next sweep gives back whatever it still holds, and it is marked
--   `left`: it stopped on its own, so its request leases are its sent calls'), else '0'
-- Returns 1 | 0 when the record is another's or gone (a sweep found the node silent and
--   gave its calls back)
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local rec = cjson.decode(raw)
if rec.token ~= ARGV[2] or num(rec.gone_ms) > 0 then return 0 end
local now = now_ms()
if ARGV[3] == '1' then
  rec.deadline = now
  rec.left = true
else
  rec.deadline = now + num(rec.lease_ms)
end
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(rec))
return 1
