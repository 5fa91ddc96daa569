"""Loading Kimi K3 checkpoints: the checks, the key map of the stacked experts, and one streaming reader.

Every tensor name, shape and dtype is compared with the model before a byte is read, so a missing, unexpected,
mis-shaped or wrongly typed tensor, a truncated shard or a corrupt header is an error naming the tensor and the file,
never a silent random init or cast. The routed experts are one `[E, ...]` parameter per projection and block
(`modeling_kimi_k3.KimiK3Experts`), where the release stores one tensor per expert: `stacked_key` and
`release_state_dict` translate. `read_tensors` fills the parameters straight from the shards: per shard in file
order, on a few threads, through reused pinned buffers and asynchronous copies where the target is a GPU, with no
per-tensor Python beyond a lookup. `load_model` is the whole single-process `from_pretrained` on top of it (one meta
build, the check, placement by `device_map`, the read); `tensor_parallel.load_tensor_parallel` reads each rank's
byte ranges through the same reader.
"""

import contextlib
import json
import os
import re
import threading
import time
from collections import namedtuple
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors import safe_open
from torch import nn
from transformers.utils import logging

logger = logging.get_logger("transformers.kimi_k3")

# The release's MoonViT vision tower: a text-only load skips it on purpose (`check_checkpoint` says so once); any
# other unexpected tensor stays an error. Its dtypes are not this model's concern.
VISION_KEYS = (r"^vision_tower\.", r"^mm_projector\.")


def checkpoint_directory(path, kwargs):
    """The local folder of checkpoint `path`: the folder itself, or the snapshot of the hub repository `path` (its
    config and safetensors files, fetched or found in the cache as `from_pretrained` would, under the hub options
    among its `kwargs`), so that a hub load is checked as strictly as a local one."""
    if not os.path.isdir(path):
        from huggingface_hub import snapshot_download

        hub = {k: kwargs[k] for k in ("cache_dir", "force_download", "local_files_only", "proxies", "revision",
                                      "token") if kwargs.get(k) is not None}
        path = snapshot_download(path, allow_patterns=["*.json", "*.safetensors"], **hub)
    return os.path.join(path, kwargs.get("subfolder") or "")


def check_checkpoint(model, directory, config, headers=None):
    """Compare a local checkpoint with `model` (built on the meta device, the model being loaded) before reading it:
    first the cheap structural pass (`check_structure`), then every tensor name and shape against the model's, in
    the release's per-expert names. Returns the headers read (`read_safetensors_headers`)."""
    found = read_safetensors_headers(directory) if headers is None else headers
    check_structure(directory, config, found)
    expected = release_shapes(model)
    mismatched = [f"{k} (checkpoint {list(found[k][2])}, model {list(s)})"
                  for k, s in expected.items() if k in found and found[k][2] != s]
    unexpected = sorted(set(found) - set(expected))
    raise_on_key_problems(directory, sorted(set(expected) - set(found)), unexpected, mismatched,
                          ignored=model._keys_to_ignore_on_load_unexpected)
    vision = [k for k in unexpected if _is_vision(k)]
    if vision:
        logger.warning(f"{directory}: skipping {len(vision)} vision-tower tensors (names matching "
                       f"{', '.join(VISION_KEYS)}): this model is text-only")
    return found


# ----------------------------------------------------------------------------------------------------------------
# The key map of the stacked experts
# ----------------------------------------------------------------------------------------------------------------

_RELEASE_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123]\.weight_(?:packed|scale))$")
_STACKED = re.compile(r"^(.*\.experts)\.(w[123]\.weight_(?:packed|scale))$")


def stacked_key(name):
    """(model name, expert) of a release tensor name: `...experts.7.w1.weight_packed` is row 7 of the model's
    `...experts.w1.weight_packed`; any other name is the model's own, expert None."""
    m = _RELEASE_EXPERT.match(name)
    return (f"{m[1]}.{m[3]}", int(m[2])) if m else (name, None)


def release_key(name, expert):
    """The release's name of row `expert` of the stacked model tensor `name`."""
    m = _STACKED.match(name)
    return f"{m[1]}.{expert}.{m[2]}"


def is_stacked(name):
    return _STACKED.match(name) is not None


