"""offload: run PyTorch models larger than the GPU.

Each block's weights live in host memory and reach the GPU just before the
block runs, the copy overlapping the previous block's compute; the device copy
is dropped after use. The engine (host store, ring, plan, coding) is the Rust
workspace's, through a small extension module: no libtorch is linked, so one
wheel serves any torch 2.x.

    import offload
    handle = offload.enable(pipe.transformer, depth=1)   # blocks found in the module tree
    image = pipe(prompt).images[0]                       # hooks stream each block
    print(handle.metrics())                              # the last step's bytes, hits, waits
    offload.disable(pipe.transformer)                    # the module as it was
"""

from ._offload import OffloadError, __version__, gguf_read, gguf_tensors, safetensors_read, safetensors_tensors
from ._module import Offloaded, disable, disable_pipeline, enable, enable_pipeline, find_blocks, offloaded

__all__ = ["__version__", "OffloadError", "Offloaded", "disable", "disable_pipeline", "enable", "enable_pipeline", "find_blocks", "gguf_read", "gguf_tensors",
           "offloaded", "safetensors_read", "safetensors_tensors"]
