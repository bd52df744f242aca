"""`llamir embed [MODEL] TEXT...`: the embeddings of each text, as llama.cpp's llama-embedding
computes and prints them (examples/embedding/embedding.cpp).

Each text is tokenized with its special tokens (CLS/SEP for a WordPiece vocab); texts are packed
into batches of up to n_batch tokens, one sequence each, and every token is an output. Pooled
embeddings (the model's pooling unless --pooling says otherwise) are one row per text; pooling
none gives one row per token. Rows are normalised as --embd-normalize says (2, the default:
Euclidean, as llama-embedding), then printed as llama-embedding prints them: "embedding i:" and
the values (all of them for one text, the first 16 for several, the first and last 3 per token),
a cosine similarity matrix for several texts, or with --json its OpenAI-style list.

With no MODEL (the first argument is one when it names a .gguf file) the built-in embedding model
all-MiniLM-L6-v2 is used.
"""

from __future__ import annotations

import json

import numpy as np

MAX_SEQUENCES = 256   # llama_max_parallel_sequences()


def embd_normalize(x: np.ndarray, mode: int) -> np.ndarray:
    """common_embd_normalize: -1 none, 0 max-absolute to the int16 range, 2 Euclidean, p > 2 the
    p-norm; the sum in double, the scale applied in float."""
    x = np.asarray(x, dtype=np.float32)
    if mode == -1:
        total = 1.0
    elif mode == 0:
        total = float(np.max(np.abs(x), initial=0.0)) / 32760.0
    elif mode == 2:
        total = float(np.sqrt(np.sum((x * x).astype(np.float64))))
    else:
        total = float(np.sum(np.abs(x).astype(np.float64) ** mode) ** (1.0 / mode))
    scale = np.float32(1.0 / total if total > 0.0 else 0.0)
    return x * scale


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """common_embd_similarity_cos: float products summed in double; two zero vectors are similar."""
    a, b = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
    dot = float(np.sum((a * b).astype(np.float64)))
    s1, s2 = float(np.sum((a * a).astype(np.float64))), float(np.sum((b * b).astype(np.float64)))
    if s1 == 0.0 or s2 == 0.0:
        return 1.0 if s1 == s2 else 0.0
    return float(np.float32(dot / (np.sqrt(s1) * np.sqrt(s2))))


def embed_tokens(ctx, inputs: list[list[int]], normalize: int) -> np.ndarray:
    """The normalised embeddings of token lists, batched as llama-embedding batches them: one row
    per input (pooled) or per token (pooling none)."""
    from llamir.context import Batch

    pooled = ctx.cparams.pooling_type != "none"
    rows: list[np.ndarray] = []
    batch: list[list[int]] = []

    def flush() -> None:
        if not batch:
            return
        tokens = [t for inp in batch for t in inp]
        pos = [p for inp in batch for p in range(len(inp))]
        seqs = [(s,) for s, inp in enumerate(batch) for _ in inp]
        if ctx.memory is not None:   # what an earlier batch left is irrelevant for embeddings
            ctx.memory.clear(True)
        status = ctx.decode(Batch(tokens=tokens, pos=pos, seq_ids=seqs, logits=[True] * len(tokens)))
        if status != 0:
            raise RuntimeError(f"decode failed with status {status}: {ctx.last_error}")
        if pooled:
            rows.extend(embd_normalize(ctx.get_embeddings_seq(s), normalize) for s in range(len(batch)))
        else:
            rows.extend(embd_normalize(ctx.get_embeddings_ith(i), normalize) for i in range(len(tokens)))
        batch.clear()

    for inp in inputs:
        if sum(map(len, batch)) + len(inp) > ctx.n_batch or len(batch) >= ctx.n_seq_max:
            flush()
        batch.append(inp)
    flush()
    return np.stack(rows) if rows else np.zeros((0, ctx.model.hparams.n_embd), dtype=np.float32)


def _fmt(value: float, normalize: int, width: str) -> str:
    return f"{value:{width}.0f}" if normalize == 0 else f"{value:{width}.6f}"