def release_shapes(model):
    """Release tensor name -> shape of every tensor `model` loads (its stacks as one entry per expert)."""
    shapes = {}
    for name, tensor in model.state_dict().items():
        if is_stacked(name):
            shapes.update((release_key(name, e), tuple(tensor.shape[1:])) for e in range(tensor.shape[0]))
        else:
            shapes[name] = tuple(tensor.shape)
    return shapes


def release_state_dict(state_dict):
    """`state_dict` in the release's names: each stack as its experts' rows (views, in expert order)."""
    out = {}
    for name, tensor in state_dict.items():
        if is_stacked(name):
            out.update((release_key(name, e), row) for e, row in enumerate(tensor.unbind(0)))
        else:
            out[name] = tensor
    return out


def raise_on_key_problems(source, missing, unexpected, mismatched, ignored=()):
    """One error naming the tensors at fault in `source`, unexpected ones matching a pattern of `ignored` aside."""
    unexpected = [k for k in unexpected if not any(re.search(p, k) for p in ignored or ())]
    problems = {"missing": sorted(missing), "unexpected": sorted(unexpected), "mismatched": sorted(mismatched)}
    if any(problems.values()):
        detail = "; ".join(f"{kind}: {', '.join(keys[:8])}" + (" ..." if len(keys) > 8 else "")
                           for kind, keys in problems.items() if keys)
        raise ValueError(f"{source}: checkpoint does not match the model ({detail})")


# The one dtype rule of the loader and `verify`: MXFP4 packs and their E8M0 scales are bytes (U8); every other
# tensor of this model is a float, stored as any dtype the model may be loaded in. A scale stored as BF16 or a router
# weight as I64 would otherwise be cast silently.
FLOAT_DTYPES = ("BF16", "F16", "F32")
PACKED_SUFFIXES = (".weight_packed", ".weight_scale")
# E8M0's NaN: no scale of a valid pack holds it, and one makes its whole group of 32 weights NaN.
E8M0_NAN = 0xFF
_LAYER = re.compile(r"^language_model\.model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^language_model\.model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.")


def accepted_dtypes(name):
    """The safetensors dtypes tensor `name` may be stored as."""
    return ("U8",) if name.endswith(PACKED_SUFFIXES) else FLOAT_DTYPES


def _is_vision(name):
    return any(re.search(p, name) for p in VISION_KEYS)


def check_structure(directory, config, headers):
    """The cheap structural pass of a checkpoint against its config, shared by the loader and `verify`, before
    anything large is allocated: the config's sizes against the shard headers (layers, experts a layer, hidden and
    latent widths, vocabulary), every tensor's dtype (`accepted_dtypes`), and a sample of the MXFP4 scales (each
    layer's first and last expert) for E8M0's NaN code. Its cost follows the headers, never the config's sizes, so a
    hostile config (10^7 experts) fails here in seconds. One error naming the fields, tensors and files at fault."""
    text = getattr(config, "text_config", config)
    problems = [f"wrong dtype: {k} in {e.file} ({e.dtype}, model expects {' or '.join(accepted_dtypes(k))})"
                for k, e in sorted(headers.items()) if not _is_vision(k) and e.dtype not in accepted_dtypes(k)]
    problems += [f"config: {problem}" for problem in _size_problems(text, headers)]
    if not problems:
        problems += [f"NaN scale: {problem}" for problem in _nan_scales(directory, headers)]
    if problems:
        detail = "; ".join(problems[:8]) + (f"; ... ({len(problems) - 8} more)" if len(problems) > 8 else "")
        raise ValueError(f"{directory}: checkpoint does not match the model ({detail})")


