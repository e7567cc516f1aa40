"""The torch this package's torch parts use, imported here once: without torch, or with a
torch older than the custom-operator API they are built on (torch.library.custom_op,
register_fake, register_autograd, opcheck: torch 2.4), the import raises an ImportError
that says what to install. The library, configs, presets and errors need no torch.
"""
MIN_VERSION = (2, 4)
_NEEDS = ("custom_op", "register_fake", "register_autograd", "opcheck")


def _version_tuple(text: str) -> tuple:
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _load():
    want = ".".join(map(str, MIN_VERSION))
    try:
        import torch
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        raise ImportError(f"comet_moe's layer and nn.Modules need PyTorch >= {want}, which is not installed: "
                          f"pip install 'torch>={want}' (the library, configs and presets work without it)") from None
    missing = [name for name in _NEEDS if not hasattr(torch.library, name)]
    if missing or _version_tuple(torch.__version__) < MIN_VERSION:
        raise ImportError(f"comet_moe needs PyTorch >= {want} (torch.library.{', '.join(missing or _NEEDS)}); "
                          f"this is torch {torch.__version__}: pip install -U 'torch>={want}'")
    return torch


torch = _load()
