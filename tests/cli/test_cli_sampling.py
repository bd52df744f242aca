"""`llamir run` / `chat` sampler flags: llama.cpp's common flags and defaults into the chain
common_sampler_init builds, the model's general.sampling.* defaults, and one-line errors."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

import llamir
from llamir.cli import CliError, build_parser, main
from llamir.cli_sampling import check_sampling_args, grammar_sampler, sampling_params
from llamir.frontend.synth import SynthSpec, write_model
from llamir.sampling.common import CommonSampler, SamplingParams


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("cli_sampling") / "m.gguf", SynthSpec(arch="llama", n_layer=1))


@pytest.fixture(scope="module")
def model(model_path):
    return llamir.load_model(model_path)


def params_of(model, *flags, command="run"):
    extra = ["-p", "x"] if command == "run" else []
    args = build_parser().parse_args([command, *extra, *flags])
    check_sampling_args(args, CliError)
    return sampling_params(args, model)


def chain_of(model, *flags) -> str:
    return CommonSampler.from_params(model.vocab, params_of(model, *flags)).describe()


def test_defaults_are_llama_cpps(model):
    for command in ("run", "chat"):
        assert params_of(model, command=command) == SamplingParams(no_perf=True)
    # what llama-cli prints as its "sampler chain" for the default parameters
    assert chain_of(model) == ("logits -> ?penalties -> ?dry -> ?top-n-sigma -> top-k -> ?typical -> top-p -> "
                               "min-p -> ?xtc -> temp-ext -> dist ")


def test_each_flag_lands_in_its_parameter(model):
    p = params_of(model, "--temp", "0.6", "--top-k", "12", "--top-p", "0.9", "--min-p", "0.1", "--typical", "0.8",
                  "--repeat-last-n", "100", "--repeat-penalty", "1.2", "--presence-penalty", "0.3",
                  "--frequency-penalty", "0.4", "--dry-multiplier", "0.8", "--dry-base", "2.0",
                  "--dry-allowed-length", "3", "--dry-penalty-last-n", "32", "--xtc-probability", "0.5",
                  "--xtc-threshold", "0.2", "--top-nsigma", "1.5", "--dynatemp-range", "0.3", "--dynatemp-exp", "2",
                  "--mirostat-lr", "0.2", "--mirostat-ent", "4", "-s", "42", "-l", "5+1.5", "-l", "7-inf")
    assert (p.temp, p.top_k, p.top_p, p.min_p, p.typ_p) == (0.6, 12, 0.9, 0.1, 0.8)
    assert (p.penalty_last_n, p.n_prev, p.penalty_repeat, p.penalty_present, p.penalty_freq) == (
        100, 100, 1.2, 0.3, 0.4)
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n) == (0.8, 2.0, 3, 32)
    assert (p.xtc_probability, p.xtc_threshold, p.top_n_sigma, p.dynatemp_range, p.dynatemp_exponent) == (
        0.5, 0.2, 1.5, 0.3, 2.0)
    assert (p.mirostat_eta, p.mirostat_tau, p.seed) == (0.2, 4.0, 42)
    assert p.logit_bias == ((5, 1.5), (7, float("-inf")))
    assert chain_of(model, "--repeat-penalty", "1.2", "--dry-multiplier", "0.8", "--xtc-probability", "0.5",
                    "--top-nsigma", "1", "--typical", "0.8", "-l", "5+1") == (
        "logits -> logit-bias -> penalties -> dry -> top-n-sigma -> top-k -> typical -> top-p -> min-p -> xtc -> "
        "temp-ext -> dist ")


def test_flag_quirks_as_llama_cpp(model):
    assert params_of(model, "--temp", "-1").temp == 0.0                   # clamped at 0
    assert params_of(model, "--dry-base", "0.5").dry_base == 1.75           # below 1: ignored
    assert params_of(model).seed == params_of(model, "--seed", "-1").seed == 0xFFFFFFFF
    assert params_of(model, "--dry-sequence-breaker", "a", "--dry-sequence-breaker", "bc").dry_sequence_breakers == (
        "a", "bc")
    assert params_of(model, "--dry-sequence-breaker", "none").dry_sequence_breakers == ()
    assert params_of(model, "--repeat-last-n", "10").n_prev == 64


def test_sampler_order_flags(model):
    assert params_of(model, "--samplers", "top_k;TEMP;nucleus;min-p;typ").samplers == (
        "top_k", "temperature", "top_p", "min_p", "typ_p")
    assert params_of(model, "--sampling-seq", "kt").samplers == ("top_k", "temperature")
    assert chain_of(model, "--samplers", "min_p;top_k") == "logits -> min-p -> top-k -> dist "
    assert chain_of(model, "--mirostat", "1") == "logits -> temp -> mirostat "
    assert chain_of(model, "--mirostat", "2", "--temp", "1") == "logits -> ?temp -> mirostat-v2 "


def test_model_sampling_defaults_fill_unset_flags(model):
    meta = {"general.sampling.top_k": 7, "general.sampling.temp": 0.6, "general.sampling.sequence": "top_k;temp",
            "general.sampling.mirostat": "2", "general.sampling.top_p": "junk"}
    fake = types.SimpleNamespace(gguf=types.SimpleNamespace(metadata=meta), vocab=model.vocab)
    p = params_of(fake)
    temp = float(np.float32(0.6))                     # read as llama.cpp does: "0.600000" through strtof
    assert (p.top_k, p.temp, p.samplers, p.mirostat, p.top_p) == (7, temp, ("top_k", "temperature"), 2, 0.95)
    p = params_of(fake, "--top-k", "3", "--samplers", "min_p", "--mirostat", "0")
    assert (p.top_k, p.samplers, p.mirostat, p.temp) == (3, ("min_p",), 0, temp)


@pytest.mark.parametrize("flags, message", [
    (["--repeat-last-n", "-1"], "--repeat-last-n must be >= 0, got -1"),
    (["--dry-penalty-last-n", "-2"], "--dry-penalty-last-n must be >= 0, got -2"),
    (["--repeat-penalty", "0"], "--repeat-penalty must be finite and greater than 0"),
    (["--presence-penalty", "inf"], "--presence-penalty must be finite"),
    (["--mirostat", "3"], "--mirostat must be 0, 1 or 2, got 3"),
    (["--samplers", "top_k;bogus"], "--samplers: unknown sampler 'bogus'"),
    (["--samplers", "top_k;adaptive_p"], "the adaptive_p sampler is not available"),
    (["--sampling-seq", "kz"], "--sampling-seq: unknown sampler letter 'z'"),
    (["--samplers", "top_k", "--sampling-seq", "k"], "give --samplers or --sampling-seq, not both"),
    (["-l", "five+1"], "--logit-bias 'five\\+1': expected TOKEN_ID\\+BIAS"),
    (["-l", "70000+1"], "LogitBias: token must be an integer in \\[0, 511\\]"),
    (["--top-p", "nan"], "TopP: p must be a number, got nan"),
    (["--grammar", "root ::= \"a\"", "--json-schema", "{}"], "give one of --grammar, --grammar-file"),
    (["--json-schema", "{not json"], "--json-schema: not valid JSON"),
    (["--grammar-file", "/nonexistent/g.gbnf"], "--grammar-file: cannot read /nonexistent/g.gbnf"),
])
def test_bad_sampler_flags_are_one_line_errors(model_path, capsys, flags, message):
    import re

    assert main(["run", str(model_path), "-p", "Hi", "-n", "2", *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("llamir: error: ") and re.search(message, err) and "Traceback" not in err


def test_grammar_flags_parse_and_need_the_grammar_module(model, monkeypatch, tmp_path):
    args = build_parser().parse_args(["chat", "--grammar", 'root ::= "yes"'])
    assert args.grammar == 'root ::= "yes"'
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object"}')
    args = build_parser().parse_args(["run", "-p", "x", "--json-schema-file", str(schema)])
    assert args.json_schema_file == str(schema)
    monkeypatch.setitem(sys.modules, "llamir.sampling.grammar", None)       # the module is not there
    with pytest.raises(CliError, match="--json-schema-file needs the grammar sampler"):
        grammar_sampler(model.vocab, args, CliError)
    assert grammar_sampler(model.vocab, build_parser().parse_args(["run", "-p", "x"]), CliError) is None


def test_grammar_flags_build_the_grammar_sampler(model, monkeypatch):
    """--grammar and --json-schema construct llamir.sampling.grammar.Grammar as its API says."""
    calls = []

    class Grammar:
        def __init__(self, vocab, text, root):
            calls.append(("gbnf", vocab, text, root))

        @classmethod
        def from_json_schema(cls, vocab, text):
            calls.append(("json", vocab, text))
            return "from-schema"

    monkeypatch.setitem(sys.modules, "llamir.sampling.grammar", types.SimpleNamespace(Grammar=Grammar))
    grammar_sampler(model.vocab, build_parser().parse_args(["run", "-p", "x", "--grammar", "root ::= [a-z]+"]),
                    CliError)
    out = grammar_sampler(model.vocab, build_parser().parse_args(["run", "-p", "x", "-j", '{"type": "string"}']),
                          CliError)
    assert calls == [("gbnf", model.vocab, "root ::= [a-z]+", "root"), ("json", model.vocab, '{"type": "string"}')]
    assert out == "from-schema"


def test_run_with_every_sampler_on_is_reproducible(model_path, capsys):
    args = ["run", str(model_path), "-p", "Hi there", "-n", "8", "--seed", "9", "--repeat-penalty", "1.3",
            "--dry-multiplier", "0.8", "--xtc-probability", "0.5", "--top-nsigma", "2", "--typical", "0.9",
            "--dynatemp-range", "0.3", "--perf"]
    assert main(args) == 0
    first = capsys.readouterr()
    assert main(args) == 0
    again = capsys.readouterr()
    assert first.out == again.out and "samplers time" in first.err
    for mirostat in ("1", "2"):
        assert main(["run", str(model_path), "-p", "Hi", "-n", "6", "--seed", "2", "--mirostat", mirostat]) == 0
