"""Domain errors shared by every service's core.

Core code raises these (it never imports grpc); each service's gRPC edge maps
them to status codes with `kvstash.common.rpc_errors.status_for`. Messages name the
quantities involved, e.g. "prompt has 900 tokens, max_model_len is 512".
"""

from __future__ import annotations

# Longest snapshot id any service accepts; longer is INVALID_ARGUMENT. (Request
# ids have their own limit: kvstash.common.ids.)
MAX_ID_CHARS = 128


def preview(value: str, limit: int = 40) -> str:
    """`value` quoted for an error message, cut to `limit` characters.

    Messages never echo more than this of what a client sent: a huge id must
    come back as a short INVALID_ARGUMENT, not overflow gRPC's metadata."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} chars)"


class KvstashError(Exception):
    """Base class; never raised directly."""

    # Raised for a failed call: the status the peer answered with, by name
    # ("UNAUTHENTICATED"), for callers that must tell apart what one class
    # covers. None for errors raised here.
    code: str | None = None


class InvalidArgument(KvstashError, ValueError):
    """The caller sent something that can never be accepted."""


class NotFound(KvstashError, KeyError):
    """The named request or snapshot does not exist."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


class AlreadyExists(KvstashError):
    """The id is taken."""


class ResourceExhausted(KvstashError):
    """Not enough capacity now; the caller may retry later or elsewhere."""


class FailedPrecondition(KvstashError):
    """The target is not in a state that allows the operation."""


class Unavailable(KvstashError):
    """A dependency could not be reached."""


class DeadlineExceeded(Unavailable):
    """A time limit ran out (a lease, a deadline); like Unavailable, worth a retry."""


class Unimplemented(KvstashError):
    """A valid request for something this service does not do (yet)."""


class DataLoss(KvstashError):
    """Bytes did not match their checksum (or size): damaged in transit or at rest."""


class IntegrityError(AssertionError):
    """An invariant of the scheduler's pool or queues does not hold: a bug, not
    a bad request (no gRPC status of its own). Here, not in the core, so that
    the core compiles with mypyc (kvstash.sim.compiled), which builds no
    subclass of a builtin exception but Exception's."""
