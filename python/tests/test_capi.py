"""test_capi.py - the library and its ctypes mirror, no GPU: libcomet loads and is found
(or the error says how to get it), the mirror of comet.h (struct field order, sizes,
offsets, the *_INIT initializers, enum values and every bound function's signature, all
read from the header itself, no C compiler), comet's statuses as exceptions through real
C calls that fail on a CPU, and the presets and configs.
"""
from __future__ import annotations

import copy
import ctypes
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import comet_moe
from comet_moe import _capi, errors
from comet_moe.moe import parse_impl
from helpers import REPO, check, check_eq, note, raises, skip

HEADER = REPO / "include" / "comet.h"


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


ENUM_TYPES = {"comet_status_t", "comet_dtype_t", "comet_impl_t", "comet_grad_mode_t"}
POINTER_TYPEDEFS = {"comet_comm_t", "comet_moe_t", "comet_moe_saved_t", "ncclComm_t", "cudaStream_t"}
SCALARS = {"ptr": (8, 8), "size_t": (8, 8), "int64_t": (8, 8), "int": (4, 4), "uint": (4, 4)}  # LP64


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
    if t is ctypes.c_int64:
        return "int64_t"
    if t is ctypes.c_int:
        return "int"
    if t is ctypes.c_uint:
        return "uint"
    return t


MIRRORS = {
    "comet_comm_config_t": _capi.CommConfigStruct,
    "comet_moe_config_t": _capi.MoeConfigStruct,
    "comet_moe_weights_t": _capi.MoeWeightsStruct,
    "comet_moe_weight_scales_t": _capi.MoeWeightScalesStruct,
    "comet_moe_args_t": _capi.MoeArgsStruct,
    "comet_moe_saved_config_t": _capi.MoeSavedConfigStruct,
    "comet_moe_weight_grads_t": _capi.MoeWeightGradsStruct,
    "comet_moe_backward_args_t": _capi.MoeBackwardArgsStruct,
}
# Sizes and offsets gcc gives on x86-64 (as offsetof prints them), a second witness beside
# the layout computed from the header.
GCC_X86_64 = {
    "comet_comm_config_t": (24, {"timeout_ms": 16}),
    "comet_moe_config_t": (64, {"hidden": 16, "dtype": 44, "resend_x": 48, "fp8_pow2_scales": 52,
                                "fp8_wgrad_cublaslt": 56}),
    "comet_moe_weights_t": (32, {"down": 24}),
    "comet_moe_weight_scales_t": (32, {"down": 24}),
    "comet_moe_args_t": (136, {"num_tokens": 16, "x": 24, "topk_ids": 32, "topk_weights": 40, "weights": 48,
                               "y": 80, "impl": 88, "weight_scales": 96, "x_scales": 128}),
    "comet_moe_saved_config_t": (32, {"max_recv_rows": 16, "gate_up_e4m3": 24}),
    "comet_moe_weight_grads_t": (40, {"down": 24, "mode": 32}),
    "comet_moe_backward_args_t": (200, {"saved": 16, "dy": 24, "x": 32, "weights": 40, "dx": 72,
                                        "d_topk_weights": 80, "grads": 88, "impl": 128, "weights_t": 136,
                                        "weight_t_scales": 168}),
}


def leaves(struct):
    out = []
    for name, t in struct._fields_:
        v = getattr(struct, name)
        out.extend(leaves(v) if isinstance(v, ctypes.Structure) else [v])
    return out


# ---- the library ----

def test_library_loads_and_names_its_version():
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


def test_library_lookup_order_and_not_found_message():
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


