"""Shared checkpoint helpers for the REAP tools: raw safetensors headers, the shard index,
the config's MoE structure, byte-range streaming and an atomic output directory.

Everything works on the raw safetensors format (8-byte little-endian header length, JSON
header, data) so tensors can be hashed and copied byte for byte without being loaded:
prune and verify stay bit-exact, fast and near-constant in memory. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
SELECTION_NAME = "reap_selection.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024
CHUNK = 8 * 1024 * 1024

DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "E8M0": 8,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
    "U16": 16, "I16": 16, "F16": 16, "BF16": 16,
    "U32": 32, "I32": 32, "F32": 32, "U64": 64, "I64": 64, "F64": 64, "C64": 64,
}

# `...layers.{i}.block_sparse_moe.{rest}` and, inside rest, `experts.{e}.{suffix}`.
MOE_RE = re.compile(r"^(?P<prefix>.*?layers\.)(?P<layer>\d+)\.block_sparse_moe\.(?P<rest>.+)$")
EXPERT_RE = re.compile(r"^experts\.(?P<expert>\d+)\.(?P<suffix>.+)$")
GATE_NAME = "gate.weight"
BIAS_NAME = "gate.e_score_correction_bias"


class CheckpointError(ValueError):
    """A checkpoint (or something read from it) is malformed; the message names the file/tensor."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor's bytes live: [start, end) are absolute offsets in `file`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def expected_nbytes(self) -> int | None:
        bits = DTYPE_BITS.get(self.dtype)
        return None if bits is None else (self.numel * bits + 7) // 8


@dataclass(frozen=True, slots=True)
class ShardHeader:
    path: Path
    header_len: int
    metadata: dict
    tensors: dict[str, TensorInfo]

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    @property
    def data_end(self) -> int:
        """Absolute end of the last tensor (the file size a well-formed shard has)."""
        return max((t.end for t in self.tensors.values()), default=self.data_start)


