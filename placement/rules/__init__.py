"""The fleet's decision rules besides placement, pure: `batching` (which waiting calls
share one forward pass) and `scaling` (when a model gets a replica, and loses one).

Imports `placement.policy`, `placement.units` and `placement.errors`.
"""
