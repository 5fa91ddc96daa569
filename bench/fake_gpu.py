"""A GPU on the CPU for code paths, not numbers: tensors that report a CUDA device while their data stays on the host,
so the model's fast-path dispatch, device guards and kernel wrappers take their CUDA branches; every Triton kernel of
`mxfp4_triton` / `fused_triton` and fla's two KDA entry points replaced by a recorder that notes the launch (its
name, the current CUDA device, its tensors' devices) instead of running it. Outputs of recorded kernels are left as
allocated, except the router's top-k, which routes every token to slots 0..k-1 with equal weights (expert ids index
the experts next).

What `tests/test_device_guard.py` (the device of every launch) and `bench/kernel_count.py` (the kernels a decode
step launches) build on.
"""

import contextlib
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map
from triton.runtime.jit import JITFunction

import fused_triton
import kda
import mxfp4
import mxfp4_triton

FAKE_GPU = torch.device("cuda", 1)  # not cuda:0, so a launch under the default device is told apart
_standing_in = [False]  # True while a stand-in's own torch calls run (no kernel of the model's: not to be counted)


def standing_in():
    """Whether the torch calls running now are a stand-in's own (a recorder's outputs, an emulated CUDA-only op)."""
    return _standing_in[0]


@contextlib.contextmanager
def stand_in():
    """Marks the torch calls within as a stand-in's own."""
    previous, _standing_in[0] = _standing_in[0], True
    try:
        yield
    finally:
        _standing_in[0] = previous


class OnFakeGpu(torch.Tensor):
    """A CPU tensor that reports itself on `FAKE_GPU`."""

    @property
    def device(self):
        return FAKE_GPU

    @property
    def is_cuda(self):
        return True


def _host(value):
    if isinstance(value, OnFakeGpu):
        return value.as_subclass(torch.Tensor)
    return torch.device("cpu") if isinstance(value, torch.device) and value.type == "cuda" else value


class FakeGpuMode(TorchFunctionMode):
    """Runs every torch call on the CPU data and hands back its tensors as `OnFakeGpu`: allocations asked for on a
    CUDA device land on the CPU. `torch.mm(..., out_dtype=)` (CUDA only) runs as the same fp32 products."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.device:
            return func(*args, **(kwargs or {}))
        given = {}  # an output that is an input (`contiguous()` of a contiguous tensor, in-place ops): the same object

        def host(value):
            if isinstance(value, OnFakeGpu):
                data = value.as_subclass(torch.Tensor)
                given[id(data)] = (data, value)
                return data
            return _host(value)

        args, kwargs = tree_map(host, args), tree_map(host, dict(kwargs or {}))
        if func is torch.mm and kwargs.get("out_dtype") is not None:
            dtype = kwargs.pop("out_dtype")
            with stand_in():
                args = tuple(a.to(dtype) for a in args)
        out = func(*args, **kwargs)

        def back(t):
            if type(t) is not torch.Tensor:
                return t
            data, original = given.get(id(t), (None, None))
            return original if data is t else t.as_subclass(OnFakeGpu)

        return tree_map(back, out)


def to_fake_gpu(module):
    """`module`'s parameters as `OnFakeGpu` (in place); returns it."""
    for m in module.modules():
        for name, p in [(n, p) for n, p in m._parameters.items() if p is not None]:
            m._parameters[name] = torch.nn.Parameter(p.data.as_subclass(OnFakeGpu), requires_grad=False)
    return module


class CudaState:
    """Stands in for CUDA's current-device state: `torch.cuda.device(d)` sets it for its block."""

    def __init__(self):
        self.current = 0
        state = self

        class device:  # noqa: N801 (torch's name)
            def __init__(self, d):
                self.index = torch.device(d).index if not isinstance(d, int) else d

            def __enter__(self):
                self.previous, state.current = state.current, self.index

            def __exit__(self, *exc):
                state.current = self.previous

        self.device = device


def tensor_devices(values):
    return {t.device for v in values for t in (v if isinstance(v, (list, tuple)) else (v,))
            if isinstance(t, torch.Tensor)}


def triton_kernels():
    """[(module, name)] of every Triton kernel the model's kernel modules define."""
    return [(m, n) for m in (mxfp4_triton, fused_triton) for n, v in vars(m).items()
            if isinstance(v, JITFunction) and n.endswith("_kernel")]


@contextlib.contextmanager
def recorded_launches(upcast_once_min_pairs_per_expert=5):
    """Within: CUDA's current device simulated, and each kernel launch recorded, not run. Yields the list of
    launches, (kernel name, current device index, devices of its tensor arguments), in order. The MoE blocks' host
    read of the largest scale code is skipped (recorded kernels write no data to read), and prompts of at least
    `upcast_once_min_pairs_per_expert` pairs an expert take the upcast-once experts path as on an SM90 GPU."""
    calls, cuda = [], CudaState()

    def recorder(name):
        def launch(*args, **kwargs):
            calls.append((name, cuda.current, tensor_devices(list(args) + list(kwargs.values()))))
            if name == "_router_topk_kernel":  # its ids index the experts next: slots 0..k-1, equal weights
                ids, weights = args[2], args[3]
                with stand_in():
                    ids.copy_(torch.arange(ids.shape[1]).expand_as(ids))
                    weights.fill_(1.0 / ids.shape[1])
        return type("Kernel", (), {"__getitem__": lambda self, grid: launch})()

    def fla_kernel(name):  # fla's chunk and recurrent entry points: outputs of their shapes
        def run(q, k, v, g, beta, initial_state=None, inplace_final_state=False, **kwargs):
            calls.append((name, cuda.current, tensor_devices([q, k, v, g, beta, initial_state])))
            batch, _, heads, dim = q.shape
            with stand_in():
                state = (initial_state if inplace_final_state and initial_state is not None
                         else torch.empty(batch, heads, dim, v.shape[-1], device=v.device))
                return torch.empty_like(v), state
        return run

    min_pairs = upcast_once_min_pairs_per_expert
    with contextlib.ExitStack() as stack:
        patch = lambda target, name, value: stack.enter_context(mock.patch.object(target, name, value))  # noqa: E731
        patch(torch.cuda, "device", cuda.device)
        patch(torch.cuda, "current_device", lambda: cuda.current)
        for module, name in triton_kernels():
            patch(module, name, recorder(name))
        patch(kda, "_fla", (fla_kernel("fla_chunk_kda"), fla_kernel("fla_fused_recurrent_kda")))
        patch(mxfp4, "max_scale_code", lambda *scales: 0)
        patch(mxfp4_triton, "upcast_once_pays", lambda pairs, experts, device: pairs >= min_pairs * experts)
        yield calls
