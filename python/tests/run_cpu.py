#!/usr/bin/env python3
"""run_cpu.py - the tests of the comet_moe package that need no GPU: the library loads
and is found (or the error says how to get it), the ctypes mirror of comet.h (struct
field order, sizes, offsets, the *_INIT initializers, enum values and every bound
function's signature, all read from the header itself, no C compiler), comet's statuses
as exceptions through real C calls that fail on a CPU, presets, and the forward call's
argument checks on small stand-in tensors. Tests that need torch run when it is
installed (on the CPU, against a stand-in for the comet layer) and print SKIP otherwise.

Prints PASS/FAIL/SKIP per test, as tests/runner.c does, and ends with
"N passed, N failed, N skipped"; exit status 1 when anything failed. No install needed:
python/ goes on sys.path.

    python3 python/tests/run_cpu.py [-v] [SUBSTRING...]   (-v: print passing tests' notes)
"""
from __future__ import annotations

import copy
import ctypes
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))

import comet_moe  # noqa: E402
from comet_moe import _capi, checks, errors  # noqa: E402
from comet_moe.moe import parse_impl  # noqa: E402

HEADER = REPO / "include" / "comet.h"
TESTS = []
NOTES = []


class Skip(Exception):
    pass


def test(fn):
    TESTS.append(fn)
    return fn


def note(msg):
    NOTES.append(msg)


def check(cond, msg="check failed"):
    if not cond:
        raise AssertionError(msg)


def check_eq(got, want, what=""):
    if got != want:
        raise AssertionError(f"{what}: got {got!r}, want {want!r}")


def raises(exc_type, fn, *contains):
    """fn() must raise exc_type whose message contains every string of `contains`."""
    try:
        fn()
    except exc_type as e:
        for s in contains:
            if s not in str(e):
                raise AssertionError(f"{type(e).__name__} message {str(e)!r} lacks {s!r}") from None
        return e
    except Exception as e:
        raise AssertionError(f"expected {exc_type.__name__}, got {type(e).__name__}: {e}") from None
    raise AssertionError(f"expected {exc_type.__name__}, nothing was raised")


def need_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        raise Skip("torch is not installed (pip install torch to run it)") from None
    return torch


# ---- comet.h, read as text ----

def header_text():
    text = HEADER.read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return text.replace("\\\n", " ")


def header_defines(text):
    return {m[1]: m[2].strip() for m in re.finditer(r"^#define\s+(\w+)[ \t]+([^\n]*)$", text, flags=re.M)}


def header_enums(text):
    """{enumerator: value} over every typedef enum (implicit values counted)."""
    values = {}
    for m in re.finditer(r"typedef enum \w+ \{(.*?)\}", text, flags=re.S):
        nxt = 0
        for item in m[1].split(","):
            item = item.strip()
            if not item:
                continue
            name, _, value = item.partition("=")
            nxt = int(value.strip(), 0) if value.strip() else nxt
            values[name.strip()] = nxt
            nxt += 1
    return values


ENUM_TYPES = {"comet_status_t", "comet_dtype_t", "comet_impl_t"}
POINTER_TYPEDEFS = {"comet_comm_t", "comet_moe_t", "ncclComm_t", "cudaStream_t"}
SCALARS = {"ptr": (8, 8), "size_t": (8, 8), "int": (4, 4), "uint": (4, 4)}  # LP64


def kind_of(ctype):
    """A C type as 'ptr', 'size_t', 'int', 'uint', or a struct typedef name."""
    if "*" in ctype:
        return "ptr"
    words = ctype.replace("const", " ").split()
    if words == ["unsigned", "int"]:
        return "uint"
    base = words[-1]
    if base in POINTER_TYPEDEFS:
        return "ptr"
    if base == "int" or base in ENUM_TYPES:
        return "int"
    return base  # size_t, or a struct


def header_structs(text):
    """{typedef name: [(field, kind)]} for every typedef struct with a body."""
    structs = {}
    for m in re.finditer(r"typedef struct \w+ \{(.*?)\}\s*(\w+);", text, flags=re.S):
        fields = []
        for decl in m[1].split(";"):
            decl = " ".join(decl.split())
            if decl:
                name = re.search(r"(\w+)$", decl)[1]
                fields.append((name, kind_of(decl[: -len(name)])))
        structs[m[2]] = fields
    return structs


def c_layout(structs, name):
    """(size, align, {field: offset}) by the C rules, LP64."""
    offset, align, offsets = 0, 1, {}
    for field, kind in structs[name]:
        size, a = SCALARS[kind] if kind in SCALARS else c_layout(structs, kind)[:2]
        offset = (offset + a - 1) // a * a
        offsets[field] = offset
        offset += size
        align = max(align, a)
    return (offset + align - 1) // align * align, align, offsets


def ctypes_kind(t):
    if t in (ctypes.c_void_p, ctypes.c_char_p) or issubclass(t, ctypes._Pointer):
        return "ptr"
    if t is ctypes.c_size_t:
        return "size_t"
    if t is ctypes.c_int:
        return "int"
    if t is ctypes.c_uint:
        return "uint"
    return t


MIRRORS = {
    "comet_comm_config_t": _capi.CommConfigStruct,
    "comet_moe_config_t": _capi.MoeConfigStruct,
    "comet_moe_weights_t": _capi.MoeWeightsStruct,
    "comet_moe_args_t": _capi.MoeArgsStruct,
}
# Sizes and offsets gcc gives on x86-64 (checked with offsetof on 2026-12-01), a second
# witness beside the layout computed from the header.
GCC_X86_64 = {
    "comet_comm_config_t": (24, {"timeout_ms": 16}),
    "comet_moe_config_t": (48, {"hidden": 16, "dtype": 44}),
    "comet_moe_weights_t": (32, {"down": 24}),
    "comet_moe_args_t": (96, {"num_tokens": 16, "x": 24, "topk_ids": 32, "topk_weights": 40, "weights": 48,
                              "y": 80, "impl": 88}),
}


def leaves(struct):
    out = []
    for name, t in struct._fields_:
        v = getattr(struct, name)
        out.extend(leaves(v) if isinstance(v, ctypes.Structure) else [v])
    return out


# ---- the library ----

