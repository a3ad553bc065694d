"""Holding a background worker at the start of its work, to run other operations meanwhile."""

from __future__ import annotations

import threading


def hold(monkeypatch, cls: type, name: str) -> tuple[threading.Event, threading.Event]:
    """Make ``cls.name`` (a worker's job) wait for ``release`` before it runs; ``started`` is set
    when one waits. Returns (started, release)."""
    started, release = threading.Event(), threading.Event()
    real = getattr(cls, name)

    def held(self, *args):
        started.set()
        release.wait(10)
        return real(self, *args)

    monkeypatch.setattr(cls, name, held)
    return started, release
