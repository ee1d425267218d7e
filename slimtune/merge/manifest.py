"""Hashes of inputs and outputs, the merged-model marker, and the reuse check.

A merge output is reused only when its manifest records the same input hashes and parameters and every
output file still hashes to what was written; anything else (partial, edited, corrupted) is recomputed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MANIFEST = "slimtune_manifest.json"
MARKER = "slimtune_merged"  # key written into the merged config.json
_VERSION = 1
_BLOB = re.compile(r"[0-9a-f]{64}")


def sha256_file(path: Path) -> str:
    """sha256 of a file. A Hub-cache snapshot file links to `blobs/<sha256>` (verified by huggingface_hub on
    download), so its name is used instead of re-reading gigabytes."""
    if path.is_symlink():
        target = Path(os.path.realpath(path))
        if target.parent.name == "blobs" and _BLOB.fullmatch(target.name):
            return target.name
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(16 * 1024**2):
            h.update(chunk)
    return h.hexdigest()


def hash_files(files: dict[str, Path]) -> dict[str, str]:
    """Hash files in parallel: hashlib releases the GIL, so 8 threads read and hash 8 shards at once."""
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(files)))) as pool:
        digests = pool.map(sha256_file, files.values())
        return dict(zip(files, digests))


def adapter_digest(adapter_hashes: dict[str, str]) -> str:
    """One hash naming the adapter, for the merged-model marker."""
    return hashlib.sha256(json.dumps(adapter_hashes, sort_keys=True).encode()).hexdigest()


def write_manifest(directory: Path, inputs: dict[str, str], params: dict, outputs: dict[str, str]) -> None:
    """Write the manifest last (to a temporary name), so its presence means the outputs are complete."""
    body = {"version": _VERSION, "inputs": inputs, "params": params, "outputs": outputs}
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(body, indent=1, sort_keys=True))
    os.replace(tmp, directory / MANIFEST)


def read_manifest(directory: Path) -> dict | None:
    """The manifest of a previous merge, or None when absent or unreadable."""
    try:
        return json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def reusable(out_dir: Path, inputs: dict[str, str], params: dict) -> bool:
    """True when `out_dir` holds a complete merge of exactly these inputs whose files all verify."""
    m = read_manifest(out_dir)
    if not m or m.get("version") != _VERSION or m.get("inputs") != inputs or m.get("params") != params:
        return False
    outputs: dict[str, str] = m.get("outputs") or {}
    present = {p.name for p in out_dir.iterdir() if p.is_file()} - {MANIFEST}
    if present != set(outputs):
        return False
    return hash_files({n: out_dir / n for n in outputs}) == outputs
