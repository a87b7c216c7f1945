"""The executable cache: an LRU in memory, then files on disk, then compile.

Disk entries are data (a Program as JSON) behind a header with a format version and a
SHA-256 of the payload; they are rebuilt against the op allow-list, never unpickled. Files
are written to a temporary name and renamed into place, so several processes can share one
directory: a reader sees a whole file or none. A corrupt or foreign file is ignored with one
warning and recompiled over.
"""
from __future__ import annotations

import collections
import hashlib
import itertools
import json
import logging
import os
import tempfile
import warnings
from typing import Callable

from device import COUNTERS

from .program import FORMAT_VERSION, BadProgram, Executable, Program

_SERIALS = itertools.count(1)

log = logging.getLogger("adaptive_eager.cache")
MAGIC = b"ADAPTIVE-EAGER-NEFF\n"


class ExecutableCache:
    def __init__(self, directory: str | None, *, max_entries: int | None = None,
                 max_mb: float | None = None, salt: str = ""):
        self.directory = directory  # None: no disk cache
        self.max_entries = max_entries
        self.max_bytes = None if max_mb is None else int(max_mb * 2**20)
        self.salt = salt  # package, torch, executor and device versions: part of the disk key
        self._mem: collections.OrderedDict[tuple, tuple[Executable, int]] = \
            collections.OrderedDict()
        self._bytes = 0
        self.bad: dict[tuple, str] = {}  # program key -> why its compile failed
        # which cache this is, for the compile history (Note [Compile causes]): never reused,
        # as an id() is once the cache is freed (a new cache at the old one's address took
        # a settings change's compile for an eviction)
        self.serial = next(_SERIALS)

    def __len__(self):
        return len(self._mem)

    def clear(self) -> None:
        """Drop the memory level (the disk level stays, as files)."""
        self._mem.clear()
        self._bytes = 0

    def get(self, program: Program, compile_fn: Callable[[Program], Executable]
            ) -> tuple[Executable, str]:
        """(executable, level) where level is 'memory', 'disk' or 'compile'."""
        key = program.key
        hit = self._mem.get(key)
        if hit is not None:
            self._mem.move_to_end(key)
            COUNTERS.cache_memory_hits += 1
            return hit[0], "memory"
        payload = None
        exe = None
        if self.directory is not None:
            exe = self._load(program)
        level = "disk"
        if exe is None:
            COUNTERS.cache_misses += 1
            exe = compile_fn(program)
            level = "compile"
            payload = json.dumps(program.to_json()).encode()
            if self.directory is not None:
                self._store(program, payload)
        else:
            COUNTERS.cache_disk_hits += 1
        self._insert(key, exe, len(payload) if payload else 1024)
        return exe, level

    # -- memory ----------------------------------------------------------------------
    def _insert(self, key, exe, size):
        self._mem[key] = (exe, size)
        self._bytes += size
        over_n = self.max_entries is not None and len(self._mem) > self.max_entries
        over_b = self.max_bytes is not None and self._bytes > self.max_bytes
        if over_n or over_b:  # evict least recently used down to 80%, as the reference
            n_goal = int(0.8 * self.max_entries) if self.max_entries is not None else None
            b_goal = int(0.8 * self.max_bytes) if self.max_bytes is not None else None
            while self._mem and ((n_goal is not None and len(self._mem) > n_goal)
                                 or (b_goal is not None and self._bytes > b_goal)):
                _, (_, sz) = self._mem.popitem(last=False)
                self._bytes -= sz
                COUNTERS.cache_evictions += 1

    # -- disk ------------------------------------------------------------------------
    def path(self, program: Program) -> str:
        h = hashlib.sha256((self.salt + repr(program.key)).encode()).hexdigest()
        return os.path.join(self.directory, h[:2], h[2:4], h + ".neff")

    def _load(self, program: Program) -> Executable | None:
        path = self.path(program)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            self._warn(path, f"unreadable ({e})")
            return None
        try:
            if not data.startswith(MAGIC):
                raise ValueError("not an adaptive-eager cache file")
            header, _, payload = data[len(MAGIC):].partition(b"\n")
            meta = json.loads(header)
            if meta.get("format") != FORMAT_VERSION:
                raise ValueError(f"format {meta.get('format')} != {FORMAT_VERSION}")
            if meta.get("sha256") != hashlib.sha256(payload).hexdigest():
                raise ValueError("checksum mismatch")
            stored = Program.from_json(json.loads(payload))
            if stored.key != program.key:
                raise ValueError("entry does not match its key")
            return Executable(stored)
        except (ValueError, KeyError, TypeError, BadProgram) as e:
            self._warn(path, str(e))
            return None

    def _store(self, program: Program, payload: bytes) -> None:
        path = self.path(program)
        header = json.dumps({"format": FORMAT_VERSION,
                             "sha256": hashlib.sha256(payload).hexdigest()}).encode()
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + header + b"\n" + payload)
            os.replace(tmp, path)  # atomic: readers see the old file, the new one, or none
        except OSError as e:
            log.warning("could not write cache entry %s: %s", path, e)

    def _warn(self, path: str, why: str) -> None:
        COUNTERS.cache_disk_errors += 1
        warnings.warn(f"Ignoring executable cache file {path}: {why}; recompiling it.",
                      stacklevel=2)