def unbuilt_tree(tmp):
    """python/ of this repository copied into `tmp`, with no build/ beside it."""
    for part in ("comet_moe", "tests"):
        shutil.copytree(REPO / "python" / part, Path(tmp) / "python" / part,
                        ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    return Path(tmp) / "python" / "tests"


def test_tests_fail_once_where_the_library_is_not_built():
    """On a tree where `make` has not run, the CPU tests fail once, saying to build first,
    not once per test: under run_cpu.py, and under pytest where it is installed."""
    with tempfile.TemporaryDirectory() as tmp:
        tests = unbuilt_tree(tmp)
        r = subprocess.run([sys.executable, str(tests / "run_cpu.py")], cwd=tmp, capture_output=True, text=True,
                           env=dict(os.environ, LD_LIBRARY_PATH="", COMET_LIBRARY=""), timeout=120)
        lines = r.stdout.splitlines()
        fails = [line for line in lines if line.startswith("FAIL")]
        check(r.returncode == 1 and len(fails) == 1 and "build first (make)" in fails[0],
              f"run_cpu.py without the library: exit {r.returncode}, FAIL lines {fails}")
        check_eq(lines[-1], "0 passed, 1 failed, 0 skipped", "run_cpu.py's closing line")
        try:
            import pytest  # noqa: F401
        except ImportError:
            note("pytest is not installed: its run without the library is left out")
            return
        r = subprocess.run([sys.executable, "-m", "pytest", str(tests), "-p", "no:cacheprovider"], cwd=tmp,
                           capture_output=True, text=True, env=dict(os.environ, LD_LIBRARY_PATH="", COMET_LIBRARY=""),
                           timeout=300)
        out = r.stdout + r.stderr
        check(r.returncode != 0 and out.count("build first (make)") == 1 and " passed" not in out,
              f"pytest without the library: exit {r.returncode}\n{out[-2000:]}")


def test_torch_parts_say_what_to_install():
    """Without torch, or with one older than 2.4 (no torch.library.custom_op and the
    rest), CometSparseMoeBlock raises ImportError saying what to install; the library,
    configs and presets still import."""
    no_torch = ("import sys, importlib.abc\n"
                "class NoTorch(importlib.abc.MetaPathFinder):\n"
                "    def find_spec(self, name, path, target=None):\n"
                "        if name.split('.')[0] == 'torch':\n"
                "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
                "sys.meta_path.insert(0, NoTorch())\n")
    probe = ("import comet_moe\ncomet_moe.MoeConfig.preset('tiny', 64)\n"
             "try:\n    comet_moe.CometSparseMoeBlock\nexcept ImportError as e:\n    print('ImportError:', e)\n")
    r = run_python(no_torch + probe, {"PYTHONPATH": str(REPO / "python")})
    check(r.returncode == 0 and "ImportError: comet_moe's layer and nn.Modules need PyTorch >= 2.4" in r.stdout
          and "pip install 'torch>=2.4'" in r.stdout, f"without torch: {r.stdout[-600:]} {r.stderr[-600:]}")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "torch").mkdir()
        (Path(tmp) / "torch" / "__init__.py").write_text(
            "__version__ = '2.3.1+cu121'\nclass library:\n    custom_op = register_fake = None\n")
        r = run_python(probe.replace("comet_moe.CometSparseMoeBlock", "from comet_moe.block import CometSparseMoeBlock"),
                       {"PYTHONPATH": f"{tmp}{os.pathsep}{REPO / 'python'}"})
    check(r.returncode == 0 and "needs PyTorch >= 2.4 (torch.library.register_autograd, opcheck)" in r.stdout
          and "this is torch 2.3.1+cu121" in r.stdout, f"with torch 2.3: {r.stdout[-600:]} {r.stderr[-600:]}")


# ---- the mirror of comet.h ----

def test_constants_and_enums_match_the_header():
    text = header_text()
    d = header_defines(text)
    check_eq(int(d["COMET_STRUCT_MAGIC"].rstrip("uU"), 0), _capi.STRUCT_MAGIC, "COMET_STRUCT_MAGIC")
    check_eq(int(d["COMET_API_VERSION"]), _capi.API_VERSION, "COMET_API_VERSION")
    enums = header_enums(text)
    statuses = {v: k for k, v in enums.items() if k.startswith("COMET_") and k[6:] in
                {n[6:] for n in _capi.STATUS_NAMES.values()}}
    check_eq(statuses, _capi.STATUS_NAMES, "comet_status_t values")
    for name in ("COMET_IMPL_AUTO", "COMET_IMPL_BASELINE", "COMET_IMPL_FUSED", "COMET_DTYPE_BF16",
                 "COMET_GRAD_WRITE_BF16", "COMET_GRAD_ACCUMULATE_FP32"):
        check_eq(getattr(_capi, name[6:]), enums[name], name)
    lib = _capi.load()
    for code, name in _capi.STATUS_NAMES.items():
        s = _capi.text(lib.comet_status_string(code))
        check(s.startswith(name + ":"), f"comet_status_string({code}) = {s!r}, want {name}: ...")


def test_struct_layouts_match_the_header():
    if ctypes.sizeof(ctypes.c_void_p) != 8:
        skip("the layouts are checked for LP64 (64-bit Linux)")
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