@test
def library_loads_and_names_its_version():
    path = comet_moe.library_path()
    check(Path(path).exists(), f"library_path() = {path}: no such file")
    d = header_defines(header_text())
    want = f"{d['COMET_VERSION_MAJOR']}.{d['COMET_VERSION_MINOR']}.{d['COMET_VERSION_PATCH']}"
    v = comet_moe.version()
    check(v.startswith(want + " "), f"version() = {v!r}, header says {want}")
    check_eq(comet_moe.__version__, want, "comet_moe.__version__ against comet.h")
    check_eq((_capi.VERSION_MAJOR, _capi.VERSION_MINOR, _capi.VERSION_PATCH),
             tuple(int(d[f"COMET_VERSION_{p}"]) for p in ("MAJOR", "MINOR", "PATCH")), "_capi.VERSION_*")
    check(comet_moe.nccl_version() >= 22800, f"NCCL {comet_moe.nccl_version()} loaded with libcomet, need >= 22800")
    note(f"{path}: {v}")


def run_python(code, env_changes, cwd=None):
    env = {k: v for k, v in os.environ.items() if k not in ("COMET_LIBRARY", "PYTHONPATH")}
    env.update(env_changes)
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=60)


@test
def library_lookup_order_and_not_found_message():
    probe = "import comet_moe; print(comet_moe.library_path())"
    built = str(REPO / "build" / "libcomet.so")
    # $COMET_LIBRARY first: a file, or a folder holding libcomet.so.
    for value in (built, str(REPO / "build")):
        r = run_python(probe, {"PYTHONPATH": str(REPO / "python"), "COMET_LIBRARY": value})
        check_eq(r.returncode, 0, f"COMET_LIBRARY={value}: {r.stderr[-400:]}")
        check_eq(r.stdout.strip(), built, f"COMET_LIBRARY={value}")
    # A $COMET_LIBRARY that does not load is an error naming it, not a silent fallback.
    r = run_python("import comet_moe; comet_moe.version()",
                   {"PYTHONPATH": str(REPO / "python"), "COMET_LIBRARY": "/nonexistent/libcomet.so"})
    check(r.returncode != 0 and "COMET_LIBRARY=/nonexistent/libcomet.so" in r.stderr,
          f"bad COMET_LIBRARY: {r.stderr[-400:]}")
    # The package alone, away from the repository: not found, and the message says what to do.
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(REPO / "python" / "comet_moe", Path(tmp) / "pkg" / "comet_moe",
                        ignore=shutil.ignore_patterns("__pycache__"))
        r = run_python("import comet_moe; comet_moe.version()", {"PYTHONPATH": str(Path(tmp) / "pkg"),
                                                                  "LD_LIBRARY_PATH": ""}, cwd=tmp)
        check(r.returncode != 0, "the package found a libcomet outside the repository")
        for s in ("LibraryNotFoundError", "libcomet.so not found", "make", "COMET_LIBRARY"):
            check(s in r.stderr, f"not-found message lacks {s!r}: {r.stderr[-600:]}")
        # Importing still works without the library: it loads on first use.
        r = run_python("import comet_moe; print('imported')", {"PYTHONPATH": str(Path(tmp) / "pkg")}, cwd=tmp)
        check_eq(r.stdout.strip(), "imported", f"import without the library: {r.stderr[-400:]}")


# ---- the mirror of comet.h ----

@test
def constants_and_enums_match_the_header():
    text = header_text()
    d = header_defines(text)
    check_eq(int(d["COMET_STRUCT_MAGIC"].rstrip("uU"), 0), _capi.STRUCT_MAGIC, "COMET_STRUCT_MAGIC")
    check_eq(int(d["COMET_API_VERSION"]), _capi.API_VERSION, "COMET_API_VERSION")
    enums = header_enums(text)
    statuses = {v: k for k, v in enums.items() if k.startswith("COMET_") and k[6:] in
                {n[6:] for n in _capi.STATUS_NAMES.values()}}
    check_eq(statuses, _capi.STATUS_NAMES, "comet_status_t values")
    for name in ("COMET_IMPL_AUTO", "COMET_IMPL_BASELINE", "COMET_IMPL_FUSED", "COMET_DTYPE_BF16"):
        check_eq(getattr(_capi, name[6:]), enums[name], name)
    lib = _capi.load()
    for code, name in _capi.STATUS_NAMES.items():
        s = _capi.text(lib.comet_status_string(code))
        check(s.startswith(name + ":"), f"comet_status_string({code}) = {s!r}, want {name}: ...")


@test
def struct_layouts_match_the_header():
    if ctypes.sizeof(ctypes.c_void_p) != 8:
        raise Skip("the layouts are checked for LP64 (64-bit Linux)")
    structs = header_structs(header_text())
    check_eq(set(structs), set(MIRRORS), "typedef structs in comet.h")
    for cname, mirror in MIRRORS.items():
        fields = structs[cname]
        check_eq([f for f, _ in mirror._fields_], [f for f, _ in fields], f"{cname} field order")
        for (field, kind), (_, t) in zip(fields, mirror._fields_):
            want = kind if kind in SCALARS else MIRRORS[kind]
            check_eq(ctypes_kind(t), want, f"{cname}.{field} type")
        size, align, offsets = c_layout(structs, cname)
        check_eq(ctypes.sizeof(mirror), size, f"sizeof({cname}) from the header")
        check_eq(ctypes.alignment(mirror), align, f"alignment of {cname}")
        for field, off in offsets.items():
            check_eq(getattr(mirror, field).offset, off, f"offsetof({cname}, {field})")
        gcc_size, gcc_offsets = GCC_X86_64[cname]
        check_eq(ctypes.sizeof(mirror), gcc_size, f"sizeof({cname}) as gcc gives it")
        for field, off in gcc_offsets.items():
            check_eq(getattr(mirror, field).offset, off, f"offsetof({cname}, {field}) as gcc gives it")
    check_eq(ctypes.sizeof(_capi.NcclUniqueId), 128, "sizeof(ncclUniqueId)")
    nccl_mk = REPO / "build" / "nccl.mk"
    if nccl_mk.exists():
        inc = re.search(r"NCCL_INC := (\S+)", nccl_mk.read_text())
        nccl_h = Path(inc[1]) / "nccl.h" if inc else None
        if nccl_h and nccl_h.exists():
            m = re.search(r"#define NCCL_UNIQUE_ID_BYTES (\d+)", nccl_h.read_text())
            check_eq(int(m[1]), ctypes.sizeof(_capi.NcclUniqueId), f"NCCL_UNIQUE_ID_BYTES in {nccl_h}")
            note(f"ncclUniqueId checked against {nccl_h}")


