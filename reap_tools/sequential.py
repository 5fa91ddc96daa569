"""Layer-sequential observe: REAP saliency of a checkpoint too large to load, one decoder layer at a time.

    python -m reap_tools observe --sequential --model DIR --data FILE ... --out report.json
        [--devices 0,1,...] [--max-host-gb G] [--scratch DIR] [--prefill-chunk 8192]
        [--stop-after-layer K] [--resume]      (and observe's calibration options)

How. Decoder layer i is built from the model's own `KimiK3DecoderLayer` and filled from the shards (`load_layer`,
experts kept packed; vision tensors and other layers are never read). Every calibration batch goes through it, in
chunks of `--prefill-chunk` tokens as the model prefills (a KDA/MLA cache lives only within one batch's chunks of
one layer), with the whole-model observer's hooks (`observe.SaliencyObserver`) on its LatentMoE block. What the
next layer needs, each batch's Block Attention Residual state (the block bank and the partial sum), is carried over;
the layer is freed and layer i+1 loaded. The statistics equal a whole-model observe of the same batches bit for bit
(the same ops on the same tensors, added up in the same float64 order); a sequence longer than the chunk equals the
whole model's chunked prefill of it (a whole-model observe runs it in one piece: equal to rounding).

Carried state (`CarriedState`). After each layer every batch's new partial sum (and, at a block boundary, its new
bank row) is written to the scratch folder (a temporary file, fsync, rename), so a run can resume there; the state
is also kept in host memory while the total stays within `--max-host-gb`, and what does not fit is read back from
the folder when its batch comes up. The scratch folder holds every bank row plus two partial sums a token (about
145 KB a token at the parent's width in bf16) and is deleted when the run completes.

Resume. The report at --out is rewritten after every layer and names the decoder layers done
(`sequential.layers_done`; its "layers" hold the MoE layers done). `--resume` checks model and calibration as
observe does and continues after the last layer done, from the scratch folder: the same report as one run.

Several devices. `--devices 0,1,...` starts one process per device (or, under torchrun, one per rank); batch b goes
to rank b mod world. Ranks add their float64 statistics after each layer (gloo: sums, and max for max_norm) and
rank 0 writes the report. `--max-host-gb` is for the whole host, shared evenly by its processes.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from . import cpu
from .observe import (REPORT_FORMAT, ObserveError, SaliencyObserver, check_resumable, describe_model, make_batches,
                      path_revision, prepare_calibration, save_report)
from .release_layout import is_vision_tensor

EMBED_KEY = "language_model.model.embed_tokens.weight"
LAYER_PREFIX = "language_model.model.layers.{}."
GB = 1e9


# ------------------------------------------------------------------------------------------------
# Reading one layer from the shards
# ------------------------------------------------------------------------------------------------


class Checkpoint:
    """A checkpoint folder and its shard headers (`kimi_k3_loading.read_safetensors_headers`: tensor name -> Entry
    of file, dtype, shape, byte range); tensors are read with the project's loader (`kimi_k3_loading.read_tensors`:
    per shard in file order, adjacent ones coalesced, straight into host tensors or through pinned buffers)."""

    def __init__(self, directory):
        from kimi_k3_loading import read_safetensors_headers

        self.directory = str(directory)
        try:
            self.headers = read_safetensors_headers(self.directory)
        except (OSError, ValueError) as e:
            raise ObserveError(str(e)) from None

    def read(self, name: str, device, dtype) -> torch.Tensor:
        """Tensor `name` on `device` in `dtype`."""
        from kimi_k3_loading import Piece, read_tensors

        entry = self.headers.get(name)
        if entry is None:
            raise ObserveError(f"{self.directory}: the checkpoint has no {name}")
        out = torch.empty(entry.shape, dtype=dtype, device=device)
        read_tensors(self.directory, self.headers, [Piece(name, None, None, out)], desc=name)
        return out


def load_layer(layer: torch.nn.Module, checkpoint: Checkpoint, index: int) -> int:
    """Fill decoder layer `layer` (a `KimiK3DecoderLayer`, on any device) with layer `index` of the checkpoint, strictly:
    its tensors under the release's names (a routed expert's packs one tensor per expert) must be exactly the ones the
    module holds, in shape and dtype, or one error names the tensors and files at fault. Then they are read with the
    project's loader straight into the module's parameters (the packs into their rows of its expert stacks).
    Returns the bytes read."""
    from kimi_k3_loading import accepted_dtypes, pieces_for, read_tensors, release_shapes

    prefix = LAYER_PREFIX.format(index)
    expected = {prefix + name: shape for name, shape in release_shapes(layer).items()}
    found = {name: entry for name, entry in checkpoint.headers.items() if name.startswith(prefix)}
    problems = [f"missing {name}" for name in expected if name not in found]
    for name, entry in found.items():
        if name not in expected:
            problems.append(f"unexpected {name} (in {entry.file})")
        elif tuple(entry.shape) != tuple(expected[name]):
            problems.append(f"mismatched: {name} in {entry.file} is {list(entry.shape)}, the model's "
                            f"{list(expected[name])}")
        elif entry.dtype not in accepted_dtypes(name):
            problems.append(f"wrong dtype: {name} in {entry.file} is {entry.dtype}, expected "
                            f"{' or '.join(accepted_dtypes(name))}")
    if problems:
        detail = "; ".join(problems[:8]) + (f"; ... ({len(problems) - 8} more)" if len(problems) > 8 else "")
        raise ObserveError(f"{checkpoint.directory}: layer {index} does not match the model ({detail})")
    sources = {name: (prefix + name, ()) for name, _ in layer.named_parameters()}
    with torch.no_grad():
        return read_tensors(checkpoint.directory, checkpoint.headers, pieces_for(layer, sources),
                            desc=f"layer {index}")


def build_layer(config, index: int, dtype: torch.dtype, device, dispatch) -> torch.nn.Module:
    """The model's decoder layer `index`, allocated on `device` (not initialised: `load_layer` fills it). Float
    parameters in `dtype` except the ones the model keeps in fp32 (its constructors make those fp32)."""
    from modeling_kimi_k3 import KimiK3DecoderLayer

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            layer = KimiK3DecoderLayer(config.text_config, index, config.experts_packed, dispatch)
    finally:
        torch.set_default_dtype(previous)
    return layer.to_empty(device=device).eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------------
# The carried state
# ------------------------------------------------------------------------------------------------


def _state_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class CarriedState:
    """Each batch's Block Attention Residual state (bank rows, partial sum) after the last finished layer.

    Every state is written to `folder` as its layer finishes (bank rows once, when made; the partial sum after every
    layer), so that a run resumes from there; a batch's state also stays in host memory while the states kept there
    total at most `budget` bytes (None: no limit). `peak` is the most bytes ever kept in memory."""

    def __init__(self, folder: Path, budget: int | None):
        self.folder, self.budget = Path(folder), budget
        self.folder.mkdir(parents=True, exist_ok=True)
        self.memory: dict[int, tuple[tuple, torch.Tensor]] = {}
        self.rows_on_disk: dict[int, int] = {}
        self.held = self.peak = 0

    def _path(self, batch: int, what: str) -> Path:
        return self.folder / f"b{batch:07d}.{what}.safetensors"

    def _write(self, path: Path, tensor: torch.Tensor) -> None:
        from safetensors.torch import save_file

        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            save_file({"state": tensor.contiguous()}, str(tmp))
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _read(self, path: Path) -> torch.Tensor:
        from safetensors.torch import load_file

        if not path.exists():
            raise ObserveError(f"{path}: missing from the scratch folder (its layer's state cannot be resumed)")
        return load_file(str(path))["state"]

    def put(self, batch: int, layer: int, bank: tuple, partial: torch.Tensor) -> None:
        """Record batch `batch`'s state after layer `layer` (CPU tensors)."""
        for row in range(self.rows_on_disk.get(batch, 0), len(bank)):
            self._write(self._path(batch, f"bank{row:02d}"), bank[row])
        self.rows_on_disk[batch] = len(bank)
        self._write(self._path(batch, f"after{layer:03d}"), partial)
        old = self.memory.pop(batch, None)
        if old is not None:
            self.held -= _state_bytes((*old[0], old[1]))
        size = _state_bytes((*bank, partial))
        if self.budget is None or self.held + size <= self.budget:
            self.memory[batch] = (tuple(bank), partial)
            self.held += size
            self.peak = max(self.peak, self.held)

    def get(self, batch: int, layer: int, block_size: int) -> tuple[tuple, torch.Tensor]:
        """Batch `batch`'s state after layer `layer`: from memory, else from the folder (its bank has one row per
        block opened up to that layer)."""
        if batch in self.memory:
            return self.memory[batch]
        rows = layer // block_size + 1
        self.rows_on_disk[batch] = rows
        bank = tuple(self._read(self._path(batch, f"bank{row:02d}")) for row in range(rows))
        return bank, self._read(self._path(batch, f"after{layer:03d}"))

    def forget(self, batches, layer: int) -> None:
        """Delete the partial sums after layer `layer` of `batches` (superseded by the next layer's)."""
        for batch in batches:
            self._path(batch, f"after{layer:03d}").unlink(missing_ok=True)

    def sync(self) -> None:
        """fsync the folder, so the renames of this layer's files are durable."""
        fd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ------------------------------------------------------------------------------------------------
