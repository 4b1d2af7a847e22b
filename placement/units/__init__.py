"""Units: memory sizes, durations and GPU types, as people write them and as the fleet
counts them. Imports only `placement.errors`.
"""
