"""llama.cpp's common sampler (common/sampling.cpp): the chain its command-line tools build from
common_params_sampling, with the grammar sampler beside it.

    params = SamplingParams(temp=0.7, seed=42)
    sampler = CommonSampler.from_params(vocab, params)      # common_sampler_init
    token = sampler.sample(ctx, -1)                          # common_sampler_sample
    sampler.accept(token)                                    # common_sampler_accept
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from llamir.sampling.basic import Dist, LogitBias, Temp, TempExt
from llamir.sampling.candidates import TokenDataArray
from llamir.sampling.chain import Chain
from llamir.sampling.infill import Infill
from llamir.sampling.mirostat import Mirostat, MirostatV2
from llamir.sampling.penalties import Dry, Penalties
from llamir.sampling.rng import LLAMA_DEFAULT_SEED
from llamir.sampling.truncation import XTC, MinP, TopK, TopNSigma, TopP, Typical

if TYPE_CHECKING:
    from llamir.frontend.vocab import Vocab

# common_sampler_type: canonical name -> its --sampling-seq letter
SAMPLER_CHARS = {"dry": "d", "top_k": "k", "typ_p": "y", "top_p": "p", "top_n_sigma": "s", "min_p": "m",
                 "temperature": "t", "xtc": "x", "infill": "i", "penalties": "e", "adaptive_p": "a"}
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")


def _name_map() -> dict[str, str]:
    """common_sampler_types_from_names' table: canonical names, their kebab-case and no-dash forms,
    and the aliases nucleus, temp, typ."""
    names = {name: name for name in SAMPLER_CHARS}
    for name in SAMPLER_CHARS:
        if "_" in name:
            names[name.replace("_", "-")] = name
            names[name.replace("_", "")] = name
    return names | {"nucleus": "top_p", "temp": "temperature", "typ": "typ_p"}


SAMPLER_NAMES = _name_map()


def sampler_types_from_names(names: Iterable[str]) -> list[str]:
    """The samplers named (case-insensitive, any alias), in order; an unknown name is an error."""
    out = []
    for name in names:
        canonical = SAMPLER_NAMES.get(name.lower())
        if canonical is None:
            raise ValueError(f"unknown sampler {name!r}: expected one of {', '.join(sorted(SAMPLER_NAMES))}")
        out.append(canonical)
    return out


def sampler_types_from_chars(chars: str) -> list[str]:
    """The samplers of a --sampling-seq string such as "edskypmxt"; an unknown letter is an error."""
    by_char = {c: name for name, c in SAMPLER_CHARS.items()}
    bad = [c for c in chars if c not in by_char]
    if bad:
        raise ValueError(f"unknown sampler letter {bad[0]!r} in {chars!r}: expected letters of "
                         f"{''.join(SAMPLER_CHARS.values())}")
    return [by_char[c] for c in chars]


@dataclass(frozen=True)
class SamplingParams:
    """common_params_sampling, with its defaults (the ones the CLI flags start from)."""

    seed: int = LLAMA_DEFAULT_SEED
    n_prev: int = 64
    min_keep: int = 0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.10
    typ_p: float = 1.0
    temp: float = 0.80
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    penalty_last_n: int = 64
    penalty_repeat: float = 1.0
    penalty_freq: float = 0.0
    penalty_present: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    mirostat: int = 0
    top_n_sigma: float = -1.0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.10
    no_perf: bool = False
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", "\"", "*")
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.mirostat not in (0, 1, 2):
            raise ValueError(f"mirostat must be 0 (off), 1 or 2, got {self.mirostat}")
        bad = [s for s in self.samplers if s not in SAMPLER_CHARS]
        if bad:
            raise ValueError(f"unknown sampler {bad[0]!r}")
        if "adaptive_p" in self.samplers:
            raise ValueError("the adaptive_p sampler is not available in llamir")

    def with_changes(self, **changes) -> SamplingParams:
        return replace(self, **changes)


# general.sampling.* keys a GGUF may set its own defaults with (common_init_sampler_from_model)
MODEL_SAMPLING_KEYS = {"top_k": int, "top_p": float, "min_p": float, "xtc_probability": float,
                       "xtc_threshold": float, "temp": float, "penalty_last_n": int, "penalty_repeat": float,
                       "mirostat": int, "mirostat_tau": float, "mirostat_eta": float}
_C_INT = re.compile(r"\s*[+-]?\d+")
_C_FLOAT = re.compile(r"\s*[+-]?(inf(inity)?|nan|(\d+\.?\d*|\.\d+)(e[+-]?\d+)?)", re.IGNORECASE)


def model_sampling_defaults(metadata: Mapping, user_set: Iterable[str] = ()) -> dict:
    """The sampling parameters a model's general.sampling.* metadata sets, except those in user_set.

    llama.cpp reads each value as text (std::to_string for numbers, so floats with six decimals) and
    keeps what strtol / strtof parse from its start; "sequence" is a ';'-separated sampler list."""
    user_set = set(user_set)
    out: dict = {}
    seq = metadata.get("general.sampling.sequence")
    if "samplers" not in user_set and isinstance(seq, str) and seq:
        names = [n for n in seq.split(";") if n.lower() in SAMPLER_NAMES]
        out["samplers"] = tuple(sampler_types_from_names(names))
    for name, kind in MODEL_SAMPLING_KEYS.items():
        value = metadata.get(f"general.sampling.{name}")
        if name in user_set or value is None or isinstance(value, bool | list | tuple | np.ndarray):
            continue
        text = value if isinstance(value, str) else (f"{value:f}" if isinstance(value, float) else str(value))
        match = (_C_INT if kind is int else _C_FLOAT).match(text)
        if match:
            out[name] = int(match.group()) if kind is int else float(np.float32(match.group()))
    return out


def build_chain(vocab: Vocab, params: SamplingParams, suppress_tokens: Iterable[int] = ()) -> Chain:
    """common_sampler_init's chain: logit biases (the user's and the model's suppressed tokens at
    -inf) first; then either the samplers in params.samplers' order and dist, or temp and mirostat."""
    n_vocab = vocab.n_tokens
    chain = Chain(no_perf=params.no_perf)
    biases = list(params.logit_bias) + [(int(t), -np.inf) for t in suppress_tokens]
    if biases:
        chain.add(LogitBias(n_vocab, biases))
    if params.mirostat == 1:
        chain.add(Temp(params.temp))
        chain.add(Mirostat(n_vocab, params.seed, params.mirostat_tau, params.mirostat_eta, 100))
        return chain
    if params.mirostat == 2:
        chain.add(Temp(params.temp))
        chain.add(MirostatV2(params.seed, params.mirostat_tau, params.mirostat_eta))
        return chain
    for name in params.samplers:
        chain.add(_sampler(name, vocab, params))
    chain.add(Dist(params.seed))
    return chain


