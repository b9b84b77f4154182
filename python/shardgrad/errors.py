"""Exceptions: one ShardgradError subclass per sg_status, carrying sg_last_error() text.

Each subclass also derives from the closest built-in exception, so that code catching
ValueError or MemoryError keeps working.
"""

from ._structs import Status

__all__ = [
    "ShardgradError", "InvalidArgumentError", "InvalidStateError", "OutOfMemoryError",
    "UnsupportedError", "MismatchError", "CommError", "ShardgradTimeoutError",
    "ShardgradIOError", "CorruptError", "CudaError", "InternalError", "error_class", "check",
]


class ShardgradError(Exception):
    """A C call returned a non-OK sg_status.

    Attributes: status (Status), function (the C function called), message (sg_last_error()
    of the calling thread right after the failure).
    """

    status = None

    def __init__(self, message, status=None, function=None):
        if status is not None:
            self.status = Status(status)
        self.function = function
        self.message = message
        name = self.status.name if self.status is not None else "?"
        super().__init__("SG_%s: %s" % (name, message) if message else "SG_%s" % name)

    def __str__(self):
        name = self.status.name if self.status is not None else "?"
        return "SG_%s: %s" % (name, self.message) if self.message else "SG_%s" % name


class InvalidArgumentError(ShardgradError, ValueError):
    status = Status.ERR_INVALID_ARGUMENT


class InvalidStateError(ShardgradError):
    status = Status.ERR_INVALID_STATE


class OutOfMemoryError(ShardgradError, MemoryError):
    status = Status.ERR_OUT_OF_MEMORY


class UnsupportedError(ShardgradError, NotImplementedError):
    status = Status.ERR_UNSUPPORTED


class MismatchError(ShardgradError):
    status = Status.ERR_MISMATCH


class CommError(ShardgradError):
    status = Status.ERR_COMM


class ShardgradTimeoutError(ShardgradError, TimeoutError):
    status = Status.ERR_TIMEOUT


class ShardgradIOError(ShardgradError, OSError):
    status = Status.ERR_IO


class CorruptError(ShardgradError):
    status = Status.ERR_CORRUPT


class CudaError(ShardgradError):
    status = Status.ERR_CUDA


class InternalError(ShardgradError):
    status = Status.ERR_INTERNAL


_BY_STATUS = {c.status: c for c in (
    InvalidArgumentError, InvalidStateError, OutOfMemoryError, UnsupportedError, MismatchError,
    CommError, ShardgradTimeoutError, ShardgradIOError, CorruptError, CudaError, InternalError)}


def error_class(status):
    """The exception class for a status (ShardgradError for an unknown value)."""
    try:
        return _BY_STATUS[Status(status)]
    except ValueError:
        return ShardgradError


def check(lib, status, function):
    """Raises the matching exception when status is not SG_OK. Must run on the thread that made
    the call: sg_last_error() is thread-local."""
    if status == 0:
        return
    raw = lib.sg_last_error()
    message = raw.decode("utf-8", "replace") if raw else ""
    cls = error_class(status)
    if cls is ShardgradError:
        err = ShardgradError("%s (unknown status %d)" % (message, status), None, function)
    else:
        err = cls(message, status, function)
    raise err
