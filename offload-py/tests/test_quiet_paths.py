"""What a demanding user does to an enabled module beyond calling it: edits
through ``.data``, a checkpoint replaced under it, two threads, lists of lists,
inference mode, bad arguments, copies and counts. Each is served correctly or
refused by a named error, and the module keeps working (or comes back whole).
Each test runs on the simulated device; those taking ``dev`` on CUDA too."""

from __future__ import annotations

import collections
import copy
import io
import os
import pickle
import threading

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import offload
from offload import OffloadError

from models import MODELS, Chain
from helpers import DEVICES, _bits, _out, _to


class _Lin(Chain):
    """Three linear blocks called in order (the issue's `M`)."""

    def __init__(self, n: int = 3, width: int = 8):
        super().__init__(lambda: nn.Linear(width, width), n)


def _setup(dev: str, **kw):
    m, x = _Lin(), torch.randn(2, 8, device=dev)
    m.to(dev)
    with torch.no_grad():
        ref = m(x).clone()
    params = {n: p for n, p in m.named_parameters()}
    m.to("cpu")
    if not {"depth", "budget_gib", "calibration"} & kw.keys():
        kw.setdefault("auto_resident_gib", 0)  # streamed throughout: a tiny model on CUDA is host-bound
    h = offload.enable(m, device=dev, **kw)
    return m, x, ref, params, h


# Every way of reaching a streamed weight's storage from Python that we know of.
_EDITS = {
    "data.mul_": lambda w: w.data.mul_(0),
    "data.zero_": lambda w: w.data.zero_(),
    "data.add_": lambda w: w.data.add_(1.0),
    "data[:] =": lambda w: w.data.__setitem__(slice(None), 0),
    "data.normal_": lambda w: w.data.normal_(),
    "data.copy_": lambda w: w.data.copy_(torch.zeros(8, 8)),
    "data =": lambda w: setattr(w, "data", torch.zeros(8, 8)),
    "mul_": lambda w: w.mul_(0),
    "detach().mul_": lambda w: w.detach().mul_(0),
    "set_": lambda w: w.set_(torch.zeros(8, 8)),
    "untyped_storage": lambda w: w.untyped_storage(),
    "data_ptr": lambda w: w.data_ptr(),
    "nn.init.zeros_": lambda w: nn.init.zeros_(w),
    "vector_to_parameters": lambda w: torch.nn.utils.vector_to_parameters(torch.zeros(64), [w]),
    "float()": lambda w: w.float().double(),
    "clone": lambda w: w.clone(),
}


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("edit", list(_EDITS))
def test_an_edit_of_a_streamed_weight_is_refused_by_name_never_silently_lost(edit, dev):
    # Resident, each edit changes the output (or reads the bytes); offloaded it
    # would act on nothing: refused at the call, naming the tensor, and the
    # module streams on, bitwise equal, and comes back whole.
    m, x, ref, params, _ = _setup(dev)
    with torch.no_grad(), pytest.raises(OffloadError, match=r"tensor 'blocks\.1\.weight' streams while offloaded and cannot be"):
        _EDITS[edit](m.blocks[1].weight)
    with torch.no_grad():
        assert torch.equal(_bits(m(x)), _bits(ref))
    offload.disable(m)
    assert all(p is params[n] for n, p in m.named_parameters())
    m.to(dev)  # back where it was enabled from (the host), then where the reference ran
    with torch.no_grad():
        assert torch.equal(_bits(m(x)), _bits(ref))


