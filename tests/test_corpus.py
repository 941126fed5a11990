import gzip
import hashlib
import io
import json
import random
import subprocess
import sys
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dtrain.collectives import dist as ddist
from dtrain.common.errors import UserError
from dtrain.engine import config, corpus, wmt14
from dtrain.engine.download import fetch

REPO = Path(__file__).resolve().parents[1]
WORDS = {"en": "the a house cat dog sits on table green small big runs river city old".split(),
         "de": "der die das Haus Katze Hund sitzt auf Tisch grün klein groß läuft Fluss Stadt alt".split()}


def synthetic(n, seed):
    rng = random.Random(seed)
    out = {"en": [], "de": []}
    for _ in range(n):
        idx = [rng.randrange(len(WORDS["en"])) for _ in range(rng.randint(1, 12))]
        for lang in out:
            out[lang].append(" ".join(WORDS[lang][i] for i in idx))
    return out


class Server:
    """A local HTTP server for `files` (name → bytes) that honours `Range: bytes=N-` (206) unless told not to,
    and records the Range header of every request."""

    def __init__(self, files, honour_range=True):
        self.files, self.ranges = files, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = outer.files.get(self.path.lstrip("/"))
                if body is None:
                    self.send_error(404)
                    return
                rng = self.headers.get("Range")
                outer.ranges.append(rng)
                start = int(rng.split("=")[1].rstrip("-")) if rng and honour_range else 0
                if start >= len(body) and rng and honour_range:
                    self.send_error(416)
                    return
                self.send_response(206 if start else 200)
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                self.wfile.write(body[start:])

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _tar(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _text(lines):
    return "".join(line + "\n" for line in lines).encode()


def _sgm(lines):
    segs = "".join(f'<seg id="{i}"> {line} </seg>\n' for i, line in enumerate(lines, 1))
    return f'<srcset setid="newstest2014">\n<doc docid="x">\n{segs}</doc>\n</srcset>\n'.encode()


def wmt14_en_de_archives():
    """Small archives laid out as statmt.org's (member names from the recipe), and the pairs in each."""
    r = wmt14.RECIPES["wmt14-en-de"]
    archives: dict[str, dict[str, bytes]] = {}
    train = []
    for k, (archive, pattern) in enumerate(r.train):
        data = synthetic(50 + 10 * k, seed=k)
        train.append(data)
        for lang in ("en", "de"):
            archives.setdefault(archive.name, {})[pattern.format(l=lang)] = _text(data[lang])
    val, test = synthetic(20, 10), synthetic(25, 11)
    for lang in ("en", "de"):
        archives.setdefault(r.val[0].name, {})[r.val[1].format(l=lang)] = _text(val[lang])
        side = "src" if lang == "en" else "ref"
        archives.setdefault(r.test[0].name, {})[r.test[1].format(l=lang, side=side)] = _sgm(test[lang])
    return {name: _tar(m) for name, m in archives.items()}, train, val, test


def test_download_assembles_wmt14_from_a_mirror(tmp_path):
    blobs, train, val, test = wmt14_en_de_archives()
    server = Server(blobs)
    try:
        out = wmt14.download("wmt14-en-de", tmp_path / "wmt", server.url, progress=False)
    finally:
        server.close()
    for lang in ("en", "de"):
        assert (out / f"train.{lang}").read_text().splitlines() == [x for d in train for x in d[lang]]
        assert (out / f"val.{lang}").read_text().splitlines() == val[lang]
        assert (out / f"test.{lang}").read_text().splitlines() == test[lang]  # seg text, stripped
    sources = json.loads((out / "SOURCES.json").read_text())
    assert sources["pairs"]["test"] == 25 and sum(sources["pairs"]["train"].values()) == 50 + 60 + 70
    assert sources["archives"]["dev.tgz"]["sha256"] == hashlib.sha256(blobs["dev.tgz"]).hexdigest()


def test_download_resumes_a_partial_file(tmp_path):
    body = bytes(random.Random(1).randbytes(300_000))
    server = Server({"big.tgz": body})
    try:
        (tmp_path / "big.tgz.part").write_bytes(body[:123_456])
        digest = fetch(f"{server.url}/big.tgz", tmp_path / "big.tgz", hashlib.sha256(body).hexdigest(),
                       progress=False)
    finally:
        server.close()
    assert server.ranges == ["bytes=123456-"]  # only the rest was asked for
    assert (tmp_path / "big.tgz").read_bytes() == body and digest == hashlib.sha256(body).hexdigest()
    assert not (tmp_path / "big.tgz.part").exists()


def test_a_server_that_ignores_range_restarts_the_download(tmp_path):
    body = b"0123456789" * 1000
    server = Server({"f.gz": body}, honour_range=False)
    try:
        (tmp_path / "f.gz.part").write_bytes(b"garbage")
        fetch(f"{server.url}/f.gz", tmp_path / "f.gz", progress=False)
    finally:
        server.close()
    assert (tmp_path / "f.gz").read_bytes() == body


def test_checksum_mismatch_is_an_error_and_keeps_nothing(tmp_path):
    server = Server({"f.tgz": b"not what was expected"})
    try:
        with pytest.raises(UserError, match=r"f\.tgz: sha256 [0-9a-f]{64} does not match the expected 0{64}"):
            fetch(f"{server.url}/f.tgz", tmp_path / "f.tgz", "0" * 64, progress=False)
        with pytest.raises(UserError, match="HTTP 404"):
            fetch(f"{server.url}/missing.tgz", tmp_path / "missing.tgz", progress=False)
    finally:
        server.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_cli_download_then_train_data_from_it(tmp_path):
    blobs, train, _, _ = wmt14_en_de_archives()
    server = Server(blobs)
    try:
        bad = subprocess.run([sys.executable, "-m", "dtrain.engine.corpus", "download", "wmt14-en-de", "--to",
                              str(tmp_path / "w"), "--mirror", server.url, "--sha256", "dev.tgz=" + "1" * 64],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("dtrain.engine.corpus: error: dev.tgz")
        ok = subprocess.run([sys.executable, "-m", "dtrain.engine.corpus", "download", "wmt14-en-de", "--to",
                             str(tmp_path / "w"), "--mirror", server.url], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    finally:
        server.close()
    assert ok.returncode == 0, ok.stderr
    cfg = config.from_dict({"data": {"corpus": "wmt14-en-de", "dir": str(tmp_path / "w"), "vocab_size": 60,
                                     "cache_dir": str(tmp_path / "cache"), "bpe_sample": 40}})
    _, _, train_pairs, val = corpus.load(cfg.data, cfg.seed)
    n = sum(len(d["en"]) for d in train)
    assert 0 < len(train_pairs) <= n and len(val) == 20  # cleaning (on for wmt14) only touches training pairs
    assert train_pairs.meta["clean"] and train_pairs.meta["stats"]["read"] == n


def _files_profile(tmp_path, n=400, **data):
    d = synthetic(n, 3)
    paths = {}
    for split, lines in (("train", d), ("val", synthetic(30, 4)), ("test", synthetic(30, 5))):
        pair = []
        for lang in ("en", "de"):
            p = tmp_path / f"{split}.{lang}.gz"
            with gzip.open(p, "wt", encoding="utf-8") as f:
                f.write("".join(x + "\n" for x in lines[lang]))
            pair.append(str(p))
        paths[split] = pair
    raw = {"data": {"corpus": "files", "files": paths, "vocab_size": 60, "cache_dir": str(tmp_path / "cache"),
                    **data}}
    return raw, d


def test_files_corpus_loads_cached_pairs_and_reuses_the_cache(tmp_path, monkeypatch):
    raw, d = _files_profile(tmp_path, train_limit=300)
    cfg = config.from_dict(raw)
    _, tok, train, val = corpus.load(cfg.data, cfg.seed)
    assert len(train) == 300 and len(val) == 30 and not train.meta["clean"]  # files: cleaning off by default
    assert tok.decode([train.src[7][:-1].tolist()]) == [d["en"][7]]

    def no_second_pass(*args):
        raise AssertionError("the corpus was read again to find the BPE model")
    monkeypatch.setattr(corpus, "sample_pairs", no_second_pass)
    again = corpus.load(cfg.data, cfg.seed)[2]
    assert again.directory == train.directory
    assert len(list((tmp_path / "cache" / "tokens").glob("*.lock"))) == 2  # train and val, built once each
    assert corpus.split_text(cfg.data, "test")[1][:2] == synthetic(30, 5)["de"][:2]


def test_bad_corpus_input_is_a_one_line_error_naming_it(tmp_path):
    raw, _ = _files_profile(tmp_path)
    raw["data"]["files"]["val"][1] = str(tmp_path / "nope.de")
    with pytest.raises(UserError, match=r"data\.files\.val: .*nope\.de: file not found"):
        corpus.load(config.from_dict(raw).data, 1)
    raw, _ = _files_profile(tmp_path)
    with gzip.open(tmp_path / "train.de.gz", "at") as f:
        f.write("extra line\n")
    with pytest.raises(UserError, match=r"train\.en\.gz:401: line counts differ"):
        corpus.load(config.from_dict(raw).data, 1)
    cfg = config.from_dict({"data": {"corpus": "wmt14-en-fr", "src": "en", "tgt": "fr", "dir": str(tmp_path)}})
    with pytest.raises(UserError, match="python -m dtrain.engine.corpus download wmt14-en-fr --to DIR"):
        corpus.load(cfg.data, 1)


def test_profile_validation_of_the_corpus_keys():
    with pytest.raises(UserError, match="'data.files' is needed"):
        config.from_dict({"data": {"corpus": "files"}})
    with pytest.raises(UserError, match="'data.files.train' must be a list of 2 values"):
        config.from_dict({"data": {"corpus": "files", "files": {"train": ["a"], "val": ["b", "c"]}}})
    with pytest.raises(UserError, match="'data.src' wmt14-en-fr is en/fr"):
        config.from_dict({"data": {"corpus": "wmt14-en-fr"}})
    for name in ("wmt14-en-de-base.yaml", "wmt14-en-fr-big.yaml", "base.yaml"):
        config.load(REPO / "dtrain" / "profiles" / name)


def _rank_loads(rank, world, init, cases):
    """Each case's corpus loaded on this rank (its profile `raws[rank]`); what it gave, into the case's folder."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    for raws, out in cases:
        try:
            corpus.load(config.from_dict(raws[rank]).data, 1)
            result = "ok"
        except UserError as e:
            result = str(e)
        Path(out, f"rank{rank}").write_text(result)
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_agree_on_the_corpus_or_all_fail_alike(tmp_path):
    """Rank 1's copy of the files holds other pairs, or lacks a file: both ranks fail with rank 1's error (both
    cases in one spawn)."""
    cases, expected = [], {}
    for case in ("other_files", "missing_file"):
        raws = []
        for rank in range(2):  # two "nodes": each its own copy of the files and its own cache
            folder = tmp_path / case / f"node{rank}"
            folder.mkdir(parents=True)
            raws.append(_files_profile(folder)[0])
        node1 = tmp_path / case / "node1"
        if case == "other_files":
            with gzip.open(node1 / "train.en.gz", "at") as f, gzip.open(node1 / "train.de.gz", "at") as g:
                f.write("one more\n"), g.write("noch einer\n")
            expected[case] = "rank 1: its copy of the files corpus gives other pairs than rank 0's"
        else:
            (node1 / "val.de.gz").unlink()
            expected[case] = "rank 1: data.files.val:"
        cases.append((raws, str(tmp_path / case)))
    ddist.spawn(_rank_loads, (2, f"file://{tmp_path / 'rdzv'}", cases), 2)
    for case, want in expected.items():
        results = [(tmp_path / case / f"rank{r}").read_text() for r in range(2)]
        assert results[0] == results[1] and results[0].startswith(want), (case, results)
