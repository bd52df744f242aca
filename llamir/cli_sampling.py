"""The sampler flags of `llamir run` and `chat`: llama.cpp's common sampling arguments (common/arg.cpp)
with its defaults, read into SamplingParams as common_params_sampling; and the grammar flags.

Flags left unset take the model's general.sampling.* defaults where it has them, else llama.cpp's,
as common_init_sampler_from_model does.
"""

from __future__ import annotations

import argparse
import json
import math
import re

from llamir.sampling.common import (
    SamplingParams,
    model_sampling_defaults,
    sampler_types_from_chars,
    sampler_types_from_names,
)

DEFAULTS = SamplingParams()
# flags whose unset value a model's metadata may fill: dest -> flag
MODEL_DEFAULTED = {"temp": "--temp", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
                   "xtc_probability": "--xtc-probability", "xtc_threshold": "--xtc-threshold",
                   "penalty_last_n": "--repeat-last-n", "penalty_repeat": "--repeat-penalty",
                   "mirostat": "--mirostat", "mirostat_tau": "--mirostat-ent", "mirostat_eta": "--mirostat-lr"}
_LOGIT_BIAS = re.compile(r"\s*([+-]?\d+)\s*([+-])(.+)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    g = p.add_argument_group("sampling", "llama.cpp's common sampler flags (unset: the model's defaults, "
                                         "else llama.cpp's)")
    g.add_argument("-s", "--seed", type=int, default=None, help="RNG seed (default: random; -1 too)")
    g.add_argument("--temp", "--temperature", type=float, default=None, dest="temp",
                   help=f"temperature (default: {d.temp}; 0: always the most likely token)")
    g.add_argument("--top-k", type=int, default=None, dest="top_k", help=f"top-k (default: {d.top_k}, 0 = off)")
    g.add_argument("--top-p", type=float, default=None, dest="top_p", help=f"top-p (default: {d.top_p}, 1.0 = off)")
    g.add_argument("--min-p", type=float, default=None, dest="min_p", help=f"min-p (default: {d.min_p}, 0.0 = off)")
    g.add_argument("--top-nsigma", "--top-n-sigma", type=float, default=d.top_n_sigma, dest="top_n_sigma",
                   help=f"top-n-sigma (default: {d.top_n_sigma}, <= 0 = off)")
    g.add_argument("--xtc-probability", type=float, default=None, dest="xtc_probability",
                   help=f"XTC probability (default: {d.xtc_probability}, 0.0 = off)")
    g.add_argument("--xtc-threshold", type=float, default=None, dest="xtc_threshold",
                   help=f"XTC threshold (default: {d.xtc_threshold}, > 0.5 = off)")
    g.add_argument("--typical", "--typical-p", type=float, default=d.typ_p, dest="typ_p",
                   help=f"locally typical sampling p (default: {d.typ_p}, 1.0 = off)")
    g.add_argument("--repeat-last-n", type=int, default=None, dest="penalty_last_n",
                   help=f"last n tokens the penalties look at (default: {d.penalty_last_n}, 0 = off)")
    g.add_argument("--repeat-penalty", type=float, default=None, dest="penalty_repeat",
                   help=f"repeat penalty (default: {d.penalty_repeat}, 1.0 = off)")
    g.add_argument("--presence-penalty", type=float, default=d.penalty_present, dest="penalty_present")
    g.add_argument("--frequency-penalty", type=float, default=d.penalty_freq, dest="penalty_freq")
    g.add_argument("--dry-multiplier", type=float, default=d.dry_multiplier, help="DRY multiplier (0.0 = off)")
    g.add_argument("--dry-base", type=float, default=d.dry_base, help="DRY base (values below 1 are ignored)")
    g.add_argument("--dry-allowed-length", type=int, default=d.dry_allowed_length)
    g.add_argument("--dry-penalty-last-n", type=int, default=d.dry_penalty_last_n, help="(0 = off)")
    g.add_argument("--dry-sequence-breaker", action="append", default=None, dest="dry_sequence_breakers",
                   help="a DRY sequence breaker (repeatable; replaces the defaults \\n : \" *; 'none': no breakers)")
    g.add_argument("--dynatemp-range", type=float, default=d.dynatemp_range, help="dynamic temperature range")
    g.add_argument("--dynatemp-exp", type=float, default=d.dynatemp_exponent, dest="dynatemp_exponent")
    g.add_argument("--mirostat", type=int, default=None, help="0 = off (default), 1 = Mirostat, 2 = Mirostat 2.0")
    g.add_argument("--mirostat-lr", type=float, default=None, dest="mirostat_eta",
                   help=f"Mirostat eta (default: {d.mirostat_eta})")
    g.add_argument("--mirostat-ent", type=float, default=None, dest="mirostat_tau",
                   help=f"Mirostat tau (default: {d.mirostat_tau})")
    g.add_argument("--samplers", default=None, help=f"sampler order, ';'-separated (default: {';'.join(d.samplers)})")
    g.add_argument("--sampling-seq", "--sampler-seq", default=None, dest="sampling_seq",
                   help="sampler order as letters (default: edskypmxt)")
    g.add_argument("-l", "--logit-bias", action="append", default=[], dest="logit_bias",
                   help="TOKEN_ID+BIAS or TOKEN_ID-BIAS (repeatable)")
    g.add_argument("--grammar", default=None, help="a GBNF grammar the output must follow")
    g.add_argument("--grammar-file", default=None, help="a file with a GBNF grammar")
    g.add_argument("-j", "--json-schema", default=None, help="a JSON schema the output must follow")
    g.add_argument("--json-schema-file", default=None, help="a file with a JSON schema")