class _KernelFirst(nn.Module):
    """A block whose first use of its weight is a kernel reading its address
    and storage (as fused and Triton kernels do, handed the parameter)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.seen = []

    def forward(self, x):
        w = self.lin.weight
        self.seen.append((w.data_ptr(), w.untyped_storage().data_ptr(), self.lin._parameters["weight"].data_ptr()))
        return self.lin(x)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("lazy", [True, False])
def test_a_kernel_reading_a_weights_address_inside_its_block_reads_the_bound_bytes(dev, lazy):
    # Inside its block's forward a weight's address and storage are the bound
    # view's (its block binding at that first use where binding is lazy); the
    # output is the resident one. Outside any forward they stay refused (above).
    torch.manual_seed(0)
    m, x = Chain(_KernelFirst, 3), torch.randn(2, 8)
    with torch.no_grad():
        ref = m.to(dev)(x.to(dev)).clone()
    m.to("cpu")
    h = offload.enable(m, device=dev, lazy=lazy, auto_resident_gib=0)
    for b in m.blocks:
        b.seen.clear()
    with torch.no_grad():
        assert torch.equal(_bits(m(x.to(dev))), _bits(ref))
    for b in m.blocks:
        (ptr, storage, view), = b.seen
        assert ptr == view and storage <= ptr and ptr != 0, b.seen
    with pytest.raises(OffloadError, match=r"read through its address"):
        m.blocks[0].lin.weight.data_ptr()
    assert h.violations() == []
    offload.disable(m)


@pytest.mark.parametrize("dev", DEVICES)
def test_counts_metadata_and_printing_of_a_streamed_weight_are_the_real_ones(dev):
    m, x, ref, params, _ = _setup(dev)
    w = m.blocks[1].weight
    assert isinstance(w, nn.Parameter) and w.shape == (8, 8) and w.dtype == torch.float32 and w.device.type == dev
    assert sum(p.numel() for p in m.parameters()) == 3 * 72
    assert "blocks.1.weight" in repr(w) and "streamed" in repr(w)
    # Freezing while offloaded holds, and comes back with the module.
    m.requires_grad_(False)
    offload.disable(m)
    assert not any(p.requires_grad for p in m.parameters())


def test_a_diffusers_model_counts_its_parameters_while_offloaded():
    model, inputs, _ = MODELS["flux"]()
    n = model.num_parameters()
    assert n == sum(p.numel() for p in model.parameters()) and n > 100_000
    offload.enable(model, device="cpu")
    assert model.num_parameters() == n and sum(p.numel() for p in model.parameters()) == n
    assert model.dtype == torch.bfloat16
    # What diffusers' fuse_qkv_projections reads is a streamed weight: refused by name.
    with pytest.raises(OffloadError, match=r"tensor 'transformer_blocks\.0\.attn\.to_q\.weight' streams while offloaded"):
        model.fuse_qkv_projections()
    with torch.no_grad():
        model(**inputs)
    offload.disable(model)


def test_a_transformers_model_counts_its_parameters_while_offloaded():
    model, inputs, _ = MODELS["t5"]()
    n = model.num_parameters()
    offload.enable(model, device="cpu")
    assert model.num_parameters() == n
    offload.disable(model)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copying_pickling_or_saving_an_offloaded_module_is_a_named_error(how):
    m, x, ref, params, _ = _setup("cpu")
    do = {
        "deepcopy": lambda: copy.deepcopy(m),
        "pickle": lambda: pickle.dumps(m),
        "torch.save": lambda: torch.save(m, io.BytesIO()),
    }[how]
    with pytest.raises(OffloadError, match=r"cannot be copied, pickled or saved"):
        do()
    with torch.no_grad():
        assert torch.equal(m(x), ref)
    offload.disable(m)
    copy.deepcopy(m)


def _write(path, m: nn.Module) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in m.state_dict().items()}, str(path))


class _Mixed(nn.Module):
    """Blocks 0 and 2 lie in a safetensors file as the store lays them out
    (served in place); block 1's weight does not (63 × 4 bytes of bias before
    it): copied into the store."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.blocks = nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 63), nn.Linear(63, 64)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("dev", DEVICES)
def test_a_checkpoint_renamed_over_under_the_module_still_gives_the_module_back(dev, tmp_path):
    # The old file stays open and unlinked, holding its bytes: the module goes
    # on computing with them (as a resident one keeps the weights it loaded),
    # and disable reads them, as enabled, bit for bit, into the same parameter objects.
    m, x = _Mixed(), torch.randn(2, 64, device=dev)
    m.to(dev)
    with torch.no_grad():
        ref = m(x).clone()
    m.to("cpu")
    path = tmp_path / "m.safetensors"
    _write(path, m)
    before = {n: (p, p.detach().clone()) for n, p in m.named_parameters()}
    h = offload.enable(m, device=dev, checkpoint=str(path), auto_resident_gib=0)
    assert h.host_tier()["in_place"] == 2 and h.host_tier()["copied"] == 1, h.host_tier()
    other = tmp_path / "new.safetensors"
    flipped = _Mixed()
    with torch.no_grad():
        for p in flipped.parameters():
            p.neg_()
    _write(other, flipped)
    os.replace(other, path)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(_bits(m(x)), _bits(ref))
    offload.disable(m)
    assert offload.offloaded(m) is None
    for n, p in m.named_parameters():
        assert p is before[n][0] and torch.equal(p.detach().cpu(), before[n][1]), n


