"""The C API of include/comet.h, mirrored with ctypes: constants, enums, structs and the
signature of every function this package calls, and the loading of libcomet.so.

Nothing here knows about torch. The structs must match comet.h byte for byte; the CPU
tests (python/tests/test_capi.py) parse the header and check field order, sizes, offsets
and the *_INIT initializers against these classes, and comet's own checks (the size and
magic fields) reject a struct of the wrong size at run time.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from ctypes import POINTER, c_char, c_char_p, c_int, c_size_t, c_uint, c_void_p
from pathlib import Path

# ---- constants and enums (comet.h) ----

VERSION_MAJOR, VERSION_MINOR, VERSION_PATCH = 0, 1, 0
API_VERSION = 3          # COMET_API_VERSION
STRUCT_MAGIC = 0xC0E7    # COMET_STRUCT_MAGIC

# comet_status_t
SUCCESS = 0
INVALID_ARGUMENT = 1
INVALID_USAGE = 2
CUDA_ERROR = 3
NCCL_ERROR = 4
OUT_OF_MEMORY = 5
TIMEOUT = 6
REMOTE_ERROR = 7
NOT_SUPPORTED = 8
INTERNAL_ERROR = 9
STATUS_NAMES = {
    SUCCESS: "COMET_SUCCESS",
    INVALID_ARGUMENT: "COMET_INVALID_ARGUMENT",
    INVALID_USAGE: "COMET_INVALID_USAGE",
    CUDA_ERROR: "COMET_CUDA_ERROR",
    NCCL_ERROR: "COMET_NCCL_ERROR",
    OUT_OF_MEMORY: "COMET_OUT_OF_MEMORY",
    TIMEOUT: "COMET_TIMEOUT",
    REMOTE_ERROR: "COMET_REMOTE_ERROR",
    NOT_SUPPORTED: "COMET_NOT_SUPPORTED",
    INTERNAL_ERROR: "COMET_INTERNAL_ERROR",
}

# comet_dtype_t
DTYPE_BF16 = 0
DTYPE_FP8_BLOCK = 1
DTYPE_NAMES = {DTYPE_BF16: "bf16", DTYPE_FP8_BLOCK: "fp8"}  # MoeConfig(dtype=...)

# comet_grad_mode_t
GRAD_WRITE_BF16 = 0
GRAD_ACCUMULATE_FP32 = 1

# comet_impl_t
IMPL_AUTO = 0
IMPL_BASELINE = 1
IMPL_FUSED = 2
IMPL_NAMES = {IMPL_AUTO: "auto", IMPL_BASELINE: "baseline", IMPL_FUSED: "fused"}

NCCL_UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES in nccl.h


# ---- structs ----
# Enums are C ints on every ABI comet builds for (gcc, x86-64 and aarch64 Linux), so
# they are c_int here. Padding is ctypes' own, which follows the C rules.

class NcclUniqueId(ctypes.Structure):
    """ncclUniqueId: typedef struct { char internal[NCCL_UNIQUE_ID_BYTES]; }."""
    _fields_ = [("internal", c_char * NCCL_UNIQUE_ID_BYTES)]


class CommConfigStruct(ctypes.Structure):
    """comet_comm_config_t; a new one holds COMET_COMM_CONFIG_INIT."""
    _fields_ = [
        ("size", c_size_t),
        ("magic", c_uint),
        ("version", c_uint),
        ("timeout_ms", c_int),
    ]

    def __init__(self, timeout_ms: int = 0):
        super().__init__(ctypes.sizeof(CommConfigStruct), STRUCT_MAGIC, API_VERSION, timeout_ms)


class MoeConfigStruct(ctypes.Structure):
    """comet_moe_config_t; a new one holds COMET_MOE_CONFIG_INIT."""
    _fields_ = [
        ("size", c_size_t),
        ("magic", c_uint),
        ("version", c_uint),
        ("hidden", c_int),
        ("ffn", c_int),
        ("num_experts", c_int),
        ("top_k", c_int),
        ("max_tokens", c_int),
        ("ep_size", c_int),
        ("tp_size", c_int),
        ("dtype", c_int),  # comet_dtype_t
        ("resend_x", c_int),
        ("fp8_pow2_scales", c_int),
        ("fp8_wgrad_cublaslt", c_int),
    ]

    def __init__(self, **fields):
        super().__init__(ctypes.sizeof(MoeConfigStruct), STRUCT_MAGIC, API_VERSION, 0, 0, 0, 0, 0, 0, 0,
                         DTYPE_BF16)
        for name, value in fields.items():
            setattr(self, name, value)


class MoeWeightsStruct(ctypes.Structure):
    """comet_moe_weights_t: device pointers to this rank's experts' bf16 weights."""
    _fields_ = [
        ("gate_up", c_void_p),  # [E_local][2F][H]: rows 0..F-1 gate, F..2F-1 up
        ("gate", c_void_p),     # [E_local][F][H], when gate_up is NULL
        ("up", c_void_p),       # [E_local][F][H], when gate_up is NULL
        ("down", c_void_p),     # [E_local][H][F]
    ]


class MoeWeightScalesStruct(ctypes.Structure):
    """comet_moe_weight_scales_t: device pointers to FP8 weights' FP32 block scales."""
    _fields_ = [
        ("gate_up", c_void_p),  # [E_local][2F / 128][ceil(H / 128)]
        ("gate", c_void_p),     # [E_local][ceil(F / 128)][ceil(H / 128)]
        ("up", c_void_p),
        ("down", c_void_p),     # [E_local][ceil(H / 128)][ceil(F / 128)]
    ]


