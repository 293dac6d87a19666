"""A dump of the engine at its defaults against vLLM's own API (direct_generate.py, nothing of the project in its
path): the same sampled tokens and every log-prob bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def assert_dump_is_vllms_own(dump: Any, checkpoint: Path, workdir: Path, max_tokens: int, seed: int, samples: int,
                             temperature: str) -> None:  # fmt: skip
    """Each prompt of ``dump`` generated again by ``LLM(model, dtype="bfloat16", seed=seed)`` on the dump's threads, its
    positions and its KV cache (a prompt past one chunked-prefill piece included)."""
    prompts = list(dict.fromkeys(tuple(s.tokens[: s.prompt_len]) for s in dump.sequences))
    (workdir / "prompts.json").write_text(json.dumps([list(p) for p in prompts]))
    script = Path(__file__).parent / "direct_generate.py"
    args = [str(checkpoint), str(workdir / "prompts.json"), str(max_tokens), str(seed), str(dump.engine["threads"]), "defaults",
            str(samples), temperature, str(dump.engine["max_model_len"]), str(dump.engine["kv_cache_gib"])]  # fmt: skip
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, check=True)
    direct = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert len(direct) == len(dump.sequences) == len(prompts) * samples
    for sequence, record, want in zip(dump.sequences, dump.logprob_records(), direct, strict=True):
        assert list(sequence.tokens[sequence.prompt_len :]) == want["generated"]
        assert record.tensor is not None
        assert [float(x).hex() for x in record.tensor[sequence.prompt_len - 1 :].tolist()] == want["logprobs"]  # bit for bit