@pytest.mark.parametrize("dev", DEVICES)
def test_a_checkpoint_rewritten_in_place_names_what_could_not_be_put_back(dev, tmp_path):
    # Served in place, blocks 0 and 2 read the file's pages, which now hold other
    # bytes: disable puts back what the store still holds (block 1, copied), names
    # the rest, and leaves the module disabled, those tensors on the meta device.
    m, x = _Mixed(), torch.randn(2, 64)
    with torch.no_grad():
        ref = m(x).clone()
    state = {k: v.clone() for k, v in m.state_dict().items()}
    # On the device the module was on when enabled (the host: the blocks were there).
    path = tmp_path / "m.safetensors"
    _write(path, m)
    offload.enable(m, device=dev, checkpoint=str(path), auto_resident_gib=0)
    raw = bytearray(path.read_bytes())
    raw[-4096:] = bytes(4096)
    with open(path, "r+b") as f:  # the same file, written in place
        f.write(raw)
    with pytest.raises(OffloadError, match=r"4 streamed tensors could not be put back.*'blocks\.\d\.(weight|bias)'") as e:
        offload.disable(m)
    assert "blocks.1." not in str(e.value), "block 1 was copied into the store: it comes back"
    assert offload.offloaded(m) is None
    assert torch.equal(m.blocks[1].weight.detach().cpu(), state["blocks.1.weight"])
    assert m.blocks[0].weight.is_meta and m.blocks[2].bias.is_meta
    # Usable: load what was lost, and it computes as before.
    m.load_state_dict(state, assign=True)
    with torch.no_grad():
        assert torch.equal(m(x), ref)
    offload.enable(m, device="cpu")
    offload.disable(m)


class _Waits(nn.Module):
    """A block that, the first time it is asked to, waits inside its forward
    until told to go on: another thread then calls while one is inside."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.inside, self.go, self.hold = threading.Event(), threading.Event(), False

    def forward(self, x):
        if self.hold:
            self.hold = False
            self.inside.set()
            assert self.go.wait(30)
        return self.lin(x)


@pytest.mark.parametrize("dev", DEVICES)
def test_a_second_thread_is_refused_by_name_and_the_first_finishes_bitwise_equal(dev):
    m, x = Chain(_Waits).to(dev), torch.randn(2, 8, device=dev)
    with torch.no_grad():
        ref = m(x).clone()
    m.to("cpu")
    offload.enable(m, device=dev, auto_resident_gib=0)
    got = {}

    def first():
        with torch.no_grad():
            got["out"] = m(x)

    m.blocks[1].hold = True
    t = threading.Thread(target=first)
    t.start()
    assert m.blocks[1].inside.wait(30)
    # While the first thread is inside block 1: the module, a block, disable.
    with pytest.raises(OffloadError, match="second thread"), torch.no_grad():
        m(x)
    with pytest.raises(OffloadError, match="second thread"), torch.no_grad():
        m.blocks[2](x)
    with pytest.raises(OffloadError, match="second thread"):
        offload.disable(m)
    m.blocks[1].go.set()
    t.join(30)
    assert torch.equal(_bits(got["out"]), _bits(ref))
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(_bits(m(x)), _bits(ref))
    offload.disable(m)


def test_two_threads_calling_at_once_get_the_resident_output_or_the_named_refusal():
    m, x, ref, _, _ = _setup("cpu")
    seen, lock = [], threading.Lock()

    def run():
        for _ in range(50):
            try:
                with torch.no_grad():
                    out = m(x)
                r = "equal" if torch.equal(out, ref) else "DIFFERENT"
            except OffloadError as e:
                r = "refused" if "second thread" in str(e) else f"other: {e}"
            with lock:
                seen.append(r)

    ts = [threading.Thread(target=run) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert len(seen) == 100 and set(seen) <= {"equal", "refused"}, sorted(set(seen))
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(m(x), ref)
    offload.disable(m)


class _Nested(nn.Module):
    """diffusers' StableCascadeUNet's shape: block lists in a list of lists,
    each inner list's items called in order."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.down_blocks = nn.ModuleList(nn.ModuleList(nn.Linear(8, 8) for _ in range(2)) for _ in range(2))

    def forward(self, x):
        for level in self.down_blocks:
            for b in level:
                x = b(x)
        return x


