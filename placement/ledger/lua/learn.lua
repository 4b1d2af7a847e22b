-- learn.lua: record a model's measured peak bytes; later placements prefer it.
-- KEYS[1] = learned hash (model -> bytes), KEYS[2] = events stream
-- ARGV[1] = model, ARGV[2] = measured bytes, ARGV[3] = events max length
-- The figure only grows: it is the most a replica of the model was seen to need (a load
-- and its warm-up, or a larger call since), so a replica placed on it fits those calls.
-- Returns the previous figure, or 0.
local before = num(redis.call('HGET', KEYS[1], ARGV[1]))
if tonumber(ARGV[2]) > before then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  event(KEYS[2], ARGV[3], now_ms(), 'measured', '', ARGV[1], 'bytes', ARGV[2], 'before', before)
end
return before