def read_header(path: str | Path) -> ShardHeader:
    """Parse one safetensors file's header without touching its data."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{path.name}: file too short for a safetensors header ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(f"{path.name}: header length {n} does not fit the file ({size} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path.name}: cannot read: {e}") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path.name}: header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + n
    tensors = {}
    for name, entry in header.items():
        try:
            start, end = (int(x) for x in entry["data_offsets"])
            info = TensorInfo(name, sys.intern(str(entry["dtype"])), tuple(int(d) for d in entry["shape"]), path,
                              base + start, base + end)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path.name}: tensor {name}: malformed header entry {entry!r}") from e
        if not 0 <= start <= end:
            raise CheckpointError(f"{path.name}: tensor {name}: bad data_offsets {[start, end]}")
        tensors[name] = info
    return ShardHeader(path, n, metadata, tensors)


def encode_header(entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict | None = None) -> bytes:
    """The 8-byte length + JSON header for tensors laid out back to back in the given order.

    entries: (name, dtype, shape, nbytes). The JSON is space-padded to a multiple of 8 bytes,
    as the safetensors writer does, so the data section starts aligned.
    """
    parts = [f'"__metadata__":{json.dumps(metadata or {"format": "pt"}, separators=(",", ":"))}']
    offset = 0
    for name, dtype, shape, nbytes in entries:
        parts.append(f'{json.dumps(name)}:{{"dtype":"{dtype}","shape":[{",".join(map(str, shape))}],'
                     f'"data_offsets":[{offset},{offset + nbytes}]}}')
        offset += nbytes
    raw = ("{" + ",".join(parts) + "}").encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def read_json(path: Path) -> dict:
    """A JSON object from `path`; CheckpointError naming the file when it is missing, unreadable or not an object."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path.name}: missing in {path.parent}") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot parse: {e}") from e
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def write_json(path: Path, obj) -> None:
    """Write JSON atomically: a temporary file beside `path`, then rename, so no half-written file is left."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_index(ckpt_dir: str | Path) -> dict | None:
    """The parsed model.safetensors.index.json, or None for a single-file checkpoint."""
    path = Path(ckpt_dir) / INDEX_NAME
    if not path.exists():
        return None
    index = read_json(path)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{path}: no weight_map object")
    bad = [name for name, file in weight_map.items()
           if not isinstance(file, str) or "/" in file or file.startswith(".")]
    if bad:
        raise CheckpointError(f"{path}: weight_map entry {bad[0]!r} -> {weight_map[bad[0]]!r} is not a shard file "
                              f"name in the folder")
    return index


def shard_names(ckpt_dir: str | Path) -> list[str]:
    """Shard file names, sorted (the files the index names, or the single file)."""
    ckpt_dir = Path(ckpt_dir)
    index = read_index(ckpt_dir)
    if index is not None:
        return sorted(set(index["weight_map"].values()))
    if (ckpt_dir / SINGLE_NAME).exists():
        return [SINGLE_NAME]
    raise CheckpointError(f"{ckpt_dir}: no {INDEX_NAME} and no {SINGLE_NAME}")


def load_tensors(ckpt_dir: str | Path) -> dict[str, TensorInfo]:
    """All tensors of a checkpoint from its shard headers, in file order then offset order."""
    ckpt_dir = Path(ckpt_dir)
    tensors: dict[str, TensorInfo] = {}
    for name in shard_names(ckpt_dir):
        header = read_header(ckpt_dir / name)
        for t in sorted(header.tensors.values(), key=lambda t: t.start):
            if t.name in tensors:
                raise CheckpointError(f"tensor {t.name} is in both {tensors[t.name].file.name} and {name}")
            tensors[t.name] = t
    return tensors


def read_config(ckpt_dir: str | Path) -> dict:
    """config.json of a checkpoint dir (or the file itself when given a .json path)."""
    path = Path(ckpt_dir)
    return read_json(path if path.suffix == ".json" else path / CONFIG_NAME)


def text_config(config: dict) -> dict:
    """The nested text_config where there is one (the release layout), else the config itself."""
    return config.get("text_config") or config


def moe_layer_ids(tc: dict) -> list[int]:
    """MoE layer indices, by the DeepSeek/Kimi rule the model uses (first_k_dense_replace, moe_layer_freq)."""
    first = int(tc.get("first_k_dense_replace", 0))
    freq = int(tc.get("moe_layer_freq", 1))
    return [i for i in range(int(tc["num_hidden_layers"])) if i >= first and i % freq == 0]


def experts_per_layer(tc: dict) -> dict[int, int]:
    """Routed-expert count of every MoE layer: num_experts_per_layer where present, else num_experts."""
    per_layer = tc.get("num_experts_per_layer")
    layers = moe_layer_ids(tc)
    if per_layer is None:
        return {i: int(tc["num_experts"]) for i in layers}
    if len(per_layer) != int(tc["num_hidden_layers"]):
        raise CheckpointError(f"config: num_experts_per_layer has {len(per_layer)} entries, "
                              f"num_hidden_layers is {tc['num_hidden_layers']}")
    return {i: int(per_layer[i]) for i in layers}


def quantization_config(config: dict) -> dict | None:
    """quantization_config at the top level or inside text_config (public loaders accept both)."""
    return config.get("quantization_config") or text_config(config).get("quantization_config")


@dataclass
class MoeLayer:
    """The block_sparse_moe tensors of one layer that pruning touches."""

    prefix: str  # e.g. "language_model.model.layers.3.block_sparse_moe."
    experts: dict[int, dict[str, TensorInfo]]  # expert id -> suffix ("w1.weight_packed") -> tensor
    gate: TensorInfo | None = None
    bias: TensorInfo | None = None


def scan_moe(tensors: dict[str, TensorInfo]) -> dict[int, MoeLayer]:
    """Group the routed experts, router rows and router bias of every MoE layer by name."""
    layers: dict[int, MoeLayer] = {}
    for t in tensors.values():
        m = MOE_RE.match(t.name)
        if not m:
            continue
        i = int(m["layer"])
        prefix = f"{m['prefix']}{i}.block_sparse_moe."
        layer = layers.setdefault(i, MoeLayer(prefix, {}))
        if layer.prefix != prefix:
            raise CheckpointError(f"layer {i} has block_sparse_moe tensors under two prefixes: "
                                  f"{layer.prefix} and {prefix}")
        rest = m["rest"]
        e = EXPERT_RE.match(rest)
        if e:
            layer.experts.setdefault(int(e["expert"]), {})[sys.intern(e["suffix"])] = t
        elif rest.startswith("experts."):
            raise CheckpointError(f"{t.name}: fused/unknown expert tensor layout (expected experts.<id>.<w>)")
        elif rest == GATE_NAME:
            layer.gate = t
        elif rest == BIAS_NAME:
            layer.bias = t
    return layers


def sha256_ranges(ranges: list[tuple[Path, int, int]]) -> str:
    """sha256 of the concatenated byte ranges (path, start, end), streamed in chunks."""
    h = hashlib.sha256()
    fds: dict[Path, int] = {}
    try:
        for path, start, end in ranges:
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            pos = start
            while pos < end:
                chunk = os.pread(fd, min(CHUNK, end - pos), pos)
                if not chunk:
                    raise CheckpointError(f"{path}: unexpected end of file at byte {pos}")
                h.update(chunk)
                pos += len(chunk)
    finally:
        for fd in fds.values():
            os.close(fd)
    return h.hexdigest()


_copy_mode = "copy_file_range"  # falls back to sendfile, then pread/write, where unsupported


def copy_range(src_fd: int, dst_fd: int, start: int, length: int) -> None:
    """Append src bytes [start, start+length) at dst's current position, in the kernel when it can.

    copy_file_range first, then sendfile, then pread/write; all three copy the bytes unchanged.
    """
    global _copy_mode
    pos, end = start, start + length
    while pos < end:
        n = min(end - pos, 1 << 30)
        try:
            if _copy_mode == "copy_file_range":
                done = os.copy_file_range(src_fd, dst_fd, n, pos)
            elif _copy_mode == "sendfile":
                done = os.sendfile(dst_fd, src_fd, pos, n)
            else:
                done = os.write(dst_fd, os.pread(src_fd, min(n, CHUNK), pos))
        except OSError as e:
            unsupported = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF)
            if e.errno in unsupported and _copy_mode != "rw":
                _copy_mode = "sendfile" if _copy_mode == "copy_file_range" else "rw"
                continue
            raise
        if done == 0:
            raise CheckpointError(f"unexpected end of source file at byte {pos}")
        pos += done


PARTIAL_RE = re.compile(r"^\.(?P<name>.+)\.partial-(?P<pid>\d+)$")


def partial_dir(dst: Path) -> Path:
    """The temporary sibling a write to dst goes to: `.<name>.partial-<pid>`."""
    return dst.parent / f".{dst.name}.partial-{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_partials(dst: Path) -> list[Path]:
    """Remove `.<name>.partial-<pid>` siblings of dst whose writer process is gone (killed)."""
    removed = []
    if not dst.parent.is_dir():
        return removed
    for p in dst.parent.iterdir():
        m = PARTIAL_RE.match(p.name)
        if m and m["name"] == dst.name and p.is_dir() and not _pid_alive(int(m["pid"])):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Terminated(KeyboardInterrupt):
    """Raised from the SIGTERM handler so cleanup (and callers) treat it as Ctrl-C."""


@contextlib.contextmanager
def atomic_output_dir(dst: str | Path):
    """Yield a temporary sibling dir; rename it to dst only when the body completes.

    dst must not exist. On an exception, Ctrl-C or SIGTERM the temporary dir is removed; after
    a SIGKILL it stays behind under a clearly marked name and the next run for the same dst
    removes it. Files are fsynced before the rename so a complete dst is a durable one.
    """
    dst = Path(dst).absolute()
    if dst.exists():
        raise FileExistsError(f"{dst} already exists; choose a new output dir or remove it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_partials(dst)
    tmp = partial_dir(dst)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    restore = None
    if threading.current_thread() is threading.main_thread():
        def on_term(signum, frame):
            raise Terminated(signum)
        restore = signal.signal(signal.SIGTERM, on_term)
    try:
        yield tmp
        for root, _, files in os.walk(tmp):
            for f in files:
                fsync_path(Path(root) / f)
        if dst.exists():
            raise FileExistsError(f"{dst} appeared while writing; the output was left unpublished")
        os.rename(tmp, dst)
        fsync_path(dst.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if restore is not None:
            signal.signal(signal.SIGTERM, restore)


def parse_size(text: str | int) -> int:
    """'5GB' / '500MB' / '2GiB' / '123' -> bytes (decimal units as the Hub uses, binary with 'i')."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*", text.upper())
    if not m:
        raise ValueError(f"cannot parse size {text!r} (examples: 5GB, 500MB, 2GiB, 1000000)")
    base = 1024 if m[3] else 1000
    return int(float(m[1]) * base ** " KMGT".index(m[2] or " "))


def human(n: float) -> str:
    """Bytes in decimal units, for messages."""
    unit = "B"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            break
        n /= 1000
    return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
