"""The comparator never calls bad data "equivalent": non-finite values, gates that fail closed, atomic
dumps, strict reads, checked name maps and recorders, one-line errors. Each test makes its own fixture."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import fx_precision as fxp
from fx_precision.compare import compare
from fx_precision.dump import DumpRecorder, dump, load_dump
from fx_precision.errors import PrecisionError
from fx_precision.tools.cli import main
from tests.cli import run_torchrun


class TinyLM(nn.Module):
    """ids -> logits: enough for module records and log-prob metrics."""

    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.vocab_size = vocab
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def make_dump(path: Path, *, seed: int = 0, vocab: int = 16, ids: torch.Tensor | None = None) -> Path:
    torch.manual_seed(seed)
    model = TinyLM(vocab)
    ids = ids if ids is not None else torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(1))
    dump(model, ids, out=path, inputs=True)
    return path


def poison(src: Path, dst: Path, *fqns: str, value: float = float("nan")) -> Path:
    """A copy of the dump at ``src`` whose first output of each module in ``fqns`` holds one ``value``."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    for fqn in fqns:
        entry = next(r for r in manifest["records"] if r["fqn"] == fqn and r["io"] == "out")
        tensor = torch.load(dst / entry["file"], weights_only=True)
        tensor.view(-1)[3] = value
        torch.save(tensor, dst / entry["file"])
    return dst


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """The CLI in this process: exit status, stdout, stderr (argument errors exit through argparse)."""
    try:
        code = main(args)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def one_line(code: int, out: str, err: str, needle: str, *, json_mode: bool = False) -> None:
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and needle in err, err
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err
    if json_mode:
        assert needle in json.loads(out)["error"]


# non-finite -----------------------------------------------------------------------------------------
def test_a_dump_against_itself_is_identical_and_one_nan_is_named_and_fails_the_gate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = make_dump(tmp_path / "good")
    same = compare(str(good), str(good))
    assert same.pairs and all(p.band == "identical" and p.bitwise for p in same.pairs)
    assert same.logprob is not None and same.logprob["comparable"] and same.logprob["bitwise_share"] == 1.0
    nan = poison(good, tmp_path / "nan", "mix")
    result = compare(str(good), str(nan))
    (bad,) = [p for p in result.pairs if p.band == "non-finite"]
    assert (bad.fqn, bad.io) == ("mix", "out") and "b: 1 NaN (first at" in (bad.non_finite or "") and "a: none" in (bad.non_finite or "")
    assert "equivalent" not in {p.band for p in result.pairs if p.fqn == "mix"}
    assert result.first_origin is not None and result.first_origin.fqn == "mix"
    # a NaN in the logits: log-probs over it are counted, never averaged, and fail the gate
    nan = poison(good, tmp_path / "nan-logits", "mix", "")
    result = compare(str(good), str(nan))
    assert result.logprob is not None and result.logprob["non_finite"] > 0
    code, out, err = run(["compare", str(good), str(nan), "--fail-above", "0", "--json"], capsys)
    assert code == 1 and "NaN or Inf" in err
    json.loads(out, parse_constant=lambda c: pytest.fail(f"bare {c} in the JSON"))  # strict: non-finite only as strings
    assert run(["compare", str(good), str(good), "--fail-above", "0"], capsys)[0] == 0


def test_nan_equals_nan_only_where_both_hold_it_and_only_when_asked(tmp_path: Path) -> None:
    good = make_dump(tmp_path / "good")
    a, b = poison(good, tmp_path / "a", "mix"), poison(good, tmp_path / "b", "mix")
    assert {p.band for p in compare(str(a), str(b)).pairs if p.fqn == "mix" and p.io == "out"} == {"non-finite"}
    asked = compare(str(a), str(b), nan_equal=True)
    assert {p.band for p in asked.pairs if p.fqn == "mix" and p.io == "out"} == {"identical"}
    elsewhere = poison(good, tmp_path / "inf", "mix", value=float("inf"))
    assert {p.band for p in compare(str(a), str(elsewhere), nan_equal=True).pairs if p.fqn == "mix" and p.io == "out"} == {"non-finite"}


# gates fail closed ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("other", "why"),
    [
        ({"ids": torch.zeros(2, 6, dtype=torch.long)}, "the token ids differ at position 0"),
        ({"ids": torch.zeros(2, 4, dtype=torch.long)}, "6 tokens on side a, 4 on side b"),
        ({"ids": torch.zeros(3, 6, dtype=torch.long)}, "side a has 2 sequence(s), side b 3"),
        ({"vocab": 24}, "the vocabularies differ"),
    ],
)
def test_a_gate_fails_closed_when_nothing_comparable(tmp_path: Path, capsys: pytest.CaptureFixture[str], other: dict, why: str) -> None:
    a = make_dump(tmp_path / "a")
    b = make_dump(tmp_path / "b", **other)
    result = compare(str(a), str(b))
    assert result.logprob is not None and not result.logprob["comparable"] and why in result.logprob["why"]
    code, out, err = run(["compare", str(a), str(b), "--fail-above", "1e9"], capsys)
    assert code == 1 and why in err and "token ids: the same" not in out


