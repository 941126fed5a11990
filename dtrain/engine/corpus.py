"""Parallel corpora beyond Multi30k: any corpus named file by file (`data.corpus: files`) and WMT14 EN-DE / EN-FR.

    python -m dtrain.engine.corpus download wmt14-en-de --to DIR     # fetch (resumable) and assemble train/val/test
    python -m dtrain.engine.corpus download wmt14-en-fr --to DIR --mirror http://host/wmt14/   # same names elsewhere

Training reads them as `load` does: find the split files, train the shared BPE model on a sample of the training
pairs (on rank 0; the others load its file), then tokenise each split once into a memory-mapped cache
(`dtrain.engine.token_cache`) that every rank maps. Multi30k keeps its own path (`dtrain.engine.data`, `dtrain.engine.startup`).
"""

from __future__ import annotations

import gzip
import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from dtrain.collectives import dist as ddist
from dtrain.common.errors import ArgumentParser, UserError, exit_on_user_error
from dtrain.common.files import replace_atomically
from dtrain.engine import token_cache, wmt14
from dtrain.engine.config import DataConfig
from dtrain.common.paths import cache_root
from dtrain.engine.data import read_parallel
from dtrain.engine.token_cache import CachedPairs
from dtrain.engine.tokenizer import Tokenizer, train_or_load

SPLITS = ("train", "val", "test")


def _existing(directory: Path, stem: str, lang: str) -> Path | None:
    return next((p for p in (directory / f"{stem}.{lang}", directory / f"{stem}.{lang}.gz") if p.is_file()), None)


def wmt14_dir(d: DataConfig) -> Path:
    """The assembled WMT14 folder: `data.dir` (or its <corpus>/ subfolder), else `$DTRAIN_DATA_DIR/<corpus>`, else
    the user cache's <corpus>/. Not downloaded on its own (gigabytes): the error says how."""
    named = [Path(d.dir).expanduser(), Path(d.dir).expanduser() / d.corpus] if d.dir else []
    if not d.dir:
        if os.environ.get("DTRAIN_DATA_DIR"):
            named.append(Path(os.environ["DTRAIN_DATA_DIR"]).expanduser() / d.corpus)
        named.append(cache_root(d.cache_dir) / d.corpus)
    for directory in named:
        if all(_existing(directory, s, l) for s in SPLITS for l in (d.src, d.tgt)):
            return directory
    where = ", ".join(str(p) for p in named)
    raise UserError(f"{d.corpus}: no train/val/test.{{{d.src},{d.tgt}}} in {where}; fetch it with "
                    f"`python -m dtrain.engine.corpus download {d.corpus} --to DIR` and set data.dir: DIR")


def split_files(d: DataConfig, split: str) -> tuple[Path, Path]:
    """The (source, target) files of `split` ("train", "val" or "test")."""
    if d.corpus == "files":
        pair = getattr(d.files, split)
        if pair is None:
            raise UserError(f"data.files.{split}: not set, and the {split} split is needed")
        paths = tuple(Path(p).expanduser() for p in pair)
        for p in paths:
            if not p.is_file():
                raise UserError(f"data.files.{split}: {p}: file not found")
        return paths
    directory = wmt14_dir(d)
    return _existing(directory, split, d.src), _existing(directory, split, d.tgt)


def _open(path: Path):
    try:
        return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None


def iter_pairs(src_path: Path, tgt_path: Path, limit: int | None = None) -> Iterator[tuple[str, str, str]]:
    """(where, source line, target line), streamed; unequal line counts or bad UTF-8 are errors naming the file."""
    n = 0
    try:
        with _open(src_path) as fs, _open(tgt_path) as ft:
            for n, (a, b) in enumerate(zip(fs, ft), 1):
                if limit is not None and n > limit:
                    return
                try:
                    s, t = a.decode("utf-8").rstrip("\r\n"), b.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError:
                    bad = src_path if not _decodes(a) else tgt_path
                    raise UserError(f"{bad}:{n}: not valid UTF-8") from None
                yield f"{src_path}:{n}", s, t
            rest_s, rest_t = fs.readline(), ft.readline()
            if rest_s or rest_t:
                longer, shorter = (src_path, tgt_path) if rest_s else (tgt_path, src_path)
                raise UserError(f"{shorter}:{n + 1}: line counts differ ({longer.name} has more lines)")
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise UserError(f"{src_path} / {tgt_path}: cannot read ({e.__class__.__name__}: {e})") from None
    if n == 0:
        raise UserError(f"{src_path}: empty split (no sentence pairs)")


