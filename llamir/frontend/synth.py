"""Random-weight GGUF models that llama.cpp loads and runs: small, deterministic test subjects.

`write_model(path, SynthSpec(...))` writes a model of any registered architecture (llama, qwen2,
qwen3, gemma3), its tensors from the architecture's tensor_specs, with every hparam key llama.cpp
needs, a real byte-level BPE tokenizer (trained on a small embedded English text) and a ChatML
template. The same spec always gives a byte-identical file.

Weights are scaled so the model behaves numerically like a trained one: the residual stream stays
O(1), attention scores have a std of about 2 (so softmax is neither uniform nor one-hot), and the
logits spread over several units, so that comparisons against llama.cpp are meaningful.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import gguf
import numpy as np
import regex

from llamir.frontend.arch import ARCHS as arch_registry
from llamir.frontend.arch.base import QK_GAIN  # noqa: F401  (the score gain, re-exported)
from llamir.frontend.gguf_rewrite import FILE_TYPES
from llamir.frontend.hparams import HParams
from llamir.ir import quants
from llamir.ir.dtypes import dtype_named

# the architectures synth writes: every registered one, from its tensor_specs
ARCHS = arch_registry
# SynthSpec fields (with their defaults) that only the architectures naming them in synth_options take
# (swa_pattern is read only with a sliding_window, so it is not refused on its own)
ARCH_OPTIONS = {"sliding_window": None, "n_expert": 0, "n_expert_used": 0, "n_ff_exp": None, "n_ff_shexp": None,
                "partial_rotary": None, "norm_eps": None, "fused_qkv": False, "ssm_d_state": None,
                "ssm_d_conv": None, "ssm_dt_rank": None, "n_dec_layer": None, "gated_ffn": None}
# general.file_type of a model whose matrices are all of one type: gguf.quants writes the types
# of FILE_TYPES, llamir's own ggml-exact reference quantizers the K-quants (rows of 256)
MATRIX_FILE_TYPES: dict[str, gguf.LlamaFileType] = {
    **FILE_TYPES,
    "q2_k": gguf.LlamaFileType.MOSTLY_Q2_K, "q3_k": gguf.LlamaFileType.MOSTLY_Q3_K_S,
    "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_S, "q5_k": gguf.LlamaFileType.MOSTLY_Q5_K_S,
    "q6_k": gguf.LlamaFileType.MOSTLY_Q6_K,
}
MATRIX_DTYPES = tuple(MATRIX_FILE_TYPES)

# Same layout as SmolLM2: specials first, bos = <|im_start|>, eos = <|im_end|>.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID = 1, 2
TOKENIZER_PRE = "smollm"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The BPE merges are learnt from this text. Changing it changes every synthetic vocabulary.
_CORPUS = """\
The capital of France is Paris, and the capital of Italy is Rome. Every morning the baker opens
the small shop on the corner of the street, and the smell of fresh bread fills the air. People
walk to work, children run to school, and the old man at the window reads his newspaper while
the cat sleeps in the sun. In the afternoon the weather changes: clouds come in from the sea,
the wind turns cold, and a light rain starts to fall on the roofs of the town.
A computer program is a list of instructions that a machine can follow. The compiler reads the
source code, checks that it is correct, and turns it into something the processor understands.
Good programs are simple and clear; they say what they mean, and they do one thing well. When a
test fails, the engineer reads the error message, finds the line that was wrong, and fixes it.
Numbers such as 1, 2, 3, 10, 42, 100 and 2024 appear in many texts; so do dates like 12 May and
prices like $9.99 or 15%. Questions end with a question mark? Exclamations end with a mark too!
The river flows through the valley and into the lake. In summer the water is warm and people
swim there; in winter it freezes and the children skate on the ice. The mountains around the
valley are covered with snow for most of the year, and the forests on their sides are home to
deer, foxes, birds and many other animals. Farmers grow wheat, corn and potatoes in the fields.
She said that she would come back tomorrow, but he did not believe her. They had been friends
for a long time, and they knew each other very well. We're sure it's going to be fine; you'll
see that they've done their best, and I'd say that's all anyone can ask. Hello, world!
Language models predict the next token from the tokens before it. A model with more layers and
more parameters can learn more patterns, but it also needs more memory and more time to run.
Attention lets each position look at the earlier positions and decide which ones matter most.
The history of science is full of surprising ideas: the earth moves around the sun, light is
both a wave and a particle, and time runs slower near a heavy star. Each idea was first met
with doubt, then tested, and finally accepted when the evidence became strong enough.
"""


@dataclass(frozen=True)
class SynthSpec:
    """The shape, types and seed of a synthetic model."""

    arch: str = "llama"        # llama | qwen2 (q/k/v biases) | qwen3 (q/k norms) | gemma3 (iSWA, post norms)
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_vocab: int = 512
    n_ctx_train: int = 2048
    head_dim: int | None = None   # None = n_embd // n_head; llama and qwen3 may differ
    dtype: str = "f32"            # type of the 2-D matrices, one of MATRIX_DTYPES
    embd_dtype: str | None = None  # token_embd type; None = dtype
    tied: bool = False            # True: no output.weight (llama.cpp reuses token_embd)
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    seed: int = 0
    rope_scaling: str | None = None    # "linear" | "yarn": write rope.scaling.* keys (factor below)
    rope_scaling_factor: float = 4.0
    sliding_window: int | None = None  # gemma3: the window of its SWA layers (every layer but each 6th)
    swa_pattern: int = 6               # gemma3: one global layer every swa_pattern layers
    # the options of the architectures that name them in synth_options (refused elsewhere):
    n_expert: int = 0                  # MoE: experts per layer
    n_expert_used: int = 0             # MoE: experts each token uses
    n_ff_exp: int | None = None        # MoE: an expert's ffn width (None: n_ff)
    n_ff_shexp: int | None = None      # MoE with a shared expert: its ffn width (None: n_ff)
    partial_rotary: float | None = None  # the rotated share of each head (stablelm, phi2); None: all
    norm_eps: float | None = None      # LayerNorm epsilon ({arch}.attention.layer_norm_epsilon)
    fused_qkv: bool = False            # bert: one attn_qkv projection per block instead of attn_q/k/v
    ssm_d_state: int | None = None     # mamba: the scan state per channel (ssm.state_size)
    ssm_d_conv: int | None = None      # mamba: the conv window (ssm.conv_kernel)
    ssm_dt_rank: int | None = None     # mamba: the step-size projection's rank (ssm.time_step_rank)
    n_dec_layer: int | None = None     # t5: decoder blocks (decoder_block_count; None: n_layer, key unwritten)
    gated_ffn: bool | None = None      # t5: False writes no ffn_gate (the original T5's relu ffn); None: gated

    @property
    def n_embd_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.n_embd // self.n_head

    @property
    def n_rot(self) -> int:
        """rope.dimension_count: the whole head, or its partial_rotary share (as convert_hf_to_gguf)."""
        return self.n_embd_head if self.partial_rotary is None else int(self.n_embd_head * self.partial_rotary)


def write_model(path: str | Path, spec: SynthSpec) -> Path:
    """Write the model described by `spec` to `path` (atomically) and return the path."""
    spec = with_arch_defaults(spec)
    _check_spec(spec)

    def fill(writer: gguf.GGUFWriter) -> None:
        _add_hparams(writer, spec)
        _add_tokenizer(writer, spec.n_vocab)
        for name, array, raw_dtype in _tensors(spec):
            writer.add_tensor(name, array, raw_dtype=raw_dtype)

    return write_gguf(path, spec.arch, fill)


def write_gguf(path: str | Path, arch: str, fill) -> Path:
    """Write a GGUF file atomically: `fill(writer)` adds the keys and tensors to a GGUFWriter for
    `arch` (which writes general.architecture)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp_name, arch)
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.chmod(tmp_name, 0o644)  # mkstemp makes it private; the file is an ordinary one
        os.replace(tmp_name, path)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return path


