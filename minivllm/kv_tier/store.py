"""A second tier for the prefix cache: the K/V of full blocks that the pool evicts, kept in RAM and/or
in a directory that outlives the process (vLLM's KV offloading, llama.cpp's --cache-ram).

Flow. The block manager hands a cached block to `KVTier.store` just before the pool reuses it, and asks
`KVTier.fetch` for the blocks that follow a waiting prompt's pool hits; the scheduler does that before
the step that would prefill them, so the prompt starts with those blocks computed. A block is stored
as the pool holds it, byte for byte (every layer's K, V and, for quantized formats, their scales), so a
prefix loaded back gives the same K/V bits as recomputing it, and the same greedy output.

Cost. The directory's reads and writes run on one background thread, so that a step never waits for
the disk: a prompt whose next blocks are on disk only waits (the others go ahead) until they have been
read and checked, and the scheduler then copies them in. What the step does pay is that copy (and, for
an evicted block, the copy out): a block's bytes moved once at memory speed (~0.1 ms for a
SmolLM2-135M float32 block of 16 tokens), while recomputing it runs every weight over its 16 tokens
(~16 x 2 x parameters FLOP, tens of ms on a CPU): hundreds to thousands of times more. The copies are
accounted in `kv_offload_load_seconds` (and in the engine's "schedule" step time), the background reads
in `kv_offload_read_seconds`.

Keys. A block is named by the prefix cache's own hash, a sha256 chain over the token ids of it and every
block before it (block_manager.block_hash), the same in every process. A directory entry is named by
that and by the digest of `KVIdentity`, everything that decides the bits; it carries the identity, its
tokens and a crc32 of its bytes, all checked before use: a corrupt, truncated or foreign entry is
deleted with a log line, never used.

Faults (disk tier). One thread does every file operation in the order asked, so a block read after
it was written finds it. Entries are written aside and renamed into place, so a reader never sees half a
file. A write that fails (disk full, a file size limit, a vanished directory) is logged and skipped:
the block is only not kept. A file deleted under the engine is a miss. Several engines may share a
directory: each keeps its own index (what it found at start and what it wrote), opens an entry it
does not know (another engine's) when looking a block up, and bounds the directory by evicting the
least recently used files it knows.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import struct
import tempfile
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from minivllm.config import EngineConfig
from minivllm.model.kernels import library_key
from minivllm.model.kv_cache import KVCache, kv_format
from minivllm.model.loader import checkpoint_digest
from minivllm.model.runner import ModelRunner

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when what an entry holds, or how, changes
MAGIC = b"MVLLMKV\0"
GIB = 2**30
STALE_WRITE_S = 3600  # a file still being written after an hour was left by a process that died


@dataclass(frozen=True)
class KVIdentity:
    """Everything that decides a block's K/V bits besides its tokens."""
    checkpoint: str  # loader.checkpoint_digest
    dtype: str
    kv_format: str
    block_size: int
    kernels: str  # the native library's build key, or "torch" where the torch twins compute
    quantization: str
    tensor_parallel_size: int
    device: str
    version: int = FORMAT_VERSION

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


@dataclass
class TierStats:
    """Counters, named as LLMEngine.get_stats() reports them. Hits are prompt tokens; the prefix cache's
    `prefix_cache_hits` counts them too (a loaded block is a cached block), these say which tier served."""
    kv_offload_ram_hits: int = 0
    kv_offload_disk_hits: int = 0
    kv_offload_stored_bytes: int = 0  # copied out of the pool
    kv_offload_loaded_bytes: int = 0  # copied back into it
    kv_offload_load_seconds: float = 0.0  # in the step: waiting for and copying blocks back


class PoolBlocks:
    """One pool block, all layers, as one flat byte tensor on the CPU, and back."""

    def __init__(self, kv_caches: list[KVCache]) -> None:
        self.tensors = [t for cache in kv_caches for t in cache.tensors()]
        self.nbytes = sum(t[0].numel() * t.element_size() for t in self.tensors)
        self.num_blocks = self.tensors[0].shape[0]

    def _views(self, block_id: int) -> list[torch.Tensor]:
        return [t[block_id].view(-1).view(torch.uint8) for t in self.tensors]  # views: the pool is contiguous

    def read(self, block_id: int) -> torch.Tensor:
        return torch.cat(self._views(block_id)).cpu()

    def write(self, block_id: int, data: torch.Tensor) -> None:
        offset = 0
        for view in self._views(block_id):
            view.copy_(data[offset:offset + view.numel()])
            offset += view.numel()