class MoeArgsStruct(ctypes.Structure):
    """comet_moe_args_t; a new one holds COMET_MOE_ARGS_INIT."""
    _fields_ = [
        ("size", c_size_t),
        ("magic", c_uint),
        ("version", c_uint),
        ("num_tokens", c_int),
        ("x", c_void_p),
        ("topk_ids", c_void_p),      # const int32_t *
        ("topk_weights", c_void_p),  # const float *
        ("weights", MoeWeightsStruct),
        ("y", c_void_p),
        ("impl", c_int),  # comet_impl_t
        ("weight_scales", MoeWeightScalesStruct),
        ("x_scales", c_void_p),      # const float *, or NULL: x is bf16
    ]

    def __init__(self):
        super().__init__(ctypes.sizeof(MoeArgsStruct), STRUCT_MAGIC, API_VERSION, 0, None, None, None,
                         MoeWeightsStruct(None, None, None, None), None, IMPL_AUTO,
                         MoeWeightScalesStruct(None, None, None, None), None)


class MoeSavedConfigStruct(ctypes.Structure):
    """comet_moe_saved_config_t; a new one holds COMET_MOE_SAVED_CONFIG_INIT."""
    _fields_ = [
        ("size", c_size_t),
        ("magic", c_uint),
        ("version", c_uint),
        ("max_recv_rows", ctypes.c_int64),
        ("gate_up_e4m3", c_int),
    ]

    def __init__(self, max_recv_rows: int = 0, gate_up_e4m3: int = 0):
        super().__init__(ctypes.sizeof(MoeSavedConfigStruct), STRUCT_MAGIC, API_VERSION, max_recv_rows, gate_up_e4m3)


class MoeWeightGradsStruct(ctypes.Structure):
    """comet_moe_weight_grads_t: device pointers to this rank's experts' weight gradients."""
    _fields_ = [
        ("gate_up", c_void_p),
        ("gate", c_void_p),
        ("up", c_void_p),
        ("down", c_void_p),
        ("mode", c_int),  # comet_grad_mode_t
    ]