# One layer over one batch
# ------------------------------------------------------------------------------------------------


def _unpadded(mask, length):
    """The model's rule (`KimiK3TextModel.run_layers`): a mask with no padding is dropped, so the layers take
    their unmasked paths."""
    if mask is not None and (mask.device.type == "cpu" or length > 1) and bool(mask.all()):
        return None
    return mask


def run_batch(layer, bank: tuple, partial: torch.Tensor, mask, chunk: int | None, observer=None):
    """One batch's state through decoder layer `layer`, as the model's forward runs it: in one piece, or through a
    cache `chunk` tokens at a time where the batch is longer (the model's chunked prefill). `mask` [B, T] (0 =
    padding) or None. The observer (if any) sees each chunk's tokens; the caller commits. Returns (bank, partial)."""
    from modeling_kimi_k3 import KimiK3Cache

    batch, length = partial.shape[:2]
    device = partial.device
    if chunk is None or length <= chunk:
        if observer is not None:
            observer.set_mask(mask)
        positions = torch.arange(length, device=device)
        return layer(bank, partial, _unpadded(mask, length), None, positions)
    cache = KimiK3Cache(layer.self_attn.dispatch.config)
    pieces, new_rows = [], []
    for start in range(0, length, chunk):
        end = min(length, start + chunk)
        seen = None if mask is None else mask[:, :end]
        seen, positions = cache.prepare(seen, batch, end - start, device)
        if observer is not None:
            observer.set_mask(None if mask is None else mask[:, start:end])
        out_bank, out = layer(tuple(row[:, start:end] for row in bank), partial[:, start:end],
                              _unpadded(seen, end - start), cache, positions)
        cache.advance(end - start)
        pieces.append(out)
        new_rows.append(out_bank[len(bank):])
    rows = tuple(torch.cat(parts, dim=1) for parts in zip(*new_rows))
    return tuple(bank) + rows, torch.cat(pieces, dim=1)


