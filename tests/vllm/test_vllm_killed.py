"""A vLLM engine with kvtier's connector killed (SIGKILL) while it serves and writes its host
memory's coldest pages to disk behind it, then restarted on the same directory.

Each round's child process serves a pool of sixteen 120-token prompts of its own, over and over,
with host memory for 40 pages: published blocks are written to disk in the background all the
time, and pushed out of host memory. It is killed at a random point once it has added pages to
the disk. A new engine on the directory then serves every prompt of every round so far: the
runner checks before each forward that every position counted as computed holds that request's
own KV (``WrongKV``), so a block restored from a torn write, or from a row naming a slot rewritten
since, fails the test.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vLLM 0.33 or 0.34 (bash .ci/vllm_env.sh)")

from tests.vllm.harness import host_pages_engine, prompt

ROOT = Path(__file__).resolve().parents[2]
POOL = 16  # prompts the child cycles through (16 x 7 full blocks: more than host memory holds)
PROMPT_TOKENS = 120

CHILD = """
import sys
from pathlib import Path
from tests.vllm.harness import host_pages_engine
from tests.vllm.test_vllm_killed import pool_prompt, POOL
round_ = int(sys.argv[2])
engine = host_pages_engine(Path(sys.argv[1]), 40)


def on_disk():
    return engine.kv_scheduler.manager.stats().tiers["disk"].pages_used


found = on_disk()
for k in range(10**9):
    for j in range(4):
        i = (4 * k + j) % POOL
        engine.add(f"c{k}-{j}", pool_prompt(round_, i) + [k % 7 + 1], max_tokens=2)
    engine.run()
    print(on_disk() - found, flush=True)
"""


def pool_prompt(round_: int, i: int) -> list[int]:
    return prompt(1000 + 100 * round_ + i, PROMPT_TOKENS)


def kill_while_serving(tmp_path: Path, round_: int, rng: random.Random) -> None:
    """Run round ``round_``'s child until it has added 20 pages or more to the disk, then SIGKILL
    it at a random point."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    command = [sys.executable, "-c", CHILD, str(tmp_path), str(round_)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, env=env)
    try:
        while True:
            line = child.stdout.readline()
            assert line, f"the child ended first (exit code {child.wait()})"
            if int(line) >= 20:
                break
        time.sleep(rng.uniform(0.0, 0.4))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()


def test_an_engine_killed_while_it_writes_to_disk_restarts_with_its_own_kv(tmp_path):
    """Three kills, each followed by an engine that serves every round's pool so far on what the
    killed one left (and then shuts down, persisting, for the next child): no position ever holds
    another prefix's KV, nothing is left held, and every restart loads blocks from disk."""
    rng = random.Random(3)
    for round_ in range(3):
        kill_while_serving(tmp_path, round_, rng)
        engine = host_pages_engine(tmp_path, 200)
        engine.poison()
        rids = [f"r{round_}-{past}-{i}" for past in range(round_ + 1) for i in range(POOL)]
        for rid in rids:
            _, past, i = rid.split("-")
            engine.add(rid, pool_prompt(int(past), int(i)) + [9], max_tokens=2)
        engine.run(max_steps=5000)
        assert all(len(engine.outputs[rid]) == 2 for rid in rids)
        assert engine.kv_scheduler.manager.stats().hit_tokens["disk"] > 0
        engine.assert_no_leaks()
        engine.shutdown()