@test
def init_macros_match_new_structs():
    text = header_text()
    d = header_defines(text)
    enums = header_enums(text)
    constants = {"0": 0, "NULL": None, "COMET_STRUCT_MAGIC": _capi.STRUCT_MAGIC,
                 "COMET_API_VERSION": _capi.API_VERSION, **enums}
    inits = {k: v for k, v in d.items() if k.endswith("_INIT")}
    check_eq(sorted(inits), ["COMET_COMM_CONFIG_INIT", "COMET_MOE_ARGS_INIT", "COMET_MOE_CONFIG_INIT"], "_INIT macros")
    for macro, value in inits.items():
        cname = "comet_" + macro[len("COMET_"):-len("_INIT")].lower() + "_t"
        items = [s.strip() for s in value.replace("{", " ").replace("}", " ").split(",")]
        got = leaves(MIRRORS[cname]())
        check_eq(len(got), len(items), f"{macro}: values against the fields of a new {MIRRORS[cname].__name__}")
        check_eq(items[:3], [f"sizeof({cname})", "COMET_STRUCT_MAGIC", "COMET_API_VERSION"], f"{macro} head")
        check_eq(got[0], ctypes.sizeof(MIRRORS[cname]), f"{macro}: size field")
        for i, (item, v) in enumerate(zip(items[1:], got[1:]), 1):
            check_eq(v, constants[item], f"{macro} value {i} ({item})")


PROTOTYPE = re.compile(r"([A-Za-z_][\w\s\*]*?)\b(comet_\w+)\s*\(([^;{)]*)\)\s*;")


@test
def function_signatures_match_the_header():
    text = header_text()
    protos = {}
    for m in PROTOTYPE.finditer(text):
        args = [] if m[3].strip() in ("", "void") else [a.strip() for a in m[3].split(",")]
        protos[m[2]] = (kind_of(m[1]), [kind_of(re.sub(r"\w+$", "", a)) for a in args])
    lib = _capi.load()
    bound = {name: (r, a) for name, r, a in _capi._COMET_FUNCTIONS}
    for name, (restype, argtypes) in bound.items():
        check(name in protos, f"{name} is bound but not declared in comet.h")
        want_ret, want_args = protos[name]
        check_eq(ctypes_kind(restype), want_ret, f"{name} return type")
        check_eq([ctypes_kind(t) for t in argtypes], want_args, f"{name} argument types")
        fn = getattr(lib, name)
        check(fn.restype is restype and list(fn.argtypes) == list(argtypes), f"{name}: signature not set on the handle")
    unbound = sorted(set(protos) - set(bound))
    if unbound:
        note(f"declared in comet.h, not bound here: {', '.join(unbound)}")


# ---- statuses as exceptions ----

@test
def status_codes_map_to_exception_classes():
    for code, name in _capi.STATUS_NAMES.items():
        if code == _capi.SUCCESS:
            errors.check(code, "f", "never read")
            continue
        e = raises(errors.CometError, lambda: errors.check(code, "comet_f", "field = 3: the limit is 2"),
                   "comet_f", name, "field = 3: the limit is 2")
        check_eq((e.status, e.status_name, e.call, e.message), (code, name, "comet_f", "field = 3: the limit is 2"),
                 f"attributes for {name}")
        check(type(e) is errors.ERROR_CLASSES[code], f"{name} -> {type(e).__name__}")
    check_eq(len(set(errors.ERROR_CLASSES.values())), len(_capi.STATUS_NAMES) - 1, "one class per status")
    check(issubclass(comet_moe.CometTimeoutError, comet_moe.CometError), "CometTimeoutError is a CometError")
    e = raises(errors.CometError, lambda: errors.check(42, "comet_f", ""), "unknown status 42")
    check(type(e) is errors.CometError, "an unknown status is a plain CometError")
    # An empty detail falls back to comet's status sentence.
    raises(comet_moe.CometTimeoutError, lambda: errors.check(_capi.TIMEOUT, "comet_f", ""), "timed out")
    calls = []
    errors.check(_capi.SUCCESS, "f", lambda: calls.append(1))
    check_eq(calls, [], "the message of a success is never read")


@test
def validate_failures_raise_with_comets_message():
    bad = comet_moe.MoeConfig(hidden=100, ffn=256, num_experts=8, top_k=2, max_tokens=64)
    e = raises(comet_moe.CometInvalidArgumentError, lambda: bad.validate(2),
               "comet_moe_config_validate", "COMET_INVALID_ARGUMENT", "config.hidden = 100", "multiple of 64")
    check_eq((e.status, e.status_name), (1, "COMET_INVALID_ARGUMENT"), "status")
    # Tensor parallelism: ep_size x tp_size = world, ffn a multiple of 64 x tp_size.
    tp = comet_moe.MoeConfig(hidden=256, ffn=256, num_experts=8, top_k=2, max_tokens=64, tp_size=2)
    check(tp.validate(2) is tp and tp.validate(4) is tp, "tp_size = 2 on 2 and 4 ranks (EP 1 and 2)")
    tp.ffn = 192
    raises(comet_moe.CometInvalidArgumentError, lambda: tp.validate(2), "COMET_INVALID_ARGUMENT", "config.ffn = 192",
           "tp_size")
    tp = comet_moe.MoeConfig(hidden=256, ffn=256, num_experts=8, top_k=2, max_tokens=64, tp_size=3)
    raises(comet_moe.CometInvalidArgumentError, lambda: tp.validate(2), "config.tp_size = 3")
    tp = comet_moe.MoeConfig(hidden=256, ffn=256, num_experts=8, top_k=2, max_tokens=64, ep_size=2, tp_size=2)
    raises(comet_moe.CometInvalidArgumentError, lambda: tp.validate(2), "ep_size = 2", "tp_size = 2")
    raises(comet_moe.CometInvalidArgumentError,
           lambda: comet_moe.MoeConfig(hidden=256, ffn=256, num_experts=6, top_k=2, max_tokens=64).validate(4),
           "config.num_experts = 6", "ep_size = 4")
    raises(comet_moe.CometInvalidArgumentError, lambda: comet_moe.MoeConfig.preset("tiny", 0).validate(1),
           "config.max_tokens = 0")


@test
def config_struct_size_is_what_comet_expects():
    # comet_moe_config_validate compares config.size with its own sizeof: a config made
    # here (size = ctypes.sizeof) passing means the mirror has C's size; that the fields
    # land where C reads them shows in the presets and the named fields of the failures.
    cfg = comet_moe.MoeConfig(hidden=256, ffn=192, num_experts=8, top_k=2, max_tokens=512)
    check_eq(cfg.size, ctypes.sizeof(_capi.MoeConfigStruct), "size field of a new config")
    check(cfg.validate(2) is cfg, "validate returns the config")
    check(cfg == comet_moe.MoeConfig.preset("tiny", 512), "the tiny preset, field for field")
    cfg.size += 8
    raises(comet_moe.CometInvalidArgumentError, lambda: cfg.validate(2), f"config.size = {cfg.size}",
           "COMET_MOE_CONFIG_INIT")
    cfg = comet_moe.MoeConfig.preset("tiny", 512)
    cfg.version = 99
    raises(comet_moe.CometInvalidArgumentError, lambda: cfg.validate(2), "config.version = 99")


