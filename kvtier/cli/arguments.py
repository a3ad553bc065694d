"""Argument types shared by the subcommands: a bad value is an argparse error naming the option
(``kvtier demo: error: argument --turns: must be >= 1, got 0``), before anything runs."""

from __future__ import annotations

import argparse
import os
import re
import socket
import tempfile
from collections.abc import Callable

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
PLOT_FORMATS = frozenset({"png", "pdf", "svg", "eps", "ps"})  # matplotlib saves these without extra packages


def at_least(low: int) -> Callable[[str], int]:
    """An integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def between(low: int, high: int) -> Callable[[str], int]:
    """An integer within [``low``, ``high``]."""

    def parse(text: str) -> int:
        value = at_least(low)(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {value}")
        return value

    return parse


def positive(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def size_in(unit: int, unit_name: str) -> Callable[[str], float]:
    """A size in ``unit`` bytes (``size_in(1 << 20, "MiB")``): a finite number > 0 that is at
    least one byte, as the tier it sizes (``int(value * unit)`` bytes) must be."""

    def parse(text: str) -> float:
        value = positive(text)
        if value * unit < 1:
            raise argparse.ArgumentTypeError(f"must be at least 1 byte ({1 / unit:.3g} {unit_name}), got {text}")
        return value

    return parse


mebibytes = size_in(1 << 20, "MiB")
gibibytes = size_in(1 << 30, "GiB")


def seconds(text: str) -> float:
    """A finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def non_empty(text: str) -> str:
    """Any text but the empty string."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, naming a device this process has."""
    if not _DEVICE.match(text):
        raise argparse.ArgumentTypeError(f"must be 'cpu', 'cuda' or 'cuda:N', got {text!r}")
    if text == "cpu":
        return text
    import torch

    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: CUDA is not available here (torch {torch.__version__})")
    index = int(text.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: this process sees {torch.cuda.device_count()} CUDA device(s)")
    return text


def free_port(text: str) -> int:
    """A TCP port (1-65535) that this process can listen on now, on 127.0.0.1 (the metrics server's
    address): a port in use is refused before a long run, not after it."""
    port = at_least(1)(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (1-65535), got {port}")
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"port {port} cannot be listened on here: {exc.strerror}") from None
    return port


def lengths(text: str) -> list[int]:
    """A comma-separated list of token counts, each >= 1 (``4096,16384``)."""
    values = []
    for part in text.split(","):
        try:
            values.append(at_least(1)(part.strip()))
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{exc} (a comma-separated list of token counts, each >= 1)") from None
    return values


def output_file(text: str) -> str:
    """A file to write at the end of a run, in a directory that exists, and not a directory itself;
    it is opened for writing now (and removed again if it was new): a typo or a place that takes no
    file is refused before a long run, not after it."""
    if text.endswith(os.sep) or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text}: a directory; name a file to write")
    directory = os.path.dirname(text) or "."
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"{text}: no directory {directory!r} to write it in")
    target = os.path.realpath(text)  # a link's file (a link whose file is not made yet stays a link)
    existed = os.path.exists(target)
    try:
        with open(text, "a"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: cannot be written ({exc.strerror or exc})") from None
    if not existed:
        os.remove(target)
    return text


def plot_file(text: str) -> str:
    """An ``output_file`` whose suffix names an image format the plot can be saved in."""
    path = output_file(text)
    suffix = os.path.splitext(path)[1].lower().lstrip(".")
    if suffix not in PLOT_FORMATS:
        raise argparse.ArgumentTypeError(f"{text}: name a file ending in one of {sorted(PLOT_FORMATS)}")
    return path


def kept_directory(text: str) -> str:
    """A directory a run keeps its files in (``~`` is the user's home, as the disk tier reads it):
    an existing one that takes files, or a new one that can be made (it is made by the run, not
    now). Probed by making a temporary directory in it (or in the nearest existing directory
    above it), removed again: a place that takes no file is refused before the run, where the
    tier it names would store nothing and the run report figures of no disk at all. Returns the
    path with ``~`` expanded, so that every part of the run uses the same directory."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    path = os.path.expanduser(text)
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if os.path.islink(existing) and not os.path.exists(existing):
        raise argparse.ArgumentTypeError(f"{text}: {existing!r} is a link to nothing; name a directory")
    if not os.path.isdir(existing):
        what = "a file" if existing == os.path.abspath(path) else f"{existing!r} is a file"
        raise argparse.ArgumentTypeError(f"{text}: {what}; name a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kvtier-probe-", dir=existing))
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: cannot be written ({exc.strerror or exc})") from None
    return path