class RamTier:
    """Blocks in host memory, at most `capacity` bytes, least recently used evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.entries: OrderedDict[bytes, tuple[tuple[int, ...], torch.Tensor]] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def get(self, key: bytes, tokens: tuple[int, ...]) -> torch.Tensor | None:
        entry = self.entries.get(key)
        if entry is None or entry[0] != tokens:
            return None
        self.entries.move_to_end(key)
        return entry[1]

    def put(self, key: bytes, tokens: tuple[int, ...], data: torch.Tensor) -> None:
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        if data.numel() > self.capacity:
            return
        while self.used + data.numel() > self.capacity:
            _, (_, old) = self.entries.popitem(last=False)
            self.used -= old.numel()
        self.entries[key] = (tokens, data)
        self.used += data.numel()


class DiskTier:
    """Blocks as files in a directory, at most `capacity` bytes of them, least recently used (by
    modification time, which a hit refreshes) deleted first.

    An entry: MAGIC, a little-endian u32 header length, a JSON header {"identity": KVIdentity.digest,
    "tokens": [...], "nbytes": n, "crc32": of the data}, then the block's n bytes. Its name: the first
    16 hex digits of the identity digest, '-', the block hash in hex, '.kv'."""

    def __init__(self, directory: Path, capacity: int, identity: KVIdentity, block_bytes: int) -> None:
        self.directory = directory
        self.capacity = capacity
        self.identity = identity.digest
        self.block_bytes = block_bytes
        self.used = 0
        self.dropped = 0  # entries refused (corrupt, truncated, foreign) or deleted under the engine
        self.write_errors = 0
        self.read_seconds = 0.0
        self.index: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, oldest first; every model's
        self.writing: set[str] = set()  # entries handed to the I/O thread, not yet written
        self.reads: OrderedDict[bytes, concurrent.futures.Future] = OrderedDict()  # asked for, not yet taken
        self.max_read_bytes = 0  # what `reads` may hold: KVTier sets it to the pool's size
        self._lock = threading.Lock()  # the index, `used` and the counters: both threads change them
        self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-tier-io")
        self._warned_write = False
        self._scan()

    def _scan(self) -> None:
        """Index the entries already there (every model's: the size bound is the directory's) and
        remove files that a dead process left half written."""
        self.directory.mkdir(parents=True, exist_ok=True)
        found = []
        for path in self.directory.iterdir():
            with contextlib.suppress(OSError):  # gone meanwhile: another engine evicted it
                st = path.stat()
                if path.suffix == ".kv":
                    found.append((st.st_mtime_ns, path.name, st.st_size))
                elif path.name.startswith(".writing-") and time.time() - st.st_mtime > STALE_WRITE_S:
                    path.unlink()
        for _, name, size in sorted(found):
            self.index[name] = size
            self.used += size
        ours = sum(name.startswith(self.identity[:16]) for name in self.index)
        logger.info("KV tier: %d entries for this model in %s (%d in all, %.2f GiB)", ours, self.directory,
                    len(self.index), self.used / GIB)
        self._evict(0)

    def _name(self, key: bytes) -> str:
        return f"{self.identity[:16]}-{key.hex()}.kv"

    def has(self, key: bytes) -> bool:
        name = self._name(key)
        with self._lock:
            if name in self.index or name in self.writing:
                return True
        try:  # written by another engine on this directory since we started?
            size = (self.directory / name).stat().st_size
        except OSError:
            return False
        with self._lock:  # the I/O thread changes the index too
            self._add(name, size)
        return True

    def prefetch(self, key: bytes, tokens: tuple[int, ...]) -> concurrent.futures.Future:
        """The entry's read on the I/O thread (get's answer), started by the first call."""
        if key not in self.reads:
            self.reads[key] = self._io.submit(self._timed_get, key, tokens)
            while len(self.reads) * self.block_bytes > self.max_read_bytes > 0:  # never taken (aborted)
                oldest = next(iter(self.reads))
                if not self.reads[oldest].done() or oldest == key:
                    break
                del self.reads[oldest]
        return self.reads[key]

    def take(self, key: bytes, tokens: tuple[int, ...]) -> torch.Tensor | None:
        """The entry's bytes, from its read ahead if one was started (waiting for it), else read now."""
        future = self.reads.pop(key, None) or self._io.submit(self._timed_get, key, tokens)
        return future.result()

    def pending_reads(self) -> list[concurrent.futures.Future]:
        return [f for f in self.reads.values() if not f.done()]

    def _timed_get(self, key: bytes, tokens: tuple[int, ...]) -> torch.Tensor | None:
        start = time.perf_counter()
        try:
            return self.get(key, tokens)
        finally:
            with self._lock:
                self.read_seconds += time.perf_counter() - start

    def get(self, key: bytes, tokens: tuple[int, ...]) -> torch.Tensor | None:
        """The entry's bytes if it exists and is intact and ours for these tokens; else None, and an
        entry found unusable is deleted. (Synchronous: the engine reads through prefetch and take.)"""
        name = self._name(key)
        path = self.directory / name
        try:
            with open(path, "rb") as f:
                buf = bytearray(os.fstat(f.fileno()).st_size)
                num_read = f.readinto(buf)
        except FileNotFoundError:
            with self._lock:
                if name in self.index:  # another engine on this directory evicted it, or a person deleted it
                    logger.info("KV tier: %s was deleted under the engine; computing its block", path)
                    self._forget(name)
                    self.dropped += 1
            return None
        except OSError as e:
            logger.warning("KV tier: cannot read %s (%s); computing its block", path, e)
            return None
        data, problem = self._parse(buf, num_read, tokens)
        if problem:
            logger.warning("KV tier: dropping %s: %s", path, problem)
            with self._lock:
                self._forget(name)
                self.dropped += 1
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        with self._lock:
            self._add(name, len(buf))
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used, also for the next process's index
        return data

    def _parse(self, buf: bytearray, num_read: int, tokens: tuple[int, ...]) -> tuple[torch.Tensor | None, str]:
        """(the data, "") or (None, what is wrong with the entry)."""
        if num_read != len(buf) or len(buf) < len(MAGIC) + 4 or buf[:len(MAGIC)] != MAGIC:
            return None, "not an entry, or cut short"
        (length,) = struct.unpack_from("<I", buf, len(MAGIC))
        start = len(MAGIC) + 4 + length
        try:
            header = json.loads(buf[len(MAGIC) + 4:start])
            identity, stored_tokens = header["identity"], header["tokens"]
            nbytes, crc = header["nbytes"], header["crc32"]
        except (ValueError, KeyError, TypeError):
            return None, "unreadable header"
        if identity != self.identity:
            return None, "written for another model, dtype, format or build"
        if tuple(stored_tokens) != tokens:
            return None, "holds other tokens"
        if nbytes != self.block_bytes:
            return None, f"a block of {nbytes} bytes, not {self.block_bytes}"
        if len(buf) != start + nbytes:
            return None, f"{len(buf) - start} bytes of data, {nbytes} expected (truncated)"
        data = torch.frombuffer(buf, dtype=torch.uint8, offset=start, count=nbytes)
        if zlib.crc32(data.numpy()) != crc:
            return None, "checksum mismatch (corrupt)"
        return data, ""

    def put(self, key: bytes, tokens: tuple[int, ...], data: torch.Tensor) -> None:
        """Write an entry on the I/O thread (`data` must not change meanwhile: a copy out of the pool)."""
        name = self._name(key)
        with self._lock:
            self.writing.add(name)
        self._io.submit(self._write, name, tokens, data)

    def _write(self, name: str, tokens: tuple[int, ...], data: torch.Tensor) -> None:
        """Write an entry aside and rename it into place; a failed write is counted and logged."""
        array = data.numpy()
        header = json.dumps({"identity": self.identity, "tokens": list(tokens), "nbytes": len(array),
                             "crc32": zlib.crc32(array)}).encode()
        size = len(MAGIC) + 4 + len(header) + len(array)
        written = False
        try:
            if size <= self.capacity:
                self._evict(size)
                with tempfile.NamedTemporaryFile(dir=self.directory, prefix=".writing-", delete=False) as f:
                    try:
                        f.write(MAGIC + struct.pack("<I", len(header)) + header)
                        f.write(array)
                        f.flush()
                        os.replace(f.name, self.directory / name)
                    except BaseException:
                        os.unlink(f.name)
                        raise
                written = True
        except OSError as e:  # ENOSPC, EFBIG (RLIMIT_FSIZE), EROFS, the directory removed ...
            log = logger.debug if self._warned_write else logger.warning
            log("KV tier: cannot write to %s (%s); the block is not kept (further failures logged at debug)",
                self.directory, e)
            self._warned_write = True
        with self._lock:
            self.writing.discard(name)
            if written:
                self._add(name, size)
            else:
                self.write_errors += 1

    def flush(self) -> None:
        """Wait for the writes asked for so far."""
        self._io.submit(lambda: None).result()

    def _add(self, name: str, size: int) -> None:
        self.used += size - self.index.pop(name, 0)
        self.index[name] = size

    def _forget(self, name: str) -> None:
        self.used -= self.index.pop(name, 0)

    def _evict(self, room: int) -> None:
        """Delete the least recently used files until `room` more bytes fit."""
        while True:
            with self._lock:
                if not self.index or self.used + room <= self.capacity:
                    return
                name, size = self.index.popitem(last=False)
                self.used -= size
            with contextlib.suppress(OSError):
                (self.directory / name).unlink()


