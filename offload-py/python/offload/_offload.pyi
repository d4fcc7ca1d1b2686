"""The engine's extension module (Rust, PyO3): what `offload` builds on. Its
public names are re-exported by `offload`; `Streamer` is the package's own."""

from typing import Any, Callable, Optional, Sequence

__version__: str

class OffloadError(Exception):
    """Every error the engine and the package raise: it names the component,
    the block or the tensor at fault."""

class Streamer:
    """One component's blocks streamed through a ring (the package's; use `offload.enable`)."""

    def __init__(
        self,
        component: str,
        tensors: Sequence[tuple[str, str, Sequence[int], Any]],
        stacks: Sequence[str],
        *,
        device: Optional[int] = None,
        stream: Any = None,
        depth: int = 1,
        budget_bytes: Optional[int] = None,
        resident_blocks: Sequence[str] = ...,
        coded: bool = False,
        pin_budget_bytes: Optional[int] = None,
        pageable_fallback: bool = False,
        checkpoint: Optional[str] = None,
        progress: Optional[Callable[[int, int], None]] = None,
        calibration: Optional[str] = None,
    ) -> None: ...
    def layouts(self) -> list[tuple[str, int, list[tuple[str, int, int]]]]: ...
    def lend(self, stack: str, index: int) -> Any: ...
    def block_bytes(self, stack: str, index: int) -> bytearray: ...
    def give_back(self) -> None: ...
    def end_step(self) -> str: ...
    def enable_timeline(self) -> None: ...
    def disable_timeline(self) -> None: ...
    def diagnose(self, link_bytes_per_s: Optional[float] = None) -> Optional[str]: ...
    def write_trace(self, path: str) -> None: ...
    def counters(self) -> list[tuple[str, int]]: ...
    def probe_bandwidth(self, passes: int) -> float: ...
    def host_bytes(self) -> tuple[int, int]: ...
    def host_tier(self) -> tuple[int, int, Optional[str]]: ...
    def plan(self) -> tuple[int, list[str]]: ...
    def calibration(self, compute_s: Optional[dict[str, float]] = None) -> str: ...
    def violations(self) -> list[str]: ...
    def close(self) -> None: ...

def safetensors_tensors(path: str) -> list[tuple[str, str, list[int]]]:
    """A safetensors file's tensors: `(name, dtype, shape)` each, its header checked."""

def safetensors_read(path: str, name: str) -> bytearray:
    """One tensor's bytes from a safetensors file."""

def gguf_tensors(path: str) -> list[tuple[str, str, list[int]]]:
    """A GGUF file's tensors as offload reads them (diffusers' names), with quant types and shapes."""

def gguf_read(path: str, name: str) -> bytearray:
    """One tensor's stored (quantized) bytes from a GGUF file."""