def _check_spec(spec: SynthSpec) -> None:
    if spec.arch not in ARCHS:
        raise ValueError(f"arch {spec.arch!r} is not one of {tuple(ARCHS)}")
    arch = ARCHS[spec.arch]()
    for option, default in ARCH_OPTIONS.items():
        if getattr(spec, option) != default and option not in arch.synth_options:
            takers = ", ".join(name for name, cls in ARCHS.items() if option in cls.synth_options)
            raise ValueError(f"{option} is a {takers or 'no architecture'} setting, not {spec.arch}'s")
    for field, value in (("dtype", spec.dtype), ("embd_dtype", spec.embd_dtype or spec.dtype)):
        if value not in MATRIX_DTYPES:
            raise ValueError(f"{field}={value!r} is not one of {MATRIX_DTYPES}")
    if arch.has_attention:
        if spec.n_head % spec.n_head_kv:
            raise ValueError(f"n_head={spec.n_head} is not a multiple of n_head_kv={spec.n_head_kv}")
        if spec.head_dim is None and spec.n_embd % spec.n_head:
            raise ValueError(f"n_embd={spec.n_embd} is not a multiple of n_head={spec.n_head}; give head_dim")
        if spec.n_embd_head % 2:
            raise ValueError(f"head_dim={spec.n_embd_head} must be even for RoPE")
    arch.synth_check(spec)
    if spec.n_vocab < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"n_vocab={spec.n_vocab} is below the {256 + len(SPECIAL_TOKENS)} "
                         "byte + special tokens")
    for field, dtype, n in (
        ("dtype", spec.dtype, spec.n_embd), ("dtype", spec.dtype, spec.n_ff if arch.has_attention else spec.n_embd),
        ("dtype", spec.dtype, spec.n_head * spec.n_embd_head if arch.has_attention else spec.n_embd),
        ("embd_dtype", spec.embd_dtype or spec.dtype, spec.n_embd),
    ):
        block = dtype_named(dtype).block_size
        if n % block:
            raise ValueError(f"{field}={dtype} needs rows that are multiples of {block}, got a row of {n}")