def _size_problems(text, headers):
    """The config's sizes that the shard headers contradict, each naming the config field and a tensor."""
    prefix = "language_model.model."

    def shape(name):
        return headers[name][2] if name in headers else None

    problems = []
    embed = shape(prefix + "embed_tokens.weight")
    if embed is not None and embed != (text.vocab_size, text.hidden_size):
        problems.append(f"vocab_size, hidden_size = {text.vocab_size}, {text.hidden_size}, but "
                        f"{prefix}embed_tokens.weight is {list(embed)}")
    layers = {int(m.group(1)) for k in headers if (m := _LAYER.match(k))}
    if layers and max(layers) + 1 != text.num_hidden_layers:
        problems.append(f"num_hidden_layers = {text.num_hidden_layers}, but the shards hold layers 0..{max(layers)}")
    experts = {}
    for k in headers:
        if m := _EXPERT.match(k):
            experts.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    field = "num_experts_per_layer[{}]" if text.num_experts_per_layer is not None else "num_experts"
    for layer in sorted(layers):
        if layer >= text.num_hidden_layers:
            continue
        want, name = text.experts_in_layer(layer), f"{prefix}layers.{layer}.block_sparse_moe.gate.weight"
        router = shape(name)
        if router is not None and router != (want, text.hidden_size):  # the router sizes a layer's experts
            problems.append(f"{field.format(layer)}, hidden_size = {want}, {text.hidden_size} (layer {layer}), but "
                            f"{name} is {list(router)}")
        elif router is None and len(experts.get(layer, ())) != want:
            problems.append(f"{field.format(layer)} = {want} (layer {layer}), but the shards hold no router for it and "
                            f"{len(experts.get(layer, ()))} experts")
        packed = shape(f"{prefix}layers.{layer}.block_sparse_moe.experts.0.w1.weight_packed")
        if packed is not None and packed != (text.moe_intermediate_size, text.routed_expert_hidden_size // 2):
            problems.append(f"moe_intermediate_size, routed_expert_hidden_size = {text.moe_intermediate_size}, "
                            f"{text.routed_expert_hidden_size}, but layer {layer}'s experts.0.w1.weight_packed is "
                            f"{list(packed)}")
    return problems


def _nan_scales(directory, headers):
    """Scales holding E8M0's NaN code among each MoE layer's first and last expert."""
    sample = {}
    for k, entry in headers.items():
        m = _EXPERT.match(k)
        if m and k.endswith(".weight_scale"):
            layer, expert = int(m.group(1)), int(m.group(2))
            sample.setdefault(layer, {}).setdefault(expert, []).append((entry.file, k))
    reads = {}
    for by_expert in sample.values():
        for expert in {min(by_expert), max(by_expert)}:
            for file, k in by_expert[expert]:
                reads.setdefault(file, []).append(k)
    problems = []
    for file, keys in sorted(reads.items()):
        with safe_open(os.path.join(directory, file), "pt") as f:
            problems += [f"{k} in {file} holds E8M0 code 0xFF (NaN)" for k in sorted(keys)
                         if bool((f.get_tensor(k) == E8M0_NAN).any())]
    return problems


# A tensor's header entry: its shard, safetensors dtype and shape, and where its bytes lie in the file.
Entry = namedtuple("Entry", "file dtype shape start stop")

DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
          "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def read_header(path):
    """Tensor name -> `Entry` of one safetensors file, failing (naming the file) on a header that is not valid JSON
    of the format, a tensor whose byte range does not match its shape and dtype, or a file shorter than its header
    promises (truncated)."""
    name = os.path.basename(path)

    def corrupt(reason):
        return ValueError(f"{path}: not a readable safetensors file, truncated or corrupt ({reason})")

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise corrupt("shorter than its 8-byte header length")
        length = int.from_bytes(head, "little")
        if length > min(size - 8, MAX_HEADER_BYTES):
            raise corrupt(f"header length {length} runs past the file's {size} bytes")
        try:
            header = json.loads(f.read(length))
        except ValueError as err:
            raise corrupt(f"header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise corrupt("header is not a JSON object")
    base, entries = 8 + length, {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            itemsize = DTYPES[dtype].itemsize
            numel = 1
            for n in shape:
                numel *= int(n)
        except (KeyError, TypeError, ValueError):
            raise corrupt(f"bad entry for {key}: {info!r:.200}") from None
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            raise corrupt(f"bad data_offsets for {key}: {info.get('data_offsets')!r}")
        if end - begin != numel * itemsize:
            raise corrupt(f"{key}: {end - begin} bytes for shape {list(shape)} of {dtype}")
        if base + end > size:
            raise corrupt(f"{key} ends at byte {base + end}, the file has {size} (truncated)")
        entries[key] = Entry(name, dtype, shape, base + begin, base + end)
    return entries


def read_safetensors_headers(directory):
    """Tensor name -> `Entry` (file name, safetensors dtype, shape, byte range) over a checkpoint's safetensors
    files, failing early (naming the file) on a malformed index, a missing shard, a truncated file or a corrupt
    header, and on a tensor stored somewhere other than the index says."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    weight_map = None
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f).get("weight_map")
        except (ValueError, AttributeError) as err:
            raise ValueError(f"{index_path}: not a JSON object ({err})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index_path}: no \"weight_map\" object of tensor name -> shard file name")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(name for name in os.listdir(directory) if name.endswith(".safetensors"))
    found = {}
    for name in files:
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: listed in model.safetensors.index.json but missing")
        for key, entry in read_header(path).items():
            if weight_map is not None and weight_map.get(key) != name:
                raise ValueError(f"{path}: holds {key}, which model.safetensors.index.json places in "
                                 f"{weight_map.get(key)}")
            found[key] = entry
    return found


def check_loaded_scales(model, source):
    """After a load, every MXFP4 scale of the model against E8M0's NaN code (free: stacking the experts read each
    block's largest code); one error naming the first tensor that holds it."""
    for name, module in model.named_modules():
        stack = getattr(module, "expert_stack", None)
        if stack is None or stack.max_scale_code != E8M0_NAN:
            continue
        for proj in ("w1", "w3", "w2"):
            bad = (getattr(module.experts, proj).weight_scale == E8M0_NAN).flatten(1).any(1).nonzero()
            if len(bad):
                key = release_key(f"{name}.experts.{proj}.weight_scale", int(bad[0]))
                raise ValueError(f"{source}: {key} holds E8M0 code 0xFF (NaN)")


# ----------------------------------------------------------------------------------------------------------------
# The streaming reader
# ----------------------------------------------------------------------------------------------------------------

# Reads are coalesced into runs of adjacent tensors up to this size; a larger tensor is read in row blocks of it.
CHUNK_BYTES = 64 << 20
READ_THREADS = 4
PROGRESS_MIN_BYTES = 2 << 30  # a progress bar for loads at least this large

# One tensor to fill: rows `rows` (a range of dim 0, or None: all) of checkpoint tensor `key`, then `index` (the rest
# of a tensor-parallel slice, or None) of those, copied into `dst` (a parameter or a view of one).
Piece = namedtuple("Piece", "key rows index dst")
# A piece placed in its file: bytes start..stop, read as `shape` of `dtype`.
_Span = namedtuple("_Span", "start stop shape dtype index dst")


def _spans(piece, entry):
    """The byte spans of one piece: its rows only, split into blocks of at most `CHUNK_BYTES` where larger."""
    shape, dtype = entry.shape, DTYPES[entry.dtype]
    row_bytes = (entry.stop - entry.start) // shape[0] if shape and shape[0] else 0
    first, last = (0, shape[0] if shape else 0) if piece.rows is None else (piece.rows.start, piece.rows.stop)
    if not shape or row_bytes == 0:
        return [_Span(entry.start, entry.stop, shape, dtype, piece.index, piece.dst)]
    step = max(1, CHUNK_BYTES // row_bytes)
    spans = []
    for r in range(first, last, step):
        end = min(last, r + step)
        dst = piece.dst if (r, end) == (first, last) else piece.dst[r - first : end - first]
        spans.append(_Span(entry.start + r * row_bytes, entry.start + end * row_bytes, (end - r, *shape[1:]), dtype,
                           piece.index, dst))
    return spans


def _runs(spans):
    """Spans of one file in file order, grouped into runs of adjacent spans of at most `CHUNK_BYTES`."""
    runs, run = [], []
    for span in sorted(spans, key=lambda s: s.start):
        if run and (span.start != run[-1].stop or span.stop - run[0].start > CHUNK_BYTES):
            runs.append(run)
            run = []
        run.append(span)
    return runs + [run] if run else runs


def _pread_into(fd, view, offset, path):
    """Fill the writable byte view from file offset `offset`; a short file is an error naming it."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ValueError(f"{path}: ends at byte {offset + done}, before the {len(view)} bytes read at {offset} "
                             f"(truncated)")
        done += n


def _preadv_into(fd, views, offset, path):
    """Fill adjacent byte views from file offset `offset` with as few calls as the OS allows (one per
    `os.IOV_MAX` views unless a read comes back short)."""
    step = getattr(os, "IOV_MAX", 1024)
    for first in range(0, len(views), step):
        batch = views[first : first + step]
        done = os.preadv(fd, batch, offset)
        for view in batch:  # a short read: the rest one view at a time (an error where the file ends)
            if done < len(view):
                _pread_into(fd, view[max(done, 0):], offset + max(done, 0), path)
            done -= len(view)
            offset += len(view)


def _byte_view(tensor):
    return memoryview(tensor.view(-1).view(torch.uint8).numpy())


class _Staging(threading.local):
    """A reader thread's two reused pinned host buffers, its copy stream on each GPU it writes to, and per buffer
    the events of the asynchronous copies out of it (on every GPU they went to)."""

    def __init__(self):
        self.buffers, self.events, self.streams, self.turn = [None, None], [[], []], {}, 0

    def next(self, nbytes):
        """The other buffer, once the copies out of it are done, at least `nbytes` long: (its slot, the view)."""
        i = self.turn = 1 - self.turn
        for event in self.events[i]:
            event.synchronize()
        buffer = self.buffers[i]
        if buffer is None or buffer.numel() < nbytes:
            buffer = self.buffers[i] = torch.empty(max(nbytes, CHUNK_BYTES), dtype=torch.uint8, pin_memory=True)
        return i, buffer[:nbytes]

    def stream(self, device):
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def copied(self, i, devices):
        """Record, on this thread's stream of each GPU, the end of the copies out of buffer `i`."""
        self.events[i] = []
        for device in devices:
            event = torch.cuda.Event()
            event.record(self.stream(device))
            self.events[i].append(event)


def read_tensors(directory, headers, pieces, threads=READ_THREADS, desc="Loading weights"):
    """Fill every piece's `dst` from the checkpoint in `directory` (`headers`: `read_safetensors_headers`). Per
    shard, the spans are read in file order, adjacent ones coalesced; a span bound for the host in its own dtype is
    read straight into its tensor, any other through a staging buffer (pinned for a GPU, copied asynchronously on
    the thread's stream; rows strided on disk are copied whole and sliced on the device). Returns the bytes read."""
    by_file = {}
    for piece in pieces:
        entry = headers[piece.key]
        by_file.setdefault(entry.file, []).extend(_spans(piece, entry))
    work = [(file, run) for file, spans in sorted(by_file.items()) for run in _runs(spans)]
    total = sum(run[-1].stop - run[0].start for _, run in work)
    pinned = any(span.dst.is_cuda for _, run in work for span in run)
    staging = _Staging() if pinned else None
    fds, lock = {}, threading.Lock()
    progress = logging.tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                            disable=total < PROGRESS_MIN_BYTES)

    def fd_of(file):
        with lock:
            if file not in fds:
                fds[file] = os.open(os.path.join(directory, file), os.O_RDONLY)
            return fds[file]

    def read(file, run):
        path, fd = os.path.join(directory, file), fd_of(file)
        if all(_direct(span) for span in run):
            _preadv_into(fd, [_byte_view(span.dst) for span in run], run[0].start, path)
        else:
            nbytes = run[-1].stop - run[0].start
            i, buffer = staging.next(nbytes) if pinned else (None, torch.empty(nbytes, dtype=torch.uint8))
            _pread_into(fd, _byte_view(buffer), run[0].start, path)
            gpus = {span.dst.device for span in run if span.dst.is_cuda}
            # grad mode is per thread: this one's copies into parameters must not be recorded
            with torch.no_grad(), contextlib.ExitStack() as streams:
                for device in gpus:
                    streams.enter_context(torch.cuda.stream(staging.stream(device)))
                for span in run:
                    source = buffer[span.start - run[0].start : span.stop - run[0].start]
                    if (span.start - run[0].start) % span.dtype.itemsize:  # after a tensor of an odd byte count
                        source = source.clone()
                    _copy(source.view(span.dtype).view(span.shape), span.index, span.dst)
                if pinned:
                    staging.copied(i, gpus)
        progress.update(run[-1].stop - run[0].start)

    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(max(1, threads)) as pool:
            for future in [pool.submit(read, file, run) for file, run in work]:
                future.result()
        for device in {span.dst.device for _, run in work for span in run if span.dst.is_cuda}:
            torch.cuda.synchronize(device)
    finally:
        progress.close()
        for fd in fds.values():
            os.close(fd)
    seconds = time.perf_counter() - start
    logger.info(f"{directory}: read {total / 1e9:.2f} GB in {seconds:.1f} s ({total / 1e9 / max(seconds, 1e-9):.2f} "
                f"GB/s, {len(work)} reads)")
    return total


def _direct(span):
    """A span that can be read straight into its tensor: host, contiguous, same dtype, nothing to slice."""
    dst = span.dst
    return dst.device.type == "cpu" and dst.dtype == span.dtype and dst.is_contiguous() and span.index is None


def _copy(source, index, dst):
    """dst <- source[index]: a slice strided on disk is copied whole to dst's device and sliced there."""
    if index is not None:
        source = source.to(dst.device, non_blocking=True)[index]
    dst.copy_(source, non_blocking=True)


def pieces_for(model, sources=None):
    """The pieces that fill `model`'s parameters (materialised, not meta): each its own checkpoint tensor, a stacked
    expert parameter one piece per expert row, and under tensor parallel (`sources`: local name -> (model name,
    index), `tensor_parallel.shard`) only the rank's slice, its leading range read as rows."""
    pieces = []
    for name, param in model.named_parameters():
        key, index = (sources or {}).get(name, (name, ()))
        rows, rest = _split_index(index, param.dim())
        if is_stacked(key):
            first = 0 if rows is None else rows.start
            rest = None if rest is None else rest[1:]
            pieces += [Piece(release_key(key, first + e), None, rest, param[e]) for e in range(param.shape[0])]
        else:
            pieces.append(Piece(key, rows, rest, param))
    return pieces


def _split_index(index, dims):
    """An index (a tuple of slices) as (its range of dim 0 or None, the rest or None)."""
    index = tuple(index) + (slice(None),) * (dims - len(index))
    head = index[0] if index else slice(None)
    rows = None if head == slice(None) else range(head.start or 0, head.stop)
    rest = (slice(None),) + index[1:]
    return rows, (None if all(i == slice(None) for i in rest) else rest)


# ----------------------------------------------------------------------------------------------------------------
# from_pretrained
# ----------------------------------------------------------------------------------------------------------------

# from_pretrained keywords that mean nothing to this loader (the Auto classes and pipelines add some of them)
IGNORED_KWARGS = ("_from_auto", "_from_pipeline", "_commit_hash", "adapter_kwargs", "trust_remote_code",
                  "low_cpu_mem_usage", "use_safetensors", "code_revision", "attn_implementation")
HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token")
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def pop_load_kwargs(kwargs):
    """(dtype, config, hub options) popped from `from_pretrained`'s keywords, the ones that mean nothing to this
    loader dropped (`torch_dtype` is `dtype`'s older name)."""
    dtype, torch_dtype = kwargs.pop("dtype", None), kwargs.pop("torch_dtype", None)
    config = kwargs.pop("config", None)
    hub = {name: kwargs.pop(name) for name in HUB_KWARGS if name in kwargs}
    for name in IGNORED_KWARGS:
        kwargs.pop(name, None)
    return (torch_dtype if dtype is None else dtype), config, hub


def resolve_dtype(dtype, config, headers):
    """The float dtype to load in, as transformers reads `dtype` ("auto": the config's, else the checkpoint's; None:
    transformers 5's default "auto", 4.x's torch default)."""
    import transformers

    if dtype is None:
        dtype = "auto" if int(transformers.__version__.split(".")[0]) >= 5 else torch.get_default_dtype()
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if dtype is None:
            names = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
            dtype = next((names[e.dtype] for e in headers.values() if e.dtype in names), torch.get_default_dtype())
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype {dtype!r} is not a floating-point torch dtype or 'auto'")
    return dtype


def build_on_meta(cls, config, dtype):
    """`cls(config)` on the meta device with float parameters in `dtype`: the one build of a load."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return cls(config)
    finally:
        torch.set_default_dtype(previous)


def materialize(model, device_of):
    """Give every meta parameter of `model` empty storage on `device_of(name)`; floats stay trainable, as
    transformers loads them."""
    for name, param in list(model.named_parameters()):
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        tensor = torch.empty(param.shape, dtype=param.dtype, device=device_of(name))
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=param.dtype.is_floating_point)


def load_generation_config(model, directory):
    from transformers import GenerationConfig

    if model.can_generate() and os.path.exists(os.path.join(directory, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(directory)


def load_model(cls, pretrained_model_name_or_path, model_args, kwargs, fast_paths=None):
    """`cls.from_pretrained` in one process: the model built once on the meta device, the checkpoint checked against
    it, every parameter placed by `device_map` (none: the CPU; a device; "auto" and accelerate's other strategies;
    a dict, "cpu" and "disk" entries offloaded by accelerate's hooks) and read by `read_tensors`. `fast_paths` is
    requested before a byte is read, so that an "on" path that cannot run is refused first. Returns the model (in
    eval mode) and the loading info."""
    if model_args:
        raise TypeError("Kimi K3's from_pretrained takes no positional model arguments")
    device_map = kwargs.pop("device_map", None)
    offload = {"max_memory": kwargs.pop("max_memory", None), "offload_dir": kwargs.pop("offload_folder", None),
               "offload_buffers": kwargs.pop("offload_buffers", False)}
    kwargs.pop("offload_state_dict", None)
    dtype, config, hub = pop_load_kwargs(kwargs)
    directory = checkpoint_directory(str(pretrained_model_name_or_path), hub)
    if not isinstance(config, cls.config_class):
        config, kwargs = cls.config_class.from_pretrained(directory, return_unused_kwargs=True, **kwargs)
    if kwargs:
        raise TypeError(f"{cls.__name__}.from_pretrained got unexpected keyword arguments {sorted(kwargs)}")
    config.name_or_path = str(pretrained_model_name_or_path)
    headers = read_safetensors_headers(directory)
    dtype = resolve_dtype(dtype, config, headers)
    model = build_on_meta(cls, config, dtype)
    model.dispatch.request(fast_paths)
    check_checkpoint(model, directory, config, headers)
    placement = _device_map(model, device_map, dtype, offload["max_memory"])
    materialize(model, lambda name: _device_of(placement, name))
    read_tensors(directory, headers, pieces_for(model))
    model.eval()
    if device_map is not None:
        model.hf_device_map = placement
        if len(set(placement.values())) > 1 or "disk" in placement.values():
            from accelerate import dispatch_model

            # a MoE block reads its expert stacks as tensors, not through their modules' forwards: its hook loads
            # all of its offloaded weights at once
            dispatch_model(model, device_map=placement, offload_dir=offload["offload_dir"],
                           offload_buffers=offload["offload_buffers"],
                           skip_keys=model._skip_keys_device_placement, preload_module_classes=["KimiK3LatentMoE"])
    load_generation_config(model, directory)
    return model, {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}


def _device_map(model, device_map, dtype, max_memory):
    """Module name -> device (or "cpu" / "disk" to offload) for `device_map`, as transformers resolves it."""
    if device_map is None:
        return {"": "cpu"}
    if isinstance(device_map, (int, torch.device)) or (isinstance(device_map, str) and device_map not in
                                                       DEVICE_MAP_STRATEGIES):
        return {"": _device_name(device_map)}
    if isinstance(device_map, dict):
        return {name: _device_name(device) for name, device in device_map.items()}
    try:
        from accelerate.utils import get_balanced_memory, get_max_memory, infer_auto_device_map
    except ImportError:
        raise ImportError(f"device_map={device_map!r} needs accelerate: pip install accelerate") from None
    no_split = model._no_split_modules
    if device_map == "sequential":
        max_memory = get_max_memory(max_memory)
    else:
        max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype,
                                         low_zero=device_map == "balanced_low_0")
    placement = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype)
    return {name: _device_name(device) for name, device in placement.items()}


def _device_name(device):
    if isinstance(device, int):
        return f"cuda:{device}"
    return device if device in ("cpu", "disk") else str(torch.device(device))


def _device_of(placement, name):
    """The device a parameter is read onto: its longest-prefix module's entry, "disk" read to the CPU first."""
    parts = name.split(".")
    for end in range(len(parts), -1, -1):
        device = placement.get(".".join(parts[:end]))
        if device is not None:
            return "cpu" if device == "disk" else device
    raise ValueError(f"device_map places no module holding {name}")