# ------------------------------------------------------------------------------------------------
# The engine
# ------------------------------------------------------------------------------------------------


@dataclass
class Job:
    """Everything a rank needs (picklable, for spawned processes)."""

    checkpoint: str
    batches: list  # [{"input_ids": [B, T], "attention_mask": [B, T]}] (numpy arrays or tensors)
    base: dict  # the report without progress and layers: format, model, calibration
    out: str
    scratch: str
    dtype: str  # torch dtype name
    max_host_bytes: int | None
    chunk: int | None
    stop_after_layer: int | None
    previous: dict | None
    progress: bool = True
    threads: int = 1  # CPU threads of each CPU rank: the launching process's, so that its numerics are one process's


def run_layer(layer, index: int, batches: list, mine: list[int], store: CarriedState, chunk: int | None,
              block_size: int, embed: torch.Tensor | None = None) -> torch.Tensor | None:
    """Batches `mine` of `batches` through decoder layer `index` (built and loaded, on its device): each one's state
    after layer index-1 from `store` (at layer 0, the embeddings `embed` of its ids), its new state put back. Returns
    the MoE statistics of these batches, float64 [4, E] in FIELDS order (None for a dense layer)."""
    device = next(layer.parameters()).device
    moe = getattr(layer, "block_sparse_moe", None)
    observer = SaliencyObserver(None, blocks={index: moe}) if moe is not None else None
    if observer is not None:
        observer.attach()
    try:
        with torch.inference_mode():
            for b in mine:
                ids, mask = (torch.as_tensor(batches[b][k]) for k in ("input_ids", "attention_mask"))
                host_bank, host_partial = ((), None) if index == 0 else store.get(b, index - 1, block_size)
                bank = tuple(r.to(device) for r in host_bank)
                partial = F.embedding(ids.to(device), embed) if index == 0 else host_partial.to(device)
                try:
                    out_bank, out = run_batch(layer, bank, partial, mask.to(device), chunk, observer)
                except BaseException:
                    if observer is not None:
                        observer.discard()
                    raise
                if observer is not None:
                    observer.commit()
                # a new bank row is this layer's input partial sum, which the host holds already (but at layer 0)
                new_rows = tuple(host_partial if (host_partial is not None and r is partial) else r.cpu()
                                 for r in out_bank[len(bank):])
                store.put(b, index, tuple(host_bank) + new_rows, out.cpu())
    finally:
        if observer is not None:
            observer.detach()
    return None if observer is None else observer.totals()[index]