def test_init_macros_match_new_structs():
    text = header_text()
    d = header_defines(text)
    enums = header_enums(text)
    constants = {"0": 0, "NULL": None, "COMET_STRUCT_MAGIC": _capi.STRUCT_MAGIC,
                 "COMET_API_VERSION": _capi.API_VERSION, **enums}
    inits = {k: v for k, v in d.items() if k.endswith("_INIT")}
    check_eq(sorted(inits), ["COMET_COMM_CONFIG_INIT", "COMET_MOE_ARGS_INIT", "COMET_MOE_BACKWARD_ARGS_INIT",
                             "COMET_MOE_CONFIG_INIT", "COMET_MOE_SAVED_CONFIG_INIT"], "_INIT macros")
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


def test_function_signatures_match_the_header():
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

def test_status_codes_map_to_exception_classes():
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


def test_validate_failures_raise_with_comets_message():
    bad = comet_moe.MoeConfig(hidden=256, ffn=256, num_experts=8, top_k=2, max_tokens=64)
    bad.hidden = 100  # assigned after the config was made: validate() and comet_moe_create check it
    e = raises(comet_moe.CometInvalidArgumentError, lambda: bad.validate(2),
               "comet_moe_config_validate", "COMET_INVALID_ARGUMENT", "config.hidden = 100", "multiple of 64")
    check_eq((e.status, e.status_name), (1, "COMET_INVALID_ARGUMENT"), "status")
    # Tensor parallelism: ep_size x tp_size = world, ffn a multiple of 64 x tp_size.
    tp = comet_moe.MoeConfig(hidden=256, ffn=256, num_experts=8, top_k=2, max_tokens=64, tp_size=2)
    check(tp.validate(2) is tp and tp.validate(4) is tp, "tp_size = 2 on 2 and 4 ranks (EP 1 and 2)")
    tp.ffn = 192
    raises(comet_moe.CometInvalidArgumentError, lambda: tp.validate(2), "COMET_INVALID_ARGUMENT", "config.ffn = 192",
           "tp_size")
    tp = comet_moe.MoeConfig(hidden=256, ffn=384, num_experts=8, top_k=2, max_tokens=64, tp_size=3)
    raises(comet_moe.CometInvalidArgumentError, lambda: tp.validate(2), "config.tp_size = 3")
    tp = comet_moe.MoeConfig(hidden=256, ffn=256, num_experts=8, top_k=2, max_tokens=64, ep_size=2, tp_size=2)
    raises(comet_moe.CometInvalidArgumentError, lambda: tp.validate(2), "ep_size = 2", "tp_size = 2")
    check(tp.validate(4) is tp, "ep_size 2 x tp_size 2 on 4 ranks")
    raises(comet_moe.CometInvalidArgumentError,
           lambda: comet_moe.MoeConfig(hidden=256, ffn=256, num_experts=6, top_k=2, max_tokens=64).validate(4),
           "config.num_experts = 6", "ep_size = 4")
    cfg = comet_moe.MoeConfig.preset("tiny", 64)
    cfg.max_tokens = 0
    raises(comet_moe.CometInvalidArgumentError, lambda: cfg.validate(1), "config.max_tokens = 0")