class MoeBackwardArgsStruct(ctypes.Structure):
    """comet_moe_backward_args_t; a new one holds COMET_MOE_BACKWARD_ARGS_INIT."""
    _fields_ = [
        ("size", c_size_t),
        ("magic", c_uint),
        ("version", c_uint),
        ("saved", c_void_p),           # comet_moe_saved_t
        ("dy", c_void_p),
        ("x", c_void_p),
        ("weights", MoeWeightsStruct),
        ("dx", c_void_p),
        ("d_topk_weights", c_void_p),  # float *
        ("grads", MoeWeightGradsStruct),
        ("impl", c_int),  # comet_impl_t
        ("weights_t", MoeWeightsStruct),             # FP8: the weights transposed, E4M3
        ("weight_t_scales", MoeWeightScalesStruct),  # FP8: their scales
    ]

    def __init__(self):
        super().__init__(ctypes.sizeof(MoeBackwardArgsStruct), STRUCT_MAGIC, API_VERSION, None, None, None,
                         MoeWeightsStruct(None, None, None, None), None, None,
                         MoeWeightGradsStruct(None, None, None, None, GRAD_WRITE_BF16), IMPL_AUTO,
                         MoeWeightsStruct(None, None, None, None), MoeWeightScalesStruct(None, None, None, None))


# ---- the functions, with their C signatures ----
# (name, restype, argtypes). Handles are opaque pointers (c_void_p); cudaStream_t and
# ncclComm_t are pointers too. comet_status_t, ncclResult_t and cudaError_t are ints.

_COMET_FUNCTIONS = [
    ("comet_status_string", c_char_p, [c_int]),
    ("comet_version_string", c_char_p, []),
    ("comet_comm_create", c_int, [c_void_p, POINTER(CommConfigStruct), POINTER(c_void_p)]),
    ("comet_comm_create_from_id", c_int,
     [POINTER(NcclUniqueId), c_int, c_int, POINTER(CommConfigStruct), POINTER(c_void_p)]),
    ("comet_comm_destroy", c_int, [c_void_p]),
    ("comet_comm_rank", c_int, [c_void_p]),
    ("comet_comm_size", c_int, [c_void_p]),
    ("comet_comm_nccl", c_void_p, [c_void_p]),
    ("comet_comm_last_error", c_char_p, [c_void_p]),
    ("comet_last_create_error", c_char_p, []),
    ("comet_comm_get_async_error", c_int, [c_void_p]),
    ("comet_moe_config_preset", c_int, [c_char_p, c_int, POINTER(MoeConfigStruct)]),
    ("comet_moe_preset_name", c_char_p, [c_int]),
    ("comet_moe_config_validate", c_int, [POINTER(MoeConfigStruct), c_int, c_char_p, c_size_t]),
    ("comet_moe_create", c_int, [c_void_p, POINTER(MoeConfigStruct), POINTER(c_void_p)]),
    ("comet_moe_destroy", c_int, [c_void_p]),
    ("comet_moe_last_error", c_char_p, [c_void_p]),
    ("comet_moe_forward", c_int, [c_void_p, POINTER(MoeArgsStruct), c_void_p]),
    ("comet_moe_saved_bytes", c_int, [c_void_p, POINTER(MoeSavedConfigStruct), POINTER(c_size_t)]),
    ("comet_moe_saved_create", c_int, [c_void_p, POINTER(MoeSavedConfigStruct), POINTER(c_void_p)]),
    ("comet_moe_saved_create_in", c_int, [c_void_p, POINTER(MoeSavedConfigStruct), c_void_p, c_size_t,
                                          POINTER(c_void_p)]),
    ("comet_moe_saved_destroy", c_int, [c_void_p]),
    ("comet_moe_forward_train", c_int, [c_void_p, POINTER(MoeArgsStruct), c_void_p, c_void_p]),
    ("comet_moe_backward", c_int, [c_void_p, POINTER(MoeBackwardArgsStruct), c_void_p]),
    ("comet_quantize_fp8_weights", c_int,
     [c_void_p, ctypes.c_int64, c_int, c_int, c_int, c_void_p, c_void_p, c_void_p]),
    ("comet_quantize_fp8_weights_transposed", c_int,
     [c_void_p, ctypes.c_int64, c_int, c_int, c_int, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p]),
    ("comet_quantize_fp8_rows", c_int, [c_void_p, ctypes.c_int64, c_int, c_int, c_void_p, c_void_p, c_void_p]),
]

