"""A vLLM engine with kvtier's connector killed (SIGKILL) while it serves and writes its host
memory's coldest pages to disk behind it, then restarted on the same directory.

The child process serves prompts of a pool of sixteen 120-token prompts, over and over, with host
memory for 40 pages: published blocks are written to disk in the background all the time, and
pushed out of host memory. It is killed at a random point once the disk holds pages. A new engine
on the directory then serves every prompt of the pool: the runner checks before each forward that
every position counted as computed holds that request's own KV (``WrongKV``), so a block restored
from a torn write, or from a row naming a slot rewritten since, fails the test.
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
engine = host_pages_engine(Path(sys.argv[1]), 40)
for k in range(10**9):
    for j in range(4):
        i = (4 * k + j) % POOL
        engine.add(f"c{k}-{j}", pool_prompt(i) + [k % 7 + 1], max_tokens=2)
    engine.run()
    print(engine.kv_scheduler.manager.stats().tiers["disk"].pages_used, flush=True)
"""


def pool_prompt(i: int) -> list[int]:
    return prompt(1000 + i, PROMPT_TOKENS)


def kill_while_serving(tmp_path: Path, rng: random.Random) -> None:
    """Run the child until its disk holds 20 pages or more, then SIGKILL it at a random point."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, env=env)
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
    """Three kills, each followed by an engine that serves the whole pool on what the killed one
    left (and then shuts down, persisting, for the next child): no position ever holds another
    prefix's KV, nothing is left held, and the restarts load blocks from disk."""
    rng = random.Random(3)
    from_disk = 0
    for round_ in range(3):
        kill_while_serving(tmp_path, rng)
        engine = host_pages_engine(tmp_path, 200)
        engine.poison()
        for i in range(POOL):
            engine.add(f"r{round_}-{i}", pool_prompt(i) + [9], max_tokens=2)
        engine.run(max_steps=3000)
        assert all(len(engine.outputs[f"r{round_}-{i}"]) == 2 for i in range(POOL))
        from_disk += engine.kv_scheduler.manager.stats().hit_tokens["disk"]
        engine.assert_no_leaks()
        engine.shutdown()
    assert from_disk > 0
