"""The contract's attention against vLLM's own CPU attention op where the engine takes a row's keys in several KV
tiles and split-KV parts (the engine environment).

vLLM's scheduler places its tiles by the L2 size, the step's requests and its threads, and with split-KV on cuts a
long decode row's keys across threads and merges the parts (contract/attention_tiles.py). Calls as a scheduler step
makes them (long prefills that cross query and KV tiles, prefills with decodes, decodes long enough to split), on 1
and 2 engine threads, split-KV off and on (attention_tiles_check.py, each in a fresh process at that thread count):
every row of every call is the engine's bits under the contract's tiles, and the one-pass kernel parts somewhere
(so the tiles are what makes them equal), on many more rows where the scores rise with the key's position (the
ramped requests the run's calls are also checked with) than on random ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).with_name("attention_tiles_check.py")


@pytest.mark.parametrize(("threads", "split_kv"), [(1, "off"), (2, "off"), (2, "on")], ids=["1-thread", "2-threads", "2-threads-split-kv"])
def test_every_row_is_the_engines_bits_in_its_tiles_and_parts(threads: int, split_kv: str) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([sys.executable, str(CHECK), str(threads), split_kv], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert sum(found["tiled"]) == 0, f"rows that part under the contract's tiles, per request: {found}"
    assert found["one_pass"]["random"] > 0, f"the one-pass kernel gave every row too: these calls do not exercise the tiles ({found})"
    # scores rising with the key's position show where the keys were cut on many more rows than random scores do
    # (the run's own calls are checked with both: check_attention_calls)
    assert found["one_pass"]["ramped"] > 2 * found["one_pass"]["random"], found["one_pass"]
    assert (found["parts"] > 1) == (split_kv == "on"), f"split-KV parts per row at most {found['parts']}"
    if split_kv == "on":  # the merge of a split row's parts as the engine's build computes it, and the other form not
        assert found["merge"]["kept"] == 0 and found["merge"]["other"] > 0, found["merge"]