def test_config_refuses_what_no_world_size_allows():
    """MoeConfig(...) and MoeConfig.preset() check what no world size makes right when the
    config is made, in comet's words (field, value, limit); what depends on the world size
    waits for validate() and comet_moe_create."""
    good = dict(hidden=256, ffn=256, num_experts=8, top_k=2, max_tokens=64)

    def made(**changes):
        return lambda: comet_moe.MoeConfig(**dict(good, **changes))

    cases = [(dict(hidden=0), "config.hidden = 0", "multiple of 64 in 64..65536"),
             (dict(hidden=-64), "config.hidden = -64", "multiple of 64"),
             (dict(hidden=100), "config.hidden = 100", "multiple of 64"),
             (dict(ffn=0), "config.ffn = 0", "multiple of 64 in 64..65536"),
             (dict(ffn=96), "config.ffn = 96", "multiple of 64"),
             (dict(num_experts=0), "config.num_experts = 0", "must be 1.."),
             (dict(num_experts=-8), "config.num_experts = -8", "must be 1.."),
             (dict(top_k=0), "config.top_k = 0", "1..min(num_experts = 8, 32)"),
             (dict(top_k=9), "config.top_k = 9", "1..min(num_experts = 8, 32)"),
             (dict(max_tokens=0), "config.max_tokens = 0", "must be 1.."),
             (dict(max_tokens=-1), "config.max_tokens = -1", "must be 1.."),
             (dict(ep_size=-1), "config.ep_size = -1", "must be >= 0"),
             (dict(tp_size=-2), "config.tp_size = -2", "must be >= 0"),
             (dict(resend_x=2), "config.resend_x = 2", "must be 0"),
             # Fixed by the config alone: ffn against its own tp_size, experts against its ep_size.
             (dict(tp_size=3), "config.ffn = 256", "64 x tp_size = 192", "world size 3"),
             (dict(ep_size=3), "config.num_experts = 8", "divisible by ep_size = 3")]
    for change, *words in cases:
        e = raises(comet_moe.CometInvalidArgumentError, made(**change), "MoeConfig", "COMET_INVALID_ARGUMENT", *words)
        check_eq(e.status, _capi.INVALID_ARGUMENT, f"status for {change}")
    # No sizes at all: the same refusal, naming the first field.
    raises(comet_moe.CometInvalidArgumentError, lambda: comet_moe.MoeConfig(), "config.hidden = 0")
    # The presets: max_tokens and the overrides are checked the same way.
    raises(comet_moe.CometInvalidArgumentError, lambda: comet_moe.MoeConfig.preset("tiny", 0), "config.max_tokens = 0")
    raises(comet_moe.CometInvalidArgumentError, lambda: comet_moe.MoeConfig.preset("tiny", 64, top_k=16),
           "config.top_k = 16", "num_experts = 8")
    raises(comet_moe.CometInvalidArgumentError, lambda: comet_moe.MoeConfig.preset("mixtral-8x7b", 64, ffn=100),
           "config.ffn = 100")
    # What depends on the world size is left to validate(): 8 experts on 3 ranks, tp_size 2 on 3.
    cfg = comet_moe.MoeConfig(**good)
    raises(comet_moe.CometInvalidArgumentError, lambda: cfg.validate(3), "config.num_experts = 8", "ep_size = 3")
    cfg = comet_moe.MoeConfig(**dict(good, tp_size=2))
    raises(comet_moe.CometInvalidArgumentError, lambda: cfg.validate(3), "config.tp_size = 2", "world size 3")
    # The widest valid shapes are taken; ep_size x tp_size past one node is named as such.
    check_eq(comet_moe.MoeConfig(**dict(good, top_k=8, ep_size=8, tp_size=4, ffn=256)).validate(32).top_k, 8,
             "EP 8 x TP 4")
    raises(comet_moe.CometInvalidArgumentError, made(ep_size=8, tp_size=16, ffn=1024), "world size 128",
           "ep_size x tp_size")


def test_config_struct_size_is_what_comet_expects():
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


def test_comm_config_struct_reaches_comet():
    # comet_comm_create_from_id checks its config before NCCL is touched: a timeout_ms of
    # -1 (which Comm refuses itself, so through the C call here) is named, so size, magic,
    # version and the timeout_ms offset all matched.
    lib = _capi.load()
    uid = bytes(128)
    config, handle = _capi.CommConfigStruct(-1), ctypes.c_void_p()
    st = lib.comet_comm_create_from_id(ctypes.byref(_capi.NcclUniqueId.from_buffer_copy(uid)), 1, 0,
                                       ctypes.byref(config), ctypes.byref(handle))
    check_eq(st, _capi.INVALID_ARGUMENT, "comet_comm_create_from_id with timeout_ms -1")
    check("comm config.timeout_ms = -1" in _capi.text(lib.comet_last_create_error()), "timeout_ms named by comet")
    # The largest timeout Comm takes reaches comet, which then names the bad rank.
    raises(comet_moe.CometInvalidArgumentError, lambda: comet_moe.Comm(uid, 2, 5, timeout_ms=3600000),
           "comet_comm_create_from_id", "rank = 5", "0..nranks-1 = 1")
    raises(comet_moe.CometInvalidArgumentError, lambda: comet_moe.Comm(uid, 0, 0), "nranks = 0")
    raises(ValueError, lambda: comet_moe.Comm(b"short", 1, 0), "unique_id has 5 bytes", "128")


