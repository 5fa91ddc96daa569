"""What runs around the model's blocks on CUDA: side streams inside a block, and CUDA-graph replay of decode steps.

Neither changes a result: the side-stream variants run a block's parts, the same kernels on the same inputs, with
the work the main path does not need yet queued on a second stream; the decode graph replays the kernels a one-token
step launched when it was captured.
"""

import dataclasses

import torch
from transformers.utils import logging

logger = logging.get_logger("transformers.kimi_k3")


# Where the `side_streams` path is on, the KDA, MLA and MoE blocks run as the variants below instead of their
# reference forwards: the same parts in the same order, but the work the main path does not need until later (the
# attention gates and query path, the MoE's router and shared experts) is queued on a second CUDA stream, so it
# overlaps the main path's chain of small kernels instead of queueing behind it; a CUDA graph captured over a decode
# step keeps both branches. The results are the same bits: the same kernels on the same inputs.
_side_streams = {}


class SideBranch:
    """`with branch:` queues its work on a second stream of x's CUDA device, after everything queued so far;
    `branch.join()` makes the main stream wait for that work (not for side work queued after it). In place (a
    no-op) for tensors off CUDA.

    No `record_stream` is needed as long as the caller joins before it returns: the branch's inputs are then still
    referenced while it runs, and memory it allocated and the caller frees is reused by later side-stream work only
    after a later fork, i.e. after every main-stream read queued before it.
    """

    def __init__(self, x):
        self.main = torch.cuda.current_stream(x.device) if x.is_cuda else None
        if self.main is not None and x.device not in _side_streams:
            _side_streams[x.device] = torch.cuda.Stream(x.device)
        self.side = _side_streams[x.device] if self.main is not None else None
        self._context = None
        self._done = None

    def __enter__(self):
        if self.side is not None:
            self.side.wait_stream(self.main)
            self._context = torch.cuda.stream(self.side)
            self._context.__enter__()
        return self

    def __exit__(self, *exc):
        if self._context is not None:
            self._done = torch.cuda.Event()
            self._done.record(self.side)
            self._context.__exit__(*exc)
            self._context = None
        return False

    def join(self):
        if self._done is not None:
            self.main.wait_event(self._done)


def kda_side_by_side(attn, x, cache, ops):
    """`KimiK3DeltaAttention.forward` (after masking) with the gate inputs beside the q/k/v projections."""
    own = attn.cache_layer(cache)
    branch = SideBranch(x)
    with branch:
        gates = attn.gate_inputs(x)
    projected = attn.qkv(x)
    branch.join()
    return attn.delta_rule(x, projected, gates, own, ops)


def mla_side_by_side(attn, x, attention_mask, cache, positions, ops, merged=None):
    """`KimiK3MLAttention.forward` with the query path and output gate beside the latent's path through the cache
    (after the one matmul of x's projections, where `merged` holds its outputs)."""
    branch = SideBranch(x)
    with branch:
        queries = attn.queries(x, merged)
    keys = attn.keys(x, cache, positions, merged)
    branch.join()
    return attn.attend(queries, keys, attention_mask, positions, ops)


def moe_side_by_side(moe, x, ops):
    """`KimiK3LatentMoE.forward` with the router beside the down projection, and the shared experts beside the
    routed experts."""
    flat = x.reshape(-1, x.shape[-1])
    routing, shared_branch = SideBranch(flat), SideBranch(flat)
    with routing:
        ids, weights = moe.gate(flat)
    with shared_branch:
        shared = moe.shared_experts(flat)
    z = moe.routed_expert_down_proj(flat)
    routing.join()
    y = moe.latent_experts(z, ids, weights, ops)
    shared_branch.join()
    return (y + shared).view(x.shape)