@test
def comm_config_struct_reaches_comet():
    # comet_comm_create_from_id checks its config before NCCL is touched: a timeout_ms of
    # -1 is named, so size, magic, version and the timeout_ms offset all matched.
    uid = bytes(128)
    raises(comet_moe.CometInvalidArgumentError, lambda: comet_moe.Comm(uid, 1, 0, timeout_ms=-1),
           "comet_comm_create_from_id", "comm config.timeout_ms = -1")
    raises(comet_moe.CometInvalidArgumentError, lambda: comet_moe.Comm(uid, 2, 5), "rank = 5", "0..nranks-1 = 1")
    raises(comet_moe.CometInvalidArgumentError, lambda: comet_moe.Comm(uid, 0, 0), "nranks = 0")
    raises(ValueError, lambda: comet_moe.Comm(b"short", 1, 0), "unique_id has 5 bytes", "128")


@test
def nccl_unique_id_through_libcomet():
    try:
        a, b = comet_moe.unique_id(), comet_moe.unique_id()
    except comet_moe.CometNcclError as e:
        raise Skip(f"NCCL cannot make an id on this machine: {e}") from None
    check(isinstance(a, bytes) and len(a) == 128, f"unique_id() gave {type(a).__name__} of {len(a)} bytes")
    check(any(a) and a != b, "two unique ids: empty, or equal")


# ---- presets and configs ----

@test
def presets_from_the_library():
    names = comet_moe.presets()
    check_eq(names, ["mixtral-8x7b", "phi-3.5-moe", "qwen2-57b-a14b", "qwen2-moe-2.7b", "tiny"], "presets()")
    m = comet_moe.MoeConfig.preset("mixtral-8x7b", max_tokens=8192)
    check_eq(m.as_dict(), dict(hidden=4096, ffn=14336, num_experts=8, top_k=2, max_tokens=8192, ep_size=0,
                               tp_size=0), "mixtral-8x7b")
    check_eq((m.size, m.magic, m.version, m.dtype), (48, _capi.STRUCT_MAGIC, _capi.API_VERSION, 0), "header fields")
    t = comet_moe.MoeConfig.preset("tiny", 100, ffn=256, top_k=4)
    check_eq((t.hidden, t.ffn, t.num_experts, t.top_k, t.max_tokens), (256, 256, 8, 4, 100), "tiny with overrides")
    check(t.copy() == t and t.copy() is not t, "copy() equals and is new")
    raises(comet_moe.CometInvalidArgumentError, lambda: comet_moe.MoeConfig.preset("mixtral", 10),
           "comet_moe_config_preset", 'unknown preset "mixtral"', "known presets: mixtral-8x7b")
    raises(TypeError, lambda: comet_moe.MoeConfig.preset("tiny", 10, hiden=64), "unknown field 'hiden'")
    raises(ValueError, lambda: comet_moe.MoeConfig(max_tokens=2**31), "MoeConfig.max_tokens = 2147483648")
    raises(TypeError, lambda: comet_moe.MoeConfig(hidden=4096.0), "MoeConfig.hidden = 4096.0", "int")


@test
def impl_names():
    check_eq([parse_impl(v) for v in ("auto", "BASELINE", "fused", 0, 1, 2)], [0, 1, 2, 0, 1, 2], "parse_impl")
    for bad in ("fast", 3, True, None):
        raises(ValueError, lambda: parse_impl(bad), f"impl = {bad!r}")


@test
def layer_refuses_wrong_types_before_calling_comet():
    cfg = comet_moe.MoeConfig.preset("tiny", 16)
    raises(TypeError, lambda: comet_moe.Moe("comm", cfg), "comm: expected a comet_moe.Comm, got str")
    # Handles are never copied (a copy would destroy them twice), and an object whose
    # constructor failed closes as a no-op.
    for cls in (comet_moe.Moe, comet_moe.Comm):
        half_made = cls.__new__(cls)
        half_made._box = None
        raises(TypeError, lambda: copy.deepcopy(half_made), "cannot be copied or pickled")
        raises(TypeError, lambda: pickle.dumps(half_made), "cannot be copied or pickled")
        check(half_made.closed, f"{cls.__name__} without a handle reads as closed")
        half_made.close()


# ---- the forward call's checks, on stand-in tensors ----

class FakeTensor:
    """What checks.py reads of a tensor."""

    def __init__(self, shape, dtype=checks.BF16, device="cuda:0", ptr=0x7F0000000000, contiguous=True, itemsize=None):
        self.shape, self.dtype, self.device, self._ptr, self._contig = tuple(shape), dtype, device, ptr, contiguous
        self._itemsize = itemsize or {checks.BF16: 2, checks.INT32: 4, checks.FLOAT32: 4}.get(dtype, 8)

    def data_ptr(self):
        return self._ptr

    def is_contiguous(self):
        return self._contig

    def stride(self):
        s, out = 1, []
        for d in reversed(self.shape):
            out.insert(0, s)
            s *= d
        return tuple(out) if self._contig else tuple(reversed(out))

    def element_size(self):
        return self._itemsize


class ArgSet:
    """A valid set of forward arguments for MoeConfig(H=256, F=128, E=8, k=2,
    max_tokens=64) on rank 0 of 2 (4 local experts), each at its own address. tp=2:
    the config has tp_size 2 and the weights are one TP rank's ffn / 2 = 64 columns
    (on rank 0 of 4: EP 2 x TP 2, still 4 local experts)."""
    H, F, K, E_LOCAL, M = 256, 128, 2, 4, 40

    def __init__(self, m=M, tp=1, **changes):
        H, K, E = self.H, self.K, self.E_LOCAL
        self.tp = tp
        F = self.F // tp
        base = iter(range(0x10000000, 0x10000000 * 100, 0x10000000))
        self.kw = dict(
            x=FakeTensor((m, H), ptr=next(base)),
            topk_ids=FakeTensor((m, K), checks.INT32, ptr=next(base)),
            topk_weights=FakeTensor((m, K), checks.FLOAT32, ptr=next(base)),
            gate_up=FakeTensor((E, 2 * F, H), ptr=next(base)),
            gate=None, up=None,
            down=FakeTensor((E, H, F), ptr=next(base)),
            out=FakeTensor((m, H), ptr=next(base)),
        )
        self.kw.update(changes)

    def run(self, **resolved):
        cfg = comet_moe.MoeConfig(hidden=self.H, ffn=self.F, num_experts=8, top_k=self.K, max_tokens=64,
                                  tp_size=0 if self.tp == 1 else self.tp)
        return checks.check_forward_args(cfg, self.E_LOCAL, "cuda:0", **self.kw, **resolved)