def test_comm_refuses_ints_ctypes_would_truncate():
    # Each would reach comet as its low 32 bits (2**32 + 1 ranks as 1, rank 2**32 as 0);
    # a timeout past comet's range would wait an hour and more. Refused before any C call.
    uid = bytes(128)
    raises(ValueError, lambda: comet_moe.Comm(uid, 1, 0, timeout_ms=2**40), "timeout_ms = 1099511627776",
           "0..3600000", "milliseconds")
    raises(ValueError, lambda: comet_moe.Comm(uid, 1, 0, timeout_ms=3600001), "timeout_ms = 3600001", "0..3600000")
    raises(ValueError, lambda: comet_moe.Comm(uid, 1, 0, timeout_ms=-1), "timeout_ms = -1", "0..3600000")
    raises(TypeError, lambda: comet_moe.Comm(uid, 1, 0, timeout_ms=1.5), "timeout_ms = 1.5", "expected an int")
    raises(TypeError, lambda: comet_moe.Comm(uid, 1, 0, timeout_ms=True), "timeout_ms = True", "not a bool")
    raises(ValueError, lambda: comet_moe.Comm(uid, 2**32 + 1, 0), "nranks = 4294967297", "-2147483648..2147483647")
    raises(ValueError, lambda: comet_moe.Comm(uid, 2, 2**32), "rank = 4294967296", "2147483647")
    raises(TypeError, lambda: comet_moe.Comm(uid, 2.0, 0), "nranks = 2.0")
    raises(TypeError, lambda: comet_moe.Comm(128, 1, 0), "unique_id: expected the bytes", "got int")
    # from_process_group checks timeout_ms first, before torch or anything collective.
    raises(ValueError, lambda: comet_moe.Comm.from_process_group(timeout_ms=2**40), "timeout_ms = 1099511627776",
           "0..3600000")


def test_nccl_unique_id_through_libcomet():
    try:
        a, b = comet_moe.unique_id(), comet_moe.unique_id()
    except comet_moe.CometNcclError as e:
        skip(f"NCCL cannot make an id on this machine: {e}")
    check(isinstance(a, bytes) and len(a) == 128, f"unique_id() gave {type(a).__name__} of {len(a)} bytes")
    check(any(a) and a != b, "two unique ids: empty, or equal")


# ---- presets and configs ----

def test_presets_from_the_library():
    names = comet_moe.presets()
    check_eq(names, ["mixtral-8x7b", "phi-3.5-moe", "qwen2-57b-a14b", "qwen2-moe-2.7b", "gpt-oss-120b", "tiny"],
             "presets()")
    m = comet_moe.MoeConfig.preset("mixtral-8x7b", max_tokens=8192)
    check_eq(m.as_dict(), dict(hidden=4096, ffn=14336, num_experts=8, top_k=2, max_tokens=8192, ep_size=0,
                               tp_size=0, resend_x=0, dtype="bf16", fp8_pow2_scales=0, fp8_wgrad_cublaslt=0),
             "mixtral-8x7b")
    check_eq((m.size, m.magic, m.version, m.dtype), (64, _capi.STRUCT_MAGIC, _capi.API_VERSION, 0), "header fields")
    t = comet_moe.MoeConfig.preset("tiny", 100, ffn=256, top_k=4)
    check_eq((t.hidden, t.ffn, t.num_experts, t.top_k, t.max_tokens), (256, 256, 8, 4, 100), "tiny with overrides")
    check(t.copy() == t and t.copy() is not t, "copy() equals and is new")
    raises(comet_moe.CometInvalidArgumentError, lambda: comet_moe.MoeConfig.preset("mixtral", 10),
           "comet_moe_config_preset", 'unknown preset "mixtral"', "known presets: mixtral-8x7b")
    raises(TypeError, lambda: comet_moe.MoeConfig.preset("tiny", 10, hiden=64), "unknown field 'hiden'")
    raises(ValueError, lambda: comet_moe.MoeConfig(max_tokens=2**31), "MoeConfig.max_tokens = 2147483648")
    raises(TypeError, lambda: comet_moe.MoeConfig(hidden=4096.0), "MoeConfig.hidden = 4096.0", "int")
    blank = comet_moe.MoeConfig._blank()  # internal: the struct as COMET_MOE_CONFIG_INIT, for copies and presets
    check_eq((blank.size, blank.hidden, blank.max_tokens), (64, 0, 0), "an unchecked blank config")