def layer_plan(config) -> list[int]:
    """The decoder layers to run: every one up to the last MoE layer (later ones change no statistic)."""
    text = config.text_config
    moe = [i for i in range(text.num_hidden_layers) if text.experts_in_layer(i)]
    if not moe:
        raise ObserveError("the checkpoint has no MoE layers to observe")
    return list(range(moe[-1] + 1))


def _load_config(checkpoint):
    from configuration_kimi_k3 import KimiK3Config

    try:
        return KimiK3Config.from_pretrained(checkpoint)
    except (OSError, ValueError) as e:
        raise ObserveError(f"{checkpoint}: cannot read the config: {e}") from None


class _Group:
    """The ranks' collective steps (no-ops for one process): float64 statistics added, barriers."""

    def __init__(self, world):
        self.world = world

    def reduce(self, stats: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return stats
        import torch.distributed as dist

        sums, maxima = stats[:3].contiguous(), stats[3].contiguous()
        dist.all_reduce(sums)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        return torch.cat([sums, maxima[None]])

    def barrier(self):
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()


def _hms(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(max(seconds, 0))))


def run_rank(job: Job, rank: int, world: int, device, local_world: int = 1) -> dict | None:
    """Run every layer still to do over this rank's batches; rank 0 returns the final report."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # kernels (Triton, fla) launch on the current device
    config = _load_config(job.checkpoint)
    text = config.text_config
    dtype = getattr(torch, job.dtype)
    checkpoint = Checkpoint(job.checkpoint)
    group = _Group(world)
    plan = layer_plan(config)
    mine = list(range(rank, len(job.batches), world))
    done = list(job.previous["sequential"]["layers_done"]) if job.previous else []
    layers = dict(job.previous["layers"]) if job.previous else {}
    if done != plan[:len(done)]:
        raise ObserveError(f"cannot resume: the report's layers done {done} are not a first run of {plan}")
    budget = None if job.max_host_bytes is None else job.max_host_bytes // local_world
    store = CarriedState(Path(job.scratch), budget)
    from modeling_kimi_k3 import new_dispatch

    dispatch = new_dispatch(config)
    dispatch.refresh()
    tokens = sum(int(b["attention_mask"].sum()) for b in job.batches)
    started, layer_seconds = time.time(), []
    report = None
    for i in plan[len(done):]:
        t0 = time.time()
        layer = build_layer(config, i, dtype, device, dispatch)
        load_layer(layer, checkpoint, i)
        load_s = time.time() - t0
        embed = checkpoint.read(EMBED_KEY, device, dtype) if i == 0 else None
        stats = run_layer(layer, i, job.batches, mine, store, job.chunk, text.attn_res_block_size, embed)
        is_moe = stats is not None
        del layer, embed
        store.sync()
        if is_moe:
            layers[str(i)] = SaliencyObserver.layers_report_of({i: group.reduce(stats)})[str(i)]
        done.append(i)
        group.barrier()  # every rank's state after layer i is durable before the report says so
        layer_seconds.append(time.time() - t0)
        complete = len(done) == len(plan)
        stopped = job.stop_after_layer is not None and i >= job.stop_after_layer
        if rank == 0:
            report = _report(job, done, plan, layers, complete, world, store.peak)
            save_report(report, job.out)
            if job.progress:
                mean = sum(layer_seconds) / len(layer_seconds)
                print(f"observe: layer {i + 1} of {len(plan)} ({text.layer_types[i]}"
                      f"{', MoE' if is_moe else ', dense'}): {tokens / layer_seconds[-1]:.0f} tokens/s "
                      f"(load {load_s:.1f}s), elapsed {_hms(time.time() - started)}, "
                      f"ETA {_hms(mean * (len(plan) - len(done)))}", file=sys.stderr, flush=True)
        group.barrier()
        if i:
            store.forget(mine, i - 1)
        if stopped and not complete:
            break
    if len(done) == len(plan):
        group.barrier()
        if rank == 0:
            shutil.rmtree(job.scratch, ignore_errors=True)
    return report


def _report(job, done, plan, layers, complete, world, peak) -> dict:
    total = sum(b["input_ids"].shape[0] for b in job.batches)
    moe_done = {str(i): layers[str(i)] for i in done if str(i) in layers}
    return {**job.base,
            "progress": {"sequences_done": total, "total_sequences": total, "complete": complete},
            "sequential": {"layers_done": list(done), "num_layers": len(plan), "world_size": world,
                           "prefill_chunk": job.chunk, "scratch": str(job.scratch),
                           "max_host_bytes": job.max_host_bytes, "peak_state_bytes_in_memory_rank0": peak},
            "layers": moe_done}


def _spawned(rank: int, job: Job, devices: list[str], init: str) -> None:
    import torch.distributed as dist

    if torch.device(devices[rank]).type == "cpu":
        torch.set_num_threads(job.threads)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=len(devices))
    try:
        run_rank(job, rank, len(devices), devices[rank], local_world=len(devices))
    finally:
        dist.destroy_process_group()


def observe_sequential(job: Job, devices: list[str]) -> dict:
    """Run `job` on `devices` (one process each, several spawned here), or on this torchrun rank's device."""
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if env_world > 1:  # under torchrun: this process is one rank
        import torch.distributed as dist

        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", env_world))
        device = devices[local] if len(devices) > 1 else (f"cuda:{local}" if torch.cuda.is_available() else "cpu")
        dist.init_process_group("gloo")
        try:
            run_rank(job, rank, env_world, device, local_world)
        finally:
            dist.destroy_process_group()
        return json.loads(Path(job.out).read_text())
    if len(devices) == 1:
        return run_rank(job, 0, 1, devices[0])
    import torch.multiprocessing as mp

    # CUDA needs fresh processes; CPU ranks are forked, which spares each one importing torch again
    cpu_only = all(torch.device(d).type == "cpu" for d in devices) and not torch.cuda.is_initialized()
    rendezvous = tempfile.mkdtemp(prefix=".observe-pg-", dir=Path(job.out).absolute().parent)
    try:
        mp.start_processes(_spawned, args=(job, devices, f"file://{rendezvous}/store"), nprocs=len(devices),
                           start_method="fork" if cpu_only else "spawn")
    except mp.ProcessRaisedException as e:
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        raise ObserveError(f"a worker failed: {lines[-1] if lines else e}") from None
    finally:
        shutil.rmtree(rendezvous, ignore_errors=True)
    return json.loads(Path(job.out).read_text())


