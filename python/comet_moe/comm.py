"""comet's communicator (comet_comm_t), made from an NCCL unique id or from an existing
torch.distributed process group.

    comm = Comm.from_process_group()        # collective: every rank of the group calls it
    ...
    comm.close()                            # collective too; closes its MoE layers first

Handles live in small boxes the communicator keeps, so close() can destroy every MoE
layer made on it before the communicator itself, whatever order Python's garbage
collector finalizes the objects in.
"""
from __future__ import annotations

import ctypes
import sys

from . import _capi
from .checks import INT_MAX, check_int
from .errors import CometError, check, error_for

# comet's range for a device wait's limit (as $COMET_TIMEOUT_MS takes it); 0: its default.
TIMEOUT_MS_MAX = 3600000


def _check_timeout_ms(timeout_ms) -> int:
    return check_int("timeout_ms", timeout_ms, 0, TIMEOUT_MS_MAX,
                     "milliseconds; 0: comet's default, 5000, or $COMET_TIMEOUT_MS")


class _Box:
    """One C handle (None once destroyed)."""
    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr


class _Device:
    """Makes `index` the calling thread's current CUDA device for comet's CUDA runtime
    (the one libcomet links) for the duration of a call, and restores the old one. comet
    launches on, and synchronizes, the current device."""

    def __init__(self, lib, index: int):
        self.lib, self.index, self.prev = lib, index, None

    def __enter__(self):
        cur = ctypes.c_int(-1)
        rc = self.lib.cudaGetDevice(ctypes.byref(cur))
        if rc != 0:
            raise error_for(_capi.CUDA_ERROR, "cudaGetDevice", _capi.text(self.lib.cudaGetErrorString(rc)))
        if cur.value != self.index:
            rc = self.lib.cudaSetDevice(self.index)
            if rc != 0:
                raise error_for(_capi.CUDA_ERROR, f"cudaSetDevice({self.index})",
                                _capi.text(self.lib.cudaGetErrorString(rc)))
            self.prev = cur.value
        return self

    def __exit__(self, *exc):
        if self.prev is not None:
            self.lib.cudaSetDevice(self.prev)
        return False


def unique_id() -> bytes:
    """A new NCCL unique id (128 bytes) from the NCCL libcomet links, for
    Comm(unique_id, nranks, rank) on every rank. Call it on one rank only."""
    lib = _capi.load()
    uid = _capi.NcclUniqueId()
    r = lib.ncclGetUniqueId(ctypes.byref(uid))
    if r != 0:
        raise error_for(_capi.NCCL_ERROR, "ncclGetUniqueId",
                        f"{_capi.text(lib.ncclGetErrorString(r))} (ncclResult_t {r})")
    return bytes(uid)


def nccl_version() -> int:
    """The version code of the NCCL loaded with libcomet (22809 for 2.28.9)."""
    lib = _capi.load()
    v = ctypes.c_int(0)
    r = lib.ncclGetVersion(ctypes.byref(v))
    if r != 0:
        raise error_for(_capi.NCCL_ERROR, "ncclGetVersion", _capi.text(lib.ncclGetErrorString(r)))
    return v.value