def test_config_refuses_ints_ctypes_would_truncate():
    # ctypes keeps the low bits of a wider int: cfg.max_tokens = 2**32 + 5 would read 5.
    cfg = comet_moe.MoeConfig.preset("tiny", 512)
    before = cfg.copy()

    def assign(field, value):
        return lambda: setattr(cfg, field, value)

    raises(ValueError, assign("max_tokens", 2**32 + 5), "MoeConfig.max_tokens = 4294967301",
           "-2147483648..2147483647", "a C int")
    for field in ("hidden", "ffn", "num_experts", "top_k", "max_tokens", "ep_size", "tp_size", "dtype"):
        raises(ValueError, assign(field, 2**31), f"MoeConfig.{field} = 2147483648", "2147483647")
        if field == "dtype":  # a name is what it takes (test_config_takes_the_fp8_format_by_name)
            continue
        raises(ValueError, assign(field, -2**31 - 1), f"MoeConfig.{field} = -2147483649", "-2147483648")
        raises(TypeError, assign(field, 64.0), f"MoeConfig.{field} = 64.0", "expected an int, got float")
        raises(TypeError, assign(field, "64"), f"MoeConfig.{field} = '64'", "got str")
        raises(TypeError, assign(field, True), f"MoeConfig.{field} = True", "not a bool")
    # The header fields by their own C types (comet's checks of them stay reachable).
    raises(ValueError, assign("size", -1), "MoeConfig.size = -1", f"0..{2**64 - 1}", "a C size_t")
    raises(ValueError, assign("size", 2**64), "MoeConfig.size = 18446744073709551616")
    raises(ValueError, assign("magic", 2**32), "MoeConfig.magic = 4294967296", "0..4294967295", "unsigned int")
    raises(ValueError, assign("version", -1), "MoeConfig.version = -1", "0..4294967295")
    check(cfg == before, f"a refused assignment changed the config: {cfg!r}")
    # A misspelt field would become a plain attribute that comet never sees.
    raises(AttributeError, assign("max_token", 64), "MoeConfig has no field 'max_token'", "max_tokens")
    # The widest values that fit are kept exactly.
    for field in ("hidden", "max_tokens"):
        for v in (2**31 - 1, -2**31):
            setattr(cfg, field, v)
            check_eq(getattr(cfg, field), v, f"MoeConfig.{field} = {v}")
    cfg.size = 2**64 - 1
    check_eq(cfg.size, 2**64 - 1, "size = SIZE_MAX")
    # The constructor and the preset's max_tokens and overrides check the same way.
    raises(ValueError, lambda: comet_moe.MoeConfig(top_k=2**32 + 2), "MoeConfig.top_k = 4294967298")
    raises(ValueError, lambda: comet_moe.MoeConfig.preset("tiny", 2**32 + 5), "MoeConfig.max_tokens = 4294967301")
    raises(ValueError, lambda: comet_moe.MoeConfig.preset("tiny", 64, ffn=2**33), "MoeConfig.ffn = 8589934592")
    raises(TypeError, lambda: comet_moe.MoeConfig.preset("tiny", 64, top_k=2.5), "MoeConfig.top_k = 2.5")
    # The name is a C string: a NUL would end it early ("tiny\0x" read as "tiny").
    raises(ValueError, lambda: comet_moe.MoeConfig.preset("tiny\0x", 64), "name = 'tiny\\x00x'", "NUL")
    raises(TypeError, lambda: comet_moe.MoeConfig.preset(b"tiny", 64), "name = b'tiny'", "expected a str")