# NCCL and the CUDA runtime, as libcomet links them (found through its handle: dlsym
# searches a library's dependencies too), so these are the copies comet itself calls.
_DEPENDENCY_FUNCTIONS = [
    ("ncclGetUniqueId", c_int, [POINTER(NcclUniqueId)]),
    ("ncclGetErrorString", c_char_p, [c_int]),
    ("ncclGetVersion", c_int, [POINTER(c_int)]),
    ("ncclCommCuDevice", c_int, [c_void_p, POINTER(c_int)]),
    ("cudaGetDevice", c_int, [POINTER(c_int)]),
    ("cudaSetDevice", c_int, [c_int]),
    ("cudaGetErrorString", c_char_p, [c_int]),
]


class LibraryNotFoundError(OSError):
    """libcomet.so could not be found or loaded."""


_lock = threading.Lock()
_lib = None
_lib_path = None


def _candidates():
    """Where libcomet.so may be: ($COMET_LIBRARY is handled by the caller), the repo's
    build/ beside this package's source (python/comet_moe -> ../../build), then the
    system loader's search (LD_LIBRARY_PATH, ld.so.cache)."""
    here = Path(__file__).resolve().parent
    yield str(here.parent.parent / "build" / "libcomet.so")
    found = ctypes.util.find_library("comet")
    if found:
        yield found
    yield "libcomet.so"


def _nccl_hint(err: str) -> str:
    if "nccl" in err.lower():
        return (" (libcomet needs NCCL >= 2.28 with its device API; if another libnccl.so.2 was loaded "
                "first, e.g. by an older PyTorch, that one is used: install a PyTorch built with NCCL "
                ">= 2.28, or build comet against the NCCL PyTorch uses)")
    return ""


def _open(path: str):
    lib = ctypes.CDLL(path)
    for name, restype, argtypes in _COMET_FUNCTIONS + _DEPENDENCY_FUNCTIONS:
        fn = getattr(lib, name)  # AttributeError names a missing symbol
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


def load():
    """The loaded libcomet (a ctypes.CDLL with every signature set), loaded on first use."""
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        env = os.environ.get("COMET_LIBRARY", "")
        if env:
            path = os.path.join(env, "libcomet.so") if os.path.isdir(env) else env
            try:
                lib = _open(path)
            except (OSError, AttributeError) as e:
                raise LibraryNotFoundError(
                    f"COMET_LIBRARY={env}: could not load {path}: {e}{_nccl_hint(str(e))}") from None
            _lib, _lib_path = lib, path
            return lib
        tried = []
        for path in _candidates():
            if os.sep in path and not os.path.exists(path):
                tried.append(f"{path} (no such file)")
                continue
            try:
                lib = _open(path)
            except (OSError, AttributeError) as e:
                if os.sep in path:  # a file that is there but does not load: say so now
                    raise LibraryNotFoundError(f"could not load {path}: {e}{_nccl_hint(str(e))}") from None
                tried.append(f"{path} via the system loader ({e})")
                continue
            _lib, _lib_path = lib, path
            return lib
        raise LibraryNotFoundError(
            "libcomet.so not found; looked at: " + "; ".join(tried) +
            ". Run `make` in the comet repository (it builds build/libcomet.so), or set "
            "COMET_LIBRARY=/path/to/libcomet.so")


def library_path() -> str:
    """The path libcomet was loaded from (loading it if need be)."""
    load()
    return _lib_path


def text(raw) -> str:
    """A C string from a c_char_p result (bytes or None) as str."""
    return raw.decode("utf-8", errors="replace") if raw else ""