def check_sampling_args(args, error) -> None:
    """What common/arg.cpp refuses, as `error` (the CLI's one-line error)."""
    for flag, name in (("--repeat-last-n", "penalty_last_n"), ("--dry-penalty-last-n", "dry_penalty_last_n")):
        value = getattr(args, name)
        if value is not None and value < 0:
            raise error(f"{flag} must be >= 0, got {value}")
    repeat = args.penalty_repeat
    if repeat is not None and not (math.isfinite(repeat) and repeat > 0 and math.isfinite(1.0 / repeat)):
        raise error(f"--repeat-penalty must be finite and greater than 0, got {repeat}")
    for flag, name in (("--presence-penalty", "penalty_present"), ("--frequency-penalty", "penalty_freq")):
        if not math.isfinite(getattr(args, name)):
            raise error(f"{flag} must be finite, got {getattr(args, name)}")
    if args.mirostat is not None and args.mirostat not in (0, 1, 2):
        raise error(f"--mirostat must be 0, 1 or 2, got {args.mirostat}")
    if args.samplers is not None and args.sampling_seq is not None:
        raise error("give --samplers or --sampling-seq, not both")
    try:
        _samplers(args)
    except ValueError as err:
        raise error(f"{'--samplers' if args.samplers is not None else '--sampling-seq'}: {err}") from None
    for text in args.logit_bias:
        if not _LOGIT_BIAS.fullmatch(text) or _bias_value(text) is None:
            raise error(f"--logit-bias {text!r}: expected TOKEN_ID+BIAS or TOKEN_ID-BIAS, e.g. 15043+1")
    given = [f for f, v in (("--grammar", args.grammar), ("--grammar-file", args.grammar_file),
                            ("--json-schema", args.json_schema), ("--json-schema-file", args.json_schema_file))
             if v is not None]
    if len(given) > 1:
        raise error("give one of --grammar, --grammar-file, --json-schema, --json-schema-file "
                    f"(got {', '.join(given)})")


def _samplers(args) -> tuple[str, ...] | None:
    if args.samplers is not None:
        return tuple(sampler_types_from_names(args.samplers.split(";")))
    if args.sampling_seq is not None:
        return tuple(sampler_types_from_chars(args.sampling_seq))
    return None


