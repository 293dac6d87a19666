"""The JSON-lines protocol between the trainer and an engine in its own process: one schema both ends import.

    client (engines/client.py)                     server (engines/serve.py, in the engine's environment)
    encode(Request) ──── one JSON line ─────▶      decode_request(line) -> Request
    decode_reply(Request, line) -> Reply ◀─────    encode(Reply) (or an ErrorReply: one line, the server goes on)

    Request               Reply
    Start(config)         Started(info)                         the engine on one checkpoint (a RolloutConfig); info:
                                                                its EngineDescription
    Generate(request)     Generated(generation)                 one engine call of a SamplingRequest
    Probe()               Probed(contract, seconds, info)       the contract of the last generation
    DumpLast(...)         Dumped(path)                          the last generation as an engine dump
    LoadWeights(path)     WeightsLoaded(seconds, digest)        a safetensors file loaded in place
    Close()               Closed()                              and the server exits

Every message is a frozen dataclass with ``op`` and its fields; decoding checks the op and the field names, so an
unknown or malformed message is one PrecisionError naming it. Log-probs travel as JSON numbers (fp32 values, exactly:
a double's shortest repr round-trips; -inf as -Infinity).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

import torch

from fx_precision.dump import Sequence as TokenSequence
from fx_precision.engine_description import EngineDescription
from fx_precision.engines.adapter import Generation, RolloutConfig, SamplingRequest
from fx_precision.errors import PrecisionError


@dataclass(frozen=True)
class Message:
    op: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, **{f.name: getattr(self, f.name) for f in fields(self)}}


@dataclass(frozen=True)
class Start(Message):
    op: ClassVar[str] = "start"
    config: dict[str, Any]  # RolloutConfig's fields (prompts as lists)

    @classmethod
    def of(cls, cfg: RolloutConfig) -> Start:
        config = asdict(cfg)
        config["prompts"] = [list(p) for p in cfg.prompts]
        return cls(config)

    def rollout_config(self) -> RolloutConfig:
        known = {f.name for f in fields(RolloutConfig)}
        unknown = sorted(set(self.config) - known)
        if unknown:
            raise PrecisionError(f"engine protocol: start: unknown config field(s) {unknown}")
        return RolloutConfig(**{**self.config, "prompts": tuple(tuple(int(t) for t in p) for p in self.config.get("prompts", ()))})


@dataclass(frozen=True)
class Generate(Message):
    op: ClassVar[str] = "generate"
    prompts: list[list[int]]
    max_tokens: int
    temperature: float
    samples: int
    prompt_logprobs: bool = True
    top_k: int = 0
    top_p: float = 1.0

    @classmethod
    def of(cls, request: SamplingRequest) -> Generate:
        return cls([list(p) for p in request.prompts], request.max_tokens, request.temperature, request.samples, request.prompt_logprobs,
                   request.top_k, request.top_p)  # fmt: skip

    def sampling(self) -> SamplingRequest:
        prompts = tuple(tuple(int(t) for t in p) for p in self.prompts)
        return SamplingRequest(prompts, int(self.max_tokens), float(self.temperature), int(self.samples), bool(self.prompt_logprobs),
                               int(self.top_k), float(self.top_p))  # fmt: skip


@dataclass(frozen=True)
class Probe(Message):
    op: ClassVar[str] = "probe"


@dataclass(frozen=True)
class DumpLast(Message):
    op: ClassVar[str] = "dump"
    path: str
    modules: bool = False
    seed: int = 0  # the seed the engine was started with, recorded in the dump
    samples: int = 1
    probe: bool = True  # the contract read off this generation (a loop without the contract writes none)


@dataclass(frozen=True)
class LoadWeights(Message):
    op: ClassVar[str] = "load_weights"
    path: str


@dataclass(frozen=True)
class Close(Message):
    op: ClassVar[str] = "close"


@dataclass(frozen=True)
class Started(Message):
    op: ClassVar[str] = "start"
    info: dict[str, Any]  # the engine's EngineDescription as JSON

    def description(self) -> EngineDescription:
        return EngineDescription.from_dict(self.info, "engine protocol: start.info")


@dataclass(frozen=True)
class Generated(Message):
    op: ClassVar[str] = "generate"
    sequences: list[list[Any]]  # [tokens, prompt_len]
    logprobs: list[list[float]]
    steps: list[list[list[int]]]
    logits_calls: list[list[int]]
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @classmethod
    def of(cls, g: Generation) -> Generated:
        return cls([[list(s.tokens), s.prompt_len] for s in g.sequences], [lp.tolist() for lp in g.logprobs],
                   [[list(r) for r in rows] for rows in g.steps], [list(c) for c in g.logits_calls], g.seconds, g.extra,
                   g.temperature, g.top_k, g.top_p)  # fmt: skip

    def generation(self) -> Generation:
        """The Generation the server's engine made (its sampled logits, the probe's evidence, stay in the engine)."""
        sequences = [TokenSequence(tuple(int(t) for t in tokens), int(prompt_len)) for tokens, prompt_len in self.sequences]
        logprobs = [torch.tensor(lp, dtype=torch.float32) for lp in self.logprobs]
        steps = [[(int(p), int(t)) for p, t in rows] for rows in self.steps]
        calls = [(int(a), int(b)) for a, b in self.logits_calls]
        return Generation(sequences, logprobs, steps, calls, float(self.seconds), dict(self.extra), None, float(self.temperature),
                          int(self.top_k), float(self.top_p))  # fmt: skip


@dataclass(frozen=True)
class Probed(Message):
    op: ClassVar[str] = "probe"
    contract: dict[str, Any]
    seconds: float
    info: dict[str, Any]  # the engine's EngineDescription as JSON, after the probe

    def description(self) -> EngineDescription:
        return EngineDescription.from_dict(self.info, "engine protocol: probe.info")


@dataclass(frozen=True)
class Dumped(Message):
    op: ClassVar[str] = "dump"
    path: str


@dataclass(frozen=True)
class WeightsLoaded(Message):
    op: ClassVar[str] = "load_weights"
    seconds: float
    digest: str


@dataclass(frozen=True)
class Closed(Message):
    op: ClassVar[str] = "close"


REQUESTS: dict[str, type[Message]] = {m.op: m for m in (Start, Generate, Probe, DumpLast, LoadWeights, Close)}
REPLIES: dict[str, type[Message]] = {m.op: m for m in (Started, Generated, Probed, Dumped, WeightsLoaded, Closed)}


def encode(message: Message | dict[str, Any]) -> str:
    """One JSON line (an error reply is ``{"error": one line}``)."""
    return json.dumps(message.to_json() if isinstance(message, Message) else message) + "\n"


def _decode(line: str, kinds: dict[str, type[Message]], op: str | None, where: str) -> Message:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PrecisionError(f"engine protocol: {where}: not a JSON line ({exc})") from None
    if not isinstance(data, dict):
        raise PrecisionError(f"engine protocol: {where}: a JSON object, got {type(data).__name__}")
    if "error" in data:
        raise PrecisionError(f"engine ({op or data.get('op', '?')}): {data['error']}")
    name = data.pop("op", op)
    kind = kinds.get(str(name))
    if kind is None:
        raise PrecisionError(f"engine protocol: {where}: unknown op {name!r}; the ops are {', '.join(kinds)}")
    if op is not None and kind.op != op:
        raise PrecisionError(f"engine protocol: a reply to {name!r} where {op!r} was asked (client and server out of step)")
    names = {f.name for f in fields(kind)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise PrecisionError(f"engine protocol: {where} {kind.op}: unknown field(s) {unknown} (client and server of other versions?)")
    try:
        return kind(**data)
    except TypeError as exc:
        raise PrecisionError(f"engine protocol: {where} {kind.op}: {exc}") from None


def decode_request(line: str) -> Message:
    return _decode(line, REQUESTS, None, "request")


def decode_reply(request: Message, line: str) -> Message:
    """The reply to ``request``; an error reply is raised as the engine's one line."""
    return _decode(line, REPLIES, request.op, "reply")