def test_a_list_of_lists_streams_its_inner_lists_and_is_refused_as_blocks_by_name():
    m, x = _Nested(), torch.randn(2, 8)
    with torch.no_grad():
        ref = m(x).clone()
    assert offload.find_blocks(m) == ["down_blocks.0", "down_blocks.1"]
    offload.enable(m, device="cpu")
    with torch.no_grad():
        assert torch.equal(m(x), ref)
    offload.disable(m)
    with pytest.raises(OffloadError, match=r"block list 'down_blocks' holds a ModuleList at 0, which has no forward"):
        offload.enable(m, device="cpu", blocks=["down_blocks"])
    assert offload.offloaded(m) is None


def test_stable_cascade_unet_streams_bitwise_equal_or_is_refused_by_name():
    from diffusers import StableCascadeUNet

    torch.manual_seed(0)
    m = StableCascadeUNet(in_channels=4, out_channels=4, timestep_ratio_embedding_dim=8, patch_size=1, conditioning_dim=16,
                          block_out_channels=(16, 16), num_attention_heads=(2, 2), down_num_layers_per_block=(1, 1),
                          up_num_layers_per_block=(1, 1), down_blocks_repeat_mappers=(1, 1), up_blocks_repeat_mappers=(1, 1),
                          block_types_per_layer=(("SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock"),) * 2,
                          clip_text_in_channels=8, clip_text_pooled_in_channels=8, clip_image_in_channels=8, clip_seq=2,
                          effnet_in_channels=None, dropout=(0.0, 0.0),
                          pixel_mapper_in_channels=None, self_attn=True, timestep_conditioning_type=("sca",),
                          switch_level=None).eval()
    inputs = dict(sample=torch.randn(1, 4, 8, 8), timestep_ratio=torch.tensor([0.5]),
                  clip_text_pooled=torch.randn(1, 1, 8), clip_text=torch.randn(1, 2, 8), clip_img=torch.randn(1, 1, 8))
    with torch.no_grad():
        ref = m(**inputs).sample.clone()
    for s in offload.find_blocks(m):
        assert all(type(c).forward is not nn.Module.forward for c in m.get_submodule(s).children()), s
    try:
        offload.enable(m, device="cpu")
    except OffloadError as e:
        assert "no block list" in str(e), e
        return
    with torch.no_grad():
        assert torch.equal(_bits(m(**inputs).sample), _bits(ref))
    offload.disable(m)


@pytest.mark.parametrize("dev", DEVICES)
def test_enable_and_disable_in_inference_mode_give_back_ordinary_tensors(dev):
    m, x = _Lin().to(dev), torch.randn(2, 8, device=dev)
    with torch.inference_mode():
        offload.enable(m, device=dev, auto_resident_gib=0)
        m(x)
        offload.disable(m)
    assert not any(p.is_inference() for p in m.parameters())
    # A training forward and backward after it.
    m(x).sum().backward()
    assert all(p.grad is not None for p in m.parameters())


@pytest.mark.parametrize("kw,what,kind", [
    (dict(budget_gib="8"), "budget_gib must be a number of GiB", TypeError),
    (dict(budget_gib=True), "budget_gib must be a number of GiB", TypeError),
    (dict(budget_gib=1e12), "budget_gib must be a finite number of GiB.*at most", ValueError),
    (dict(depth="2"), "depth must be an integer", TypeError),
    (dict(depth=True), "depth must be an integer", TypeError),
    (dict(depth=2**70), "depth must be an integer from 1 to", ValueError),
])
def test_bad_arguments_are_refused_by_name_by_enable_and_enable_pipeline(kw, what, kind):
    # Each an OffloadError, and the TypeError or ValueError Python raises for it.
    m = _Lin()
    with pytest.raises(OffloadError, match=what) as e:
        offload.enable_pipeline({"transformer": m}, **kw)
    assert isinstance(e.value, kind), type(e.value).__mro__
    with pytest.raises(kind, match=what):
        offload.enable(m, device="cpu", **kw)
    assert offload.offloaded(m) is None