def _bias_value(text: str) -> tuple[int, float] | None:
    token, sign, value = _LOGIT_BIAS.fullmatch(text).groups()
    try:
        bias = float(value)
    except ValueError:
        return None
    return int(token), -bias if sign == "-" else bias


def _breakers(given: list[str] | None) -> tuple[str, ...]:
    """--dry-sequence-breaker: the first use clears the defaults, "none" clears all so far."""
    if given is None:
        return DEFAULTS.dry_sequence_breakers
    out: list[str] = []
    for value in given:
        out = [] if value == "none" else out + [value]
    return tuple(out)


def sampling_params(args, model) -> SamplingParams:
    """common_params_sampling from the flags, with the model's general.sampling.* defaults."""
    samplers = _samplers(args)
    user_set = {name for name in MODEL_DEFAULTED if getattr(args, name) is not None}
    if samplers is not None:
        user_set.add("samplers")
    values = {name: getattr(DEFAULTS, name) for name in MODEL_DEFAULTED} | {"samplers": DEFAULTS.samplers}
    values |= model_sampling_defaults(model.gguf.metadata, user_set)
    values |= {name: getattr(args, name) for name in MODEL_DEFAULTED if getattr(args, name) is not None}
    if samplers is not None:
        values["samplers"] = samplers
    seed = args.seed
    return SamplingParams(
        seed=0xFFFFFFFF if seed is None or seed == -1 else seed,
        n_prev=max(DEFAULTS.n_prev, values["penalty_last_n"]),
        typ_p=args.typ_p, top_n_sigma=args.top_n_sigma,
        penalty_present=args.penalty_present, penalty_freq=args.penalty_freq,
        dry_multiplier=args.dry_multiplier, dry_base=args.dry_base if args.dry_base >= 1.0 else DEFAULTS.dry_base,
        dry_allowed_length=args.dry_allowed_length, dry_penalty_last_n=args.dry_penalty_last_n,
        dry_sequence_breakers=_breakers(args.dry_sequence_breakers),
        dynatemp_range=args.dynatemp_range, dynatemp_exponent=args.dynatemp_exponent,
        logit_bias=tuple(_bias_value(t) for t in args.logit_bias),
        no_perf=not getattr(args, "perf", False),
        **(values | {"temp": max(values["temp"], 0.0)}))


def suppress_tokens(model) -> list[int]:
    """The model's tokenizer.ggml.suppress_tokens within the vocab (llama_vocab_get_suppress_tokens)."""
    tokens = model.gguf.metadata.get("tokenizer.ggml.suppress_tokens")
    if tokens is None:
        return []
    n_vocab = model.vocab.n_tokens
    return [int(t) for t in tokens if 0 <= int(t) < n_vocab]


def grammar_sampler(vocab, args, error):
    """The grammar sampler of --grammar / --grammar-file / --json-schema(-file), or None."""
    text, kind, flag = None, None, None
    for flag_name, value, is_file, what in (("--grammar", args.grammar, False, "gbnf"),
                                            ("--grammar-file", args.grammar_file, True, "gbnf"),
                                            ("--json-schema", args.json_schema, False, "json"),
                                            ("--json-schema-file", args.json_schema_file, True, "json")):
        if value is not None:
            text, kind, flag = (_read(value, flag_name, error) if is_file else value), what, flag_name
    if text is None:
        return None
    if kind == "json":
        try:
            json.loads(text)
        except json.JSONDecodeError as err:
            raise error(f"{flag}: not valid JSON: {err}") from None
    try:
        from llamir.sampling.grammar import Grammar
    except ImportError as err:
        raise error(f"{flag} needs the grammar sampler (llamir.sampling.grammar), which is not available: {err}") \
            from None
    try:
        return Grammar.from_json_schema(vocab, text) if kind == "json" else Grammar(vocab, text, "root")
    except ValueError as err:
        raise error(f"{flag}: {err}") from None


def _read(path: str, flag: str, error) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as err:
        raise error(f"{flag}: cannot read {path}: {err.strerror or err}") from None