def _decodes(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def sample_pairs(src_path: Path, tgt_path: Path, k: int, seed: int, limit: int | None,
                 clean: bool) -> tuple[list[str], list[str]]:
    """A uniform sample of k training pairs (reservoir sampling, Vitter's algorithm R): memory O(k), one pass.
    The BPE model learns from it, as SentencePiece's own input_sentence_size samples, but reproducibly."""
    rng = random.Random(f"bpe/{seed}")
    reservoir: list[tuple[str, str]] = []
    for n, (_, s, t) in enumerate(iter_pairs(src_path, tgt_path, limit)):
        pair = (token_cache.normalise(s), token_cache.normalise(t)) if clean else (s, t)
        if n < k:
            reservoir.append(pair)
        elif (j := rng.randrange(n + 1)) < k:
            reservoir[j] = pair
    return [s for s, _ in reservoir], [t for _, t in reservoir]


def shared_tokenizer(d: DataConfig, seed: int, clean: bool) -> Tokenizer:
    """Rank 0 trains (or finds cached) the joint BPE model on a sample of the training split and sends its bytes;
    every other rank keeps a copy in its own cache (no filesystem is assumed shared between nodes)."""
    bpe_dir = cache_root(d.cache_dir) / "bpe"

    def train() -> tuple[str, bytes]:
        files = split_files(d, "train")
        # The model is cached by its sample's hash; this index, keyed by what the sample depends on, finds it
        # without reading the corpus again (a pass over millions of lines at every start otherwise).
        key = token_cache.cache_key(files, None, vocab=d.vocab_size, sample=d.bpe_sample, seed=seed,
                                    limit=d.train_limit, clean=clean)
        index = bpe_dir / f"sample-{key}.name"
        if index.is_file() and (bpe_dir / index.read_text().strip()).is_file():
            model_file = bpe_dir / index.read_text().strip()
        else:
            src, tgt = sample_pairs(*files, d.bpe_sample, seed, d.train_limit, clean)
            model_file = train_or_load(src, tgt, d.vocab_size, bpe_dir).model_file
            replace_atomically(index, model_file.name + "\n")
        return model_file.name, model_file.read_bytes()

    name, blob = ddist.main_decides(train)
    path = bpe_dir / name
    if not ddist.is_main() and not (path.is_file() and path.read_bytes() == blob):
        tmp = path.with_name(f".{name}.{os.getpid()}.tmp")  # ranks of a node may write it at once: each rename whole
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(blob)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise UserError(f"{path}: cannot write the BPE model ({e.strerror}); set data.cache_dir") from None
    return Tokenizer(path)


def cached_split(d: DataConfig, tokenizer: Tokenizer, split: str, clean: bool) -> CachedPairs:
    """`split` tokenised once per machine (the first process to lock the cache builds it) and memory-mapped."""
    src_path, tgt_path = split_files(d, split)
    train = split == "train"
    rules = dict(split=split, clean=clean and train, max_len=d.max_len if train else None,
                 limit=d.train_limit if train else None)
    key = token_cache.cache_key([src_path, tgt_path], tokenizer.model_file, **rules)
    folder = token_cache.ensure(
        cache_root(d.cache_dir) / "tokens", key, tokenizer, iter_pairs(src_path, tgt_path, rules["limit"]),
        rules["clean"], rules["max_len"],
        describe={"what": f"{d.corpus} {split}", "files": [str(src_path), str(tgt_path)],
                  "model": str(tokenizer.model_file)})
    return CachedPairs(folder)


def cleaning(d: DataConfig) -> bool:
    return d.clean if d.clean is not None else d.corpus.startswith("wmt14-")


def load(d: DataConfig, seed: int) -> tuple[Path, Tokenizer, CachedPairs, CachedPairs]:
    """(folder of the training files, tokenizer, training pairs, validation pairs) for `dtrain.engine.startup.Corpus`."""
    clean = cleaning(d)
    tokenizer = shared_tokenizer(d, seed, clean)

    def both() -> tuple[CachedPairs, CachedPairs]:
        return cached_split(d, tokenizer, "train", clean), cached_split(d, tokenizer, "val", clean)
    train, val = _agreed(both, d.corpus)
    return split_files(d, "train")[0].parent, tokenizer, train, val


def _agreed(build, corpus: str):
    """`build()` on every rank (one per machine builds the caches; the others wait for it), then a check that every
    rank holds the same pairs as rank 0 (counts of pairs and tokens: nodes read their own copies of the files). Any
    rank's failure is the same one-line UserError on every rank, not a hang at the next collective."""
    try:
        result, problem = build(), None
    except UserError as e:
        result, problem = None, str(e)
    if ddist.world_size() == 1:
        if problem:
            raise UserError(problem)
        return result
    summary = None if result is None else [(p.meta["pairs"], p.meta["stats"]["tokens"]) for p in result]
    everyone = [None] * ddist.world_size()
    dist.all_gather_object(everyone, (summary, problem))
    for r, (theirs, why) in enumerate(everyone):
        if why is not None:
            raise UserError(why if r == 0 else f"rank {r}: {why}")
        if theirs != everyone[0][0]:
            raise UserError(f"rank {r}: its copy of the {corpus} corpus gives other pairs than rank 0's ({theirs} "
                            f"against {everyone[0][0]}: pairs and tokens of train and val); every node needs the "
                            "same files")
    return result


def split_text(d: DataConfig, split: str) -> tuple[list[str], list[str]]:
    """The raw source sentences and references of `split` (for decoding and BLEU); "val" or "test"."""
    return read_parallel(*split_files(d, split))


def main(argv=None) -> None:
    ap = ArgumentParser(prog="python -m dtrain.engine.corpus", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    dl = sub.add_parser("download", help="fetch a named corpus and assemble its train/val/test files")
    dl.add_argument("name", choices=sorted(wmt14.RECIPES))
    dl.add_argument("--to", required=True, help="the corpus folder (archives go to DIR/raw, kept for resuming)")
    dl.add_argument("--mirror", help="a base URL serving the archives under their usual file names")
    dl.add_argument("--sha256", action="append", default=[], metavar="FILE=HEX",
                    help="the expected sha256 of an archive (repeatable); none is published for these")
    with exit_on_user_error("dtrain.engine.corpus"):
        args = ap.parse_args(argv)
        checksums = {}
        for item in args.sha256:
            name, sep, digest = item.partition("=")
            if not sep or len(digest) != 64:
                raise UserError(f"--sha256 '{item}': expected FILE=<64 hex digits>")
            checksums[name] = digest.lower()
        to = wmt14.download(args.name, Path(args.to), args.mirror, checksums)
        print(f"{args.name}: train/val/test files in {to} (archives and their sha256 in {to / 'SOURCES.json'})")


if __name__ == "__main__":
    sys.exit(main())
