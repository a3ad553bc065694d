"""Stamps of files on local disk: whether the weights at a path are still the ones seen before.

A stamp is a digest of file names, sizes and modification times: weights trained again and saved
at the same path (a fine-tuned model or a LoRA adapter written over its earlier version) give
another stamp, the same files the same one, in any process on the machine (and on machines that
share the files, or copied them with their times). Reading it costs a directory listing, never
the files' bytes.
"""

from __future__ import annotations

import hashlib
import os

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
"""The files of a model directory that hold weights (the configuration is fingerprinted by its content)."""


def files_stamp(path: str, suffixes: tuple[str, ...] | None = None) -> str | None:
    """A digest of the names, sizes and modification times of the files of a local directory (its
    files ending in one of ``suffixes`` when given) or of one file; None where ``path`` is no local
    file or directory (a hub name, or a path that cannot be read), or a directory without such files."""
    if not path:
        return None
    try:
        if os.path.isdir(path):
            with os.scandir(path) as entries:
                files = sorted(
                    (e.name, e.stat().st_size, e.stat().st_mtime_ns)
                    for e in entries
                    if e.is_file() and (suffixes is None or e.name.endswith(suffixes))
                )
            if not files and suffixes is not None:
                return None
        elif os.path.isfile(path):
            stat = os.stat(path)
            files = [("", stat.st_size, stat.st_mtime_ns)]
        else:
            return None
    except OSError:
        return None
    return hashlib.blake2b(repr(files).encode(), digest_size=8).hexdigest()


def model_weights_stamp(model: str, revision: str | None) -> str | None:
    """What says which weights vLLM loads for ``model``: for a local directory (or one file, a
    GGUF) the stamp of its weight files; for a hub name the commit of its snapshot in the local
    Hugging Face cache (its files are stored by content: the commit alone fixes them, on every
    machine); None when neither is found."""
    if os.path.exists(model):
        return files_stamp(model, WEIGHT_SUFFIXES)
    snapshot = _cached_snapshot(model, revision)
    return None if snapshot is None else f"commit:{os.path.basename(snapshot)}"


def _cached_snapshot(repo_id: str, revision: str | None) -> str | None:
    """The directory of ``repo_id``'s snapshot in the local Hugging Face cache (the one its revision
    names there), or None: nothing is downloaded."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except Exception:  # an id the hub library refuses, or no such library: no snapshot to stamp
        return None
    return os.path.dirname(found) if isinstance(found, str) else None