@test
def forward_checks_accept_valid_arguments():
    check_eq(ArgSet().run(), ArgSet.M, "num_tokens of a valid call")
    check_eq(ArgSet(m=64).run(), 64, "exactly max_tokens")
    check_eq(ArgSet(m=0, x=FakeTensor((0, 256), ptr=0), out=None).run(), 0, "no tokens (null data pointers)")
    H, F = ArgSet.H, ArgSet.F
    split = ArgSet(gate_up=None, gate=FakeTensor((4, F, H), ptr=0x90000000), up=FakeTensor((4, F, H), ptr=0xA0000000))
    check_eq(split.run(), ArgSet.M, "gate and up apart")
    check_eq(ArgSet(out=None).run(), ArgSet.M, "out allocated by forward")


@test
def forward_checks_refuse_wrong_dtypes():
    raises(TypeError, lambda: ArgSet(x=FakeTensor((40, 256), "torch.float16")).run(),
           "x.dtype = torch.float16", "expected torch.bfloat16", "x.to(torch.bfloat16)")
    raises(TypeError, lambda: ArgSet(topk_ids=FakeTensor((40, 2), "torch.int64")).run(),
           "topk_ids.dtype = torch.int64", "expected torch.int32", "topk_ids.to(torch.int32)")
    raises(TypeError, lambda: ArgSet(topk_weights=FakeTensor((40, 2), checks.BF16)).run(),
           "topk_weights.dtype = torch.bfloat16", "expected torch.float32")
    raises(TypeError, lambda: ArgSet(down=FakeTensor((4, 256, 128), checks.FLOAT32)).run(), "down.dtype")
    raises(TypeError, lambda: ArgSet(out=FakeTensor((40, 256), checks.FLOAT32)).run(), "out.dtype")
    raises(TypeError, lambda: ArgSet(x=[[0.0] * 256] * 40).run(), "x: expected a torch.Tensor, got list")
    raises(TypeError, lambda: ArgSet(topk_ids=None).run(), "topk_ids: expected a torch.Tensor, got NoneType")


@test
def forward_checks_refuse_wrong_shapes_and_sizes():
    raises(ValueError, lambda: ArgSet(m=65).run(), "x.shape[0] = 65 tokens", "config.max_tokens = 64")
    raises(ValueError, lambda: ArgSet(x=FakeTensor((40, 255))).run(), "x.shape = (40, 255)", "hidden = 256")
    raises(ValueError, lambda: ArgSet(x=FakeTensor((2, 20, 256))).run(), "x.shape = (2, 20, 256)", "reshape(-1, 256)")
    raises(ValueError, lambda: ArgSet(topk_ids=FakeTensor((40, 3), checks.INT32)).run(),
           "topk_ids.shape = (40, 3)", "num_tokens = 40, top_k = 2")
    raises(ValueError, lambda: ArgSet(topk_weights=FakeTensor((39, 2), checks.FLOAT32)).run(),
           "topk_weights.shape = (39, 2)")
    raises(ValueError, lambda: ArgSet(gate_up=FakeTensor((8, 256, 256))).run(),
           "gate_up.shape = (8, 256, 256)", "local experts = 4")
    raises(ValueError, lambda: ArgSet(down=FakeTensor((4, 128, 256))).run(), "down.shape = (4, 128, 256)",
           "hidden = 256, ffn = 128")
    raises(ValueError, lambda: ArgSet(out=FakeTensor((41, 256))).run(), "out.shape = (41, 256)")
    raises(ValueError, lambda: ArgSet(gate=FakeTensor((4, 128, 256))).run(), "gate_up, or gate and up, not both")
    raises(ValueError, lambda: ArgSet(gate_up=None, gate=FakeTensor((4, 128, 256))).run(), "up is None")
    raises(ValueError, lambda: ArgSet(down=None).run(), "down is None")


@test
def forward_checks_refuse_wrong_devices_and_layouts():
    raises(ValueError, lambda: ArgSet(x=FakeTensor((40, 256), device="cpu")).run(),
           "x is on cpu", "expected cuda:0, the communicator's device")
    raises(ValueError, lambda: ArgSet(topk_weights=FakeTensor((40, 2), checks.FLOAT32, device="cuda:1")).run(),
           "topk_weights is on cuda:1")
    raises(ValueError, lambda: ArgSet(gate_up=FakeTensor((4, 256, 256), device="cuda:1")).run(), "gate_up is on cuda:1")
    raises(ValueError, lambda: ArgSet(x=FakeTensor((40, 256), contiguous=False)).run(),
           "x is not contiguous", "x.contiguous()")
    raises(ValueError, lambda: ArgSet(down=FakeTensor((4, 256, 128), contiguous=False)).run(), "down is not contiguous")
    raises(ValueError, lambda: ArgSet(x=FakeTensor((40, 256), ptr=0x10000008)).run(),
           "x.data_ptr() = 0x10000008", "16-byte aligned")
    raises(ValueError, lambda: ArgSet(topk_ids=FakeTensor((40, 2), checks.INT32, ptr=0x20000002)).run(),
           "4-byte aligned")
    x = FakeTensor((40, 256), ptr=0x10000000)
    raises(ValueError, lambda: ArgSet(x=x, out=FakeTensor((40, 256), ptr=0x10000000 + 256 * 2 * 8)).run(),
           "out overlaps x")


