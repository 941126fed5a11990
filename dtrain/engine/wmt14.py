"""WMT14 EN-DE and EN-FR as the paper trained on them: which archives, which files in them, how they are joined.

Sources, as in fairseq's examples/translation/prepare-wmt14en2de.sh (run with --icml17: News Commentary v9) and
prepare-wmt14en2fr.sh, and tensor2tensor's data_generators/translate_ende.py / translate_enfr.py:

- EN-DE training: Europarl v7 + Common Crawl + News Commentary v9 (about 4.5M pairs before cleaning).
- EN-FR training: Europarl v7 + Common Crawl + UN + News Commentary v9 + the 10^9 French-English (Giga) corpus
  (about 36M pairs before cleaning; the paper's section 5.1).
- Validation: newstest2013 (tensor2tensor and the paper; fairseq's scripts instead hold out every 100th training
  pair). Test: newstest2014, the full set (test-full.tgz: 3,003 sentences for EN-DE, 3,003 for EN-FR), read
  from its SGM files as sacreBLEU reads them.

`assemble` turns the downloaded archives into plain parallel files (train/val/test.<lang>) in the corpus folder,
written under temporary names and renamed, so a folder holding them holds all of them. Cleaning and length
filtering are not done here but when the tokens are cached (`dtrain.engine.token_cache`), so that one rule serves any
corpus. docs/data.md says what is and is not done compared with those scripts.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

from dtrain.common.errors import UserError
from dtrain.engine.download import fetch


@dataclass(frozen=True)
class Archive:
    url: str
    sha256: str | None  # None: no published checksum (statmt.org publishes none); the one seen is recorded

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[1]


EUROPARL = Archive("http://statmt.org/wmt13/training-parallel-europarl-v7.tgz", None)
COMMONCRAWL = Archive("http://statmt.org/wmt13/training-parallel-commoncrawl.tgz", None)
NEWS_COMMENTARY_V9 = Archive("http://statmt.org/wmt14/training-parallel-nc-v9.tgz", None)
UN = Archive("http://statmt.org/wmt13/training-parallel-un.tgz", None)
GIGA = Archive("http://statmt.org/wmt10/training-giga-fren.tar", None)
DEV = Archive("http://statmt.org/wmt14/dev.tgz", None)
TEST_FULL = Archive("http://statmt.org/wmt14/test-full.tgz", None)


@dataclass(frozen=True)
class Recipe:
    langs: tuple[str, str]  # (English, the other)
    train: tuple[tuple[Archive, str], ...]  # (archive, member with {l} for the language)
    val: tuple[Archive, str]
    test: tuple[Archive, str]  # {side}: src for English, ref for the other, as in the fairseq scripts

    @property
    def archives(self) -> list[Archive]:
        seen = {}
        for archive, _ in (*self.train, self.val, self.test):
            seen.setdefault(archive.url, archive)
        return list(seen.values())


RECIPES = {
    "wmt14-en-de": Recipe(
        ("en", "de"),
        train=((EUROPARL, "training/europarl-v7.de-en.{l}"), (COMMONCRAWL, "commoncrawl.de-en.{l}"),
               (NEWS_COMMENTARY_V9, "training/news-commentary-v9.de-en.{l}")),
        val=(DEV, "dev/newstest2013.{l}"),
        test=(TEST_FULL, "test-full/newstest2014-deen-{side}.{l}.sgm"),
    ),
    "wmt14-en-fr": Recipe(
        ("en", "fr"),
        train=((EUROPARL, "training/europarl-v7.fr-en.{l}"), (COMMONCRAWL, "commoncrawl.fr-en.{l}"),
               (UN, "un/undoc.2000.fr-en.{l}"), (NEWS_COMMENTARY_V9, "training/news-commentary-v9.fr-en.{l}"),
               (GIGA, "giga-fren.release2.fixed.{l}.gz")),
        val=(DEV, "dev/newstest2013.{l}"),
        test=(TEST_FULL, "test-full/newstest2014-fren-{side}.{l}.sgm"),
    ),
}
SPLIT_STEMS = ("train", "val", "test")
_SEG = re.compile(r"<seg[^>]*>(.*)</seg>", re.IGNORECASE)


def recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise UserError(f"unknown corpus '{name}' (known: {', '.join(RECIPES)})")
    return RECIPES[name]


def download(name: str, to: Path, mirror: str | None = None, checksums: dict[str, str] | None = None,
             progress: bool = True) -> Path:
    """Fetch every archive of `name` into `to/raw/` (resumable), then assemble the parallel files in `to`.

    `mirror`: a base URL serving the same file names (a local copy, or a test server); `checksums`: sha256 by
    archive name, over the recipe's (none is published for these archives: the ones seen go to SOURCES.json)."""
    r = recipe(name)
    raw = Path(to) / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    seen = {}
    for archive in r.archives:
        url = f"{mirror.rstrip('/')}/{archive.name}" if mirror else archive.url
        expected = (checksums or {}).get(archive.name, archive.sha256)
        seen[archive.name] = {"url": url, "sha256": fetch(url, raw / archive.name, expected, progress=progress),
                              "checked": expected is not None}
    counts = assemble(name, raw, Path(to))
    (Path(to) / "SOURCES.json").write_text(json.dumps({"corpus": name, "archives": seen, "pairs": counts},
                                                      indent=1) + "\n")
    return Path(to)


