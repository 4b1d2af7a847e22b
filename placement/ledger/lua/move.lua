-- move.lua: the broker's side, not the ledger's. A message a consumer took into its
-- in-flight list goes on to another queue instead of being recorded as unacknowledged
-- (tasks/broker/transport.py, `Channel.divert`), in one step: never in both lists, nor in neither.
-- Broker keys carry no fleet hash tag: kombu names them (see redeliver.lua).
-- KEYS[1] = the list it goes to (the queue's list for its priority)
-- KEYS[2] = the in-flight list it was taken into
-- ARGV[1] = the message to push, ARGV[2] = the message as taken
-- Returns 1 when it moved, 0 when it was no longer in flight (nothing pushed).
-- The push comes before the removal: a push that fails (a key of another type) changes
-- nothing, since Redis does not undo what a failing script did before the error.
if not redis.call('LPOS', KEYS[2], ARGV[2]) then return 0 end
redis.call('LPUSH', KEYS[1], ARGV[1])
redis.call('LREM', KEYS[2], 1, ARGV[2])
return 1
