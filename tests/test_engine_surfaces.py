"""The engine surfaces under bad input: a weights identity of every byte, dumps read against themselves, output
directories that never take their own input, prompts and checkpoints checked before an engine starts.

The dumps here are written in code with the fields ``fx-precision rollout`` writes (the engine itself runs in
tests/engine); what is tested is what the readers refuse."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fx_precision.checkpoints import (
    check_weights_fit_config,
    load_checkpoint,
    read_checkpoint_config,
    stored_tensors,
    tensors_digest,
    weights_digest,
)
from fx_precision.dump import Dump, Sequence, check_engine_dump, check_out_path, load_dump
from fx_precision.engines.prompts import MAX_PROMPTS, check_prompts, read_prompts
from fx_precision.errors import PrecisionError
from fx_precision.out_dirs import remove_stale_staging
from fx_precision.tools.checkpoint import write_tiny_checkpoint

pytestmark = pytest.mark.needs_transformers  # the checkpoints are transformers models


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("ckpt") / "qwen3", seed=1)


def _tensor_past(directory: Path, offset: int) -> tuple[Path, int]:
    """A file of ``directory`` and the byte offset of a tensor element that lies past ``offset`` in it."""
    for file in sorted(directory.glob("*.safetensors")):
        raw = file.read_bytes()
        size = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8 : 8 + size])
        for name, info in header.items():
            if name != "__metadata__" and 8 + size + info["data_offsets"][1] > offset + 64:
                return file, max(offset, 8 + size + info["data_offsets"][0]) + 9
    raise AssertionError(f"{directory}: no tensor past {offset} bytes")


def test_the_weights_digest_covers_every_byte_and_is_the_digest_of_the_loaded_weights(checkpoint: Path, tmp_path: Path) -> None:
    before = weights_digest(checkpoint)
    model = load_checkpoint(checkpoint, dtype=torch.bfloat16)  # bf16 stored: what an engine loads, byte for byte
    stored = {t.name for t in stored_tensors(checkpoint)}  # tied weights are stored once
    assert tensors_digest((n, t) for n, t in model.state_dict().items() if n in stored) == before
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in checkpoint.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    file, at = _tensor_past(copy, 1 << 20)  # one exponent bit of one element past the first MiB
    data = bytearray(file.read_bytes())
    data[at] ^= 0x40
    file.write_bytes(bytes(data))
    assert weights_digest(copy) != before


def _engine_dump(checkpoint: Path) -> Dump:
    """A dump with what a rollout records: two sequences, their log-probs, the steps that fed them."""
    dump = Dump("Qwen3ForCausalLM", source="engine test dump")
    sequences = [Sequence((5, 6, 7, 8, 9, 3, 4), 5), Sequence((1, 2, 3, 4, 5, 6), 5)]
    steps = [[(p, t) for s in sequences for p, t in enumerate(s.tokens[: s.prompt_len])]]
    steps += [[(s.prompt_len, s.tokens[s.prompt_len]) for s in sequences if len(s.tokens) > s.prompt_len + 1]]
    for s in sequences:
        dump.add_logprobs(s, -torch.rand(len(s.tokens) - 1))
    dump.engine = {"name": "vllm", "version": "0", "threads": 1, "split_kv": False, "weights": weights_digest(checkpoint),
                   "temperature": 1.0, "seed": 0, "steps": [[list(r) for r in rows] for rows in steps],
                   "logits_calls": [[0, 4], [0, 4], [1, 1]], "logprobs": "raw"}  # fmt: skip
    return dump


def test_an_engine_dump_is_read_against_itself(checkpoint: Path, tmp_path: Path) -> None:
    """A dump's records, sequences, steps and engine record are checked against each other and their types: the
    engine's description (EngineDescription) read typed out of its record, the run's fields beside it."""
    good = _engine_dump(checkpoint)
    check_engine_dump(good)
    good.save(tmp_path / "good")
    check_engine_dump(load_dump(str(tmp_path / "good")))

    short = _engine_dump(checkpoint)
    short.records[0].tensor = short.records[0].tensor[:-1]
    with pytest.raises(PrecisionError, match=r"log-prob record seq\[0\] holds \(5,\) values; sequence 0 has 7 tokens, so 6"):
        check_engine_dump(short)

    edited = _engine_dump(checkpoint)
    edited.sequences[1] = Sequence((1, 2, 99, 4, 5, 6), 5)  # a prompt token edited in the sequences, not in the steps
    with pytest.raises(PrecisionError, match=r"sequences\[1\] token 2 \(99\) at position 2 is in no step the engine ran"):
        check_engine_dump(edited)

    for key, value, needle in (("threads", "1", "engine.threads = '1'"), ("split_kv", 0, "engine.split_kv = 0"),
                               ("weights", None, "engine.weights = None"), ("logprobs", "cooked", "engine.logprobs = 'cooked'"),
                               ("temperature", True, "engine.temperature = True"), ("top_k", -1, "engine.top_k = -1"),
                               ("top_p", 0.0, "engine.top_p = 0.0"), ("top_p", True, "engine.top_p = True"),
                               ("attention_isa", 3, "engine.attention_isa=3: a str"),  # how it ran: EngineDescription's types
                               ("compiled", "yes", "engine.compiled='yes': a bool"),
                               ("head_dim", 1.5, "engine.head_dim=1.5: a int")):  # fmt: skip
        bad = _engine_dump(checkpoint)
        bad.engine = {**(bad.engine or {}), key: value}
        with pytest.raises(PrecisionError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            check_engine_dump(bad)


def test_booleans_are_not_token_ids_in_a_dump(checkpoint: Path, tmp_path: Path) -> None:
    _engine_dump(checkpoint).save(tmp_path / "d")
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    manifest["sequences"][0]["tokens"][1] = True
    (tmp_path / "d" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PrecisionError, match=r"sequences\[0\].tokens holds True, not a token id"):
        load_dump(str(tmp_path / "d"))


def test_a_dump_of_other_weights_or_of_no_recorded_weights_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    from fx_precision.tools.train_side import _check_weights

    dump = _engine_dump(checkpoint)
    _check_weights(str(checkpoint), dump)
    dump.engine = {**(dump.engine or {}), "weights": "sha256:" + "0" * 64}
    with pytest.raises(PrecisionError, match="was made from other weights than"):
        _check_weights(str(checkpoint), dump)
    dump.engine = {k: v for k, v in (dump.engine or {}).items() if k != "weights"}
    with pytest.raises(PrecisionError, match="records no weights digest"):
        _check_weights(str(checkpoint), dump)


def test_an_output_directory_never_takes_its_own_input(checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for out, relation in ((checkpoint, "is"), (checkpoint / "sub", "sits inside"), (checkpoint.parent, "holds")):
        with pytest.raises(PrecisionError, match=f"--out {out} {relation} {checkpoint}, which this run reads"):
            check_out_path(out, overwrite=True, sources=[checkpoint])
    made = tmp_path / "made"
    _engine_dump(checkpoint).save(made)
    monkeypatch.chdir(made)
    with pytest.raises(PrecisionError, match="is \\(or holds\\) the working directory"):
        check_out_path(".", overwrite=True)
    assert (made / "manifest.json").exists()


def test_checkpoint_out_inside_its_config_or_the_working_directory_destroys_nothing(checkpoint: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ckpt"
    copy.mkdir()
    for f in checkpoint.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    before = sorted(p.name for p in copy.iterdir())
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cli = [sys.executable, "-m", "fx_precision.tools.cli", "checkpoint"]
    for args in (
        ["--model", "qwen3", "--out", ".", "--overwrite"],
        ["--config", "config.json", "--layers", "1", "--out", ".", "--overwrite"],
    ):
        done = subprocess.run([*cli, *args], cwd=copy, capture_output=True, text=True, env=env, check=False)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert "--out ." in done.stderr.strip().splitlines()[-1]
    assert sorted(p.name for p in copy.iterdir()) == before and not list(tmp_path.glob(".ckpt*"))


def test_stale_staging_of_a_dead_writer_is_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    stale = tmp_path / f".out.writing-{dead.stdout.strip()}-abcd1234"
    live = tmp_path / f".out.writing-{os.getpid()}-abcd1234"
    for d in (stale, live):
        (d / "tensors").mkdir(parents=True)
    assert remove_stale_staging(tmp_path / "out") == [stale]
    assert not stale.exists() and live.exists()


def test_prompts_are_token_ids_within_bounds(tmp_path: Path) -> None:
    cases = {
        "bools.json": (json.dumps([[1, True, 3]]), "prompt 0 holds True, not a token id"),
        "latin1.json": (b"[[1, 2]] \xff", "not a readable UTF-8 JSON file"),
        "many.json": (json.dumps([[1]] * (MAX_PROMPTS + 1)), f"over the limit of {MAX_PROMPTS} per rollout"),
        "floats.json": (json.dumps([[1, 2.5]]), "prompt 0 holds 2.5"),
        "flat.json": (json.dumps([1, 2, 3]), "prompt 0 is not a non-empty list"),
    }
    for name, (text, needle) in cases.items():
        path = tmp_path / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(PrecisionError, match=needle):
            read_prompts(str(path))
    with pytest.raises(PrecisionError, match="token id 64 is outside the vocabulary"):
        check_prompts([[1, 64]], 64, 100, 4, "ckpt")
    with pytest.raises(PrecisionError, match="needs prompts of at least 5 tokens"):
        check_prompts([[1, 2, 3]], 64, 100, 4, "ckpt", min_len=5)
    with pytest.raises(PrecisionError, match="exceed the 100 positions"):
        check_prompts([[1] * 98], 64, 100, 4, "ckpt")


def test_a_config_that_is_not_the_weights_is_one_line_before_anything_loads(checkpoint: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ckpt"
    copy.mkdir()
    for f in checkpoint.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    config = json.loads((copy / "config.json").read_text())
    config["vocab_size"] = 4096
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(PrecisionError, match=r"model.embed_tokens.weight is \[2048, 128\] in the weights, \[4096, 128\] by the config"):
        check_weights_fit_config(read_checkpoint_config(copy))
    with pytest.raises(PrecisionError, match="the config is not the weights'"):
        load_checkpoint(copy)