def test_dumps_of_other_models_are_not_compared_and_the_gate_value_must_be_finite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = make_dump(tmp_path / "a")
    other = nn.Sequential(nn.Embedding(16, 16))
    dump(other, torch.zeros(2, 6, dtype=torch.long), out=tmp_path / "b")
    result = compare(str(a), str(tmp_path / "b"))
    assert result.logprob is not None and not result.logprob["comparable"] and "different models" in result.logprob["why"]
    for value in ("-1", "nan", "inf", "x"):
        code, _, err = run(["compare", str(a), str(a), "--fail-above", value], capsys)
        assert code == 2 and "--fail-above" in err and "Traceback" not in err


# atomic, never mixed ---------------------------------------------------------------------------------
def test_an_existing_dump_is_refused_unless_overwrite_which_replaces_it_whole(tmp_path: Path) -> None:
    out = make_dump(tmp_path / "out")
    (out / "tensors" / "stale.pt").write_bytes(b"left over")
    with pytest.raises(PrecisionError, match="holds a dump already; pass --overwrite"):
        make_dump(out, seed=1)
    torch.manual_seed(1)
    dump(TinyLM(), torch.zeros(1, 3, dtype=torch.long), out=out, overwrite=True)
    assert not (out / "tensors" / "stale.pt").exists()
    assert load_dump(out).records[0].shape == (1, 3)  # the new dump, whole
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left behind


@pytest.mark.parametrize(
    ("setup", "needle"),
    [
        ("file", "a file is there"),
        ("foreign", "holds files that are not a dump"),
        ("empty", "--out is empty"),
    ],
)
def test_output_paths_are_checked_before_any_model_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: str, needle: str
) -> None:
    target = tmp_path / "out"
    if setup == "file":
        target.write_text("x")
    elif setup == "foreign":
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    out = "" if setup == "empty" else str(target)
    # the model would fail to build: the path error comes first
    code, stdout, err = run(["dump", "--model", "tests.lint_models:NoSuchFactory", "--out", out, "--json"], capsys)
    one_line(code, stdout, err, needle, json_mode=True)