@pytest.mark.parametrize("kw,what,kind", [
    (dict(resident_blocks="blocks.0"), r"resident_blocks must be a list of names, not the string 'blocks\.0'", TypeError),
    (dict(blocks=["blocks", "blocks"]), r"block list 'blocks' is named twice", ValueError),
    (dict(blocks=[""]), r"the module itself as its block list cannot stream", ValueError),
    (dict(blocks="blocks"), r"blocks must be a list of names, not the string", TypeError),
    (dict(lazy="yes"), r"lazy must be True or False", TypeError),
])
def test_misnamed_block_arguments_are_refused_by_name(kw, what, kind):
    m = _Lin()
    with pytest.raises(OffloadError, match=what) as e:
        offload.enable(m, device="cpu", **kw)
    assert isinstance(e.value, kind), type(e.value).__mro__
    assert offload.offloaded(m) is None
    seq = nn.Sequential(*_Lin().blocks)
    with pytest.raises(OffloadError, match="the module itself as its block list"):
        offload.enable(seq, device="cpu", blocks=[""])


def test_enable_pipelines_budget_error_gives_small_sizes_in_small_units():
    with pytest.raises(OffloadError, match=r"transformer \d+\.\d\d KiB"):
        offload.enable_pipeline({"transformer": _Lin()}, budget_gib=1e-9)