def _sampler(name: str, vocab: Vocab, p: SamplingParams):
    if name == "dry":
        return Dry(vocab, p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n,
                   p.dry_sequence_breakers)
    if name == "penalties":
        return Penalties(vocab.n_tokens, p.penalty_last_n, p.penalty_repeat, p.penalty_freq, p.penalty_present)
    build = {"top_k": lambda: TopK(p.top_k), "top_p": lambda: TopP(p.top_p, p.min_keep),
             "top_n_sigma": lambda: TopNSigma(p.top_n_sigma), "min_p": lambda: MinP(p.min_p, p.min_keep),
             "xtc": lambda: XTC(p.xtc_probability, p.xtc_threshold, p.min_keep, p.seed),
             "typ_p": lambda: Typical(p.typ_p, p.min_keep),
             "temperature": lambda: TempExt(p.temp, p.dynatemp_range, p.dynatemp_exponent),
             "infill": lambda: Infill(vocab)}
    return build[name]()


@dataclass
class CommonSampler:
    """common_sampler: the chain, an optional grammar sampler kept beside it, and the recent tokens.

    sample() runs the chain and checks its pick against the grammar; a pick the grammar refuses is
    redrawn with the grammar applied first (the chain runs again, its random draws included)."""

    chain: Chain
    grammar: object | None = None
    prev: deque = field(default_factory=lambda: deque(maxlen=64))

    @classmethod
    def from_params(cls, vocab: Vocab, params: SamplingParams, grammar=None,
                    suppress_tokens: Iterable[int] = ()) -> CommonSampler:
        for name in ("penalty_repeat", "penalty_freq", "penalty_present"):
            if not np.isfinite(getattr(params, name)):
                raise ValueError(f"{name} must be finite, got {getattr(params, name)}")
        if not (params.penalty_repeat > 0 and np.isfinite(np.float32(1) / np.float32(params.penalty_repeat))):
            raise ValueError(f"penalty_repeat must be finite and greater than 0, got {params.penalty_repeat}")
        return cls(build_chain(vocab, params, suppress_tokens), grammar, deque(maxlen=max(32, params.n_prev)))

    def sample(self, ctx, idx: int = -1, grammar_first: bool = False) -> int:
        row = np.asarray(ctx.get_logits_ith(idx), dtype=np.float32)
        return self.sample_logits(row, grammar_first)

    def sample_logits(self, row: np.ndarray, grammar_first: bool = False) -> int:
        """common_sampler_sample on one row of logits (the token is not accepted)."""
        cur = TokenDataArray.from_logits(row)
        if grammar_first and self.grammar is not None:
            self.grammar.apply(cur)
        self.chain.apply(cur)
        token = cur.selected_token
        if grammar_first or self.grammar is None:
            return token
        single = TokenDataArray(np.array([token]), np.array([1.0]), np.array([0.0]))
        self.grammar.apply(single)
        if single.logits[0] != -np.inf:
            return token
        cur = TokenDataArray.from_logits(row)
        self.grammar.apply(cur)
        self.chain.apply(cur)
        return cur.selected_token

    def accept(self, token: int, is_generated: bool = True) -> None:
        """common_sampler_accept: prompt tokens (is_generated False) reach the chain (penalties see
        them) but not the grammar."""
        if self.grammar is not None and is_generated:
            self.grammar.accept(int(token))
        self.chain.accept(int(token))
        self.prev.append(int(token))

    def reset(self) -> None:
        self.prev.clear()
        self.chain.reset()

    def clone(self) -> CommonSampler:
        grammar = self.grammar.clone() if self.grammar is not None else None
        return CommonSampler(self.chain.clone(), grammar, deque(self.prev, maxlen=self.prev.maxlen))

    def describe(self) -> str:
        """common_sampler_print: "logits -> top-k -> ... -> dist "."""
        return "logits " + "".join(f"-> {s.name} " for s in self.chain)