def test_killing_a_dump_mid_write_leaves_the_old_dump_or_nothing(tmp_path: Path) -> None:
    old = make_dump(tmp_path / "out")
    before = [r.key for r in load_dump(old).records]
    started = tmp_path / "started"
    script = f"""
import time, torch
import fx_precision.dump as d
from tests.test_comparator_integrity import TinyLM
real = d.torch.save
count = [0]
def slow(obj, f):
    real(obj, f)
    count[0] += 1
    if count[0] == 3:
        open({str(started)!r}, "w").close()
        time.sleep(120)
d.torch.save = slow
torch.manual_seed(5)
d.dump(TinyLM(), torch.zeros(1, 5, dtype=torch.long), out={str(old)!r}, overwrite=True, inputs=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).resolve().parent.parent)
    deadline = time.time() + 120
    while not started.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert started.exists(), "the writer never got going"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    loaded = load_dump(old)  # the old dump, whole: nothing of the killed write is mixed in
    assert [r.key for r in loaded.records] == before and all(r.tensor is not None for r in loaded.records)


# strict reads ------------------------------------------------------------------------------------------
class Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("code ran",))


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        ("truncate", "is not a readable tensor file"),
        ("dict", "holds a dict, not a tensor"),
        ("pickle", "refused by weights_only"),
        ("shape", "but the manifest says"),
        ("io", "has io 'sideways'"),
        ("outside", "not a file inside the dump"),
    ],
)
def test_every_read_error_is_one_line_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str, needle: str) -> None:
    good = make_dump(tmp_path / "good")
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    entry = manifest["records"][1]
    file = bad / entry["file"]
    if damage == "truncate":
        file.write_bytes(file.read_bytes()[:40])
    elif damage == "dict":
        torch.save({"not": "a tensor"}, file)
    elif damage == "pickle":
        with open(file, "wb") as f:
            pickle.dump(Evil(), f)
    elif damage == "shape":
        entry["shape"] = [7, 7]
    elif damage == "io":
        entry["io"] = "sideways"
    elif damage == "outside":
        entry["file"] = "../good/" + entry["file"]
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PrecisionError, match=needle):
        load_dump(bad)
    code, out, err = run(["compare", str(bad), str(good), "--json"], capsys)
    one_line(code, out, err, needle, json_mode=True)
    assert "code ran" not in out + err


# name maps and recorders -------------------------------------------------------------------------------
def test_a_name_map_that_merges_modules_or_names_nothing_is_an_error() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    with pytest.raises(PrecisionError, match="both to"):
        compare(fxp.Side(model, (x,)), fxp.Side(model, (x,)), fqn_map="0=1")
    with pytest.raises(PrecisionError, match="both sides need a name"):
        compare(fxp.Side(model, (x,)), fxp.Side(model, (x,)), fqn_map={"0": ""})
    with pytest.raises(PrecisionError, match="a text 'a_name=b_name"):
        compare(fxp.Side(model, (x,)), fxp.Side(model, (x,)), fqn_map=5)  # type: ignore[arg-type]


def test_a_recorder_is_entered_once_and_a_model_has_one_recorder_at_a_time() -> None:
    model = TinyLM()
    recorder = DumpRecorder(model)
    with recorder:
        with pytest.raises(PrecisionError, match="another DumpRecorder"), DumpRecorder(model):
            pass
    with pytest.raises(PrecisionError, match="entered already"), recorder:
        pass
    errors: list[str] = []
    gate, release = threading.Event(), threading.Event()

    def hold() -> None:
        with DumpRecorder(model):
            gate.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    gate.wait(10)
    try:
        with DumpRecorder(model):
            pass
    except PrecisionError as exc:
        errors.append(str(exc))
    release.set()
    thread.join()
    assert errors and "another DumpRecorder" in errors[0]
    with DumpRecorder(model) as again:  # free again once the other is done
        model(torch.zeros(1, 2, dtype=torch.long))
    assert again.dump.records


# the minor cases ---------------------------------------------------------------------------------------
def test_options_of_the_built_in_sides_are_refused_with_two_dumps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = make_dump(tmp_path / "a")
    code, out, err = run(["compare", str(a), str(a), "--model", "toy-decoder", "--compute", "fp16"], capsys)
    one_line(code, out, err, "--model, --compute describe the built-in sides")


def test_mesh_and_world_size_must_agree(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["dump", "--model", "toy-decoder", "--out", "/tmp/never-written", "--world-size", "1", "--mesh", "2x1"], capsys)
    one_line(code, out, err, "--mesh 2x1 is 2 ranks but --world-size is 1")


def test_the_api_raises_precision_errors_not_raw_type_errors(tmp_path: Path) -> None:
    good = make_dump(tmp_path / "good")
    with pytest.raises(PrecisionError, match=r"a dump directory, a Dump or an fx_precision\.Side"):
        compare(str(good), 42)
    with pytest.raises(PrecisionError, match=r"DumpRecorder\(out=3\)"):
        dump(TinyLM(), torch.zeros(1, 2, dtype=torch.long), out=3)  # type: ignore[arg-type]
    with pytest.raises(PrecisionError, match=r"records an nn\.Module"):
        DumpRecorder("model")  # type: ignore[arg-type]


class Raising(nn.Module):
    """A model whose forward fails inside a layer."""

    def __init__(self) -> None:
        super().__init__()
        self.vocab_size = 8
        self.layer = nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.layer(ids)  # int64 ids into a linear: the model's own bug


def test_a_forward_that_raises_inside_a_layer_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["dump", "--model", "tests.test_comparator_integrity:Raising", "--out", str(tmp_path / "x")], capsys)
    one_line(code, out, err, "the forward of Raising raised RuntimeError")
    assert not (tmp_path / "x").exists()  # nothing written half


def test_under_torchrun_every_rank_writes_its_own_directory(tmp_path: Path) -> None:
    out = tmp_path / "ranks"
    launched = run_torchrun(2, "dump", "--model", "toy-decoder", "--out", str(out), "--json")
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert json.loads(launched.stdout)["ranks"] == 2  # printed once, by rank 0, with the launcher's rank count
    ranks = load_dump(out)
    assert isinstance(ranks, dict) and sorted(ranks) == [0, 1] and all(d.world_size == 2 for d in ranks.values())
    assert [p.name for p in tmp_path.iterdir()] == ["ranks"]  # no staging left behind


def test_identical_is_said_only_where_the_bit_patterns_agree() -> None:
    """The same numbers in other bits (fp32 against bf16 holding bf16 values; -0 against +0) are ``same-values``, not
    ``identical``: that word, and ``bitwise``, only where the bit patterns were compared and agree."""
    from fx_precision.compare import MATCHING, tensor_diff
    from fx_precision.dump import Record

    def record(t: torch.Tensor) -> Record:
        return Record("m", 0, "out", "", str(t.dtype).removeprefix("torch."), tuple(t.shape), t)

    values = torch.randn(4, 8).to(torch.bfloat16)
    for a, b in ((values, values.float()), (torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0]))):
        diff = tensor_diff(record(a), record(b))
        assert diff.band == "same-values" and not diff.bitwise and diff.band in MATCHING, diff
    same = tensor_diff(record(values), record(values.clone()))
    assert same.band == "identical" and same.bitwise
    ids = tensor_diff(record(torch.arange(4)), record(torch.arange(4, dtype=torch.int32)))
    assert ids.band == "same-values" and not ids.bitwise