def test_a_file_level_checkpoint_error_names_no_empty_tensor(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{notjson")
    with pytest.raises(OffloadError) as e:
        offload.enable(_Lin(), device="cpu", checkpoint=str(bad))
    assert 'tensor ""' not in str(e.value) and "bad.safetensors" in str(e.value), e.value


class _Checkpointed(_Lin):
    def forward(self, x):
        for b in self.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
        return x


@pytest.mark.parametrize("dev", DEVICES)
def test_a_checkpointing_recompute_is_a_step_of_its_own_in_the_metrics(dev):
    m, x = _Checkpointed().to(dev), torch.randn(2, 8, device=dev, requires_grad=True)
    m.requires_grad_(False)
    m(x).sum().backward()
    ref = x.grad.clone()
    x.grad = None
    m.to("cpu")
    h = offload.enable(m, device=dev, auto_resident_gib=0)
    for _ in range(2):
        m(x).sum().backward()
        assert torch.equal(x.grad, ref)
        x.grad = None
    with torch.no_grad():
        m(x)
    assert h.metrics()["blocks"] == 3, h.metrics()
    offload.disable(m)


def test_a_block_whose_bind_failed_outside_a_forward_leaves_the_module_to_other_threads():
    m, x, ref, _, _ = _setup("cpu")
    keep = m.blocks[1].weight
    m.blocks[1].weight = nn.Parameter(torch.zeros(8, 8))
    with pytest.raises(OffloadError, match="was replaced"), torch.no_grad():
        m.blocks[1](x)
    m.blocks[1]._parameters["weight"] = keep
    got = []
    t = threading.Thread(target=lambda: got.append(torch.equal(m(x).detach(), ref)))
    t.start()
    t.join(30)
    assert got == [True]
    offload.disable(m)


class _Leaky(nn.Module):
    """A block returning a view of its own weight beside its output, and
    keeping another in an attribute of its own (read after every block ran)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))
        self.last = None

    def forward(self, x):
        self.last = self.weight[1:]
        return x @ self.weight.t(), self.weight.t()


class _LeakyBlocks(nn.Module):
    def __init__(self, n: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(_Leaky() for _ in range(n))

    def forward(self, x):
        seen = []
        for b in self.blocks:
            x, w = b(x)
            seen.append(w)
        return x, seen + [b.last for b in self.blocks]


class _Lent:
    """The buffers the package lends a block's bytes in from now on (each
    bind's buffer, recorded as a weak reference to its storage).

    A tensor lies in one when it shares the storage of a lent buffer still
    alive. A buffer that is gone does not count: on CUDA the lent buffers come
    from torch's caching allocator, which hands a freed one's address to the
    next allocation of its size (a copy made off the slot among them), so an
    address alone cannot tell a copy from a view. A view keeps its buffer alive."""

    def __init__(self, h):
        self.buffers, bind = [], h._bind_views

        def record(block, data):
            s = data.untyped_storage()
            self.buffers.append((s.data_ptr(), StorageWeakRef(s)))
            return bind(block, data)

        h._bind_views = record

    def __contains__(self, t: torch.Tensor) -> bool:
        at = t.untyped_storage().data_ptr()
        return any(ptr == at and not ref.expired() for ptr, ref in self.buffers)

    def __bool__(self) -> bool:
        return bool(self.buffers)


def _views_of_own_weights_outlive_the_slot(dev: str, prepare=lambda m: None) -> None:
    """Three forwards of `_LeakyBlocks` streamed on ``dev`` at depth 1 (after
    ``prepare(m)`` on the enabled module): each view of a block's weight it
    returns, or keeps in an attribute, is equal to the resident one and lies in
    no buffer the package lent."""
    torch.manual_seed(0)
    m, x = _LeakyBlocks(), torch.randn(2, 8, device=dev)
    m.to(dev)
    with torch.no_grad():
        ref_out, ref_seen = m(x)
        ref_seen = [w.clone() for w in ref_seen]
    m.to("cpu")
    h = offload.enable(m, device=dev, depth=1)
    prepare(m)
    lent = _Lent(h)
    with torch.no_grad():
        for _ in range(3):
            out, seen = m(x)
            if dev == "cuda":
                torch.cuda.synchronize()
            assert torch.equal(_bits(out), _bits(ref_out))
            for w, ref in zip(seen, ref_seen):
                assert w not in lent
                assert torch.equal(_bits(w), _bits(ref))
    assert lent, "no block was lent"
    offload.disable(m)


@pytest.mark.parametrize("dev", DEVICES)
def test_a_block_returning_a_view_of_its_own_weight_gets_a_copy_that_outlives_the_slot(dev):
    # The slot is reused by a later block: a view of it handed out by a block
    # (or kept in an attribute of its own) would change under its holder (on
    # CUDA) or pin a lent copy (simulated). Each such tensor is copied off the
    # slot, equal to the resident one.
    _views_of_own_weights_outlive_the_slot(dev)


_Pair = collections.namedtuple("_Pair", "h w")

# A block's output as each structure the post-hook looks into, holding the view
# (at any depth torch's pytree reaches).
_SHAPES = {
    "tensor": lambda h, w: w,
    "tuple": lambda h, w: (h, w),
    "list": lambda h, w: [h, w],
    "namedtuple": lambda h, w: _Pair(h, w),
    "dict": lambda h, w: {"h": h, "w": w},
    "nested": lambda h, w: (h, [{"w": w}]),
    "diffusers-output": lambda h, w: _output(h, w),
}


def _output(h, w):
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return (h, Transformer2DModelOutput(sample=w))


def _the_view(shape: str, out):
    """Where ``_SHAPES[shape]`` put the view of the weight in ``out``."""
    if shape == "tensor":
        return out
    if shape == "dict":
        return out["w"]
    if shape == "nested":
        return out[1][0]["w"]
    if shape == "diffusers-output":
        return out[1].sample
    return out[1]


class _Shaped(nn.Module):
    def __init__(self, shape: str):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))
        self.shape = shape

    def forward(self, x):
        return _SHAPES[self.shape](x @ self.weight.t(), self.weight[1:])


@pytest.mark.parametrize("shape", list(_SHAPES))
def test_a_view_of_a_blocks_weight_is_copied_off_the_slot_in_each_output_structure(shape):
    torch.manual_seed(0)
    m = nn.Module()
    m.blocks = nn.ModuleList(_Shaped(shape) for _ in range(3))
    m.forward = lambda x: [b(x) for b in m.blocks]
    x = torch.randn(2, 8)
    with torch.no_grad():
        ref = [b.weight[1:].clone() for b in m.blocks]
    h = offload.enable(m, device="cpu", depth=1)
    lent = _Lent(h)
    with torch.no_grad():
        outs = m(x)
    for out, r in zip(outs, ref):
        assert type(out) is type(_SHAPES[shape](x, x))
        w = _the_view(shape, out)
        assert w not in lent
        assert torch.equal(w, r)
    assert lent, "no block was lent"
    offload.disable(m)