class KVTier:
    """The tiers behind the pool: RAM first, then the directory. The block manager stores what the
    pool evicts (into every tier: the directory also serves the next process) and fetches blocks back."""

    def __init__(self, pool: PoolBlocks, ram: RamTier | None, disk: DiskTier | None) -> None:
        self.pool, self.ram, self.disk = pool, ram, disk
        self.stats = TierStats()

    def store(self, key: bytes, tokens: tuple[int, ...], block_id: int) -> None:
        """Keep pool block `block_id` (about to be overwritten) under its hash `key`."""
        in_ram = self.ram is None or key in self.ram
        on_disk = self.disk is None or self.disk.has(key)
        if in_ram and on_disk:
            if self.ram is not None:
                self.ram.get(key, tokens)  # recently used again
            return
        data = self.pool.read(block_id)
        self.stats.kv_offload_stored_bytes += data.numel()
        if not in_ram:
            self.ram.put(key, tokens, data)
        if not on_disk:
            self.disk.put(key, tokens, data)

    def ready(self, key: bytes, tokens: tuple[int, ...]) -> bool | None:
        """Whether the block named `key` can be fetched now: True (in RAM, or read from the directory),
        None (being read: asking starts the read), False (no tier has it intact)."""
        if self.ram is not None and self.ram.get(key, tokens) is not None:
            return True
        if self.disk is None or not self.disk.has(key):
            return False
        read = self.disk.prefetch(key, tokens)
        return (read.result() is not None) if read.done() else None

    def pending_reads(self) -> list[concurrent.futures.Future]:
        return self.disk.pending_reads() if self.disk is not None else []

    def fetch(self, key: bytes, tokens: tuple[int, ...]) -> torch.Tensor | None:
        """The verified bytes of the block named `key` holding `tokens`, from the nearest tier; None
        if no tier has it intact."""
        start = time.perf_counter()
        data = self.ram.get(key, tokens) if self.ram is not None else None
        if data is not None:
            self.stats.kv_offload_ram_hits += len(tokens)
        elif self.disk is not None:
            data = self.disk.take(key, tokens)
            if data is not None:
                self.stats.kv_offload_disk_hits += len(tokens)
        self.stats.kv_offload_load_seconds += time.perf_counter() - start
        return data

    def copy_into(self, block_id: int, data: torch.Tensor) -> None:
        start = time.perf_counter()
        self.pool.write(block_id, data)
        self.stats.kv_offload_loaded_bytes += data.numel()
        self.stats.kv_offload_load_seconds += time.perf_counter() - start

    def persist(self, blocks: Iterable[tuple[bytes, tuple[int, ...], int]]) -> None:
        """Write (hash, tokens, block id) of the pool's cached blocks to the directory and wait for every
        write, so that the next process finds them (at close: what the pool still holds was never evicted)."""
        if self.disk is None:
            return
        for key, tokens, block_id in blocks:
            if not self.disk.has(key):
                self.disk.put(key, tokens, self.pool.read(block_id))
        self.disk.flush()