@test
def forward_checks_take_the_tp_slice():
    H, F = ArgSet.H, ArgSet.F  # tp 2: Fl = 64
    check_eq(ArgSet(tp=2).run(), ArgSet.M, "tp 2: gate_up [4, 128, 256], down [4, 256, 64]")
    check_eq(ArgSet(tp=2).run(ffn_local=64, tp_size=2), ArgSet.M, "tp 2, as Moe passes it resolved")
    split = ArgSet(tp=2, gate_up=None, gate=FakeTensor((4, 64, H), ptr=0x90000000),
                   up=FakeTensor((4, 64, H), ptr=0xA0000000))
    check_eq(split.run(), ArgSet.M, "tp 2: gate and up [4, 64, 256] apart")
    # The whole expert (full F) is refused, naming the dimension as ffn / tp_size.
    raises(ValueError, lambda: ArgSet(tp=2, gate_up=FakeTensor((4, 2 * F, H))).run(),
           "gate_up.shape = (4, 256, 256)", "2 * ffn / tp_size = 128", "tp_size = 2", "ffn = 128")
    raises(ValueError, lambda: ArgSet(tp=2, down=FakeTensor((4, H, F))).run(),
           "down.shape = (4, 256, 128)", "hidden = 256, ffn / tp_size = 64]")
    raises(ValueError, lambda: ArgSet(tp=2, gate_up=None, gate=FakeTensor((4, F, H), ptr=0x90000000),
                                      up=FakeTensor((4, 64, H), ptr=0xA0000000)).run(),
           "gate.shape = (4, 128, 256)", "ffn / tp_size = 64")
    raises(ValueError, lambda: ArgSet(tp=2, gate_up=None, gate=FakeTensor((4, 64, H))).run(), "up is None",
           "[E_local, F/tp, H]")
    raises(ValueError, lambda: ArgSet(tp=2, down=None).run(), "down is None", "[E_local, H, F/tp]")
    # A config with tp_size 0 read as 1; the resolved values Moe passes win over the config.
    e = raises(ValueError, lambda: ArgSet().run(tp_size=2, ffn_local=64), "2 * ffn / tp_size = 128")
    check("tp_size" in str(e), "resolved tp_size named")
    # tp_size 1 keeps the messages without tensor parallelism.
    e = raises(ValueError, lambda: ArgSet(down=FakeTensor((4, H, 64))).run(), "hidden = 256, ffn = 128]")
    check("tp_size" not in str(e), f"tp 1 message mentions tp_size: {e}")


@test
def rank_layout_under_tensor_parallelism():
    from comet_moe.moe import _rank_layout
    cfg = comet_moe.MoeConfig(hidden=256, ffn=512, num_experts=8, top_k=2, max_tokens=64, tp_size=2)
    got = [_rank_layout(cfg, 4, r) for r in range(4)]
    check_eq([(g["ep_size"], g["tp_size"], g["ep_rank"], g["tp_rank"], g["experts_per_rank"], g["first_expert"],
               g["ffn_local"]) for g in got],
             [(2, 2, 0, 0, 4, 0, 256), (2, 2, 0, 1, 4, 0, 256), (2, 2, 1, 0, 4, 4, 256), (2, 2, 1, 1, 4, 4, 256)],
             "EP 2 x TP 2 on 4 ranks")
    cfg.tp_size = 0
    check_eq(_rank_layout(cfg, 2, 1), dict(tp_size=1, ep_size=2, ep_rank=1, tp_rank=0, experts_per_rank=4,
                                           first_expert=4, ffn_local=512), "tp_size 0: EP only")
    cfg.tp_size = 2
    check_eq(_rank_layout(cfg, 2, 1), dict(tp_size=2, ep_size=1, ep_rank=0, tp_rank=1, experts_per_rank=8,
                                           first_expert=0, ffn_local=256), "EP 1 x TP 2")


# ---- with torch (on the CPU; skipped without it) ----

class FakeComm:
    def __init__(self, torch):
        self.device = torch.device("cpu")
        self.device_index = None


class FakeMoe:
    """Stands in for comet_moe.Moe on the CPU: checks its arguments as Moe.forward does,
    computes what comet_moe_forward computes, from the packed layout comet.h describes,
    in float32, and counts its calls. With tp_size > 1 it gives this TP rank's partial
    sum only (comet adds the other TP ranks' to it)."""

    def __init__(self, torch, cfg, first_expert, experts_per_rank, tp_size=1, tp_rank=0):
        self.torch, self.config, self.comm = torch, cfg, FakeComm(torch)
        self.first_expert, self.experts_per_rank, self.calls = first_expert, experts_per_rank, []
        self.tp_size, self.tp_rank, self.ffn_local = tp_size, tp_rank, int(cfg.ffn) // tp_size

    def forward(self, x, topk_ids, topk_weights, *, gate_up=None, gate=None, up=None, down=None, out=None, impl=0):
        torch, Fd = self.torch, self.ffn_local
        checks.check_forward_args(self.config, self.experts_per_rank, "cpu", x, topk_ids, topk_weights, gate_up, gate,
                                  up, down, out, ffn_local=self.ffn_local, tp_size=self.tp_size)
        if gate_up is None:
            gate_up = torch.cat([gate, up], dim=1)
        self.calls.append((tuple(x.shape), impl))
        y = torch.zeros(x.shape, dtype=torch.float32)
        for t in range(x.shape[0]):
            for j in range(topk_ids.shape[1]):
                le = int(topk_ids[t, j]) - self.first_expert
                g = gate_up[le, :Fd].float() @ x[t].float()   # rows 0..F-1: gate
                u = gate_up[le, Fd:].float() @ x[t].float()   # rows F..2F-1: up
                y[t] += float(topk_weights[t, j]) * (down[le].float() @ (torch.nn.functional.silu(g) * u))
        y = y.to(torch.bfloat16)
        if out is not None:
            out.copy_(y)
            return out
        return y

    def close(self):
        pass


def hf_state_dict(torch, E, H, Fd, seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = {"gate.weight": (torch.randn(E, H, generator=g) / H ** 0.5).to(torch.bfloat16)}
    for i in range(E):
        sd[f"experts.{i}.w1.weight"] = (torch.randn(Fd, H, generator=g) / H ** 0.5).to(torch.bfloat16)
        sd[f"experts.{i}.w3.weight"] = (torch.randn(Fd, H, generator=g) / H ** 0.5).to(torch.bfloat16)
        sd[f"experts.{i}.w2.weight"] = (torch.randn(H, Fd, generator=g) / Fd ** 0.5).to(torch.bfloat16)
    return sd


def hf_mixtral_reference(torch, sd, x, top_k):
    """Hugging Face's MixtralSparseMoeBlock, written out in float32 from the full state dict."""
    F_ = torch.nn.functional
    logits = F_.linear(x, sd["gate.weight"])
    probs = F_.softmax(logits, dim=1, dtype=torch.float)
    w, sel = torch.topk(probs, top_k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    y = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(sel[t, j])
            xf = x[t].float()
            h = F_.silu(sd[f"experts.{e}.w1.weight"].float() @ xf) * (sd[f"experts.{e}.w3.weight"].float() @ xf)
            y[t] += w[t, j] * (sd[f"experts.{e}.w2.weight"].float() @ h)
    return y, logits


def rel_err(got, want):
    return float(((got.float() - want).norm() / want.norm()).item())


@test
def torch_mixtral_route():
    torch = need_torch()
    from comet_moe import mixtral_route
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.5, 0.25, 0.0]], dtype=torch.bfloat16)
    ids, w = mixtral_route(logits, 2)
    check_eq((ids.dtype, w.dtype, ids.is_contiguous(), w.is_contiguous()),
             (torch.int32, torch.float32, True, True), "dtypes and layout")
    check_eq(ids.tolist(), [[3, 2], [0, 1]], "ids, largest first")
    p = torch.softmax(torch.tensor([0.0, 1.0, 2.0, 3.0]), 0)
    want = torch.stack([p[3], p[2]]) / (p[3] + p[2])
    check(torch.allclose(w[0], want, atol=1e-6), f"weights {w[0].tolist()} vs {want.tolist()}")
    check(torch.allclose(w.sum(1), torch.ones(2)), "each token's weights sum to 1")


