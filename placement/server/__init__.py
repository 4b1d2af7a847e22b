"""The fleet's own Redis: `redis_server` runs a private redis-server on 127.0.0.1, with
the users of `acl` (caller, operator, fleet) and their rights.

Imports `placement.errors` only.
"""