# ------------------------------------------------------------------------------------------------
# CLI (reached through `observe --sequential`)
# ------------------------------------------------------------------------------------------------


def parse_devices(text: str | None) -> list[str]:
    """"0,1" -> ["cuda:0", "cuda:1"]; "cpu,cpu" -> two CPU processes; None -> cuda:0 where there is one, else cpu."""
    if not text:
        return ["cuda:0" if torch.cuda.is_available() else "cpu"]
    devices = []
    for part in text.split(","):
        part = part.strip()
        name = f"cuda:{part}" if part.isdigit() else part
        try:
            torch.device(name)
        except RuntimeError:
            raise ObserveError(f"--devices: {part!r} is not a device (use indices like 0,1 or names like cpu)")
        devices.append(name)
    return devices


def checkpoint_dtype(checkpoint: Checkpoint):
    """The checkpoint's own float dtype: its embedding's."""
    entry = checkpoint.headers.get(EMBED_KEY)
    if entry is None:
        raise ObserveError(f"{checkpoint.directory}: the checkpoint has no {EMBED_KEY}")
    from kimi_k3_loading import DTYPES

    return DTYPES[entry.dtype]


def observe_cli(args, previous: dict | None) -> dict:
    """`observe --sequential`: check the checkpoint, prepare the calibration batches, run, return the report."""
    from kimi_k3_loading import check_structure, checkpoint_directory

    directory = checkpoint_directory(args.model, {"revision": args.revision})
    config = _load_config(directory)
    checkpoint = Checkpoint(directory)
    try:
        check_structure(directory, config, checkpoint.headers)
    except (OSError, ValueError) as e:
        raise ObserveError(str(e)) from None
    vision = [name for name in checkpoint.headers if is_vision_tensor(name)]
    if vision:
        print(f"observe: skipping the checkpoint's {len(vision)} vision-tower tensors (a text-only observe)",
              file=sys.stderr)
    devices = parse_devices(args.devices)
    where = "cpu" if all(torch.device(d).type == "cpu" for d in devices) else "cuda"
    dtype = cpu.choose("observe", args.dtype, where, args.threads)
    dtype = checkpoint_dtype(checkpoint) if dtype == "auto" else dtype
    sequences, calibration, pad_id = prepare_calibration(args, config)
    calibration["device_map"] = None
    model = describe_model(config, args.model, path_revision(directory), dtype)
    scratch = args.scratch or args.out.with_name(args.out.name + ".scratch")
    if previous is not None:
        check_resumable(previous, model, calibration)
        was = {"batch_size": previous.get("calibration", {}).get("batch_size"),
               "prefill_chunk": previous["sequential"].get("prefill_chunk")}
        for key, now in (("batch_size", args.batch_size), ("prefill_chunk", args.prefill_chunk)):
            if was[key] != now:
                raise ObserveError(f"cannot resume: {key} was {was[key]!r}, now {now!r} (the carried state is kept "
                                   f"per batch, and the report must equal one run's)")
        done = previous["sequential"].get("layers_done") or []
        if done and not scratch.is_dir():
            raise ObserveError(f"cannot resume: the scratch folder {scratch} with the state after layer {done[-1]} "
                               f"is missing (pass --scratch where it is)")
    elif scratch.exists():
        raise ObserveError(f"{scratch}: the scratch folder exists (from an interrupted run?); pass --resume to "
                           f"continue it or remove it")
    # numpy, so that spawned ranks get them by value (torch would share one file descriptor per tensor)
    batches = [{k: v.numpy() for k, v in b.items()}
               for b in make_batches(sequences, args.batch_size, pad_id, args.padding_side)]
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    cal = {**calibration, "num_sequences": len(sequences), "num_tokens": tokens,
           "num_padding_tokens": sum(b["attention_mask"].size for b in batches) - tokens}
    job = Job(checkpoint=str(directory), batches=batches, base={"format": REPORT_FORMAT, "model": model,
                                                                 "calibration": cal},
              out=str(args.out), scratch=str(scratch), dtype=str(dtype).removeprefix("torch."),
              max_host_bytes=None if args.max_host_gb is None else int(args.max_host_gb * GB),
              chunk=args.prefill_chunk, stop_after_layer=args.stop_after_layer, previous=previous,
              progress=not args.no_progress, threads=torch.get_num_threads())
    return observe_sequential(job, devices)