def format_text(emb: np.ndarray, texts: list[str], pooling: str, normalize: int) -> str:
    """llama-embedding's default output."""
    lines = [""]
    n_embd, pooled = emb.shape[1], pooling != "none"
    if pooling == "rank":
        for j, row in enumerate(emb):
            lines += [f"rerank score {j}: {v:8.3f}" + (f" [{i}]" if len(row) > 1 else "") for i, v in enumerate(row)]
        return "\n".join(lines)
    if not pooled:
        for j, row in enumerate(emb):
            head = " ".join(_fmt(v, normalize, "6" if normalize == 0 else "9") for v in row[:min(3, n_embd)])
            tail = " ".join(_fmt(v, normalize, "6" if normalize == 0 else "9") for v in row[n_embd - 3:])
            lines.append(f"embedding {j}: {head}  ...  {tail} ")
        return "\n".join(lines)
    n_show = n_embd if len(texts) == 1 else min(16, n_embd)
    for j, row in enumerate(emb):
        lines.append(f"embedding {j}: " + "".join(_fmt(v, normalize, "6" if normalize == 0 else "9") + " "
                                                  for v in row[:n_show]))
    if len(texts) > 1:
        lines += ["", "cosine similarity matrix:", "", "".join(f"{t[:6]:>6} " for t in texts)]
        for i in range(len(texts)):
            lines.append("".join(f"{cosine(emb[i], emb[j]):6.2f} " for j in range(len(texts))) + texts[i][:10])
    return "\n".join(lines)


def format_json(emb: np.ndarray, normalize: int) -> str:
    """llama-embedding --embd-output-format json: {"object": "list", "data": [...]}."""
    data = [{"object": "embedding", "index": j,
             "embedding": [float(f"{v:1.0f}") if normalize == 0 else float(f"{v:1.7f}") for v in row]}
            for j, row in enumerate(emb)]
    return json.dumps({"object": "list", "data": data}, indent=2)


def cmd_embed(args) -> int:
    from llamir.cli import CliError, _context, _load

    items = list(args.items)
    model_arg = items.pop(0) if items and items[0].endswith(".gguf") else None
    if not items:
        raise CliError("give at least one TEXT to embed")
    if model_arg is None:
        from llamir.frontend.default_model import default_embedding_model_path

        model_arg = str(default_embedding_model_path(progress=True))
    model = _load(model_arg)
    hp = model.hparams
    n_ctx = args.n_ctx or hp.n_ctx_train
    inputs = []
    for i, text in enumerate(items):
        try:
            tokens = model.vocab.tokenize(text.encode("utf-8", "surrogatepass"), add_special=True, parse_special=True)
        except ValueError as err:
            raise CliError(f"text {i}: {err}") from None
        if len(tokens) > n_ctx:
            raise CliError(f"text {i} has {len(tokens)} tokens, more than the batch size {n_ctx}: "
                           f"raise --n-ctx (the model was trained on {hp.n_ctx_train})")
        inputs.append(tokens)
    ctx = _context(model, args, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, embeddings=True,
                   pooling_type=args.pooling, n_seq_max=min(len(inputs), MAX_SEQUENCES), kv_unified=True)
    try:
        emb = embed_tokens(ctx, inputs, args.embd_normalize)
    except RuntimeError as err:
        raise CliError(str(err)) from None
    pooling = ctx.cparams.pooling_type
    if pooling == "rank":
        emb = emb[:, :max(1, getattr(hp.extra, "n_cls_out", 1))]
    print(format_json(emb, args.embd_normalize) if args.json else format_text(emb, items, pooling,
                                                                               args.embd_normalize))
    return 0


def add_parser(sub) -> None:
    from llamir.cli import _add_runtime

    p = sub.add_parser("embed", help="print the embeddings of texts, as llama-embedding does",
                       description="llamir embed [MODEL.gguf] TEXT... (default model: all-MiniLM-L6-v2)")
    p.add_argument("items", nargs="+", metavar="[MODEL] TEXT",
                   help="a GGUF file first (optional; taken when it ends in .gguf), then the texts")
    p.add_argument("--pooling", choices=["none", "mean", "cls", "last", "rank"], default="unspecified",
                   help="pooling (default: the model's)")
    p.add_argument("--embd-normalize", type=int, default=2, dest="embd_normalize",
                   help="-1 none, 0 max-absolute (int16 range), 2 Euclidean (default), >2 p-norm")
    p.add_argument("--json", action="store_true", help="print llama-embedding's JSON list")
    _add_runtime(p, n_ctx=0)
    p.set_defaults(func=cmd_embed)


__all__ = ["add_parser", "cmd_embed", "cosine", "embd_normalize", "embed_tokens", "format_json", "format_text"]
