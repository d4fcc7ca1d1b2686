"""`Offloaded`: one module's streaming state, its metrics and plan, and the
binding of a block's weights around its forward (and again in the backward)."""

from __future__ import annotations

import contextlib
import gc
import json
import math
import numbers
import threading
import warnings
from typing import Any, Optional

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from ._offload import OffloadError, Streamer

from ._placeholder import _ArgumentTypeError, _ArgumentValueError, _Placeholder
from . import _traced
from ._blocks import _Block, _Cast, _Dequant, _Moved, _Outer, _Param, _Saved, _SavedParam
from ._hooks import _Compiled, _SavedByUs, _Watch, _host_tensors, _in_autograd_pass


class Offloaded:
    """A module whose blocks stream through the Rust engine. Made by
    :func:`enable`; :meth:`disable` (or :func:`disable` on the module) puts it
    back."""

    def __init__(self) -> None:
        self.component: str = ""
        self.device: torch.device = torch.device("cpu")
        self._streamer: Optional[Streamer] = None
        self._blocks: dict[nn.Module, _Block] = {}
        # The blocks in the order enable found them, and the token a compiled
        # graph's ops name this module by (`_traced`).
        self._order: list[_Block] = []
        # Each block's place in the order blocks were first called (`_arm`).
        self._first_called: dict[int, int] = {}
        self._token = _traced.register(self)
        # Traced: the last block's `unbind` output, which the next op takes.
        self._receipt = None
        self._params: dict[str, _Param] = {}
        self._moved_tensors: list[_Moved] = []
        self._hooks: list = []
        self._engine_stream = None
        # The engine's compute stream as torch's raw handle and its device's index:
        # compared at every block, where making a `torch.cuda.Stream` costs host time.
        self._engine_raw = (0, 0)
        self._last_metrics: Optional[dict] = None
        self._steps = 0
        # The depth is the package's to choose (no depth, budget or calibration
        # given): the first two steps are traced, and the depth chosen at the second's end.
        self._auto = False
        self._traced_by_user = False
        # The device memory the automatic plan may keep host-bound blocks
        # resident in (None: a quarter of the free memory at the choice), and
        # why it kept those it kept.
        self._allowance: Optional[int] = None
        self._kept_why = ""
        self.module: Optional[nn.Module] = None
        self._bound: Optional[_Block] = None
        # Blocks run in the step under way: a block asked for again begins the
        # next step (a component the pipeline calls through another method than
        # forward, a VAE's decode, has no forward hook to end its steps).
        self._ran: set = set()
        # Inside the module's forward (its pre-hook to its step hook): there a
        # block run twice is the model's own doing, not the next step. A step hook
        # outside it (a pre-hook raised first) has no step to end.
        self._in_forward = False
        self._buffer = None
        self._version: Optional[int] = None
        self._stream = None
        # The thread inside the module (a forward, or a block bound outside one),
        # and whether a block's bind took it (given back at its unbind): the ring
        # serves one caller at a time, so a second thread is refused at entry.
        self._owner: Optional[int] = None
        self._owned_by_block = False
        self._lock = threading.Lock()
        # Lazy binding: the block whose forward runs and whose weights are not
        # bound yet, and how many blocks this step ran without using them.
        self._lazy = True
        self._armed: Optional[_Block] = None
        # The block whose compiled call `_Compiled` runs: its binding is that call's,
        # so its own hooks, run eagerly inside it (around a graph break), do nothing.
        self._calling: Optional[_Block] = None
        # Whether the forward under way was begun by a compiled graph's op (the
        # module compiled whole), not by the module's eager pre-hook.
        self._compiled_forward = False
        self._skipped = 0
        # Backward streaming: the saved-tensor hooks pushed while a block is bound
        # in grad mode (and the hooks they sit on), whether the engine serves a
        # backward now, and that backward's step metrics.
        self._saving: Optional[tuple] = None
        # Whether a push of ours may sit under hooks pushed since (left by a
        # block an interrupt ended mid-forward, which skips torch's always_call
        # hooks): popped when it comes back on top, never by popping another's.
        self._stale = False
        # The block whose pre-hook ran last and its keyword arguments, and
        # whether the grad-off graph check is walking a graph (`_hooks`).
        self._kwargs_of: Optional[tuple] = None
        self._walking = False
        # Each lend of the step (a weak reference to its bytes, the block): at
        # the step's end a block's bytes still referenced beyond the ring's
        # slots are counted (`retained_blocks`) and warned of once.
        self._lent: list = []
        self._warned_retained = False
        self._gc_tries = 0
        self._held_earlier = [False, False]  # by pass (forward, backward): whether a step of it held lent bytes
        self._retained_warning: Optional[str] = None
        # The hooks that push sat on: where a user's context wrapped the block,
        # its exit popped ours in place of its own, which are left on top.
        self._stale_outer: Optional[tuple] = None
        self._backward = False
        # The last step of each pass (forward, backward).
        self._by_pass: list = [None, None]
        # Host tensors a block moves to the device itself (a rotary table the
        # model makes on the host): learned in its first forward (`_Watch`), then
        # moved once a step, page-locked and without a host sync, before the
        # block's weights are lent, so the block's own copy finds them there
        # instead of queueing a pageable copy and a stream sync behind the
        # prefetch on the copy engine. Per block: the paths of those arguments;
        # the watch of the block being learned; this step's moved tensors.
        self._moves: dict = {}
        self._watch: Optional[tuple] = None
        self._moved: dict = {}
        # The GGUF layer (diffusers' GGUFLinear) of the bound block whose forward
        # runs in grad mode, with its streamed parameter: what autograd saves
        # inside it is its dequantized weight (`_pack`).
        self._gguf: Optional[tuple] = None

    @property
    def steps(self) -> int:
        """Steps ended since enabling (forward and backward passes alike)."""
        return self._steps

    def __reduce_ex__(self, protocol):
        raise OffloadError(f"component {self.component!r}: an offloaded module cannot be copied, pickled or saved (its block "
                           "weights are in the engine's store); disable it first")

    def __deepcopy__(self, memo):
        return self.__reduce_ex__(2)

    # -- public ---------------------------------------------------------------
    def metrics(self, which: str = "last") -> dict:
        """The last step's metrics (bytes streamed, prefetch hits, misses, host
        waits, device bytes, ...; ``kept_bytes``: the device bytes of the
        blocks the automatic plan keeps resident, which the ring's
        ``device_weight_bytes`` do not count; a step is one forward of the module, or
        for a module called through another method, such as a VAE's
        ``decode``, one pass over its blocks: a block run again begins the
        next step; a backward that brings the blocks back is a step of its
        own, ``"backward": True``). ``which``: ``"last"``, or the last
        ``"forward"`` or ``"backward"`` step."""
        if which not in ("last", "forward", "backward"):
            raise _ArgumentValueError(f"component {self.component!r}: which must be 'last', 'forward' or 'backward', not {which!r}")
        m = self._last_metrics if which == "last" else self._by_pass[which == "backward"]
        if m is None:
            raise OffloadError(f"component {self.component!r}: no {'' if which == 'last' else which + ' '}step has ended yet")
        return dict(m)

    def counters(self) -> dict:
        """The device's counters since enabling: host synchronisations
        (``syncs``; none in a steady-state step), copies, bytes copied, slot
        bytes live and at peak."""
        return dict(self._engine().counters())

    def probe_bandwidth(self, passes: int = 3) -> float:
        """Host-to-device bytes per second: every streamed block copied, the
        best of ``passes`` passes (synchronises the host; call it between steps)."""
        self._refuse_capture("probe_bandwidth")
        return self._engine().probe_bandwidth(passes)

    def host_bytes(self) -> tuple[int, int]:
        """Host bytes the store holds, and how many are page-locked."""
        return self._engine().host_bytes()

    def host_tier(self) -> dict:
        """How the host store holds the blocks: ``{"in_place": n, "copied": m,
        "copy_reason": ...}``. With ``checkpoint=``, a block is served in place
        from the file's pages when its tensors lie in the file as the store lays
        them out (one after another, each a multiple of 256 bytes from the
        block's first); otherwise it is copied, and the reason says why."""
        mapped, copied, why = self._engine().host_tier()
        return {"in_place": mapped, "copied": copied, "copy_reason": why}

    def enable_trace(self) -> None:
        """Time both streams from now on (a few events per block, and a wait
        for them at each step's end; it synchronises once now): write the last
        step with :meth:`write_trace`, read it with :meth:`diagnose`. Leave it
        off when timing the steady state (:meth:`disable_trace`)."""
        self._refuse_capture("enable_trace")
        self._engine().enable_timeline()
        self._traced_by_user = True

    def disable_trace(self) -> None:
        """Stop timing the streams (the recorded steps are dropped)."""
        self._engine().disable_timeline()
        self._traced_by_user = False

    def diagnose(self, link_gbps: Optional[float] = None) -> dict:
        """Why the last traced step was slower than its bound: call
        :meth:`enable_trace`, run a step (the first one after enabling learns
        the block order: run two), then this.

        Each wait of the compute stream for a block's copy is charged to what
        held the copy back: ``"link"`` (copies back to back at the link's rate:
        a copy-bound step), ``"late"`` (the copy stream sat idle before the copy:
        issued too late behind a short block; a larger ``depth`` helps),
        ``"slot"`` (the copy waited for its slot's previous block to finish),
        ``"shared_link"`` (the copy ran slower than the link: the model's own
        host-to-device copies shared it); and ``"host"`` names a host that
        needed about the device's whole step (Python time per block, or a host
        synchronisation inside a block). Returns ``{"summary": str, "verdict":
        cause or None, "causes": {cause: seconds}, "waits": [{"block", "wait_s",
        "by_cause", "copy_gbps", ...}], "step_s", "compute_s", "wait_s",
        "between_s", "host_s", "host_blocks", "link_gbps", ...}`` and
        ``"host_tables"``: the host tensors the package moves once a step for
        the blocks (their bytes share the link). ``link_gbps``: the link's
        rate to measure copies against (:meth:`probe_bandwidth` ÷ 1e9), else
        the step's fastest copy."""
        if link_gbps is not None and (isinstance(link_gbps, bool) or not isinstance(link_gbps, numbers.Real)):
            raise _ArgumentTypeError(f"component {self.component!r}: link_gbps must be a number of GB/s, not {link_gbps!r}")
        if link_gbps is not None and not (math.isfinite(link_gbps) and link_gbps > 0):
            raise _ArgumentValueError(f"component {self.component!r}: link_gbps must be a finite number above 0, not {link_gbps!r}")
        raw = self._engine().diagnose(None if link_gbps is None else float(link_gbps) * 1e9)
        if raw is None:
            if self._blocks and all(b.kept is not None for b in self._blocks.values()):
                raise OffloadError(f"component {self.component!r}: nothing to diagnose: every block is kept resident (the "
                                   "automatic plan found the step host-bound; plan() says why), so no step copies a block")
            raise OffloadError(f"component {self.component!r}: no traced step to diagnose: call enable_trace(), run a step, "
                               "then diagnose()")
        d = json.loads(raw)
        d["causes"] = {c: s for c, s in d["causes"]}
        d["host_blocks"] = {b: s for b, s in d["host_blocks"]}
        for w in d["waits"]:
            w["by_cause"] = {c: s for c, s in w["by_cause"]}
        def where(path) -> str:
            kind, key, *inner = path
            return (f"args[{key}]" if kind == "a" else f"{key}=") + "".join(f"[{i}]" for i in inner)

        d["host_tables"] = {f"{b.stack}.{b.index}": [where(p) for p in self._moves[id(b)]]
                            for b in self._blocks.values() if self._moves.get(id(b))}
        d["host_table_bytes"] = sum(h[2].nbytes for h in self._moved.values())
        return d

    def write_trace(self, path: str) -> None:
        """Write the last step's Chrome trace (Perfetto opens it)."""
        self._engine().write_trace(str(path))

    def plan(self) -> dict:
        """The plan the ring runs and why: ``{"depth": d, "resident_blocks":
        [...], "chosen_by": "given" | "budget" | "auto", "why": str}``.
        ``"auto"`` (no ``depth`` given): the package timed its first two steps
        and chose the depth from the second (the replay of that step at each
        depth, ``why`` lists the predictions, and says where the ring was made
        one deeper for a first block asked for late); until then the depth is 1 and ``why`` says the
        choice is pending. ``"budget"``: the planner's choice under
        ``budget_gib``; ``"given"``: what was asked."""
        depth, resident, chosen_by, why = self._engine().plan()
        if self._auto and chosen_by == "given":
            chosen_by, why = "auto", "depth 1 until the second step ends: the package then times it and chooses the depth"
        kept = [f"{b.stack}.{b.index}" for b in self._blocks.values() if b.kept is not None]
        return {"depth": depth, "resident_blocks": list(resident) + kept, "chosen_by": chosen_by, "why": why + self._kept_why}

    def calibration(self, compute_s: Optional[dict] = None, backward_s: Optional[dict] = None) -> dict:
        """This module's cost model, for :func:`enable`'s ``calibration=``: each
        block's bytes and compute time and the link's bandwidth (probed now; it
        synchronises). The compute times are the traced forward steps' (call
        :meth:`enable_trace`, run a step, then this; CUDA), or ``compute_s``
        (``{"transformer_blocks.0": seconds, ...}``, every block). A training
        step's backward times come from ``backward_s``, or from the traced
        backward steps where every block ran in one: the planner then replays a
        forward and a backward, each block streamed again in reverse. Take it
        from a ring that is not coded. Blocks the automatic plan keeps resident
        run untraced: their times must be given (``compute_s``, and
        ``backward_s`` for a training step)."""
        self._refuse_capture("calibration")
        kept = [f"{b.stack}.{b.index}" for b in self._blocks.values() if b.kept is not None]
        if kept and (compute_s is None or (backward_s is None and self._by_pass[True] is not None)):
            raise OffloadError(
                f"component {self.component!r}: blocks {', '.join(kept)} are kept resident by the automatic plan (see "
                "plan()) and ran in no traced step: give every block's time in compute_s (and backward_s for a training "
                "step), or enable with auto_resident_gib=0 to trace every block"
            )
        return json.loads(self._engine().calibration(compute_s, backward_s))

    def violations(self) -> list[str]:
        """Breaks of the ring's protocol the engine saw (expected: none)."""
        return self._engine().violations()

    def disable(self) -> None:
        """Put the module back: hooks removed, every parameter and buffer the
        same object with the same bytes on the device it was on. An error once
        this handle's offloading has ended (a later :func:`enable` of the same
        module has a handle of its own)."""
        from ._enable import disable, offloaded

        if self.module is None or offloaded(self.module) is not self:
            raise OffloadError(f"component {self.component!r}: this handle's offloading was disabled already")
        disable(self.module)

    # -- hooks ----------------------------------------------------------------
    def _refuse_capture(self, what: str) -> None:
        """An error while torch's current stream on this device is being captured
        into a CUDA graph. The engine checks its own compute stream; this checks
        the caller's, which is where ``torch.cuda.graph`` captures (a side stream
        of its own), so that a capture is refused before the engine issues or
        waits on anything."""
        if self.device.type == "cuda" and _capturing(self.device):
            raise OffloadError(
                f"component {self.component!r}: {what} while torch's current stream is being captured into a CUDA graph "
                "(torch.cuda.graph, torch.compile's \"reduce-overhead\"): a replay would repeat the engine's copies from "
                "host memory it no longer holds; run the offloaded module outside capture"
            )

    def _claim(self, by_block: bool) -> None:
        """Take the module for this thread, or refuse it by name while another
        thread is inside (before anything is bound or lent)."""
        me = threading.get_ident()
        with self._lock:
            owner = self._owner
            if owner is None:
                self._owner, self._owned_by_block = me, by_block
                return
        if owner != me:
            raise OffloadError(
                f"component {self.component!r}: called from a second thread while another one is inside it: an offloaded "
                "module serves one caller at a time (its blocks share one ring of device slots). Call it from one thread, "
                "or enable one copy of the module per thread"
            )

    def _mine(self) -> bool:
        return self._owner == threading.get_ident()

    def _release(self) -> None:
        with self._lock:
            self._owner, self._owned_by_block = None, False

    def _changed(self, p: _Param, now: Any) -> str:
        """What happened to streamed tensor ``p`` since enable, as an error's text."""
        again = "disable (which puts back the tensors as enabled), change the module, then enable again"
        head = f"component {self.component!r}: tensor {p.name!r}"
        if now is not p.holder:
            what = "removed" if now is None else f"a {type(now).__name__} of {getattr(now, 'dtype', '?')}"
            return f"{head} was replaced while offloaded (the module now holds {what}); its block streams the enabled bytes, so {again}"
        if p.holder.dtype != p.dtype or p.holder.device != self.device:
            return (f"{head} was converted to {p.holder.dtype} on {p.holder.device} while offloaded (it streams as {p.dtype} to "
                    f"{self.device}); disable, convert, then enable again")
        return (f"{head} was changed while offloaded (edited in place or given other data: the module holds an empty "
                f"placeholder for it); its block streams the enabled bytes, so {again}")

    def _engine(self) -> Streamer:
        if self._streamer is None:
            raise OffloadError(f"component {self.component!r}: offloading is disabled")
        return self._streamer

    def _bind(self, block: _Block) -> None:
        """The block's pre-hook: armed, its weights bound at their first use
        (:func:`_arming`), or at once where ``lazy=False``."""
        if self._arm(block) and (not self._lazy or block.eager):
            self._lend(block)

    def _inputs(self, block: _Block, args, kwargs):
        """The block's pre-hook's new arguments on CUDA (or None): its host tensors
        that it moves to the device, moved once a step (learned in its first forward)."""
        paths = self._moves.get(id(block))
        if paths is None:
            if self._watch is not None:
                # A block called inside another's first forward: learned on a later call.
                return None
            hosts = _host_tensors(args, kwargs)
            self._moves[id(block)] = ()
            if hosts:
                watch = _Watch(hosts)
                watch.__enter__()
                self._watch = (block, watch)
            return None
        if not paths:
            return None
        args, kwargs = list(args), dict(kwargs)
        for path in paths:
            where, key, *inner = path
            box = args if where == "a" else kwargs
            if (key >= len(box)) if where == "a" else (key not in box):
                continue
            top = box[key]
            t = top[inner[0]] if inner and isinstance(top, (tuple, list)) and inner[0] < len(top) else (None if inner else top)
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            hit = self._moved.get(id(t))
            if hit is None or hit[0] is not t or hit[1] != t._version:
                # Page-locked first: the copy is then asynchronous, no host sync.
                hit = (t, t._version, t.pin_memory().to(self.device, non_blocking=True))
                self._moved[id(t)] = hit
            if inner:
                top = list(top)
                top[inner[0]] = hit[2]
                box[key] = tuple(top) if isinstance(box[key], tuple) else top
            else:
                box[key] = hit[2]
        return tuple(args), kwargs

    def _end_watch(self, block: _Block) -> None:
        if self._watch is not None and self._watch[0] is block:
            watch = self._watch[1]
            self._watch = None
            watch.__exit__(None, None, None)
            self._moves[id(block)] = tuple(sorted(watch.moved, key=str))

    def _view_of(self, ph: torch.Tensor) -> torch.Tensor:
        """What the module holds now in place of placeholder ``ph``: its view
        while its block is bound, else the placeholder."""
        lazy = ph._offload_lazy
        if lazy is None or self._bound is not lazy[1]:
            return ph
        p = lazy[2]
        return p.owner._parameters[p.attr]

    def _arm(self, block: _Block) -> bool:
        """Arm ``block`` to bind at its first weight's use; False where the
        step this ended kept it resident (the automatic plan): its views are
        bound for good, and nothing is to be lent."""
        self._claim(by_block=not self._in_forward)
        if self._bound is not None or self._armed is not None:
            self._unbind()
        if not self._in_forward and not self._backward and _in_autograd_pass():
            # A block run by autograd's pass (a checkpoint's recompute, before
            # any weight of it is unpacked): the backward's step begins here,
            # not after a step of the recomputed block alone.
            if not self._begin_backward(block):
                return False
        if id(block) in self._ran and not self._in_forward and not self._backward:
            # (Inside autograd's pass a block comes round again where the pass
            # recomputes two forwards' checkpoints, `(l1 + l2).backward()`: one
            # backward step, ended with the pass.)
            self._end_step()
            if block.kept is not None:
                return False
        # Again: the unbind or the step's end above gave a block's claim back.
        self._claim(by_block=not self._in_forward)
        self._ran.add(id(block))
        if len(self._first_called) < len(self._blocks) and id(block) not in self._first_called:
            self._first_called[id(block)] = len(self._first_called)
        hooks = block.module._forward_hooks
        if next(reversed(hooks), None) != block.post_hook:
            hooks.move_to_end(block.post_hook)
        for params, attr, prm, p in block.same:
            if params.get(attr) is not prm:
                raise OffloadError(self._changed(p, params.get(attr)))
        for params, attr, prm, version, dtype, device, shape, p in block.held:
            now = params.get(attr)
            if now is not prm or prm._version != version or prm.dtype != dtype or prm.device != device or prm.shape != shape:
                raise OffloadError(self._changed(p, now))
        self._refuse_capture(f"block {block.stack}.{block.index}")
        self._armed = block
        if torch.is_grad_enabled():
            # From the block's start, not its first weight's use: that use may
            # be inside a hand-written autograd function, whose forward runs with
            # grad off and saves what it was given (`_pack`).
            self._save_weights_as_places(block)
        return True

    def _lend(self, block: _Block) -> None:
        """Bind ``block``'s weights: lent by the engine, views in the module."""
        self._armed = None
        buf = self._engine().lend(block.stack, block.index)
        if self.device.type == "cuda":
            raw, index = self._engine_raw
            if torch._C._cuda_getCurrentRawStream(index) != raw:
                cur = torch.cuda.current_stream(self.device)
                cur.wait_stream(self._engine_stream)
                self._stream = cur
            data = buf
        else:
            data = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
        # Set first: if a view fails, the post hook's unbind still puts every
        # parameter back and gives the block back.
        self._bound = block
        self._buffer = data
        lent = [StorageWeakRef(data.untyped_storage()), block, False]
        self._lent.append(lent)
        # Writes through the views bump the buffer's version counter (an inference
        # tensor has none: torch refuses in-place writes to it outside inference mode).
        self._version = None if data.is_inference() else data._version
        self._bind_views(block, data)
        if self._saving is not None or torch.is_grad_enabled():
            self._save_weights_as_places(block)
            # A streamed weight that requires grad is held by its graph (its
            # backward refused by name): its bytes not counted as retained.
            lent[2] = self._refuse_gradients(block)

    def _save_weights_as_places(self, block: _Block) -> None:
        """What autograd saves of this block's weights for the backward is
        saved as where it lies in the block, not as the block's buffer: the
        buffer is let go after the forward, and the backward brings the block
        back (`_unpack`). A recompute in the backward (gradient checkpointing)
        saves the same way, so a checkpoint finds the same tensors saved as in
        the forward. Once per bind (the hooks are popped at its unbind).
        Not where torch has disabled the hooks (inside torch.func's
        transforms, which raise at a push): what a transform saves is consumed
        within it, and a block whose grad-mode uses continue past it pushed
        at its start (`_arm`)."""
        if self._saving is None and torch._C._autograd._saved_tensors_hooks_is_enabled():
            self._surface()
            outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if self._ours(outer):
                # A stale push of ours not popped yet (inside autograd's pass):
                # never chained to, which would chain ours to themselves.
                outer = None
            torch._C._autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)
            self._saving = (outer,)

    def _ours(self, hooks: Optional[tuple]) -> bool:
        """Whether ``hooks`` (a pack and unpack pair from torch's stack) are the
        ones this handle pushes (its bound ``_pack``)."""
        return hooks is not None and getattr(hooks[0], "__self__", None) is self

    def _pop_hooks(self, outer: Optional[tuple]) -> None:
        """Pop our pushed hooks (pushed on ``outer``) where they are on top.
        An interrupt inside a block skips the pop (torch's always_call hooks do
        not run for it): ours are then stale. Where another's are on top (a
        context entered since), ours stay until they come back on top: popping
        blindly would pop the user's, and their context's exit then ours.
        Where a user's context wrapped the block, its exit popped ours in place
        of its own, which are left on top: ``_surface`` pops them."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if self._ours(top):
            torch._C._autograd._pop_saved_tensors_default_hooks()
        else:
            self._stale, self._stale_outer = True, outer
        self._surface()

    def _surface(self) -> None:
        """Pop a stale push of ours (or the user's hooks it sat on, left by
        their context's exit) once back on top; none of ours is current here
        (``_saving`` is None). Not inside autograd's pass or its final
        callback: the backward runs on a copy of the caller's hooks, which a
        pop there would not change."""
        if not self._stale or torch._C._current_graph_task_id() != -1:
            return
        while True:
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if top is None:
                self._stale, self._stale_outer = False, None
                return
            if self._ours(top):
                torch._C._autograd._pop_saved_tensors_default_hooks()
            elif self._stale_outer is not None and top[0] is self._stale_outer[0]:
                torch._C._autograd._pop_saved_tensors_default_hooks()
                self._stale_outer = None
            else:
                return

    def _bind_views(self, block: _Block, data: torch.Tensor) -> None:
        """Put a view of ``data`` in the module for each of the block's tensors."""
        # One strided view per parameter over the buffer seen once per dtype
        # (slicing, reinterpreting and reshaping each would be three calls: host
        # time on every block of every step).
        n = data.numel()
        whole = {}
        for dt in block.dtypes:
            w = data[: n - n % dt.itemsize].view(dt)
            # as_strided counts its offset from the storage, not from the view.
            whole[dt] = (w.as_strided, w.storage_offset())
        for params, attr, dt, shape, stride, offset, rewrap in block.views:
            strided, base = whole[dt]
            view = strided(shape, stride, base + offset)
            params[attr] = view if rewrap is None else rewrap(view)
        for p in block.sliced:
            view = data[p.offset : p.offset + p.nbytes].view(p.dtype).as_strided(p.shape, p.layout)
            p.owner._parameters[p.attr] = view if p.rewrap is None else p.rewrap(view)

    def _refuse_gradients(self, block: _Block) -> bool:
        """A streamed weight gets no gradient: one that asks for it makes the
        backward an error naming it, never a gradient quietly left None.
        Whether any of the block's weights asked."""
        asked = False
        for p in block.params:
            if p.holder.requires_grad:
                asked = True
                view = p.owner._parameters[p.attr]
                if view.is_floating_point() and not view.requires_grad:
                    view.requires_grad_(True)
                    view.register_hook(_no_gradient(self.component, p.name))
        return asked

    def _pack(self, t):
        """Autograd saves ``t`` for the backward: one of the bound block's
        weights (a view of its buffer, as `linear` saves `weight.t()`) is saved
        as its place in the block; anything else as the hooks below ours save it."""
        if type(t) is _Placeholder:
            # The module's placeholder itself (a hand-written autograd function
            # given the weight before its block bound): saved as its parameter.
            lazy = t._offload_lazy
            if lazy is not None and lazy[0] is self and lazy[1] in (self._bound, self._armed):
                return _SavedParam(lazy[1], lazy[2])
        buf, block = self._buffer, self._bound
        if block is not None and buf is not None and type(t) is torch.Tensor and not t.requires_grad and t.device == buf.device:
            at = t.untyped_storage().data_ptr()
            if at == buf.untyped_storage().data_ptr():
                return _Saved(block, t.dtype, tuple(t.shape), t.stride(),
                              t.storage_offset() * t.element_size() - buf.storage_offset() * buf.element_size())
            # A weight a layer of the block cast for its compute (diffusers'
            # layerwise casting puts the cast in the parameter's place): saved as
            # that cast of its place in the block, made again in the backward.
            for p in block.params:
                now = p.owner._parameters.get(p.attr)
                if type(now) is torch.Tensor and now.dtype == t.dtype and now.untyped_storage().data_ptr() == at:
                    return _Cast(block, p, t.dtype, tuple(t.shape), t.stride(), t.storage_offset() - now.storage_offset())
            gguf = self._gguf
            if gguf is not None and gguf[2] is block and t.dim() == 2 and t.numel() == gguf[0].in_features * gguf[0].out_features:
                # Inside a GGUF layer's forward the one tensor its linear saves
                # is its dequantized weight (the input is saved only for a weight
                # that needs a gradient, which a streamed one never does).
                layer, p, _ = gguf
                return _Dequant(block, layer, p, tuple(t.shape), t.stride(), t.storage_offset())
        outer = self._saving[0] if self._saving else None
        return (_Outer, outer[1], outer[0](t)) if outer else t

    def _unpack(self, saved):
        """The backward asks for what `_pack` saved: a block's weight comes back
        from the block lent again (each block once, in the reverse order the
        engine learns for a backward), the rest from the hooks that saved it."""
        if self._walking:
            raise _SavedByUs()
        if isinstance(saved, tuple) and len(saved) == 3 and saved[0] is _Outer:
            return saved[1](saved[2])
        if isinstance(saved, _Dequant):
            self._bring_back(saved.block)
            from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

            w = dequantize_gguf_tensor(saved.param.owner._parameters[saved.param.attr]).to(saved.layer.compute_dtype)
            return w.as_strided(saved.shape, saved.stride, saved.offset)
        if isinstance(saved, _SavedParam):
            self._bring_back(saved.block)
            return saved.param.owner._parameters[saved.param.attr]
        if isinstance(saved, _Cast):
            self._bring_back(saved.block)
            cast = saved.param.owner._parameters[saved.param.attr].to(saved.dtype)
            return cast.as_strided(saved.shape, saved.stride, cast.storage_offset() + saved.offset)
        if not isinstance(saved, _Saved):
            return saved
        self._bring_back(saved.block)
        # A block kept resident since its forward saved this: its kept buffer
        # holds the same bytes, and its views stay bound.
        buf = self._buffer if saved.block.kept is None else saved.block.kept
        n = buf.numel()
        size = saved.dtype.itemsize
        w = buf[: n - n % size].view(saved.dtype)
        return w.as_strided(saved.shape, saved.stride, w.storage_offset() + saved.offset // size)

    def _bring_back(self, block: _Block) -> None:
        """The block a saved weight lies in, bound for the backward: lent again,
        unless it is bound already or kept resident (its views bound for good)."""
        if self._bound is not block and block.kept is None:
            self._lend_for_backward(block)

    def _lend_for_backward(self, block: _Block) -> None:
        """Bind ``block`` for the backward (autograd's thread, between two of its
        nodes): the block bound before is given back (its kernels enqueued), the
        engine switched to its backward order at the backward's first block, and
        the backward's step ended when autograd's pass ends."""
        if self._bound is not None:
            self._unbind()
        if not self._backward and not self._begin_backward(block):
            return  # kept resident by the forward's end (the automatic plan): bound for good
        self._ran.add(id(block))
        self._lend(block)

    def _begin_backward(self, block: Optional[_Block]) -> bool:
        """Autograd's pass asks for ``block`` first (or runs the module's
        forward: None): the step before it ends (a forward, or blocks run since
        outside one), the engine switches to its backward order, and the
        backward's step is to end with autograd's pass. False where the step's
        end kept ``block`` resident."""
        if self._ran or self._in_forward:
            self._end_step()
            if block is not None and block.kept is not None:
                return False
        self._claim(by_block=False)
        self._owned_by_block = False  # held until the backward's end, not a block's
        self._engine().set_backward(True)
        self._backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        return True

    def _end_abandoned_backward(self) -> None:
        """A backward that raised never reached its end (autograd runs its end
        callbacks only after a pass that completed): the next forward ends it,
        from whichever thread autograd used, so the module stays usable."""
        with self._lock:
            self._owner, self._owned_by_block = threading.get_ident(), False
        self._end_backward()

    def _end_backward(self) -> None:
        """Autograd's pass ended: the last block given back, the backward's step ended."""
        try:
            if self._bound is not None:
                self._unbind()
        finally:
            try:
                self._end_engine_step()
            finally:
                self._engine().set_backward(False)
                self._backward = False
                self._release()

    def _unbind(self) -> None:
        if self._saving is not None:
            (outer,), self._saving = self._saving, None
            self._pop_hooks(outer)
        block, self._bound = self._bound, None
        if self._armed is not None:
            # Run without using its weights (a cache returned its output): never copied.
            self._armed = None
            self._skipped += 1
        if self._owned_by_block:
            # Given back even where nothing was bound (the bind raised first).
            self._release()
        if block is None:
            return
        for params, attr, param in block.restore:
            params[attr] = param
        if self._stream is not None:
            self._engine_stream.wait_stream(self._stream)
            self._buffer.record_stream(self._stream)
            self._stream = None
        wrote = self._version is not None and self._buffer._version != self._version
        self._buffer = None
        self._engine().give_back()
        if wrote:
            raise OffloadError(
                f"component {self.component!r}: block {block.stack}.{block.index} wrote its streamed weights in place during "
                "its forward; the write went to a lent copy that the next step no longer holds, so it would be lost. Keep "
                "state a block updates in a buffer (register_buffer), which stays resident, or make that parameter trainable"
            )

    def _end_step(self) -> None:
        try:
            if self._bound is not None or self._armed is not None:
                self._unbind()
            self._surface()
        finally:
            self._end_engine_step()

    def _end_engine_step(self) -> None:
        self._ran.clear()
        self._moved.clear()
        self._in_forward = False
        if self.device.type == "cuda" and _capturing(self.device):
            # A forward refused under capture (nothing was lent): ending the
            # engine's step would poll its events, which a capture forbids; the
            # step goes on with the next forward outside capture.
            return
        self._last_metrics = json.loads(self._engine().end_step())
        # Blocks whose forward ran without reading their weights (a cache hit): not copied.
        self._last_metrics["skipped_blocks"], self._skipped = self._skipped, 0
        self._last_metrics["retained_blocks"] = self._count_retained(bool(self._last_metrics.get("backward")))
        self._by_pass[bool(self._last_metrics.get("backward"))] = self._last_metrics
        self._steps += 1
        try:
            if self._auto:
                self._choose_depth()
        finally:
            # The blocks the automatic plan keeps resident are held outside the
            # ring: their device bytes, beside the ring's own (counted after the
            # choice, so the step that kept them says so too).
            self._last_metrics["kept_bytes"] = sum(b.kept.numel() * b.kept.element_size()
                                                   for b in self._blocks.values() if b.kept is not None)
        # Warned of once the step's bookkeeping is done (a warning turned into
        # an error leaves the step ended).
        said, self._retained_warning = self._retained_warning, None
        if said is not None:
            warnings.warn(said, stacklevel=2)

    def _count_retained(self, backward: bool) -> int:
        """How many blocks' lent bytes from the step ending are still
        referenced, beyond the ring's own (the buffers its slots hold now,
        ``held_buffers``: on CUDA the last blocks copied into them, a block
        lent twice from one slot, as a checkpointed backward does, among them;
        the simulated device's ring holds none, each lend a fresh copy):
        something outside the package keeps a view of them (a custom autograd
        Function's ctx, a hook, a list), so device memory grows by a block
        each. Warned of once, naming them (after the step's bookkeeping,
        `_end_engine_step`), where they are still held after a garbage
        collection and an earlier step of the pass held some too."""
        lent, self._lent = self._lent, []
        if not lent:
            return 0
        ring = {StorageWeakRef(b.untyped_storage()).cdata for b in self._engine().held_buffers()}
        held: dict = {}
        for r, b, graphed in lent:
            if not graphed and r.cdata not in ring and not r.expired():
                held.setdefault(r.cdata, (r, b))
        if held and not self._warned_retained and self._gc_tries < 4:
            # A view in a reference cycle (a traceback's frames) lives until the
            # collector runs: collected before the warning, a few times per
            # handle (milliseconds each). And a compiler tracing the first call
            # holds its frames' values while it runs: warned of only where an
            # earlier step of the pass held some too (not only the step before:
            # a hold every other step, one pass of two under guidance, warns).
            self._gc_tries += 1
            gc.collect()
            held = {k: (r, b) for k, (r, b) in held.items() if not r.expired()}
            if held and self._held_earlier[backward]:
                self._warned_retained = True
                names = ", ".join(dict.fromkeys(f"{b.stack}.{b.index}" for _, b in held.values()))
                self._retained_warning = (
                    f"component {self.component!r}: the lent weights of {len(held)} block(s) ({names}) were still "
                    "referenced at the end of the step: something outside the package keeps a view of them (a custom "
                    "autograd Function that keeps a weight on its ctx instead of save_for_backward, a hook or a list "
                    "holding a parameter), so each keeps its block's bytes on the device; metrics()['retained_blocks'] "
                    "counts them per step"
                )
        self._held_earlier[backward] = self._held_earlier[backward] or bool(held)
        return len(held)

    def _choose_depth(self) -> None:
        """The automatic depth: the first two steps timed (the timeline starts
        at :func:`enable`), the depth chosen at the second's end from it and the
        gap between the two (training, at the end of the first forward timed
        after the first step, from that forward and the backward before it:
        the replay runs both passes)."""
        engine = self._engine()
        if self._steps == 1:
            return  # the first step: its last block's end is the second's gap
        if self._last_metrics is not None and self._last_metrics.get("backward"):
            return
        self._auto = False
        try:
            try:
                traced = self.diagnose()  # before the depth's choice rebuilds the ring (its timeline with it)
            except OffloadError:
                traced = None  # the step lent no block
            engine.choose_depth(4)
            if traced is not None:
                self._keep_host_bound(traced)
        finally:
            if not self._traced_by_user:
                engine.disable_timeline()

    def _keep_host_bound(self, d: dict) -> None:
        """The automatic plan's resident blocks: where the traced step was
        host-bound (:func:`_host_bound`), each block kept resident runs with
        none of the package's host time, as it would unoffloaded. As many as
        the allowance holds are kept, counted with those of the most host time
        per byte first; the ones left to stream are then spread over the run
        order (:func:`_spread_streamed`) where a spread fits the allowance."""
        if not _host_bound(d, self.device.type == "cuda"):
            share = d["host_s"] / d["step_s"] if d["step_s"] > 0 else 0.0
            self._kept_why = (
                f"; no block kept: the host took {d['host_s']:.4f} s to issue the traced {d['step_s']:.4f} s step "
                f"({share:.2f} of it), verdict {d['verdict'] or 'none'}"
            )
            return
        lost = d["causes"].get("host", 0.0)
        if self._allowance is not None:
            allowance, of = self._allowance, "auto_resident_gib"
        elif self.device.type == "cuda":
            allowance, of = torch.cuda.mem_get_info(self.device)[0] // 4, "a quarter of the device's free memory"
        else:
            allowance, of = 0, "none on the simulated device unless auto_resident_gib is given"
        in_ring = set(self._engine().plan()[1])  # resident in the ring already
        # In the order the blocks were first called (the run order; blocks never
        # called yet after them, as registered), each with the bytes it holds kept.
        first = self._first_called
        blocks = sorted(self._blocks.values(), key=lambda b: first.get(id(b), len(first) + b.at))
        sizes = {f"{b.stack}.{b.index}": (b, b.nbytes) for b in blocks if f"{b.stack}.{b.index}" not in in_ring}
        host = d["host_blocks"]
        order = sorted(sizes, key=lambda n: -host.get(n, 0.0) / max(sizes[n][1], 1))
        chosen, fit = [], 0
        for name in order:
            if fit + sizes[name][1] <= allowance:
                chosen.append(name)
                fit += sizes[name][1]
        spread = _spread_streamed([(n, sizes[n][1]) for n in sizes], len(sizes) - len(chosen), allowance)
        spread_why = ""
        if spread is not None:
            chosen, spread_why = spread, ", the streamed ones spread over the run order"
        kept, used, failed = [], 0, ""
        for name in chosen:
            blk, size = sizes[name]
            try:
                self._keep(blk)
            except (OffloadError, RuntimeError) as e:
                failed = f"; keeping {name} failed ({str(e).splitlines()[0][:200]}), the rest stream"
                break
            kept.append(name)
            used += size
        if self.device.type == "cuda" and kept:
            self._engine_stream.synchronize()  # every kept block's copy done, for any stream
        if kept:
            # The copies that kept them close a step of their own, so that the
            # next step's metrics are its own (the totals count them); then they
            # are never prefetched again, and the next step's first streamed
            # block is copied ahead now (a copy of that step).
            try:
                self._engine().end_step()
            finally:
                self._engine().hold_outside([(b.stack, b.index) for b in self._blocks.values() if b.kept is not None])
        self._kept_why = (
            f"; the traced step was host-bound (the host took {d['host_s']:.4f} s to issue a {d['step_s']:.4f} s step, "
            f"{lost:.4f} s charged to it): {len(kept)} of "
            f"{len(sizes)} blocks kept resident ({used / 2**30:.2f} GiB of an allowance of {allowance / 2**30:.2f} GiB: "
            f"{of}), bound once, with no per-block hooks{spread_why}{failed}"
        )

    def _keep(self, block: _Block) -> None:
        """Keep ``block`` resident: copied once more, its views bound for good,
        its hooks removed. Its tensors then behave as resident ones: an edit
        is used by the next step and kept by :func:`disable`."""
        buf = self._engine().lend(block.stack, block.index, keep=True)
        try:
            if self.device.type == "cuda":
                data = buf
            else:
                data = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
            with torch.inference_mode(False):
                # A plain tensor and plain views, even where the step that chose
                # the plan ran in inference mode: a kept block's weights can be
                # edited afterwards, as resident ones.
                if data.numel() > block.nbytes or data.is_inference():
                    # The slot's buffer has the ring's slot size (its largest
                    # block's): kept as it is, a small block would hold that for
                    # good (Flux-dev's 44 kept blocks held 11.7 GB more than their
                    # own 18.4 GB on the H100). Its own span is copied off the
                    # slot, on the engine's stream, after the copy that filled it.
                    on = torch.cuda.stream(self._engine_stream) if self.device.type == "cuda" else contextlib.nullcontext()
                    with on:
                        data = data[: block.nbytes].clone()
                data = data if not data.requires_grad else data.detach()
                self._bind_views(block, data)
        except BaseException:
            for params, attr, param in block.restore:
                params[attr] = param
            raise
        finally:
            self._engine().give_back()
        with torch.enable_grad():
            self._refuse_gradients(block)
        block.kept = data
        block.kept_views = [(p, p.owner._parameters[p.attr]) for p in block.params]
        for h in block.handles:
            h.remove()
        fn = block.module.__dict__.get("_compiled_call_impl")
        if isinstance(fn, _Compiled):
            block.module._compiled_call_impl = fn.fn


# On CUDA, blocks are kept where the host took at least this share of the
# device's step to issue it and the step was not copy-bound. The diagnosis
# charges the host from 0.8; traced steps of models whose offloaded step lost
# a few per cent to the host took 0.65-1.0 of the device's step, straddling 0.8
# from one process to the next, while copy-bound steps (verdict "link") took
# 0.3-0.95 (bench/NOTES.md, the sweeps at c96b7fc and e9cc56c).
_KEEP_HOST_SHARE = 0.6


def _spread_streamed(blocks: list[tuple[str, int]], streamed: int, allowance: int) -> list[str] | None:
    """The blocks to keep resident so that the ``streamed`` left to stream lie
    spread evenly over ``blocks`` (names and sizes, in the order the model
    runs them), the first kept; None where all or none stream, or where that
    spread does not fit ``allowance`` (the host-time order's choice stands:
    a spread keeping fewer blocks would keep more of the package's per-block
    host time, which keeping is for).

    Each streamed block's copy then overlaps the compute of the kept blocks
    before it. Kept as a run (the first ones, as ties of host time per byte
    fall), the streamed blocks would come back to back at the step's end,
    where a block's copy takes longer than its compute and the link sets their
    pace: Flux-dev's 13 last single blocks of 57 made each computed step 1.10 ×
    the resident one on the H100 (bench/NOTES.md)."""
    n = len(blocks)
    if streamed <= 0 or streamed >= n:
        return None
    # At multiples of n / (streamed + 1): distinct (the step is at least 1),
    # never the first block nor past the last.
    out = {(i + 1) * n // (streamed + 1) for i in range(streamed)}
    if sum(size for j, (_, size) in enumerate(blocks) if j not in out) > allowance:
        return None
    return [name for j, (name, _) in enumerate(blocks) if j not in out]


def _host_bound(d: dict, cuda: bool) -> bool:
    """Whether a traced step's diagnosis ``d`` is host-bound enough for the
    automatic plan to keep blocks. On CUDA: the host took at least
    :data:`_KEEP_HOST_SHARE` of the device's step to issue it, and the step
    was not copy-bound (a copy-bound step's blocks are the budget's to keep:
    kept by default they would take device memory for the link's time). On the simulated
    device, whose compute is the host's (the diagnosis charges the host with
    the time between blocks), the host must be the diagnosis's verdict and
    charged with over 1 % of the step."""
    step = d["step_s"]
    if step <= 0:
        return False
    if cuda:
        return d["verdict"] != "link" and d["host_s"] >= _KEEP_HOST_SHARE * step
    return d["verdict"] == "host" and d["causes"].get("host", 0.0) > 0.01 * step


def _capturing(device: torch.device) -> bool:
    """Whether torch's current stream on ``device`` is being captured into a CUDA graph."""
    if device.index is None or device.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def _no_gradient(component: str, name: str):
    def hook(grad):
        raise OffloadError(
            f"component {component!r}: tensor {name!r} streams and gets no gradient; freeze it "
            "(requires_grad_(False)) and train an adapter, or run the forward under torch.no_grad()"
        )

    return hook


def _refuse_state_dict(component: str, block: str):
    """The state_dict hook of a block and of each layer in it while offloaded:
    their parameters hold placeholders."""

    def hook(module, state_dict, prefix, local_metadata):
        raise OffloadError(
            f"component {component!r}: {block} streams its weights, so the state_dict of "
            f"{prefix.rstrip('.') or type(module).__name__} would hold empty placeholders; disable offloading first"
        )

    return hook


def _refuse_load_state_dict(component: str, block: str):
    def hook(state_dict, prefix, *args):
        raise OffloadError(
            f"component {component!r}: {block} streams its weights from the engine's store, so "
            f"{prefix.rstrip('.') or 'its layer'} cannot load a state_dict; disable offloading first"
        )

    return hook