def test_config_takes_the_fp8_format_by_name():
    """dtype "bf16" | "fp8" (or comet_dtype_t's values) and fp8_pow2_scales, mapped to
    comet_moe_config_t's fields; anything else refused as it is set, naming what is taken."""
    good = dict(hidden=512, ffn=256, num_experts=8, top_k=2, max_tokens=64)
    cfg = comet_moe.MoeConfig(**good, dtype="fp8")
    check_eq((cfg.dtype, cfg.dtype_name, cfg.is_fp8, cfg.fp8_pow2_scales), (_capi.DTYPE_FP8_BLOCK, "fp8", True, 0),
             "dtype='fp8'")
    check_eq((comet_moe.DTYPE_BF16, comet_moe.DTYPE_FP8_BLOCK), (0, 1), "COMET_DTYPE_BF16, COMET_DTYPE_FP8_BLOCK")
    raw = bytes(cfg)  # what comet reads: dtype at byte 44, fp8_pow2_scales at 52 (GCC_X86_64)
    check_eq((raw[44], raw[52]), (1, 0), "the struct's dtype and fp8_pow2_scales bytes")
    pow2 = comet_moe.MoeConfig(**good, dtype="FP8", fp8_pow2_scales=True)
    check_eq((pow2.dtype, pow2.fp8_pow2_scales, bytes(pow2)[52]), (1, 1, 1), "dtype='FP8', fp8_pow2_scales=True")
    check_eq(comet_moe.MoeConfig(**good).dtype_name, "bf16", "the default format")
    check_eq(comet_moe.MoeConfig(**good, dtype=comet_moe.DTYPE_FP8_BLOCK), cfg, "dtype by comet_dtype_t's value")
    check_eq(comet_moe.MoeConfig(**pow2.as_dict()), pow2, "MoeConfig(**cfg.as_dict()) gives the config back")
    check("dtype='fp8', fp8_pow2_scales=1" in repr(pow2), f"repr: {pow2!r}")
    check(pow2.validate(2) is pow2, "an FP8 config passes comet's validate")
    p = comet_moe.MoeConfig.preset("tiny", 64, dtype="fp8", fp8_pow2_scales=1)
    check_eq((p.dtype_name, p.fp8_pow2_scales), ("fp8", 1), "a preset with dtype and fp8_pow2_scales overrides")
    cfg.dtype = "bf16"
    check_eq(cfg.dtype, _capi.DTYPE_BF16, "cfg.dtype = 'bf16'")
    # Refused as they are set, before comet sees them; a refused assignment changes nothing.
    before = cfg.copy()
    for bad, exc, words in (("fp16", ValueError, ("MoeConfig.dtype = 'fp16'", "expected 'bf16' or 'fp8'")),
                            ("float8_e4m3fn", ValueError, ("'float8_e4m3fn'", "'bf16' or 'fp8'")),
                            (2, ValueError, ("MoeConfig.dtype = 2", "DTYPE_FP8_BLOCK = 1")),
                            (-1, ValueError, ("MoeConfig.dtype = -1",)),
                            (1.0, TypeError, ("MoeConfig.dtype = 1.0", "expected an int")),
                            (True, TypeError, ("MoeConfig.dtype = True", "not a bool")),
                            (None, TypeError, ("MoeConfig.dtype = None",))):
        raises(exc, lambda: setattr(cfg, "dtype", bad), *words)
        raises(exc, lambda: comet_moe.MoeConfig(**good, dtype=bad), *words)
    raises(ValueError, lambda: comet_moe.MoeConfig.preset("tiny", 64, dtype="int8"), "MoeConfig.dtype = 'int8'")
    for bad, exc, words in ((2, ValueError, ("MoeConfig.fp8_pow2_scales = 2", "True / 1")),
                            (-1, ValueError, ("MoeConfig.fp8_pow2_scales = -1",)),
                            ("yes", TypeError, ("MoeConfig.fp8_pow2_scales = 'yes'",)),
                            (0.5, TypeError, ("MoeConfig.fp8_pow2_scales = 0.5",))):
        raises(exc, lambda: setattr(cfg, "fp8_pow2_scales", bad), *words)
    check(cfg == before, f"a refused assignment changed the config: {cfg!r}")
    # Powers of two are for FP8 scales: comet refuses them on a bf16 config, in its words.
    raises(comet_moe.CometInvalidArgumentError, lambda: comet_moe.MoeConfig(**good, fp8_pow2_scales=True),
           "config.fp8_pow2_scales = 1 is for config.dtype COMET_DTYPE_FP8_BLOCK")


def test_config_takes_the_fp8_weight_gradients_switch():
    """fp8_wgrad_cublaslt: a bool or 0 / 1 at byte 56, for FP8 configs (comet refuses it on
    bf16, in its words), in repr and as_dict; anything else refused as it is set."""
    good = dict(hidden=512, ffn=256, num_experts=8, top_k=2, max_tokens=64)
    cfg = comet_moe.MoeConfig(**good, dtype="fp8", fp8_wgrad_cublaslt=True)
    check_eq((cfg.fp8_wgrad_cublaslt, bytes(cfg)[56]), (1, 1), "fp8_wgrad_cublaslt=True")
    check_eq(bytes(comet_moe.MoeConfig(**good, dtype="fp8"))[56], 0, "the default: comet's weight gradients")
    check("fp8_wgrad_cublaslt=1" in repr(cfg), f"repr: {cfg!r}")
    check_eq(comet_moe.MoeConfig(**cfg.as_dict()), cfg, "MoeConfig(**cfg.as_dict()) gives the config back")
    check(cfg.validate(2) is cfg, "passes comet's validate")
    before = cfg.copy()
    for bad, exc, words in ((2, ValueError, ("MoeConfig.fp8_wgrad_cublaslt = 2", "True / 1 (cuBLASLt's")),
                            (-1, ValueError, ("MoeConfig.fp8_wgrad_cublaslt = -1",)),
                            ("on", TypeError, ("MoeConfig.fp8_wgrad_cublaslt = 'on'",))):
        raises(exc, lambda: setattr(cfg, "fp8_wgrad_cublaslt", bad), *words)
    check(cfg == before, f"a refused assignment changed the config: {cfg!r}")
    raises(comet_moe.CometInvalidArgumentError, lambda: comet_moe.MoeConfig(**good, fp8_wgrad_cublaslt=1),
           "config.fp8_wgrad_cublaslt = 1 is for config.dtype COMET_DTYPE_FP8_BLOCK")


