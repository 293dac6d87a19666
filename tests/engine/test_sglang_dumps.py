"""The SGLang adapter reads the files SGLang's dumper writes (sglang_writer.py: written exactly as its code writes them,
the dumper itself not importable here), on a live model whose module tree SGLang's shares (vLLM's).

    the same forward recorded two ways                 vLLM's module pass (engines/vllm/modules.py) and SGLang-style
                                                       dumper files read by engines/sglang: the same transformers
                                                       records, bit for bit
    compare reads a directory of dumper files          `fx-precision compare A SGLANG_DIR`, no manifest needed
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from fx_precision.compare import compare
from fx_precision.dump import Sequence
from fx_precision.engines import engine_adapter
from fx_precision.engines.adapter import RolloutConfig
from fx_precision.tools.checkpoint import write_tiny_checkpoint
from tests.engine.sglang_writer import SglangStyleDumper


def test_sglang_dumper_files_read_as_the_vllm_module_pass(tmp_path: Path) -> None:
    checkpoint = write_tiny_checkpoint("qwen3", tmp_path / "ckpt", seed=9)
    prompt = tuple(torch.randint(0, 2048, (37,), generator=torch.Generator().manual_seed(2)).tolist())
    session = engine_adapter("vllm").start(RolloutConfig(model=str(checkpoint), prompts=(prompt,), launch="eager"))
    writer = SglangStyleDumper(session.model, tmp_path / "sglang")
    try:
        module_pass = session.record_modules([Sequence(prompt, len(prompt))], temperature=1.0)
    finally:
        writer.remove()
        session.close()
    files = list((tmp_path / "sglang").rglob("step=*___rank=*___dump_index=*___name=*.pt"))
    assert files and all(set(torch.load(f, weights_only=True)) == {"value", "meta"} for f in files[:5])
    reader = engine_adapter("sglang")
    assert reader.recognizes(str(tmp_path / "sglang"))
    read = reader.read_dump(str(tmp_path / "sglang"), config=session.config)
    by_key = {r.key: r for r in read.records}
    mine = [r for r in module_pass.records if r.io in ("in", "out")]
    shared = [r for r in mine if r.key in by_key]
    assert len(shared) >= 0.9 * len(mine), (len(shared), len(mine), sorted({r.fqn for r in mine} - {r.fqn for r in shared})[:8])
    for record in shared:  # the same engine forward, named the same way from SGLang's names as from vLLM's
        assert torch.equal(record.tensor, by_key[record.key].tensor), record.key
    assert read.sequences and read.sequences[0].tokens == prompt


def test_compare_reads_a_directory_of_dumper_files(tmp_path: Path) -> None:
    checkpoint = write_tiny_checkpoint("qwen3", tmp_path / "ckpt", seed=9)
    prompt = tuple(range(5, 40))
    session = engine_adapter("vllm").start(RolloutConfig(model=str(checkpoint), prompts=(prompt,), launch="eager"))
    for name in ("a", "b"):  # two dumps of one forward: every module equal, no origin
        writer = SglangStyleDumper(session.model, tmp_path / name)
        session.record_modules([Sequence(prompt, len(prompt))], temperature=1.0)
        writer.remove()
    session.close()
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-m", "fx_precision.tools.cli", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json"],
                          capture_output=True, text=True, env=env, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["first_origin"] is None and report["first_differing"] is None, report
    result = compare(engine_adapter("sglang").read_dump(str(tmp_path / "a")), engine_adapter("sglang").read_dump(str(tmp_path / "b")))
    assert result.pairs and all(d.band == "identical" for d in result.pairs)
