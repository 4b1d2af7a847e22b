"""Tenants in the workers: the queues each takes in turns by weight (`tenancy`), the
quotas a router holds their calls to (`quotas`), and their usage counted as calls end
(`accounting`)."""
