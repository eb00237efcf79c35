"""Small JSON state that proves its own content: the document carries its format and the
SHA-256 of everything else (values_digest, under the key the .pt checkpoints use for it),
is written atomically, and is given back only when the digest matches. For state kept
beside a framework's own checkpoint files, or inside one that the framework writes.

A document is made from the content as JSON gives it back (tuples become lists, keys
strings), so that its digest is the one a read computes."""

import json
from pathlib import Path

from hetcomm.files.verified import NON_TENSORS, CheckpointError, values_digest, write_atomically


def sealed(content: dict, format: int) -> dict:
    """content, as JSON gives it back, with its format and digest."""
    plain = json.loads(json.dumps(content))
    return {"format": format, **plain, "digests": {NON_TENSORS: values_digest(plain)}}


def unsealed(where, document, format: int) -> dict:
    """The content of a sealed document of `format`; CheckpointError naming `where` when
    it is not one, or when its content is not what was sealed (damaged or edited)."""
    if not isinstance(document, dict) or not isinstance(document.get("digests"), dict):
        raise CheckpointError(f"{where}: not a hetcomm state file (no digest)")
    if document.get("format") != format:
        raise CheckpointError(f"{where}: format {document.get('format')!r}, expected {format}")
    content = {key: value for key, value in document.items() if key not in ("format", "digests")}
    if values_digest(content) != document["digests"].get(NON_TENSORS):
        raise CheckpointError(f"{where}: does not hold what was written (damaged or edited)")
    return content


def write_json(path: Path, document: dict) -> None:
    """Writes a sealed document to `path`, atomically."""
    write_atomically(path, lambda f: f.write(json.dumps(document).encode()))


def read_json(path: Path):
    """The parsed JSON in `path`; CheckpointError naming it when it is missing or is not
    whole JSON (truncated, damaged)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}: unreadable ({type(error).__name__}: {error})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: not whole JSON, truncated or damaged ({error})") from None