def execution_device(module):
    """Where `module` computes: accelerate's hook's device where it has one (its weights may be offloaded), else that
    of its first parameter."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return next(module.parameters()).device


@dataclasses.dataclass
class DecodeSegment:
    """Consecutive decode stages on one device: captured as one CUDA graph (`graph`, replayed on copies of its inputs
    into `inputs`, its results in `outputs`), or run eagerly where `why_eager` says why not."""

    device: torch.device
    stages: list
    why_eager: str = None
    inputs: tuple = None
    mask: torch.Tensor = None
    positions: torch.Tensor = None
    graph: torch.cuda.CUDAGraph = None
    outputs: tuple = None

    def run(self, state, mask, positions, cache):
        for stage in self.stages:
            state = stage(state, mask, positions, cache)
        return state


class KimiK3DecodeGraph:
    """One-token decode steps of a `KimiK3ForCausalLM` on a `KimiK3StaticCache`, replayed from CUDA graphs.

    The step is cut into stages (the embedding, each decoder layer, the output depth mix + norm, the head);
    consecutive stages on one CUDA device form a segment, one graph, so a model on one GPU is one graph and a model
    spread over GPUs by `device_map` one graph per contiguous run of layers on each, replayed in order with the hops
    (copies of a segment's results onto the next device) between them. Segments on the CPU, with weights offloaded
    by accelerate (its hooks load them at each call: not capturable) or with the `cuda_graphs` path off on their
    device run eagerly, logged once. The first step runs eagerly (it warms up kernels and libraries and gives each
    segment's input shapes), the second captures, the rest replay; a segment that cannot be captured warns once and
    runs eagerly. It lives on its cache (`cache.decode_graph`), so a `reset()` cache reuses the captured graphs.
    """

    def __init__(self, model):
        self.model = model
        self.segments = []
        for device, stage, offloaded in model.decode_stages():
            if device.type != "cuda":
                why = "not on a CUDA device"
            elif offloaded:
                why = "weights offloaded by accelerate (loaded at each call)"
            elif not model.language_model.model.dispatch.resolved(device).paths.cuda_graphs:
                why = "the cuda_graphs fast path is off there"
            else:
                why = None
            if not self.segments or (self.segments[-1].device, self.segments[-1].why_eager) != (device, why):
                self.segments.append(DecodeSegment(device, [], why))
            self.segments[-1].stages.append(stage)
        self.steps = 0
        eager = [f"{s.device} ({s.why_eager})" for s in self.segments if s.why_eager]
        if eager and self.enabled:
            logger.info(f"Kimi K3 decode graphs: {len(self.segments)} segments, run eagerly on {'; '.join(eager)}")

    @property
    def enabled(self):
        """Whether any segment is (to be) captured with the `cuda_graphs` path on on its device now."""
        dispatch = self.model.language_model.model.dispatch
        return any(s.why_eager is None and dispatch.resolved(s.device).paths.cuda_graphs for s in self.segments)

    @property
    def captured(self):
        """Whether any segment runs from a captured graph."""
        return any(s.graph is not None for s in self.segments)

    def __call__(self, cache, input_ids, attention_mask):
        """Logits [B, 1, vocab] of one new token per row."""
        self.model.language_model.model.dispatch.refresh()
        if cache.get_seq_length() == 0:
            raise ValueError("KimiK3DecodeGraph runs decode steps: prefill the cache first")
        mask, positions = cache.prepare(attention_mask, input_ids.shape[0], 1, input_ids.device)
        if self.steps == 1:
            self._capture(cache)
        state = (input_ids,)
        for segment in self.segments:
            state = tuple(t.to(segment.device) for t in state)  # the hop onto this segment's device
            if segment.graph is None:
                if self.steps == 0 and segment.why_eager is None:
                    segment.inputs = tuple(t.clone() for t in state)  # the shapes (and values) to capture on
                state = segment.run(state, mask.to(segment.device), positions.to(segment.device), cache)
                continue
            for buffer, value in zip(segment.inputs + (segment.mask, segment.positions), state + (mask, positions)):
                buffer.copy_(value)
            with torch.cuda.device(segment.device):
                segment.graph.replay()
            state = segment.outputs
        self.steps += 1
        cache.advance(1)
        return state[0].clone() if self.segments[-1].graph is not None else state[0]

    def _capture(self, cache):
        for segment in self.segments:
            if segment.why_eager:
                continue
            segment.mask = cache.mask.to(segment.device, copy=True)
            segment.positions = torch.zeros(1, dtype=torch.long, device=segment.device)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.device(segment.device), torch.cuda.graph(graph):
                    outputs = segment.run(segment.inputs, segment.mask, segment.positions, cache)
            except RuntimeError as err:  # e.g. a host sync in a path without a CUDA kernel (reference experts)
                logger.warning(f"Kimi K3: decode segment on {segment.device} not capturable as a CUDA graph, running "
                               f"it eagerly ({err})")
                segment.why_eager = "capture failed"
            else:
                segment.graph, segment.outputs = graph, outputs
