"""Exceptions: every comet status other than COMET_SUCCESS becomes a CometError (one
subclass per status), carrying comet's own sentence that names the field, the value and
the limit.

Checks this package makes in Python before anything is launched raise TypeError (a
wrong dtype or type) or ValueError (a wrong shape, device, layout or size) instead, so
a CometError always means comet itself refused or failed.
"""
from __future__ import annotations

from . import _capi


class CometError(RuntimeError):
    """A comet call returned a status other than COMET_SUCCESS.

    Attributes: status (the comet_status_t code, an int), status_name
    ("COMET_TIMEOUT", ...), call (the C function), message (comet's own detail, which
    names the field, value and limit; may be empty)."""

    def __init__(self, status: int, call: str, message: str):
        self.status = int(status)
        self.status_name = _capi.STATUS_NAMES.get(self.status, f"unknown status {self.status}")
        self.call = call
        self.message = message
        super().__init__(f"{call}: {self.status_name}: {message or _status_string(self.status)}")


class CometInvalidArgumentError(CometError):
    """COMET_INVALID_ARGUMENT: a field or argument out of range (also an expert id out of
    [0, num_experts), reported by the forward call or, on the fused path, afterwards)."""


class CometInvalidUsageError(CometError):
    """COMET_INVALID_USAGE: calls in the wrong order, or a handle used wrongly."""


class CometCudaError(CometError):
    """COMET_CUDA_ERROR: a CUDA runtime, driver or cuBLAS call failed."""


class CometNcclError(CometError):
    """COMET_NCCL_ERROR: an NCCL call failed."""


class CometOutOfMemoryError(CometError):
    """COMET_OUT_OF_MEMORY: a host or device allocation failed."""


class CometTimeoutError(CometError):
    """COMET_TIMEOUT: a device-side wait for a peer ran past timeout_ms; the
    communicator is unusable afterwards."""


class CometRemoteError(CometError):
    """COMET_REMOTE_ERROR: another rank reported a failure."""


class CometNotSupportedError(CometError):
    """COMET_NOT_SUPPORTED: a valid request this build cannot serve (e.g. the fused path
    for top_k > 8)."""


class CometInternalError(CometError):
    """COMET_INTERNAL_ERROR: a bug in comet."""


ERROR_CLASSES = {
    _capi.INVALID_ARGUMENT: CometInvalidArgumentError,
    _capi.INVALID_USAGE: CometInvalidUsageError,
    _capi.CUDA_ERROR: CometCudaError,
    _capi.NCCL_ERROR: CometNcclError,
    _capi.OUT_OF_MEMORY: CometOutOfMemoryError,
    _capi.TIMEOUT: CometTimeoutError,
    _capi.REMOTE_ERROR: CometRemoteError,
    _capi.NOT_SUPPORTED: CometNotSupportedError,
    _capi.INTERNAL_ERROR: CometInternalError,
}


def _status_string(status: int) -> str:
    try:
        return _capi.text(_capi.load().comet_status_string(status))
    except OSError:
        return _capi.STATUS_NAMES.get(status, "unknown status")


def error_for(status: int, call: str, message: str) -> CometError:
    """The exception for a failed call: the subclass of its status, or CometError."""
    return ERROR_CLASSES.get(int(status), CometError)(status, call, message)


def check(status: int, call: str, message=None) -> None:
    """Raise the exception for `status` unless it is COMET_SUCCESS. `message` is comet's
    detail, or a callable returning it (read only on failure)."""
    if status == _capi.SUCCESS:
        return
    if callable(message):
        message = message()
    raise error_for(status, call, message or "")
