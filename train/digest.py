"""A file named by its bytes: the one SHA-256 reader of the checkpoints' manifests
(train/checkpoint.py) and of the token cache's keys (train/tokenizer.py).

Imports nothing heavy: train/preflight.py reaches it through the tokenizer before any process
group or model exists.
"""

import hashlib

CHUNK = 16 << 20  # hashing reads: large enough that hashlib, not Python, sets the pace


def file_digest(path: str) -> dict:
    """``{"bytes": size, "sha256": hex digest}`` of a file, read in CHUNK pieces."""
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return {"bytes": size, "sha256": h.hexdigest()}
