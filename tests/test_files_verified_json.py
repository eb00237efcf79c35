"""hetcomm.files.verified_json: a sealed document reads back as its content as JSON gives
it (tuples as lists), its digest the SHA-256 of that content computed independently here;
a changed value, a truncated file, another format and a document without a digest are
refused naming the file."""

import hashlib
import json

import pytest

from hetcomm.files.verified import NON_TENSORS, CheckpointError
from hetcomm.files.verified_json import read_json, sealed, unsealed, write_json

CONTENT = {"steps": 3, "sizes": (5, 5, 5, 1), "estimates": {"speed": 0.25, "level": None}, "fixed": False}


def test_a_sealed_file_reads_back_as_its_content_in_json(tmp_path):
    path = tmp_path / "state.json"
    write_json(path, sealed(CONTENT, 2))
    document = read_json(path)
    plain = {"estimates": [("'level'", None), ("'speed'", 0.25)], "fixed": False, "sizes": ("list", [5, 5, 5, 1]),
             "steps": 3}
    skeleton = [(repr(key), plain[key]) for key in sorted(plain, key=repr)]
    assert document["digests"] == {NON_TENSORS: hashlib.sha256(repr(skeleton).encode()).hexdigest()}
    assert unsealed(path, document, 2) == {**CONTENT, "sizes": [5, 5, 5, 1]}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]   # no temporary left


@pytest.mark.parametrize("spoil, named", [
    (lambda text: text.replace('"steps": 3', '"steps": 4'), "does not hold what was written"),
    (lambda text: text.replace('"format": 2', '"format": 3'), "format 3, expected 2"),
    (lambda text: json.dumps(CONTENT), "not a hetcomm state file"),
])
def test_a_changed_document_is_refused_naming_the_file(tmp_path, spoil, named):
    path = tmp_path / "state.json"
    write_json(path, sealed(CONTENT, 2))
    path.write_text(spoil(path.read_text()))
    with pytest.raises(CheckpointError, match=f"^{path}: {named}"):
        unsealed(path, read_json(path), 2)


def test_a_truncated_or_missing_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "state.json"
    write_json(path, sealed(CONTENT, 2))
    path.write_text(path.read_text()[:40])
    with pytest.raises(CheckpointError, match=f"^{path}: not whole JSON, truncated or damaged"):
        read_json(path)
    with pytest.raises(CheckpointError, match="no such file"):
        read_json(tmp_path / "absent.json")
