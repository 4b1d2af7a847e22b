"""The teams sharing a fleet, in the registry: their records (`tenants`), their quotas'
running slots and parked calls (`quotas`), and what their calls used (`usage`)."""
