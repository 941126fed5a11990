"""One file over HTTP(S): resumable (HTTP Range), with a progress bar and, where the sha256 is known, checked.

A download that stops half way leaves `<name>.part`; the next call asks the server for the rest
(`Range: bytes=<have>-`, RFC 9110 §14) and appends it, or starts over when the server ignores the range (a 200 reply
rather than 206). The finished file is renamed into place only after its checksum matched, so a file under its
final name is always whole.
"""

from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.request
from pathlib import Path

from dtrain.common.errors import UserError
from dtrain.common.progress import Bar

CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def fetch(url: str, dest: Path, sha256: str | None = None, timeout: float = 60, progress: bool = True) -> str:
    """`url` saved as `dest` (resuming `dest.part` if there is one); returns the file's sha256.

    A file already at `dest` is kept if it matches `sha256` (or no checksum is known). A mismatch removes the
    download (a corrupt part would only be resumed into a corrupt whole) and raises a one-line `UserError`."""
    dest = Path(dest)
    if dest.is_file():
        digest = sha256_of(dest)
        if sha256 is None or digest == sha256:
            return digest
        dest.unlink()  # a stale or corrupt copy: fetch it again
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.is_file() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            if have and resp.status != 206:  # the server sends the whole file: start over
                have = 0
            length = resp.headers.get("Content-Length")
            total = have + int(length) if length else None
            bar = Bar(total, dest.name, "B", enabled=progress, unit_scale=True)
            bar.update(have)
            with open(part, "ab" if have else "wb") as out:
                for block in iter(lambda: resp.read(CHUNK), b""):
                    out.write(block)
                    bar.update(len(block))
            bar.close()
    except urllib.error.HTTPError as e:
        if not (e.code == 416 and have):  # 416 with a part: nothing left to send, the part is whole
            raise UserError(f"download of {url} failed: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        kept = f"; {part} kept, run again to resume" if part.is_file() else ""
        raise UserError(f"download of {url} failed ({getattr(e, 'reason', e)}){kept}") from None
    digest = sha256_of(part)
    if sha256 is not None and digest != sha256:
        part.unlink()
        raise UserError(f"{dest.name}: sha256 {digest} does not match the expected {sha256} ({url}); "
                        "the download was removed")
    os.replace(part, dest)
    return digest
