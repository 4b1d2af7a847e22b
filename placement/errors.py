"""The one error hierarchy of gpufleet.

Every class takes a single human-readable message, so Celery can carry it across
processes with the JSON serializer and rebuild it on the caller's side. Messages say
what went wrong and what to do about it.
"""

from __future__ import annotations


class GpufleetError(Exception):
    """Root of every error gpufleet raises on purpose."""


class ConfigError(GpufleetError):
    """A setting or environment variable holds a value gpufleet cannot use."""


class MemorySizeError(ConfigError, ValueError):
    """A memory string such as "8GiB" could not be parsed."""


class CatalogError(ConfigError):
    """The model catalog is missing, malformed, or has an invalid field."""


class UnknownModelError(GpufleetError, LookupError):
    """The caller named a model that is not in the catalog."""


class UnknownAdapterError(UnknownModelError):
    """The caller named an adapter that its base model does not list."""


class UnknownReplicaError(GpufleetError, LookupError):
    """The caller named a replica the model does not have."""


class EstimateError(GpufleetError):
    """A model's memory could not be estimated from its config."""


class CheckpointError(GpufleetError):
    """A model's weight files are truncated or malformed; re-save or re-download the model."""


class UnsupportedCheckpointError(CheckpointError):
    """The fast loader cannot read this checkpoint as is; transformers' loader takes over."""


class PlacementError(GpufleetError):
    """A model could not be placed on the fleet."""


class CantAccommodateError(PlacementError):
    """No GPU can take the model now, even after every allowed eviction."""


class NeverFitsError(CantAccommodateError):
    """The model is larger than any GPU set of the fleet could ever hold."""


class SettlingError(PlacementError):
    """A copy of the model is leaving its GPU right now; the call is routed again shortly."""


class PlanRejectedError(PlacementError):
    """The registry refused a plan because the fleet changed; plan again on a fresh snapshot."""


class AtFloorError(PlacementError):
    """Scaling in would take a model below its `replicas: {min}`; the replica stays."""


class ScaledSinceError(PlacementError):
    """A model's replicas changed after a scaling decision about it; the next look decides again."""


class WarmCopyGoneError(PlacementError):
    """A neighbour's warm copy was gone or changed while it was read; the load reads the disk."""


class RegistryError(GpufleetError):
    """The registry refused an operation or could not be reached."""


class AccessDeniedError(RegistryError):
    """The Redis user of this URL may not do that (docs/deploy.md, "Security")."""


class GpuOwnedError(RegistryError):
    """A GPU is already owned by another live worker."""


class BrokerInUseError(ConfigError):
    """The broker's Redis database already carries another fleet's calls."""


class LeaseLostError(RegistryError):
    """A worker's lease expired; its reservations are released and it must re-register."""


class EvictedError(GpufleetError):
    """The replica left the GPU before the request reached it; route the request again."""


class PayloadError(GpufleetError, ValueError):
    """A request's inputs or params are malformed."""


class AdapterError(PayloadError):
    """An adapter's files are damaged or do not fit its base model; the operator must fix it."""


class UnknownTenantError(GpufleetError, LookupError):
    """No tenant of the fleet has that name; `gpufleet tenant list` names them."""


class QuotaError(GpufleetError):
    """A tenant has as many calls waiting as its `--max-queued` allows; send it again later."""


class FleetStoppedError(GpufleetError):
    """The fleet stopped before the call ran; send it again once a fleet runs."""


def describe(value: object, limit: int = 80) -> str:
    """A caller's value as an error message may quote it: short, and typed.

    Strings and numbers are quoted up to `limit` characters; anything else only by type
    (never repr an arbitrary object: it may be huge or hostile).
    """
    if isinstance(value, (bool, int, float, str)) or value is None:
        text = repr(value)
        text = text if len(text) <= limit else text[: limit - 3] + "..."
        return f"{text} ({type(value).__name__})"
    return type(value).__name__