def _member(tar: tarfile.TarFile, archive: Path, path: str):
    try:
        f = tar.extractfile(path)
    except KeyError:
        f = None
    if f is None:
        raise UserError(f"{archive}: no file {path} in it (is it the archive the recipe names?)")
    return gzip.open(f) if path.endswith(".gz") else f


def _lines(stream, where: str):
    for raw in stream:
        # Decoded leniently: one stray byte in 36M lines must not stop the build; it becomes U+FFFD.
        yield raw.decode("utf-8", errors="replace").rstrip("\r\n")


def _sgm_lines(stream, where: str) -> list[str]:
    return [m.group(1).strip() for line in _lines(stream, where) if (m := _SEG.search(line))]


def assemble(name: str, raw: Path, to: Path) -> dict:
    """train/val/test.<lang> in `to`, from the archives in `raw`; returns the pairs per split and source."""
    r = recipe(name)
    en, other = r.langs
    counts: dict = {"train": {}}
    tmp = {(s, l): to / f".{s}.{l}.tmp" for s in SPLIT_STEMS for l in r.langs}
    outs = {}
    try:
        try:
            for key, path in tmp.items():
                outs[key] = open(path, "w", encoding="utf-8")
            for archive, pattern in r.train:
                with tarfile.open(raw / archive.name) as tar:
                    n = {}
                    for l in r.langs:
                        member = pattern.format(l=l)
                        n[l] = 0
                        for line in _lines(_member(tar, raw / archive.name, member), member):
                            outs["train", l].write(line + "\n")
                            n[l] += 1
                    if n[en] != n[other]:
                        raise UserError(f"{raw / archive.name}: {pattern.format(l=en)} has {n[en]} lines, "
                                        f"{pattern.format(l=other)} {n[other]}")
                    counts["train"][pattern.format(l="*")] = n[en]
            for split, (archive, pattern) in (("val", r.val), ("test", r.test)):
                with tarfile.open(raw / archive.name) as tar:
                    got = {}
                    for l in r.langs:
                        member = pattern.format(l=l, side="src" if l == en else "ref")
                        stream = _member(tar, raw / archive.name, member)
                        got[l] = _sgm_lines(stream, member) if member.endswith(".sgm") else list(_lines(stream, member))
                    if len(got[en]) != len(got[other]):
                        raise UserError(f"{raw / archive.name}: {split} sides differ ({len(got[en])} and "
                                        f"{len(got[other])} lines)")
                    for l in r.langs:
                        outs[split, l].write("".join(line + "\n" for line in got[l]))
                    counts[split] = len(got[en])
        finally:
            for f in outs.values():
                f.close()
        for (split, l), path in tmp.items():
            os.replace(path, to / f"{split}.{l}")
    except (tarfile.TarError, OSError, EOFError, gzip.BadGzipFile, io.UnsupportedOperation) as e:
        raise UserError(f"{raw}: cannot read the {name} archives ({e.__class__.__name__}: {e})") from None
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    return counts