def tier_stats(tier: KVTier | None) -> dict[str, float]:
    """The counters, the directory's (entries refused, writes failed, seconds reading) and the bytes each
    tier holds; zeros without a tier."""
    ram, disk = (tier.ram, tier.disk) if tier is not None else (None, None)
    return {**asdict(tier.stats if tier is not None else TierStats()),
            "kv_offload_read_seconds": disk.read_seconds if disk else 0.0,
            "kv_offload_write_errors": disk.write_errors if disk else 0,
            "kv_offload_dropped_entries": disk.dropped if disk else 0,
            "kv_offload_ram_usage_bytes": ram.used if ram else 0,
            "kv_offload_disk_usage_bytes": disk.used if disk else 0}


def make_kv_tier(config: EngineConfig, model_path: Path, quantization: str, runner: ModelRunner) -> KVTier:
    """The tier that `config.kv_offloading_*` ask for, behind `runner`'s pool (a single rank's: config.py
    refuses tensor parallelism); `quantization`: the weights' (EngineConfig.weight_quantization)."""
    pool = PoolBlocks(runner.kv_caches)
    ram = RamTier(int(config.kv_offloading_size * GIB)) if config.kv_offloading_size else None
    disk = None
    if config.kv_offloading_dir is not None:
        # The native kernels and their torch twins round differently; the library's build key names the former.
        kernels = library_key() if runner.batch_invariant else "torch"
        identity = KVIdentity(checkpoint_digest(model_path), str(config.torch_dtype).removeprefix("torch."),
                              kv_format(config.kv_cache_dtype).name, config.block_size, kernels, quantization,
                              config.tensor_parallel_size, config.torch_device.type)
        disk = DiskTier(Path(config.kv_offloading_dir), int(config.kv_offloading_disk_size * GIB), identity,
                        pool.nbytes)
        disk.max_read_bytes = pool.num_blocks * pool.nbytes  # a prompt loads no more than the pool
    return KVTier(pool, ram, disk)