@test
def torch_block_keeps_local_experts_and_names_them_the_hf_way():
    torch = need_torch()
    from comet_moe import CometSparseMoeBlock
    E, H, Fd = 8, 64, 32
    cfg = comet_moe.MoeConfig(hidden=H, ffn=Fd, num_experts=E, top_k=2, max_tokens=16)
    block = CometSparseMoeBlock(moe=FakeMoe(torch, cfg, first_expert=4, experts_per_rank=2))  # rank 2 of 4
    sd = hf_state_dict(torch, E, H, Fd)
    result = block.load_state_dict(sd)
    check_eq((result.missing_keys, result.unexpected_keys), ([], []), "load of a full state dict")
    check_eq(list(block.local_experts), [4, 5], "local experts")
    for le, e in enumerate((4, 5)):
        check(torch.equal(block.w13[le, :Fd], sd[f"experts.{e}.w1.weight"]), f"w13[{le}] rows 0..F-1 = expert {e} w1")
        check(torch.equal(block.w13[le, Fd:], sd[f"experts.{e}.w3.weight"]), f"w13[{le}] rows F..2F-1 = expert {e} w3")
        check(torch.equal(block.w2[le], sd[f"experts.{e}.w2.weight"]), f"w2[{le}] = expert {e} w2")
    check(torch.equal(block.gate.weight, sd["gate.weight"]), "gate.weight")
    own = block.state_dict()
    check_eq(sorted(own), sorted(["gate.weight"] + [f"experts.{e}.{w}.weight" for e in (4, 5) for w in ("w1", "w2", "w3")]),
             "state_dict keys: the router and this rank's experts")
    for k, v in own.items():
        check(torch.equal(v, sd[k]), f"state_dict()[{k!r}] round trip")
    # Loading its own state dict back works (only local experts present).
    check_eq(block.load_state_dict(own).missing_keys, [], "reload of its own state dict")
    # A local expert missing is named; another rank's missing is fine.
    partial = {k: v for k, v in sd.items() if k != "experts.5.w3.weight" and k != "experts.0.w1.weight"}
    e = raises(RuntimeError, lambda: block.load_state_dict(partial), "Missing key(s)", "experts.5.w3.weight")
    check("experts.0.w1.weight" not in str(e), "another rank's expert reported missing")
    check_eq(block.load_state_dict(partial, strict=False).missing_keys, ["experts.5.w3.weight"], "strict=False")
    bad = dict(sd)
    bad["experts.9.w1.weight"] = sd["experts.0.w1.weight"]
    raises(RuntimeError, lambda: block.load_state_dict(bad), "Unexpected key(s)", "experts.9.w1.weight")
    wrong = dict(sd)
    wrong["experts.4.w2.weight"] = sd["experts.4.w1.weight"]  # [F, H] where [H, F] belongs
    raises(RuntimeError, lambda: block.load_state_dict(wrong), "size mismatch for experts.4.w2.weight", "(32, 64)")
    prefixed = {"model.layers.3.block_sparse_moe." + k: v for k, v in sd.items()}
    prefixed["model.layers.3.self_attn.q_proj.weight"] = torch.zeros(1)
    check_eq(block.load_full_state_dict(prefixed, prefix="model.layers.3.block_sparse_moe.").missing_keys, [],
             "load_full_state_dict with a prefix")


