-- claim.lua: hold a Celery broker database for one fleet (tasks/broker/claim.py).
-- KEYS[1] = the claim key, `gpufleet:broker-fleet`: the broker database's own, outside
--           every fleet's `gpufleet:{fleet}:` keys (one database carries one fleet)
-- ARGV[1] = fleet name, ARGV[2] = seconds the claim lives unless renewed
-- A claim that is free or this fleet's is (re)set to live ARGV[2] seconds; another fleet's
-- is left as it is.
-- Returns false when this fleet holds the database now, else the fleet that holds it.
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return holder end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return false