class _Handle:
    """What Comm and Moe share as owners of a C handle in `_box`: a context manager, no
    copies, and close() from __del__ as a fallback only."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __reduce_ex__(self, protocol):
        # A copy would destroy the same C handle twice; a pickle cannot carry GPU state.
        raise TypeError(f"comet_moe.{type(self).__name__} holds a C handle: it cannot be copied or pickled")

    def __del__(self):
        # Not at interpreter exit: the CUDA runtime may be gone already, and a collective
        # destroy on one rank alone would wait for the others until the timeout.
        if sys is None or sys.is_finalizing() or getattr(self, "_box", None) is None:
            return
        try:
            self.close()
        except Exception:
            pass


class Comm(_Handle):
    """comet_comm_t: NCCL plus the symmetric memory comet's kernels use, on the CUDA
    device that was current when it was made (`device_index`). Creating and closing
    it are collective: every rank calls them, in the same order."""

    def __init__(self, unique_id: bytes, nranks: int, rank: int, *, timeout_ms: int = 0):
        """comet_comm_create_from_id on the calling thread's current CUDA device. comet
        owns the NCCL communicator it makes. timeout_ms: the longest a device-side wait
        on a peer spins before COMET_TIMEOUT, 1..3600000 (0: comet's default, 5000, or
        $COMET_TIMEOUT_MS). nranks and rank must be C ints (comet checks the rest)."""
        self._box = None
        if not isinstance(unique_id, (bytes, bytearray, memoryview)):  # bytes(128) of an int is 128 zeros
            raise TypeError(f"unique_id: expected the bytes comet_moe.unique_id() gives, got "
                            f"{type(unique_id).__name__}")
        uid_bytes = bytes(unique_id)
        if len(uid_bytes) != _capi.NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"unique_id has {len(uid_bytes)} bytes: an NCCL unique id has "
                             f"{_capi.NCCL_UNIQUE_ID_BYTES}")
        nranks, rank = check_int("nranks", nranks), check_int("rank", rank)
        timeout_ms = _check_timeout_ms(timeout_ms)
        lib = _capi.load()
        uid = _capi.NcclUniqueId.from_buffer_copy(uid_bytes)
        config = _capi.CommConfigStruct(timeout_ms)
        handle = ctypes.c_void_p()
        st = lib.comet_comm_create_from_id(ctypes.byref(uid), nranks, rank, ctypes.byref(config),
                                           ctypes.byref(handle))
        check(st, "comet_comm_create_from_id", lambda: _capi.text(lib.comet_last_create_error()))
        self._lib = lib
        self._box = _Box(handle.value)
        self._moe_boxes = []  # boxes of the MoE layers made on this communicator
        self.rank = lib.comet_comm_rank(self._box.ptr)
        self.size = lib.comet_comm_size(self._box.ptr)
        dev = ctypes.c_int(-1)
        r = lib.ncclCommCuDevice(lib.comet_comm_nccl(self._box.ptr), ctypes.byref(dev))
        if r != 0:  # cannot happen on a communicator NCCL just made; keep comet's view then
            lib.cudaGetDevice(ctypes.byref(dev))
        self.device_index = dev.value

    @classmethod
    def from_process_group(cls, group=None, *, device=None, timeout_ms: int = 0) -> "Comm":
        """A communicator over the ranks of a torch.distributed process group (default:
        the world), in the group's rank order. Collective over the group: rank 0 makes
        an NCCL unique id and broadcasts it through the group, then every rank calls
        comet_comm_create_from_id on `device` (default: torch.cuda.current_device()).
        timeout_ms as for Comm(); it and an int `device` are checked before anything
        collective, so a bad one fails on every rank alike."""
        timeout_ms = _check_timeout_ms(timeout_ms)
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("Comm.from_process_group: torch.distributed is not initialised; call "
                               "torch.distributed.init_process_group first")
        rank, nranks = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise ValueError("Comm.from_process_group: this process is not a member of `group`")
        if device is None:
            index = torch.cuda.current_device()
        elif isinstance(device, int) and not isinstance(device, bool):
            index = check_int("Comm.from_process_group: device", device, 0, INT_MAX, "a CUDA device index")
        else:
            dev = torch.device(device)
            if dev.type != "cuda" or dev.index is None:
                raise ValueError(f"Comm.from_process_group: device = {device!r}: name a CUDA device with its "
                                 f"index, e.g. 'cuda:0'")
            index = dev.index
        src = 0 if group is None else dist.get_global_rank(group, 0)
        with torch.cuda.device(index), _Device(_capi.load(), index):
            payload = [None]
            if rank == 0:
                try:
                    payload = [("id", unique_id())]
                except CometError as e:  # tell the others, so no rank waits for an id forever
                    payload = [("error", str(e))]
            dist.broadcast_object_list(payload, src=src, group=group)
            kind, value = payload[0]
            if kind != "id":
                raise RuntimeError(f"Comm.from_process_group: rank 0 could not make an NCCL unique id: {value}")
            return cls(value, nranks, rank, timeout_ms=timeout_ms)

    @property
    def handle(self) -> int:
        """The comet_comm_t pointer, as an int (for other C code)."""
        return self._require()

    @property
    def device(self):
        import torch
        return torch.device("cuda", self.device_index)

    @property
    def closed(self) -> bool:
        return self._box is None or self._box.ptr is None

    def _require(self) -> int:
        if self.closed:
            raise RuntimeError("comet_moe.Comm: used after close()")
        return self._box.ptr

    def _on_device(self):
        return _Device(self._lib, self.device_index)

    def check_async_error(self, synchronize: bool = False) -> None:
        """Raise errors kernels found after the launching call returned: COMET_TIMEOUT
        (a peer that stopped answering; the communicator is unusable then) and, on the
        fused path, CometInvalidArgumentError for an expert id out of range (reported
        once), a training forward routing more rows than its saved state's bound, or
        ranks in different calls (the backwards of different forwards, a forward beside
        a backward); these two leave the communicator unusable. Does not synchronize unless `synchronize`: to be sure, synchronize the
        stream of the forward calls first."""
        ptr = self._require()
        if synchronize:
            import torch
            torch.cuda.synchronize(self.device_index)
        st = self._lib.comet_comm_get_async_error(ptr)
        check(st, "comet_comm_get_async_error", lambda: _capi.text(self._lib.comet_comm_last_error(ptr)))

    def close(self) -> None:
        """Destroy every MoE layer still open on this communicator, then the
        communicator (comet_comm_destroy, collective; waits for the device). A second
        close() does nothing."""
        if self.closed:
            return
        first_error = None
        for box in self._moe_boxes:
            try:
                _destroy_moe(self, box)
            except CometError as e:
                first_error = first_error or e
        self._moe_boxes.clear()
        ptr, self._box.ptr = self._box.ptr, None
        with self._on_device():
            st = self._lib.comet_comm_destroy(ptr)
        # The handle is freed now; comet moved its message to comet_last_create_error().
        check(st, "comet_comm_destroy", lambda: _capi.text(self._lib.comet_last_create_error()))
        if first_error is not None:
            raise first_error

    def __repr__(self):
        state = "closed" if self.closed else f"rank {self.rank} of {self.size} on cuda:{self.device_index}"
        return f"comet_moe.Comm({state})"


def _destroy_moe(comm: Comm, box: _Box) -> None:
    """comet_moe_destroy on a box of `comm`'s (no-op once destroyed)."""
    if box.ptr is None:
        return
    ptr, box.ptr = box.ptr, None
    with comm._on_device():
        st = comm._lib.comet_moe_destroy(ptr)
    # The handle is freed now; comet moved its message to comet_last_create_error().
    check(st, "comet_moe_destroy", lambda: _capi.text(comm._lib.comet_last_create_error()))
