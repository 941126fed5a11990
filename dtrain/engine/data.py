"""Parallel corpora, the Multi30k source, and token-based batching with disjoint per-rank shards.

Pipeline position: files → (`read_parallel`) sentence pairs → (`dtrain.engine.tokenizer`) ids → (`TokenBatcher`) batches of
about `max_tokens` padded tokens → (`collate`) tensors for the model. The batch order is a pure function of
(seed, epoch, global batches consumed), so a resumed run sees exactly the batches an uninterrupted one would, and a
run resumed on another number of ranks continues the same epoch order.
"""

from __future__ import annotations

import gzip
import os
import random
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

from dtrain.common.errors import UserError
from dtrain.common.paths import cache_root
from dtrain.common.progress import Bar
from dtrain.engine.checkpoint import sha256_file
from dtrain.engine.tokenizer import BOS, EOS, PAD

# ---------------------------------------------------------------------------------------------------------------
# Reading


def _open_text(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def read_lines(path: Path) -> list[str]:
    """UTF-8 lines without their newline; an undecodable line is an error naming file and line."""
    lines = []
    try:
        with _open_text(path) as f:
            for n, raw in enumerate(f, 1):
                try:
                    lines.append(raw.decode("utf-8").rstrip("\r\n"))
                except UnicodeDecodeError:
                    raise UserError(f"{path}:{n}: not valid UTF-8") from None
    except FileNotFoundError:
        raise UserError(f"{path}: file not found") from None
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise UserError(f"{path}: cannot read ({e.__class__.__name__}: {e})") from None
    return lines


def read_parallel(src_path: Path, tgt_path: Path) -> tuple[list[str], list[str]]:
    """Line i of the source translates line i of the target; both files must have as many lines, and some."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        shorter = src_path if len(src) < len(tgt) else tgt_path
        raise UserError(
            f"{shorter}:{min(len(src), len(tgt)) + 1}: line counts differ "
            f"({src_path.name}: {len(src)}, {tgt_path.name}: {len(tgt)})"
        )
    if not src:
        raise UserError(f"{src_path}: empty split (no sentence pairs)")
    for n, (s, t) in enumerate(zip(src, tgt), 1):
        if not s.strip() or not t.strip():
            raise UserError(f"{src_path if not s.strip() else tgt_path}:{n}: empty sentence")
    return src, tgt


# ---------------------------------------------------------------------------------------------------------------
# Multi30k: find the files, or download them with checksums

MULTI30K_URL = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/{}"
MULTI30K_SPLITS = {"train": "train", "val": "val", "test": "test_2016_flickr"}
MULTI30K_SHA256 = {
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
}


def _split_files(directory: Path, split: str, src: str, tgt: str) -> tuple[Path, Path] | None:
    """The split's file pair in `directory` (gzip or plain), or None if either is missing."""
    stem = MULTI30K_SPLITS[split]
    found = []
    for lang in (src, tgt):
        candidates = [directory / f"{stem}.{lang}.gz", directory / f"{stem}.{lang}"]
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            return None
        found.append(path)
    return found[0], found[1]


def _missing_files(directory: Path, src: str, tgt: str) -> list[str]:
    """The Multi30k files (name without .gz) that `directory` lacks in either form."""
    return [f"{stem}.{lang}" for stem in MULTI30K_SPLITS.values() for lang in (src, tgt)
            if not any((directory / f"{stem}.{lang}{gz}").is_file() for gz in (".gz", ""))]


def multi30k_dir(data_dir: str | None, cache_dir: str | None, src: str = "en", tgt: str = "de") -> Path:
    """Where the Multi30k files are. A profile's `data.dir` is where they must be (that folder or its multi30k/):
    a named folder without them is an error, not a reason to look elsewhere. Without it: `$DTRAIN_DATA_DIR/multi30k`,
    then the user cache; if neither has them, download into the cache (checksummed)."""
    if data_dir:
        named = Path(data_dir).expanduser()
        missing = {d: _missing_files(d, src, tgt) for d in (named, named / "multi30k")}
        closest = min(missing, key=lambda d: len(missing[d]))
        if not missing[closest]:
            return closest
        raise UserError(f"data.dir {named}: no Multi30k there ({', '.join(missing[closest])} missing from {closest}, "
                        "as .gz or plain text); fix data.dir or leave it unset")
    candidates = []
    if os.environ.get("DTRAIN_DATA_DIR"):
        candidates.append(Path(os.environ["DTRAIN_DATA_DIR"]).expanduser() / "multi30k")
    cache = cache_root(cache_dir) / "multi30k"
    candidates.append(cache)
    for d in candidates:
        if not _missing_files(d, src, tgt):
            return d
    download_multi30k(cache, src, tgt, searched=candidates[:-1])
    return cache


def download_multi30k(cache: Path, src: str, tgt: str, searched: list[Path] = ()) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    for stem in MULTI30K_SPLITS.values():
        for lang in (src, tgt):
            name = f"{stem}.{lang}.gz"
            target = cache / name
            if target.is_file():
                continue
            if name not in MULTI30K_SHA256:
                raise UserError(f"Multi30k has no file '{name}' (languages: en, de)")
            tmp = cache / f".{name}.part"
            try:
                with urllib.request.urlopen(MULTI30K_URL.format(name), timeout=30) as resp, open(tmp, "wb") as out:
                    total = int(resp.headers.get("Content-Length") or 0) or None
                    bar = Bar(total, f"downloading {name}", "B", unit_scale=True)
                    for chunk in iter(lambda: resp.read(1 << 16), b""):
                        out.write(chunk)
                        bar.update(len(chunk))
                    bar.close()
            except (urllib.error.URLError, OSError, TimeoutError) as e:
                tmp.unlink(missing_ok=True)
                where = ", ".join(str(p) for p in [*searched, cache])
                raise UserError(
                    f"Multi30k not found (searched {where}) and download of {name} failed "
                    f"({getattr(e, 'reason', e)}); set data.dir or DTRAIN_DATA_DIR to a folder with the files"
                ) from None
            digest = sha256_file(tmp)
            if digest != MULTI30K_SHA256[name]:
                tmp.unlink(missing_ok=True)
                raise UserError(f"downloaded {name} has sha256 {digest[:12]}…, "
                                f"expected {MULTI30K_SHA256[name][:12]}…")
            os.replace(tmp, target)


def multi30k_split(directory: Path, split: str, src: str, tgt: str) -> tuple[list[str], list[str]]:
    files = _split_files(directory, split, src, tgt)
    if files is None:
        raise UserError(f"{directory}: no {split} files for {src}-{tgt}")
    return read_parallel(*files)


# ---------------------------------------------------------------------------------------------------------------
# Encoded pairs and token-based batching


@dataclass
class Pairs:
    """Encoded sentence pairs: src = ids + [EOS]; tgt = [BOS] + ids + [EOS] (shifted in `collate`)."""

    src: list[torch.Tensor]
    tgt: list[torch.Tensor]

    @classmethod
    def encode(cls, tokenizer, src_lines: list[str], tgt_lines: list[str], max_len: int | None = None) -> "Pairs":
        src_ids, tgt_ids = tokenizer.encode(src_lines), tokenizer.encode(tgt_lines)
        src, tgt = [], []
        for s, t in zip(src_ids, tgt_ids):
            if max_len is not None and (len(s) + 1 > max_len or len(t) + 1 > max_len):
                continue
            src.append(torch.tensor(s + [EOS], dtype=torch.long))
            tgt.append(torch.tensor([BOS] + t + [EOS], dtype=torch.long))
        return cls(src, tgt)

    def __len__(self) -> int:
        return len(self.src)

    def lengths(self) -> list[int]:
        """The padded length that a pair costs in a batch: its longer side (target counted without BOS)."""
        return [max(len(s), len(t) - 1) for s, t in zip(self.src, self.tgt)]


@dataclass
class Batch:
    src: torch.Tensor  # (B, S)
    tgt_in: torch.Tensor  # (B, T): BOS y_1 ... y_n
    tgt_out: torch.Tensor  # (B, T): y_1 ... y_n EOS
    ntokens: int  # non-pad target tokens

    def to(self, device) -> "Batch":
        return Batch(self.src.to(device, non_blocking=True), self.tgt_in.to(device, non_blocking=True),
                     self.tgt_out.to(device, non_blocking=True), self.ntokens)


def collate(pairs: Pairs, indices: list[int]) -> Batch:
    src = pad_sequence([pairs.src[i] for i in indices], batch_first=True, padding_value=PAD)
    tgt = pad_sequence([pairs.tgt[i] for i in indices], batch_first=True, padding_value=PAD)
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    return Batch(src, tgt_in, tgt_out, int((tgt_out != PAD).sum()))


def pack(order: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Greedily cut `order` (already length-sorted) into batches whose padded size n · max_len ≤ max_tokens."""
    batches, current, longest = [], [], 0
    for i in order:
        new_longest = max(longest, lengths[i])
        if current and new_longest * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, new_longest = [], lengths[i]
        current.append(i)
        longest = new_longest
    if current:
        batches.append(current)
    return batches


class TokenBatcher:
    """Batches of about `max_tokens` padded tokens, drawn from length-sorted buckets and shuffled per epoch.

    Epoch e: shuffle the pairs with seed (seed, e), stable-sort by length (ties stay shuffled, so batches differ
    between epochs), pack, shuffle the batch order. That global order of the epoch's batches depends on the seed and
    the data only, never on the world size. Ranks take turns along it: with g batches of the epoch consumed, rank r
    takes batch g + r and together they consume `world` more. Ranks get disjoint batches, every rank runs the same
    number of steps, and the epoch ends when fewer than `world` batches are left (those few are dropped, a different
    few each epoch). Step k of an unchanged world size is batch k · world + r.
    """

    def __init__(self, lengths: list[int], max_tokens: int, seed: int, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True):
        if max(lengths, default=0) > max_tokens:
            raise UserError(f"data.max_tokens ({max_tokens}) is smaller than the longest pair ({max(lengths)} tokens)")
        self.lengths, self.max_tokens, self.seed = lengths, max_tokens, seed
        self.rank, self.world_size, self.shuffle = rank, world_size, shuffle
        self._cached: tuple[int, list[list[int]]] | None = None

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """Every batch of the epoch, all ranks' together, in the order they are consumed."""
        if self._cached and self._cached[0] == epoch:
            return self._cached[1]
        order = list(range(len(self.lengths)))
        rng = random.Random(f"{self.seed}/{epoch}")
        if self.shuffle:
            rng.shuffle(order)
        order.sort(key=self.lengths.__getitem__)
        batches = pack(order, self.lengths, self.max_tokens)
        if self.shuffle:
            rng.shuffle(batches)
        self._cached = (epoch, batches)
        return batches

    def steps_per_epoch(self, epoch: int) -> int:
        return len(self.epoch_batches(epoch)) // self.world_size

    def rank_batch(self, epoch: int, step: int) -> list[int]:
        return self.epoch_batches(epoch)[step * self.world_size + self.rank]

    def shard(self) -> list[list[int]]:
        """This rank's share of an unshuffled pass (validation): batches r, r + world, ... (may be uneven)."""
        return self.epoch_batches(0)[self.rank :: self.world_size]


class BatchStream:
    """An endless stream of this rank's training batches. Its position is (epoch, global batches consumed in the
    epoch), which a run of another world size continues from (see `TokenBatcher`)."""

    def __init__(self, pairs: Pairs, batcher: TokenBatcher):
        self.pairs, self.batcher = pairs, batcher
        self.epoch, self.consumed = 0, 0
        self.last: list[int] = []  # the pair indices of the batch `next` returned last
        if batcher.steps_per_epoch(0) == 0:
            raise UserError(
                f"too little training data for {batcher.world_size} ranks: {len(pairs)} pairs make "
                f"{len(batcher.epoch_batches(0))} batches of data.max_tokens={batcher.max_tokens}"
            )

    def next(self) -> Batch:
        world = self.batcher.world_size
        if self.consumed + world > len(self.batcher.epoch_batches(self.epoch)):
            self.epoch, self.consumed = self.epoch + 1, 0
        self.last = self.batcher.epoch_batches(self.epoch)[self.consumed + self.batcher.rank]
        self.consumed += world
        return collate(self.pairs, self.last)

    def state_dict(self) -> dict:
        # "step": this world size's steps into the epoch (what `checkpoint inspect` shows); "consumed" is the position.
        return {"epoch": self.epoch, "step": self.consumed // self.batcher.world_size, "consumed": self.consumed}

    def load_state_dict(self, state: dict, world_size: int | None = None) -> None:
        """`world_size`: the ranks that wrote `state`, for a state without "consumed" (written by earlier versions,
        which counted this rank's steps)."""
        self.epoch = int(state["epoch"])
        if "consumed" in state:
            self.consumed = int(state["consumed"])
        else:
            self.consumed = int(state["step"]) * (world_size or self.batcher.world_size)
