"""Placement: the Redis ledger of GPU memory, the pure policy, sizes and the model catalog.

Imports neither `tasks` nor `worker`, and nothing heavy (torch, Celery) at import time.
"""
