"""Where the host store's fill time goes on this machine (bench/NOTES.md, the
fourteenth session): page-locked allocation (`cuMemHostAlloc`, portable, as
offload-cuda calls it), zeroing it, and copying a pageable tensor into it, each
timed on one thread and on several. Prints one JSON line; needs a CUDA device.

    python3 bench/anchors/host_fill_probe.py [--gib 2] [--threads 8]
"""
import argparse
import contextlib
import ctypes
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=8)
    a = ap.parse_args()
    n = int(a.gib * (1 << 30))
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    cuda = ctypes.CDLL("libcuda.so.1")
    out = {"gib": a.gib, "threads": a.threads, "cpu_threads": torch.get_num_threads()}

    def timed(f):
        t = time.perf_counter()
        r = f()
        return r, time.perf_counter() - t

    src = torch.empty(n, dtype=torch.uint8)
    _, out["src_first_touch_s"] = timed(lambda: src.random_(0, 255))

    def host_alloc():
        p = ctypes.c_void_p()
        rc = cuda.cuMemHostAlloc(ctypes.byref(p), ctypes.c_size_t(n), ctypes.c_uint(1))  # CU_MEMHOSTALLOC_PORTABLE
        assert rc == 0, f"cuMemHostAlloc: {rc}"
        return p

    results = {}
    for threads in (1, a.threads):
        torch.set_num_threads(threads)
        p, alloc_s = timed(host_alloc)
        buf = (ctypes.c_uint8 * n).from_address(p.value)
        dst = torch.frombuffer(buf, dtype=torch.uint8)
        _, zero_s = timed(lambda: dst.zero_())
        _, copy_s = timed(lambda: dst.copy_(src))
        _, copy2_s = timed(lambda: dst.copy_(src))  # the same pages again
        assert torch.equal(dst[:: 1 << 20], src[:: 1 << 20])
        del dst, buf
        _, free_s = timed(lambda: cuda.cuMemFreeHost(p))
        results[threads] = {"alloc_s": alloc_s, "zero_s": zero_s, "copy_s": copy_s, "copy_again_s": copy2_s, "free_s": free_s}
    gb = n / 1e9
    for threads, r in results.items():
        r["alloc_gb_s"] = gb / r["alloc_s"]
        r["zero_gb_s"] = gb / r["zero_s"]
        r["copy_gb_s"] = gb / r["copy_s"]
        # The fill as offload-cuda does it today: allocate, zero, copy.
        r["fill_gb_s"] = gb / (r["alloc_s"] + r["zero_s"] + r["copy_s"])
    out["by_threads"] = results
    out["pinning"] = pinning(cuda, n, a.threads)
    print(json.dumps(out))


def pinning(cuda, n: int, threads: int) -> dict:
    """Ways to pin `n` bytes, each timed: `cuMemHostAlloc` of n / threads
    bytes on each of `threads` threads at once (ctypes lets the GIL go during
    the call); and ordinary memory (mmap, huge pages advised) touched, then
    registered with `cuMemHostRegister`, on one thread and with the touch on
    several."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    res = {}
    part = n // threads
    # The worker threads have no current context: torch's (the primary one) made current in each.
    ctx = ctypes.c_void_p()
    assert cuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value, "no current CUDA context"

    def alloc_one(_):
        assert cuda.cuCtxSetCurrent(ctx) == 0, "cuCtxSetCurrent"
        p = ctypes.c_void_p()
        rc = cuda.cuMemHostAlloc(ctypes.byref(p), ctypes.c_size_t(part), ctypes.c_uint(1))
        assert rc == 0, f"cuMemHostAlloc: {rc}"
        return p

    with ThreadPoolExecutor(threads) as ex:
        t = time.perf_counter()
        ptrs = list(ex.map(alloc_one, range(threads)))
        res["alloc_parallel_s"] = time.perf_counter() - t
    for p in ptrs:
        cuda.cuMemFreeHost(p)
    libc = ctypes.CDLL("libc.so.6")
    for touch_threads in (1, threads):
        m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(Exception):
            m.madvise(14)  # MADV_HUGEPAGE
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        chunk = n // touch_threads
        t = time.perf_counter()
        with ThreadPoolExecutor(touch_threads) as ex:
            list(ex.map(lambda i: libc.memset(ctypes.c_void_p(addr + i * chunk), 0, ctypes.c_size_t(chunk)), range(touch_threads)))
        touch_s = time.perf_counter() - t
        t = time.perf_counter()
        rc = cuda.cuMemHostRegister_v2(ctypes.c_void_p(addr), ctypes.c_size_t(n), ctypes.c_uint(1))
        reg_s = time.perf_counter() - t
        res[f"mmap_touch_{touch_threads}_s"] = touch_s
        res[f"register_after_touch_{touch_threads}_rc"] = rc
        res[f"register_after_touch_{touch_threads}_s"] = reg_s
        if rc == 0:
            cuda.cuMemHostUnregister(ctypes.c_void_p(addr))
        del addr
        with contextlib.suppress(BufferError):
            m.close()
    gb = n / 1e9
    res["alloc_parallel_gb_s"] = gb / res["alloc_parallel_s"]
    return res


if __name__ == "__main__":
    main()