@test
def torch_block_keeps_this_tp_ranks_slice():
    torch = need_torch()
    from comet_moe import CometSparseMoeBlock
    from comet_moe.block import _tp_slice
    w = torch.arange(6 * 4).view(6, 4)  # [F = 6, H = 4]
    check_eq(_tp_slice("w1", w, 1, 3).tolist(), w[3:].tolist(), "_tp_slice of w1: rows")
    check_eq(_tp_slice("w3", w, 0, 6).tolist(), w.tolist(), "_tp_slice with one TP rank: all")
    w = torch.arange(4 * 6).view(4, 6)  # [H = 4, F = 6]
    check_eq(_tp_slice("w2", w, 1, 3).tolist(), w[:, 3:].tolist(), "_tp_slice of w2: columns")
    E, H, Fd, k, tp = 4, 64, 64, 2, 2
    Fl = Fd // tp
    cfg = comet_moe.MoeConfig(hidden=H, ffn=Fd, num_experts=E, top_k=k, max_tokens=16, tp_size=tp)
    sd = hf_state_dict(torch, E, H, Fd, seed=3)
    blocks = []
    for t in range(tp):  # EP 1 x TP 2: both ranks hold every expert, half of ffn each
        block = CometSparseMoeBlock(moe=FakeMoe(torch, cfg, 0, E, tp_size=tp, tp_rank=t), impl="fused")
        result = block.load_state_dict(sd)
        check_eq((result.missing_keys, result.unexpected_keys), ([], []), f"tp rank {t}: load of a full state dict")
        check_eq((block.tp_size, block.tp_rank, block.ffn_local), (tp, t, Fl), f"tp rank {t}: attributes")
        check_eq((tuple(block.w13.shape), tuple(block.w2.shape)), ((E, 2 * Fl, H), (E, H, Fl)), "packed shapes")
        cols = slice(t * Fl, (t + 1) * Fl)
        for e in range(E):
            check(torch.equal(block.w13[e, :Fl], sd[f"experts.{e}.w1.weight"][cols]), f"tp {t}: expert {e} w1 rows")
            check(torch.equal(block.w13[e, Fl:], sd[f"experts.{e}.w3.weight"][cols]), f"tp {t}: expert {e} w3 rows")
            check(torch.equal(block.w2[e], sd[f"experts.{e}.w2.weight"][:, cols]), f"tp {t}: expert {e} w2 columns")
        r = repr(block)
        check(f"tp=2 (tp rank {t}: ffn columns {t * Fl}..{(t + 1) * Fl - 1})" in r, f"repr: {r}")
        blocks.append(block)
    check("tp=" not in repr(CometSparseMoeBlock(moe=FakeMoe(torch, cfg, 0, E))), "repr with tp 1 names no tp")
    # The TP ranks' partial sums add up to HF Mixtral's output.
    x = torch.randn(10, H, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.no_grad():
        parts = [b(x)[0].float() for b in blocks]
    want, _ = hf_mixtral_reference(torch, sd, x, k)
    err = rel_err(parts[0] + parts[1], want)
    check(err < 1e-2, f"sum of the TP partials against HF Mixtral written out: {err:.3g}")
    note(f"EP 1 x TP 2, partials summed vs HF Mixtral (float32): relative error {err:.2e}")
    # The layer's checks want the slice: the whole expert is refused, naming the dim.
    ids, tw = comet_moe.mixtral_route(blocks[0].gate(x), k)
    whole = torch.zeros(E, 2 * Fd, H, dtype=torch.bfloat16)
    raises(ValueError, lambda: blocks[0].moe.forward(x, ids, tw, gate_up=whole, down=blocks[0].w2),
           "gate_up.shape = (4, 128, 64)", "2 * ffn / tp_size = 64")
    # The full HF shapes are still what load_state_dict takes: a slice is refused.
    wrong = dict(sd)
    wrong["experts.1.w1.weight"] = sd["experts.1.w1.weight"][:Fl]
    raises(RuntimeError, lambda: blocks[1].load_state_dict(wrong), "size mismatch for experts.1.w1.weight",
           "(32, 64)", "(64, 64)", "ffn / tp_size = 32")
    # state_dict() cannot name a slice the HF way.
    raises(NotImplementedError, lambda: blocks[0].state_dict(), "tp_size = 2", "ffn columns 0..31")
    # EP 2 x TP 2 on 4 ranks: rank 3 holds experts 2..3, columns Fl..F-1.
    block = CometSparseMoeBlock(moe=FakeMoe(torch, cfg, 2, 2, tp_size=tp, tp_rank=1))
    check_eq(block.load_state_dict(sd).missing_keys, [], "rank 3 of EP 2 x TP 2: load")
    check_eq(list(block.local_experts), [2, 3], "rank 3 of EP 2 x TP 2: local experts")
    for le, e in enumerate((2, 3)):
        check(torch.equal(block.w13[le, Fl:], sd[f"experts.{e}.w3.weight"][Fl:]), f"rank 3: expert {e} w3 rows")
        check(torch.equal(block.w2[le], sd[f"experts.{e}.w2.weight"][:, Fl:]), f"rank 3: expert {e} w2 columns")


@test
def torch_block_forward_matches_hf_mixtral():
    torch = need_torch()
    from comet_moe import CometSparseMoeBlock
    E, H, Fd, k = 4, 64, 32, 2
    cfg = comet_moe.MoeConfig(hidden=H, ffn=Fd, num_experts=E, top_k=k, max_tokens=16)
    fake = FakeMoe(torch, cfg, first_expert=0, experts_per_rank=E)  # one rank holds all
    block = CometSparseMoeBlock(moe=fake, impl="baseline")
    sd = hf_state_dict(torch, E, H, Fd, seed=1)
    block.load_state_dict(sd)
    x = torch.randn(2, 6, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        y, logits = block(x)
    want, want_logits = hf_mixtral_reference(torch, sd, x.view(-1, H), k)
    check_eq((tuple(y.shape), y.dtype, tuple(logits.shape)), ((2, 6, H), torch.bfloat16, (12, E)), "output shapes")
    check(torch.equal(logits, want_logits), "router logits")
    err = rel_err(y.view(-1, H), want)
    check(err < 1e-2, f"relative error against HF Mixtral written out: {err:.3g}")
    check_eq(fake.calls, [((12, H), _capi.IMPL_BASELINE)], "one call to the layer, flattened tokens, impl")
    out = torch.full((2, 6, H), float("nan"), dtype=torch.bfloat16)
    with torch.no_grad():
        y2, _ = block(x, out=out)
    check(y2.data_ptr() == out.data_ptr() and torch.equal(y2, y), "out= is written")
    note(f"block vs HF Mixtral (float32): relative error {err:.2e}")


@test
def torch_block_refuses_before_launching():
    torch = need_torch()
    from comet_moe import CometSparseMoeBlock
    cfg = comet_moe.MoeConfig(hidden=64, ffn=32, num_experts=4, top_k=2, max_tokens=16)
    fake = FakeMoe(torch, cfg, 0, 4)
    block = CometSparseMoeBlock(moe=fake)
    x = torch.zeros(17, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        raises(ValueError, lambda: block(x), "17 tokens", "config.max_tokens = 16")
        raises(TypeError, lambda: block(torch.zeros(4, 64)), "hidden_states.dtype = torch.float32")
        raises(ValueError, lambda: block(torch.zeros(4, 63, dtype=torch.bfloat16)), "hidden = 64")
        raises(ValueError, lambda: block(torch.zeros(64, 8, dtype=torch.bfloat16).t()), "not contiguous")
        raises(ValueError, lambda: block(torch.zeros(4, 64, dtype=torch.bfloat16), out=torch.zeros(5, 64, dtype=torch.bfloat16)),
               "out.shape = (5, 64)")
    x = torch.zeros(4, 64, dtype=torch.bfloat16, requires_grad=True)
    raises(RuntimeError, lambda: block(x), "forward-only", "torch.no_grad()")
    check_eq(fake.calls, [], "nothing reached the layer")
    raises(TypeError, lambda: CometSparseMoeBlock(), "give comm and config, or moe")


# ---- the runner ----

def main(argv):
    verbose = "-v" in argv
    filters = [a for a in argv if a != "-v"]
    passed = failed = skipped = 0

    def on_alarm(signum, frame):
        raise TimeoutError("timed out after 120 s")

    signal.signal(signal.SIGALRM, on_alarm)
    for fn in TESTS:
        name = fn.__name__
        if filters and not any(f in name for f in filters):
            continue
        NOTES.clear()
        start = time.monotonic()
        signal.alarm(120)
        try:
            fn()
        except Skip as e:
            print(f"SKIP {name}: {e}")
            skipped += 1
            continue
        except Exception as e:  # noqa: BLE001 - a test's failure of any kind is reported
            print(f"FAIL {name}: {type(e).__name__}: {e}")
            for line in traceback.format_exc().rstrip().splitlines():
                print("    " + line)
            failed += 1
            continue
        finally:
            signal.alarm(0)
        print(f"PASS {name} ({time.monotonic() - start:.2f} s)")
        if verbose:
            for n in NOTES:
                print("    " + n)
        passed += 1
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
