-- learn.lua: record a model's measured peak bytes; later placements prefer it.
-- KEYS[1] = learned hash (model -> bytes), KEYS[2] = events stream
-- ARGV[1] = model, ARGV[2] = measured bytes, ARGV[3] = events max length
-- Returns the previous figure, or 0.
local before = num(redis.call('HGET', KEYS[1], ARGV[1]))
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
event(KEYS[2], ARGV[3], now_ms(), 'measured', '', ARGV[1], 'bytes', ARGV[2], 'before', before)
return before
