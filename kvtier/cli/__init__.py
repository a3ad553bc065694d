"""``kvtier`` on the command line: ``demo``, ``bench copy|manager|e2e|hf|vllm``, ``probe``.

Each subcommand lives in its own module, listed in ``SUBCOMMANDS`` or ``BENCHES``, which defines
``add_arguments(parser)`` and ``run(args) -> int``. Only the module of the subcommand being run
is imported, so ``kvtier probe`` does not pay for the engine. A value kvtier refuses while a
command runs (``ValueError``: a model name, tiers too small for the workload, a GPU benchmark
without a GPU; a disk directory in use) ends it with its message on stderr and exit status 2,
as argparse ends a bad option. Ctrl-C once ``main`` runs ends it with one line and status 130,
as a shell reports an interrupted command; the managers and temporary directories of the run are
closed on the way. SIGTERM (``kill``, ``timeout``, a container stopped) ends it the same way,
with ``terminated`` and status 143. (One during the first imports, of torch by ``kvtier``, before
``main`` is called, is Python's own traceback, or for SIGTERM its default: the process ends at
once.)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import sys
import threading
from collections.abc import Iterator

from kvtier import interrupts
from kvtier.cli.arguments import output_file
from kvtier.errors import DiskTierBusyError, OutOfPagesError

INTERRUPTED = 130  # the exit status of a command ended by Ctrl-C (128 + SIGINT)
TERMINATED = 143  # the exit status of a command ended by SIGTERM (128 + SIGTERM)

# subcommand -> (module, help). Each module defines add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("kvtier.cli.demo", "multi-turn chat workload: kvtier against a no-reuse baseline"),
    "probe": ("kvtier.cli.probe", "the device, link kind, chosen copy paths and knob values"),
}
# bench targets -> (module, help), under ``kvtier bench``.
BENCHES: dict[str, tuple[str, str]] = {
    "manager": ("kvtier.cli.bench_manager", "manager CPU overhead (docs/benchmarks.md target 2)"),
    "copy": ("kvtier.cli.bench_copy", "host<->GPU page copy paths (docs/benchmarks.md target 1)"),
    "e2e": ("kvtier.cli.bench_e2e", "TTFT of a prefix back from each tier, a full GPU, a busy queue (targets 3-5)"),
    "vllm": ("kvtier.cli.bench_vllm", "the vLLM connector's block saves and loads in vLLM's KV layout (GPU)"),
    "hf": ("kvtier.cli.bench_hf", "kvtier.hf: TTFT of a transformers chat's second turn, history on GPU/host/disk"),
}


def _parser(selected: tuple[str | None, str | None]) -> argparse.ArgumentParser:
    """The parser; only the selected (command, bench target) module adds its arguments."""
    parser = argparse.ArgumentParser(prog="kvtier", description="A tiered, paged KV-cache manager.")
    subs = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub = subs.add_parser(name, help=help_text)
        sub.set_defaults(_module=module)
        if selected[0] == name:
            importlib.import_module(module).add_arguments(sub)
    bench = subs.add_parser("bench", help="benchmarks: " + ", ".join(BENCHES))
    targets = bench.add_subparsers(dest="target", required=True)
    for name, (module, help_text) in BENCHES.items():
        sub = targets.add_parser(name, help=help_text)
        sub.set_defaults(_module=module)
        sub.add_argument("--json", metavar="PATH", type=output_file, help="write the full figures as JSON to PATH")
        if selected == ("bench", name):
            importlib.import_module(module).add_arguments(sub)
    return parser


def _selected(argv: list[str]) -> tuple[str | None, str | None]:
    words = [a for a in argv if not a.startswith("-")]
    command = words[0] if words else None
    target = words[1] if command == "bench" and len(words) > 1 else None
    return command, target


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    selected = _selected(argv)
    command = " ".join(word for word in ("kvtier", *selected) if word)  # until the arguments are read
    with _sigterm_as_interrupt() as terminated:
        try:
            args = _parser(selected).parse_args(argv)  # (imports the command's module)
            command = " ".join(word for word in ("kvtier", args.command, getattr(args, "target", None)) if word)
            return int(importlib.import_module(args._module).run(args) or 0)
        except (ValueError, DiskTierBusyError, OutOfPagesError) as refused:  # refused: its message says what to change
            print(f"{command}: error: {refused}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"{command}: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
            return TERMINATED if terminated else INTERRUPTED


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[list[int]]:
    """While the command runs, SIGTERM interrupts it as Ctrl-C does (``kvtier.interrupts``), so the
    run closes its managers and temporary directories; the list yielded gets the signal's number.
    Only on the main thread (elsewhere nothing changes); the previous handler is put back."""
    terminated: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield terminated
        return

    def on_sigterm(signum: int, frame: object) -> None:
        terminated.append(signum)
        interrupts.interrupt_main()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield terminated
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
