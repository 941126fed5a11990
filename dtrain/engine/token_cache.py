"""Tokenised splits cached on disk once and memory-mapped by every rank.

Layout of one split's cache folder (`<cache>/tokens/<key>/`):

    src.tok  int32[T_src]   the source ids of every pair, end to end (no EOS; added when read)
    src.off  int64[n + 1]   pair i's source ids are src.tok[src.off[i] : src.off[i + 1]]
    tgt.tok, tgt.off        the same for the target (no BOS/EOS)
    meta.json               what was built from what, and the counts (written last)

`<key>` hashes everything the tokens depend on (the text files' paths, sizes and times, the BPE model's bytes, the
cleaning and length rules), so a changed input builds a new folder rather than reusing a stale one. One process per
machine builds it (an exclusive `fcntl.flock` on `<key>.lock`; the others wait on the lock and then find it built)
into `<key>.tmp-<pid>`, renamed to `<key>` when whole: a reader never sees half a cache, and no rank tokenises
anything that another rank of its machine has. Each rank then maps the files (`numpy.memmap`, read-only): only the
offsets are read whole (the batcher needs every pair's length), and a rank's batches read just the ids of its own
pairs (the pages around them come into the shared page cache, not into the rank's own memory).

Cleaning (training split, when asked): the rule of Moses' scripts/training/clean-corpus-n.perl as fairseq's
prepare-wmt14en2de.sh calls it (`-ratio 1.5 ... 1 250`), counted in subword tokens as fairseq counts them (its
cleaning runs after BPE): a pair is dropped when either side has fewer than 1 or more than 250 tokens, or one side
is more than 1.5 times as long as the other. Before encoding, every line loses its non-printing characters (Unicode
category C, replaced by a space, as Moses' remove-non-printing-char.perl does) and its outer whitespace.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import itertools
import json
import os
import re
import shutil
import time
import unicodedata
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from dtrain.common.errors import UserError
from dtrain.engine.data import Pairs
from dtrain.engine.tokenizer import BOS, EOS

VERSION = 1
CLEAN_MIN, CLEAN_MAX, CLEAN_RATIO = 1, 250, 1.5
CHUNK = 20_000  # pairs encoded at a time: bounds the memory a build needs, whatever the corpus size


@functools.cache
def _non_printing() -> re.Pattern:
    """Unicode category C (control, format, private use, unassigned, surrogate) in the Basic Multilingual Plane, as
    one character class of ranges: one regex pass per line rather than a Python loop per character."""
    runs: list[list[int]] = []
    for c in range(0x10000):
        if unicodedata.category(chr(c)).startswith("C"):
            if runs and runs[-1][1] == c - 1:
                runs[-1][1] = c
            else:
                runs.append([c, c])
    return re.compile("[" + "".join(re.escape(chr(a)) + (f"-{re.escape(chr(b))}" if b > a else "")
                                    for a, b in runs) + "]")


def normalise(line: str) -> str:
    if line.isprintable():  # no category C character (nor any space but " "): the common case, at C speed
        return line.strip()
    return _non_printing().sub(" ", line).strip()


def keep_mask(src_len: np.ndarray, tgt_len: np.ndarray) -> np.ndarray:
    """clean-corpus-n.perl's test on token counts: both sides within [1, 250], neither over 1.5× the other."""
    ok = (src_len >= CLEAN_MIN) & (src_len <= CLEAN_MAX) & (tgt_len >= CLEAN_MIN) & (tgt_len <= CLEAN_MAX)
    with np.errstate(divide="ignore", invalid="ignore"):
        ok &= (src_len <= CLEAN_RATIO * tgt_len) & (tgt_len <= CLEAN_RATIO * src_len)
    return ok


