"""Every TorchTPU name the jobs call, in one place, each with the file of the torch-tpu wheel it was read in.

torch-tpu loads itself whenever torch is imported, so it was read in a side environment, never the
project's: `pip download torch-tpu==0.2.0 --no-deps` and the wheel unzipped (0.3.0, which the TPU image may
carry, was not offered to this machine; its names are unchecked). Without a TPU the package registers
nothing and runs no tensor code, so none of this runs off a TPU; the image's torch-tpu is `:latest`
(docs/limits.md).
"""

from __future__ import annotations

# name -> the 0.2.0 wheel's file that defines or exports it
READ_IN = {
    "torch_tpu": "torch_tpu/__init__.py (importing it registers the tpu device and the tpu_dist backend)",
    "torch_tpu._internal.optim.AdamW": "torch_tpu/_internal/optim/__init__.py, from _internal/optim/adamw.py: "
    "torch.optim.AdamW with its states made on the device at construction",
    "torch_tpu._internal.optim.patch_optimizer_graph_breaks": "torch_tpu/_internal/optim/__init__.py, from "
    "_internal/optim/patch.py: removes the graph break torch's optimizers insert for dynamo",
    "COMPILE_BACKEND": "torch_tpu/_internal/compile/__init__.py registers TpuBackend() as torch.compile's 'tpu' "
    "(and torch_tpu/_loader.py warns that 'inductor' on TPU is experimental)",
    "torch.tpu._get_cache_misses": "torch_tpu/_internal/device/_device_module.py, _DeviceModule._get_cache_misses "
    "(private: looked up, never assumed): the programs TorchTPU had to compile, fused eager's and compile's alike",
}
COMPILE_BACKEND = "tpu"


def register() -> None:
    """The tpu device and the tpu_dist process-group backend (backend.Backend.prepare)."""
    import torch_tpu  # noqa: F401


def adamw(params: list, lr, weight_decay: float):
    """TorchTPU's AdamW, as its Gemma 4 tutorial uses it (with the optimizer's graph breaks patched out): the
    learning rate a device tensor (capturable: the step counts on the device too). Not run here (no TPU)."""
    from torch_tpu._internal.optim import AdamW, patch_optimizer_graph_breaks

    patch_optimizer_graph_breaks()
    return AdamW(params, lr=lr, weight_decay=weight_decay, capturable=True)


def cache_misses() -> int | None:
    """TorchTPU's program-cache misses so far (each one a program compiled), or None where the installed torch-tpu
    has no such count (it is private API) or this is no TPU process."""
    import torch

    misses = getattr(getattr(torch, "tpu", None), "_get_cache_misses", None)
    return None if misses is None else int(misses())