def test_validate_refuses_a_world_size_ctypes_would_truncate():
    cfg = comet_moe.MoeConfig.preset("tiny", 512)
    raises(ValueError, lambda: cfg.validate(2**40), "world_size = 1099511627776", "1..2147483647")
    raises(ValueError, lambda: cfg.validate(2**32 + 2), "world_size = 4294967298")
    raises(ValueError, lambda: cfg.validate(0), "world_size = 0", "1..2147483647")
    raises(TypeError, lambda: cfg.validate(2.0), "world_size = 2.0", "expected an int")
    raises(TypeError, lambda: cfg.validate(True), "world_size = True")
    # Inside the C int range comet says what it takes.
    raises(comet_moe.CometInvalidArgumentError, lambda: cfg.validate(2**31 - 1), "world size 2147483647")
    check(cfg.validate(2) is cfg, "world size 2")


def test_impl_names():
    check_eq([parse_impl(v) for v in ("auto", "BASELINE", "fused", 0, 1, 2)], [0, 1, 2, 0, 1, 2], "parse_impl")
    for bad in ("fast", 3, True, None):
        raises(ValueError, lambda: parse_impl(bad), f"impl = {bad!r}")


def test_layer_refuses_wrong_types_before_calling_comet():
    cfg = comet_moe.MoeConfig.preset("tiny", 16)
    raises(TypeError, lambda: comet_moe.Moe("comm", cfg), "comm: expected a comet_moe.Comm, got str")
    # [g u] in E4M3 between the forward and the backward: FP8 layers only, by name.
    raises(ValueError, lambda: comet_moe.Moe("comm", cfg, fp8_gate_up="fp8"), "fp8_gate_up = 'fp8'",
           "expected 'bf16' or 'e4m3'")
    raises(ValueError, lambda: comet_moe.Moe("comm", cfg, fp8_gate_up="e4m3"), "is for FP8 layers")
    fp8 = comet_moe.MoeConfig.preset("tiny", 16, dtype="fp8")
    raises(TypeError, lambda: comet_moe.Moe("comm", fp8, fp8_gate_up="e4m3"), "comm: expected a comet_moe.Comm")
    check_eq(bytes(_capi.MoeSavedConfigStruct(5, 1))[16:28], bytes([5, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]),
             "comet_moe_saved_config_t's max_recv_rows and gate_up_e4m3 bytes")
    # Handles are never copied (a copy would destroy them twice), and an object whose
    # constructor failed closes as a no-op.
    for cls in (comet_moe.Moe, comet_moe.Comm):
        half_made = cls.__new__(cls)
        half_made._box = None
        raises(TypeError, lambda: copy.deepcopy(half_made), "cannot be copied or pickled")
        raises(TypeError, lambda: pickle.dumps(half_made), "cannot be copied or pickled")
        check(half_made.closed, f"{cls.__name__} without a handle reads as closed")
        half_made.close()


def test_python_sources_pass_flake8_names():
    """Every Python file of the repo against flake8's pyflakes checks (F: undefined names,
    unused imports and locals): the GPU-only paths of the package run nowhere in CI, and a
    name lost in an edit there would first fail on a GPU."""
    try:
        import flake8  # noqa: F401
    except ImportError:
        skip("flake8 is not installed (pip install flake8 to run it)")
    run = subprocess.run([sys.executable, "-m", "flake8", "--select=F", "python", "bench", "scripts"],
                         cwd=REPO, capture_output=True, text=True)
    check(run.returncode == 0, "flake8 --select=F:\n" + (run.stdout + run.stderr).strip())
