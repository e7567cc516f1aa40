"""comet_moe: PyTorch access to libcomet (include/comet.h) through ctypes.

    import torch.distributed as dist
    from comet_moe import Comm, MoeConfig, CometSparseMoeBlock

    comm = Comm.from_process_group()                      # after dist.init_process_group
    block = CometSparseMoeBlock(comm, MoeConfig.preset("mixtral-8x7b", max_tokens=8192))
    block.load_state_dict(full_state_dict)                # HF Mixtral names; keeps this rank's experts
    with torch.inference_mode():
        y, router_logits = block(hidden_states)
    block.close(); comm.close()

libcomet.so is found through $COMET_LIBRARY, then the repository's build/ beside this
package's source, then the system loader. The package imports without torch (the
library, configs, presets and errors need none); Comm.from_process_group, Moe.forward
and CometSparseMoeBlock need torch (>= 2.4; without it they raise ImportError saying what
to install). Under torch, comet's calls are torch custom operators (comet_moe::forward,
forward_out, forward_train, backward, their FP8 forms and the quantizers; see ops.py), so
torch.compile(model, fullgraph=True) traces a model that holds these layers, forward and
backward, without a graph break.

Block-scaled FP8 experts (MoeConfig(..., dtype="fp8"); Moe trains them from bf16 master
weights, CometSparseMoeBlock serves FP8 checkpoints): with torch,
quantize_fp8_weights[_transposed] and quantize_fp8_rows (comet's quantizers, on a GPU),
dequantize_fp8 (plain torch) and stack_fp8_experts (this rank's experts from an HF FP8
checkpoint's state dict); CometSparseMoeBlock.load_state_dict takes such a state dict too.
"""
from ._capi import (API_VERSION, DTYPE_BF16, DTYPE_FP8_BLOCK, IMPL_AUTO, IMPL_BASELINE, IMPL_FUSED,
                    LibraryNotFoundError, STATUS_NAMES, STRUCT_MAGIC, library_path)
from .comm import Comm, nccl_version, unique_id
from .config import MoeConfig, presets
from .errors import (CometCudaError, CometError, CometInternalError, CometInvalidArgumentError,
                     CometInvalidUsageError, CometNcclError, CometNotSupportedError, CometOutOfMemoryError,
                     CometRemoteError, CometTimeoutError)
from .moe import Moe

__version__ = "0.1.0"


def version() -> str:
    """libcomet's version string, e.g. "0.1.0 (NCCL 2.28.9 at build time)"."""
    from . import _capi
    return _capi.text(_capi.load().comet_version_string())


def __getattr__(name):
    # The torch module is imported on first use, so `import comet_moe` works without torch.
    if name in ("CometSparseMoeBlock", "mixtral_route"):
        from . import block
        return getattr(block, name)
    if name in ("quantize_fp8_weights", "quantize_fp8_weights_transposed", "quantize_fp8_rows", "dequantize_fp8"):
        from . import fp8
        return getattr(fp8, name)
    if name == "stack_fp8_experts":
        from . import checkpoint
        return checkpoint.stack_fp8_experts
    raise AttributeError(f"module 'comet_moe' has no attribute {name!r}")


__all__ = [
    "API_VERSION", "DTYPE_BF16", "DTYPE_FP8_BLOCK", "IMPL_AUTO", "IMPL_BASELINE", "IMPL_FUSED", "STATUS_NAMES",
    "STRUCT_MAGIC", "LibraryNotFoundError", "library_path", "version", "Comm", "nccl_version", "unique_id", "MoeConfig",
    "presets", "Moe", "CometError", "CometInvalidArgumentError", "CometInvalidUsageError", "CometCudaError",
    "CometNcclError", "CometOutOfMemoryError", "CometTimeoutError", "CometRemoteError", "CometNotSupportedError",
    "CometInternalError",
]  # and, with torch: CometSparseMoeBlock, mixtral_route, quantize_fp8_weights[_transposed], quantize_fp8_rows,
#   dequantize_fp8, stack_fp8_experts
