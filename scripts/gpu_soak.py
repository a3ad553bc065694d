"""A time-boxed soak on a CUDA device, where the copies run on the mover's own streams.

Rounds until ``--seconds`` run out, each of three parts, every one drawing fresh random cases:

- the property machines of ``tests/test_cache_properties.py`` and
  ``tests/test_background_properties.py`` (write-through, the free reserve, the disk written
  behind) on the device, every page checked byte for byte after each step;
- ``tests/test_reliability_soak.py``'s churn of requests over three tiers on the device, with a
  restart (the manager closed and opened again on its directory) that serves back every block
  restored from disk;
- the reference engine (tiny llama, sliding-window and hybrid models in float64) with random
  tiers, scheduling and prefetch policies, each answer checked against the dense oracle.

CPU runs of the same parts are the test suite's; here they meet the device's streams, pinned
memory and the copy paths. Prints a line per failure as it happens and a table last; exits 1 on
any failure. Run from the source tree: ``PYTHONPATH=. python scripts/gpu_soak.py --seconds 240``.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

os.environ.setdefault("KVTIER_DEBUG", "1")  # every invariant checked after each call

import torch
from hypothesis import HealthCheck, settings

import kvtier
import tests.test_background_properties as background
import tests.test_cache_properties as properties
from kvtier.engine import LLMEngine, SamplingParams, SchedulerConfig
from kvtier.models import build_model
from tests.test_engine import page_bytes
from tests.test_reliability_soak import Churn, verify_restored
from tests.test_tiers import manager

KINDS = ("llama", "swa", "hybrid")
MODELS = {"llama": "tiny-llama", "swa": "tiny-swa", "hybrid": "tiny-hybrid"}


def machines(device: str) -> list[tuple[str, type]]:
    """The property machines, each on ``device``."""
    out = []
    for kind in KINDS:
        out += [
            (f"tiers {kind}", properties.machine(kind, {"primary": 8, "host": 6, "disk": 20}, device=device)),
            (f"write-through {kind}", background.machine(kind, {"primary": 10, "host": 12}, 0.2, device=device)),
            (
                f"selective write-through {kind}",
                background.machine(kind, {"primary": 10, "host": 12}, 0.2, device=device, min_hits=1),
            ),
            (f"behind {kind}", background.machine(kind, {"primary": 8, "host": 6, "disk": 20}, 0.0, device=device)),
        ]
    return out


def run_machine(machine: type, examples: int) -> None:
    machine.TestCase.settings = settings(
        max_examples=examples,
        stateful_step_count=40,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    machine.TestCase().runTest()


def churn(kind: str, seed: int, device: str) -> None:
    """Random requests, a restart, every restored block served back; then more requests."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        for steps in (150, 100):  # the second manager opens what the first left on disk
            mgr = manager(Path(tmp), kind=kind, primary=10, host=8, disk=48, device=device, snapshot_interval_blocks=2)
            if steps == 100:
                verify_restored(mgr)
            work = Churn(mgr, rng)
            for _ in range(steps):
                work.step()
            for cache, _ in work.kept:
                cache.close()
            mgr.check_invariants()
            mgr.close()


def engine_round(kind: str, seed: int, device: str) -> None:
    """One engine with random tiers and policies; two or three turns, each answer against the oracle."""
    rng = random.Random(seed)
    model = build_model(MODELS[kind], device, torch.float64, seed=seed % 3)
    pb = page_bytes(model)
    with tempfile.TemporaryDirectory() as tmp:
        tiers = [kvtier.PrimaryTier(pb * rng.choice([24, 40, 64]))]
        if rng.random() < 0.8:
            tiers.append(kvtier.HostTier(pb * rng.choice([4, 12, 40]), write_through=rng.choice([None, False])))
        if rng.random() < 0.7:
            tiers.append(kvtier.DiskTier(pb * 400, tmp))
        config = kvtier.CacheConfig(16, tiers, device=device, snapshot_interval_blocks=2)
        scheduler = SchedulerConfig(
            policy=rng.choice(["guaranteed_no_evict", "max_utilization"]),
            max_num_tokens=rng.choice([64, 256]),
            max_batch_size=rng.choice([2, 8]),
            prefetch_policy=rng.choice(["off", "best_effort", "timeout", "wait_complete"]),
            recompute_when_faster=False,
        )
        g = torch.Generator().manual_seed(seed)
        shared = torch.randint(0, model.vocab_size, (rng.choice([0, 40, 90]),), generator=g).tolist()
        prompts = [
            shared + torch.randint(0, model.vocab_size, (rng.randrange(5, 60),), generator=g).tolist()
            for _ in range(rng.randrange(2, 7))
        ]
        with LLMEngine(model, config, scheduler) as eng:
            for _ in range(rng.choice([2, 3])):
                max_tokens = rng.randrange(1, 6)
                outs = eng.generate(prompts, SamplingParams(max_tokens=max_tokens))
                for prompt, out in zip(prompts, outs, strict=True):
                    expected = model.reference_generate(prompt, max_tokens)
                    if out.token_ids != expected:
                        raise AssertionError(f"request {out.request_id}: {out.token_ids} != {expected}")
                prompts = [
                    p + o.token_ids + [rng.randrange(model.vocab_size)] for p, o in zip(prompts, outs, strict=True)
                ]
            eng.cache_manager.check_invariants()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=240.0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--examples", type=int, default=10, help="examples per property machine and round")
    args = parser.parse_args()
    logging.getLogger("kvtier").setLevel(logging.ERROR)  # the tests' set-ups warn by design (no model_id)
    deadline = time.monotonic() + args.seconds
    runs: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    seed = random.SystemRandom().randrange(1 << 30)
    print(f"gpu soak on {args.device}, first seed {seed}, KVTIER_DEBUG={os.environ['KVTIER_DEBUG']}", flush=True)
    cases = [(f"machine {name}", lambda m=m: run_machine(m, args.examples)) for name, m in machines(args.device)]
    while time.monotonic() < deadline:
        round_cases = list(cases)
        for kind in KINDS:
            round_cases.append((f"churn {kind} seed {seed}", lambda k=kind, s=seed: churn(k, s, args.device)))
            round_cases.append((f"engine {kind} seed {seed}", lambda k=kind, s=seed: engine_round(k, s, args.device)))
            seed += 1
        random.shuffle(round_cases)
        for name, case in round_cases:
            if time.monotonic() >= deadline:
                break
            runs[name.split(" ")[0]] += 1
            try:
                case()
            except Exception:
                failures[name.split(" ")[0]] += 1
                print(f"FAIL {name}", flush=True)  # (a machine's failing example is in its traceback)
                traceback.print_exc()
    print(f"{'part':10s} {'runs':>6s} {'failures':>9s}")
    for part in ("machine", "churn", "engine"):
        print(f"{part:10s} {runs[part]:6d} {failures[part]:9d}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
