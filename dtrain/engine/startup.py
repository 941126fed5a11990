"""What every rank needs before its first step: the corpus, the shared tokenizer and the checkpoint to resume from,
decided on rank 0 and shared through the process group, so that only one rank downloads or trains anything.

Each decision goes through `dtrain.collectives.dist.main_decides`: rank 0 sends either its result or its error, so when it
fails (no corpus under data.dir, a failed download) every rank raises the same one-line UserError and exits alike,
instead of the others dying on a closed connection while rank 0 reports the cause.

No filesystem is assumed to be shared between nodes. What rank 0 made travels as bytes, not as a path: the BPE model
(each rank writes it into its own cache) and the resume state (`checkpoint.load_on_main`). The corpus may be on every
node, or downloaded by each: a rank that does not see rank 0's folder finds or downloads its own copy, and every copy
must hold the same sentences as rank 0's.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch.distributed as dist

from dtrain.collectives import dist as ddist
from dtrain.common.errors import UserError
from dtrain.common.paths import cache_root
from dtrain.engine import checkpoint
from dtrain.engine import corpus as corpora
from dtrain.engine import paper_bleu
from dtrain.engine.config import RunConfig
from dtrain.engine.data import MULTI30K_SPLITS, Pairs, multi30k_dir, multi30k_split
from dtrain.engine.tokenizer import Tokenizer, train_or_load


class Corpus(NamedTuple):
    data_dir: Path
    tokenizer: Tokenizer
    train: Pairs  # encoded, cut to data.train_limit
    val: Pairs


def locate_corpus(cfg: RunConfig) -> Path:
    """This rank's Multi30k folder. Rank 0 finds (or downloads) its own first; every other rank takes rank 0's folder
    if it holds the corpus on this node too, else finds or downloads its own the same way (one download per node:
    each node's local rank 0 goes first). All copies must hold the same sentences as rank 0's; a rank without one,
    or with a different one, is the same one-line UserError on every rank."""
    d = cfg.data
    chosen = Path(ddist.main_decides(lambda: str(multi30k_dir(d.dir, d.cache_dir, d.src, d.tgt))))
    if ddist.world_size() == 1:
        return chosen

    def own_copy() -> tuple[str, str]:
        try:
            return str(chosen), corpus_fingerprint(chosen, d.src, d.tgt)
        except UserError:  # not here: this node's own copy, as rank 0 found its own
            found = multi30k_dir(d.dir, d.cache_dir, d.src, d.tgt)
            return str(found), corpus_fingerprint(found, d.src, d.tgt)

    copies = on_every_rank(own_copy, local_rank_first=True)
    main_path, main_print = copies[0]
    for r, (path, fingerprint) in enumerate(copies):
        if fingerprint != main_print:
            raise UserError(f"rank {r}: Multi30k at {path} differs from rank 0's at {main_path}; every node needs "
                            "the same corpus (set data.dir or DTRAIN_DATA_DIR to a copy of it)")
    return Path(copies[ddist.rank()][0])


def corpus_fingerprint(directory: Path, src: str, tgt: str) -> str:
    """A digest of the sentences of every split (the text, so a gzipped and a plain copy agree)."""
    h = hashlib.sha256()
    for split in MULTI30K_SPLITS:
        for side in multi30k_split(directory, split, src, tgt):
            for line in side:
                h.update(line.encode("utf-8") + b"\n")
            h.update(b"\0")
    return h.hexdigest()


def shared_tokenizer(cfg: RunConfig, src: list[str], tgt: list[str]) -> Tokenizer:
    """Rank 0 trains (or loads the cached) BPE model and sends its bytes; every other rank writes them into its own
    cache (`data.cache_dir`, else the user cache) under the same name and loads that file."""
    bpe_dir = cache_root(cfg.data.cache_dir) / "bpe"

    def trained() -> tuple[str, bytes]:
        model_file = train_or_load(src, tgt, cfg.data.vocab_size, bpe_dir).model_file
        return model_file.name, model_file.read_bytes()

    name, blob = ddist.main_decides(trained)
    if ddist.world_size() == 1:
        return Tokenizer(bpe_dir / name)
    paths = on_every_rank(lambda: str(bpe_dir / name) if ddist.is_main() else str(_local_copy(bpe_dir / name, blob)))
    return Tokenizer(paths[ddist.rank()])


def _local_copy(path: Path, blob: bytes) -> Path:
    """`path` holding exactly `blob`: kept if it already does, else written to a temporary name and renamed (ranks
    of one node may write it at once; each rename is whole)."""
    try:
        if path.is_file() and path.read_bytes() == blob:
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), 0o644)  # as rank 0's own file, not mkstemp's owner-only 0600
                f.write(blob)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        raise UserError(f"{path}: cannot write the BPE model into this node's cache "
                        f"({e.strerror or e}); set data.cache_dir to a writable folder") from None
    return path


def on_every_rank(fn, local_rank_first: bool = False) -> list:
    """`fn()` on every rank; every rank gets the list of all ranks' results. If any rank fails, every rank raises the
    first failure (lowest rank) as one UserError naming that rank. `local_rank_first`: each node's local rank 0 runs
    `fn` before the node's other ranks, so that what it fetches or writes (a download) is there for them."""
    local_rank = ddist.env_rank()[1]

    def attempt():
        try:
            return fn(), None
        except Exception as e:
            return None, str(e)

    mine = attempt() if not local_rank_first or local_rank == 0 else None
    if local_rank_first:
        ddist.barrier()
        if local_rank != 0:
            mine = attempt()
    everyone = [None] * ddist.world_size()
    dist.all_gather_object(everyone, mine)
    for r, (_, problem) in enumerate(everyone):
        if problem is not None:
            raise UserError(problem if r == 0 else f"rank {r}: {problem}")
    return [result for result, _ in everyone]


def resume_checkpoint(run_dir: Path) -> Path | None:
    """The latest complete checkpoint of `run_dir` as rank 0 finds it, the same on every rank; None: there is none,
    start from step 0."""
    found = ddist.main_decides(lambda: str(checkpoint.latest(run_dir) or ""))
    return Path(found) if found else None


def resume_state(run_dir: Path) -> tuple[Path | None, dict | None]:
    """(the checkpoint rank 0 resumes from, its training state) on every rank, read from rank 0's disk only and sent
    through the process group; (None, None): no complete checkpoint, start from step 0."""
    path = resume_checkpoint(run_dir)
    if path is None:
        return None, None
    return path, checkpoint.load_on_main(path, keys=checkpoint.TRAINING_KEYS)


def load_corpus(cfg: RunConfig) -> Corpus:
    """The training and validation pairs, encoded with the BPE model trained on the whole training split."""
    if cfg.data.corpus.startswith("wmt14-"):
        paper_bleu.check_available()  # scored with the paper's tokenized BLEU at the end: fail now, not then
    if cfg.data.corpus != "multi30k":  # files, wmt14-*: BPE on a sample, a memory-mapped token cache
        return Corpus(*corpora.load(cfg.data, cfg.seed))
    d = cfg.data
    data_dir = locate_corpus(cfg)
    train_src, train_tgt = multi30k_split(data_dir, "train", d.src, d.tgt)
    tokenizer = shared_tokenizer(cfg, train_src, train_tgt)  # on the whole split, before train_limit
    if d.train_limit:
        train_src, train_tgt = train_src[: d.train_limit], train_tgt[: d.train_limit]
    train = Pairs.encode(tokenizer, train_src, train_tgt, d.max_len)
    val = Pairs.encode(tokenizer, *multi30k_split(data_dir, "val", d.src, d.tgt))
    return Corpus(data_dir, tokenizer, train, val)