def cache_key(files: Iterable[Path], model_file: Path | None, **rules) -> str:
    """What a product of `files` depends on: each file's path, size and modification time, the BPE model's bytes
    (`model_file`, if any) and `rules`."""
    h = hashlib.sha256(f"v{VERSION}".encode())
    for f in files:
        st = Path(f).stat()
        h.update(f"{Path(f).resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    if model_file is not None:
        h.update(hashlib.sha256(Path(model_file).read_bytes()).digest())
    h.update(json.dumps(rules, sort_keys=True).encode())
    return h.hexdigest()[:20]


def _write(out: Path, tokenizer, pairs: Iterator[tuple[str, str, str]], clean: bool, max_len: int | None) -> dict:
    """Encode `pairs` ((where, source, target) triples) chunk by chunk into the four files under `out`."""
    t0 = time.perf_counter()
    stats = {"read": 0, "kept": 0, "dropped_clean": 0, "dropped_max_len": 0}
    files = {name: open(out / name, "wb") for name in ("src.tok", "src.off", "tgt.tok", "tgt.off")}
    ends = {"src": 0, "tgt": 0}
    try:
        for f in (files["src.off"], files["tgt.off"]):
            np.zeros(1, np.int64).tofile(f)
        chunk: list[tuple[str, str, str]] = []

        def flush():
            srcs = tokenizer.encode([normalise(s) if clean else s for _, s, _ in chunk])
            tgts = tokenizer.encode([normalise(t) if clean else t for _, _, t in chunk])
            ns = np.fromiter(map(len, srcs), np.int64, len(srcs))
            nt = np.fromiter(map(len, tgts), np.int64, len(tgts))
            keep = np.ones(len(chunk), bool)
            if clean:
                keep = keep_mask(ns, nt)
                stats["dropped_clean"] += int((~keep).sum())
            else:
                for (where, s, t), a, b in zip(chunk, ns, nt):
                    if a == 0 or b == 0:
                        raise UserError(f"{where}: empty sentence (data.clean: true drops such pairs)")
            if max_len is not None:  # as Pairs.encode: the side with its EOS must fit
                fits = (ns + 1 <= max_len) & (nt + 1 <= max_len)
                stats["dropped_max_len"] += int((keep & ~fits).sum())
                keep &= fits
            for side, ids, n in (("src", srcs, ns), ("tgt", tgts, nt)):
                kept = [ids[i] for i in np.flatnonzero(keep)]
                flat = np.fromiter(itertools.chain.from_iterable(kept), np.int32, int(n[keep].sum()))
                flat.tofile(files[f"{side}.tok"])
                (ends[side] + np.cumsum(n[keep])).astype(np.int64).tofile(files[f"{side}.off"])
                ends[side] += int(n[keep].sum())
            stats["kept"] += int(keep.sum())
            chunk.clear()

        for triple in pairs:
            chunk.append(triple)
            stats["read"] += 1
            if len(chunk) == CHUNK:
                flush()
        if chunk:
            flush()
    finally:
        for f in files.values():
            f.close()
    stats["tokens"] = ends
    stats["build_s"] = round(time.perf_counter() - t0, 3)
    return stats


def ensure(root: Path, key: str, tokenizer, pairs: Iterable[tuple[str, str, str]], clean: bool,
           max_len: int | None, describe: dict) -> Path:
    """The cache folder `root/key`, built first by whichever process takes the lock (`pairs` is only iterated
    then). Returns the folder; raises `UserError` (nothing left behind) when the input is bad."""
    final = root / key
    if (final / "meta.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if (final / "meta.json").is_file():  # another process built it while this one waited
            return final
        tmp = root / f"{key}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            stats = _write(tmp, tokenizer, iter(pairs), clean, max_len)
            if stats["kept"] == 0:
                raise UserError(f"{describe.get('what', key)}: no sentence pairs left "
                                f"({stats['read']} read, {stats['dropped_clean']} dropped by cleaning, "
                                f"{stats['dropped_max_len']} longer than data.max_len)")
            meta = {"version": VERSION, "pairs": stats["kept"], "clean": clean, "max_len": max_len,
                    **describe, "stats": stats}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
            shutil.rmtree(final, ignore_errors=True)  # a folder without meta.json: an older, interrupted layout
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


class _Side:
    """One side of the cached pairs as the list of tensors `Pairs` holds: item i is built from the map on demand."""

    def __init__(self, tok: np.ndarray, off: np.ndarray, prefix: list[int], suffix: list[int]):
        self.tok, self.off = tok, off
        self.prefix, self.suffix = np.asarray(prefix, np.int64), np.asarray(suffix, np.int64)

    def __len__(self) -> int:
        return len(self.off) - 1

    def __getitem__(self, i: int) -> torch.Tensor:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        ids = self.tok[self.off[i]: self.off[i + 1]]
        return torch.from_numpy(np.concatenate([self.prefix, ids.astype(np.int64), self.suffix]))

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def sizes(self) -> np.ndarray:
        return np.diff(self.off) + len(self.prefix) + len(self.suffix)


def _map(path: Path, dtype) -> np.ndarray:
    # numpy cannot map an empty file; a split whose one side has no ids at all is only possible uncleaned
    return np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)


class CachedPairs(Pairs):
    """`Pairs` read from a cache folder: src = ids + [EOS], tgt = [BOS] + ids + [EOS], as `Pairs.encode` makes."""

    def __init__(self, directory: Path):
        directory = Path(directory)
        try:
            self.meta = json.loads((directory / "meta.json").read_text())
            src = _Side(_map(directory / "src.tok", np.int32), _map(directory / "src.off", np.int64), [], [EOS])
            tgt = _Side(_map(directory / "tgt.tok", np.int32), _map(directory / "tgt.off", np.int64), [BOS], [EOS])
        except (OSError, ValueError) as e:
            raise UserError(f"{directory}: not a readable token cache ({e.__class__.__name__}: {e}); "
                            "remove the folder to rebuild it") from None
        if len(src) != len(tgt) or len(src) != self.meta["pairs"]:
            raise UserError(f"{directory}: token cache is inconsistent ({len(src)} source, {len(tgt)} target "
                            f"pairs, meta.json says {self.meta['pairs']}); remove the folder to rebuild it")
        super().__init__(src, tgt)
        self.directory = directory

    def lengths(self) -> list[int]:
        """As `Pairs.lengths`: max(len(src), len(tgt) - 1) per pair, from the offsets alone."""
        return np.maximum(self.src.sizes(), self.tgt.sizes() - 1).tolist()