def _add_hparams(w: gguf.GGUFWriter, spec: SynthSpec) -> None:
    w.add_name(ARCHS[spec.arch]().synth_name(spec))
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    attention = ARCHS[spec.arch].has_attention
    w.add_feed_forward_length(spec.n_ff if attention else 0)
    w.add_head_count(spec.n_head if attention else 0)
    kv_heads = ARCHS[spec.arch]().synth_kv_heads(spec)
    w.add_head_count_kv(kv_heads[0] if len(set(kv_heads)) == 1 else list(kv_heads))
    w.add_layer_norm_rms_eps(spec.rms_eps)
    if attention:
        w.add_rope_freq_base(spec.rope_base)
        w.add_rope_dimension_count(spec.n_rot)
    if attention and spec.n_embd_head * spec.n_head != spec.n_embd:
        w.add_key_length(spec.n_embd_head)
        w.add_value_length(spec.n_embd_head)
    w.add_vocab_size(spec.n_vocab)
    if spec.rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType(spec.rope_scaling))
        w.add_rope_scaling_factor(spec.rope_scaling_factor)
        w.add_rope_scaling_orig_ctx_len(spec.n_ctx_train // 4)
    ARCHS[spec.arch]().synth_metadata(w, spec)
    if spec.sliding_window:   # llama.cpp's generic keys, for the architectures that take them
        w.add_sliding_window(spec.sliding_window)
        w.add_uint32(f"{spec.arch}.attention.sliding_window_pattern", spec.swa_pattern)
        w.add_float32(f"{spec.arch}.rope.freq_base_swa", 10000.0)
    w.add_file_type(MATRIX_FILE_TYPES[spec.dtype])
    if dtype_named(spec.dtype).is_quantized or dtype_named(spec.embd_dtype or spec.dtype).is_quantized:
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def synth_hparams(spec: SynthSpec) -> HParams:
    """The hparams llamir loads from the model `spec` describes (the shapes its tensor specs need)."""
    spec = with_arch_defaults(spec)
    arch = ARCHS[spec.arch]()
    n, hd = spec.n_layer, spec.n_embd_head
    heads = spec.n_head if arch.has_attention else 0
    return HParams(arch=spec.arch, n_vocab=spec.n_vocab, n_ctx_train=spec.n_ctx_train, n_embd=spec.n_embd,
                   n_layer=n, n_ff_arr=(spec.n_ff,) * n, n_head_arr=(heads,) * n,
                   n_head_kv_arr=arch.synth_kv_heads(spec), n_embd_head_k=hd, n_embd_head_v=hd, n_rot=spec.n_rot,
                   f_norm_rms_eps=spec.rms_eps, rope_freq_base_train=spec.rope_base,
                   rope_scaling_type_train=spec.rope_scaling or "linear", n_expert=spec.n_expert,
                   n_expert_used=spec.n_expert_used, n_ff_exp=spec.n_ff_exp or 0, n_ff_shexp=spec.n_ff_shexp or 0,
                   extra=arch.synth_extra(spec))


def with_arch_defaults(spec: SynthSpec) -> SynthSpec:
    """`spec` with the options its architecture needs set (synth_defaults) where it leaves them unset."""
    cls = ARCHS.get(spec.arch)
    unset = {k: v for k, v in (cls.synth_defaults if cls else {}).items() if getattr(spec, k) == ARCH_OPTIONS.get(k)}
    return replace(spec, **unset) if unset else spec


# ----------------------------------------------------------------------------------------------
# Tokenizer


def _add_tokenizer(w: gguf.GGUFWriter, n_vocab: int) -> None:
    tokens, types, merges = build_vocab(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(TOKENIZER_PRE)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(0)
    w.add_pad_token_id(EOS_ID)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


@lru_cache(maxsize=8)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable unicode character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


@lru_cache(maxsize=8)
def build_vocab(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of an `n_vocab`-token byte-level BPE vocabulary.

    Layout: the special tokens, the 256 byte tokens, then one token per learnt merge; if the
    embedded corpus runs out of pairs, the rest are tokens `<|unused_i|>` of GGUF type UNUSED (as real
    vocabularies reserve them).
    """
    byte_chars = bytes_to_unicode()
    tokens = list(SPECIAL_TOKENS) + [byte_chars[b] for b in range(256)]
    types = [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS) + [gguf.TokenType.NORMAL] * 256
    merges, new_tokens = _learn_merges(n_vocab - len(tokens))
    tokens += new_tokens
    types += [gguf.TokenType.NORMAL] * len(new_tokens)
    n_unused = n_vocab - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(n_unused)]
    types += [gguf.TokenType.UNUSED] * n_unused
    return tokens, [int(t) for t in types], merges


# smollm's pre-tokenizer: digits stand alone (its first regex), then GPT-2's split (its second).
_PRE_TOKENIZER = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")


def _learn_merges(n_new: int) -> tuple[list[str], list[str]]:
    """Greedy BPE on the corpus: the most frequent pair first, ties broken by the pair itself."""
    byte_chars = bytes_to_unicode()
    word_counts: dict[tuple[str, ...], int] = {}
    for word in _PRE_TOKENIZER.findall(_CORPUS):
        symbols = tuple(byte_chars[b] for b in word.encode("utf-8"))
        word_counts[symbols] = word_counts.get(symbols, 0) + 1
    known = set(byte_chars.values())
    merges: list[str] = []
    new_tokens: list[str] = []
    while len(new_tokens) < n_new:
        pair_counts: dict[tuple[str, str], int] = {}
        for symbols, count in word_counts.items():
            for pair in zip(symbols, symbols[1:], strict=False):
                pair_counts[pair] = pair_counts.get(pair, 0) + count
        if not pair_counts:
            break
        best = min(pair_counts, key=lambda p: (-pair_counts[p], p))
        merges.append(f"{best[0]} {best[1]}")
        merged = best[0] + best[1]
        # two different pairs can spell the same token; the merge still applies, the token exists once
        if merged not in known:
            known.add(merged)
            new_tokens.append(merged)
        word_counts = _apply_merge(word_counts, best, merged)
    return merges, new_tokens


def _apply_merge(word_counts: dict[tuple[str, ...], int], pair: tuple[str, str], merged: str,
                 ) -> dict[tuple[str, ...], int]:
    out: dict[tuple[str, ...], int] = {}
    for symbols, count in word_counts.items():
        result: list[str] = []
        i = 0
        while i < len(symbols):
            if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
                result.append(merged)
                i += 2
            else:
                result.append(symbols[i])
                i += 1
        key = tuple(result)
        out[key] = out.get(key, 0) + count
    return out


# ----------------------------------------------------------------------------------------------
# Weights


def _matrix(rng: np.random.Generator, shape: tuple[int, ...], gain: float) -> np.ndarray:
    # std 1/sqrt(fan_in) keeps each projection's output O(1) for an O(1) input
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(gain / np.sqrt(shape[-1]))


def _norm(rng: np.random.Generator, shape: tuple[int, ...], gain: float) -> np.ndarray:
    return (gain + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)


def _bias(rng: np.random.Generator, shape: tuple[int, ...], gain: float) -> np.ndarray:
    return (0.2 * gain) * rng.standard_normal(shape, dtype=np.float32)


def _embedding(rng: np.random.Generator, shape: tuple[int, ...], gain: float) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(gain)


# one function per arch.base.INIT_RULES entry: (rng, shape, gain) -> float32 values
_INIT = {"matrix": _matrix, "norm": _norm, "bias": _bias, "embedding": _embedding}


def _tensors(spec: SynthSpec):
    """(name, array, raw ggml type or None) for every tensor of the architecture's specs that a
    synthetic model has (output.weight not when tied), in spec order."""
    rng = np.random.default_rng(spec.seed)
    storage = {"weight": spec.dtype, "embd": spec.embd_dtype or spec.dtype, "f32": "f32"}
    for t in _synth_specs(spec):
        yield _typed(t.name, _INIT[t.init_rule](rng, t.shape, t.gain), storage[t.storage_kind])


def _synth_specs(spec: SynthSpec):
    """The tensor specs of the tensors a synthetic model has, in spec order."""
    for t in ARCHS[spec.arch]().tensor_specs(synth_hparams(spec)):
        ungated = spec.gated_ffn is False and t.name.endswith(".ffn_gate.weight") and not t.required
        if t.in_synth and not (spec.tied and t.name == "output.weight") and not ungated:
            yield t


def _typed(name: str, values: np.ndarray, dtype: str):
    """The tensor stored as `dtype`: gguf.quants packs the quantized and bf16 types it knows into
    bytes, llamir's reference quantizers (the same as ggml's quantize_row_*_ref) the K-quants."""
    dt = dtype_named(dtype)
    if dtype in FILE_TYPES or not dt.is_quantized:
        data = gguf.quants.quantize(values.astype(np.float32), dt.ggml_type)
    else:
        data = quants.quantize(values.astype(np.float32), dt)
    return name, data, dt.ggml_type if data.dtype == np.uint8 else None


# ----------------------------------------------------------------------------------------------
# Adapters: random LoRA and control vector files for a model

# what write_lora adapts unless told: every projection of the blocks (PEFT's usual target_modules)
LORA_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def write_lora(path: str | Path, model, rank: int = 8, alpha: float | None = None,
               targets: tuple[str, ...] | None = None, seed: int = 0, dtype: str = "f32",
               gain: float = 0.25) -> Path:
    """A random LoRA GGUF for `model` (a SynthSpec, a GGUF path or a loaded Model) that llama.cpp
    loads: for each target weight W (a short name such as "attn_q" for every block's, "output",
    "token_embd", or an fnmatch pattern of full names), a [rank, n_in] and b [n_out, rank] (per
    expert for expert weights; a [n_vocab, rank], b [n_embd, rank] for token_embd), stored as
    `dtype`. alpha (default: rank, so the product is scaled by 1) is written as adapter.lora.alpha;
    alpha=0 writes no key. b is drawn so the product is about `gain` times W x."""
    import fnmatch

    arch, shapes = _base_shapes(model)
    wanted = targets or LORA_TARGETS
    chosen: list[str] = []
    for target in wanted:
        if "." in target:
            hits = [n for n in shapes if fnmatch.fnmatchcase(n, target)]
        else:
            hits = [n for n in shapes if n.endswith(".weight") and n.split(".")[-2] == target]
        if not hits and targets:
            raise ValueError(f"LoRA target {target!r} matches no tensor of the {arch} model")
        chosen += [n for n in hits if n not in chosen]
    if not chosen:
        raise ValueError(f"no LoRA target matches a tensor of the {arch} model")
    rng = np.random.default_rng(seed)
    pairs = [_lora_pair(rng, name, shapes[name], rank, gain) for name in chosen]
    alpha = float(rank) if alpha is None else float(alpha)

    def fill(writer: gguf.GGUFWriter) -> None:
        writer.add_name(f"synth-lora-r{rank}")
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        if alpha:
            writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        for name, a, b in pairs:
            for part, values in (("lora_a", a), ("lora_b", b)):
                block = dtype_named(dtype).block_size
                if values.shape[-1] % block:
                    raise ValueError(f"{name}.{part} {list(values.shape)}: {dtype} needs rows that are multiples "
                                     f"of {block}")
                _, data, raw = _typed(f"{name}.{part}", values, dtype)
                writer.add_tensor(f"{name}.{part}", data, raw_dtype=raw)

    return write_gguf(path, arch, fill)


def _base_shapes(model) -> tuple[str, dict[str, tuple[int, ...]]]:
    """(architecture, tensor name -> numpy shape) of a SynthSpec, a GGUF path or a Model."""
    if isinstance(model, SynthSpec):
        spec = with_arch_defaults(model)
        return spec.arch, {t.name: tuple(t.shape) for t in _synth_specs(spec)}
    if isinstance(model, (str, Path)):
        from llamir.frontend.gguf_file import GGUFFile

        f = GGUFFile(model)
        return f.metadata.get_str("general.architecture", required=True), {n: t.shape for n, t in f.tensors.items()}
    return model.hparams.arch, {n: t.shape for n, t in model.tensors.items()}


def _lora_pair(rng: np.random.Generator, name: str, shape: tuple[int, ...], rank: int, gain: float):
    """(name, a, b) for base weight `name` of numpy shape `shape` (2-D, expert 3-D, or a 1-D row)."""
    if name.endswith("token_embd.weight"):   # rows are looked up: a row of a ~ N(0, 1) like an embedding
        n_vocab, n_embd = shape
        return (name, rng.standard_normal((n_vocab, rank), dtype=np.float32),
                _matrix(rng, (n_embd, rank), gain))
    batch, n_out, n_in = shape[:-2], (shape[-2] if len(shape) > 1 else 1), shape[-1]
    return (name, _matrix(rng, (*batch, rank, n_in), 1.0), _matrix(rng, (*batch, n_out, rank), gain))


def write_control_vector(path: str | Path, model=None, *, n_embd: int | None = None, layers=None,
                         directions=None, seed: int = 0, gain: float = 0.5, model_hint: str = "") -> Path:
    """A control vector GGUF as llama.cpp's cvector-generator writes it (general.architecture
    controlvector, controlvector.model_hint, controlvector.layer_count, direction.{il} f32
    [n_embd]): `directions` {il: vector} as given, or random ones (std `gain`) for `layers`
    (default 1..n_layer-1 of `model`, a SynthSpec, GGUF path or Model)."""
    if directions is None:
        if model is not None:
            arch, shapes = _base_shapes(model)
            n_embd = shapes["token_embd.weight"][-1] if n_embd is None else n_embd
            blocks = [int(m[1]) for n in shapes if (m := regex.match(r"(?:\w+\.)?blk\.(\d+)\.", n))]
            n_layer = 1 + max(blocks, default=0)
            layers = range(1, n_layer) if layers is None else layers
        if n_embd is None or layers is None:
            raise ValueError("write_control_vector needs directions, or a model (or n_embd and layers)")
        rng = np.random.default_rng(seed)
        directions = {il: gain * rng.standard_normal(n_embd, dtype=np.float32) for il in layers}

    def fill(writer: gguf.GGUFWriter) -> None:
        writer.add_string("controlvector.model_hint", model_hint)
        writer.add_int32("controlvector.layer_count", len(directions))
        for il, vector in directions.items():
            writer.add_tensor(f"direction.{il}", np.asarray(vector, dtype=np.float32))

    return write_gguf(path, "controlvector", fill)
