"""checklist.chk: the md5 of every file of a Meta checkpoint, in md5sum's format, as Meta ships it; written
beside every checkpoint this package saves and verified before one is trusted."""

import hashlib
import re
from pathlib import Path
from typing import Iterable, List, Tuple

CHECKLIST = "checklist.chk"


def md5_file(path, chunk: int = 1 << 20) -> str:
    """md5 of a file read in chunks (checkpoints are far larger than RAM allows reading whole)."""
    h = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_checklist(out_dir, names: Iterable[str]) -> Path:
    """checklist.chk in md5sum's format, as Meta ships it: `<md5>  <filename>` per line."""
    out_dir = Path(out_dir)
    path = out_dir / CHECKLIST
    path.write_text("".join(f"{md5_file(out_dir / n)}  {n}\n" for n in names))
    return path


def read_checklist(path) -> List[Tuple[str, str]]:
    """(md5, filename) pairs of a checklist; md5sum's binary marker `*name` is accepted."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checklist {path} not found")
    entries = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        m = re.fullmatch(r"([0-9a-fA-F]{32}) [ *](.+)", line.rstrip("\r"))
        if not m:
            raise ValueError(f"{path} line {i} is not `<md5>  <filename>`: {line[:80]!r}")
        name = m.group(2)
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"{path} line {i} names a file outside its directory: {name!r}")
        entries.append((m.group(1).lower(), name))
    if not entries:
        raise ValueError(f"checklist {path} lists no files")
    return entries


def verify_checklist(ckpt_dir, checklist: str = CHECKLIST) -> List[str]:
    """Check every file listed in checklist.chk against its md5; return the names verified.

    Raises FileNotFoundError for a missing checklist or listed file, ValueError naming every corrupt file, and
    ValueError for a shard present but not listed (it could not be trusted).
    """
    ckpt_dir = Path(ckpt_dir)
    entries = read_checklist(ckpt_dir / checklist)
    bad = []
    for want, name in entries:
        path = ckpt_dir / name
        if not path.is_file():
            raise FileNotFoundError(f"{path} is listed in {checklist} but does not exist")
        got = md5_file(path)
        if got != want:
            bad.append(f"{name} (md5 {got}, expected {want})")
    if bad:
        raise ValueError(f"checksum mismatch in {ckpt_dir}: {'; '.join(bad)} -- the file is corrupt or incomplete")
    listed = {name for _, name in entries}
    unlisted = [p.name for p in sorted(ckpt_dir.glob("*.pth")) if p.name not in listed]
    if unlisted:
        raise ValueError(f"{ckpt_dir / unlisted[0]} is not listed in {checklist}, so it cannot be verified")
    return [name for _, name in entries]
