"""load_model: a GGUF file as an architecture, hyper-parameters, a vocab and memory-mapped weights."""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path

import numpy as np

from llamir.frontend.arch import ARCHS, ArchError, Architecture, TensorSpec
from llamir.frontend.gguf_file import GGUFError, GGUFFile, GGUFTensor
from llamir.frontend.graph_context import BuiltGraph, GraphConfig, GraphContext
from llamir.frontend.hparams import HParams, load_hparams
from llamir.ir import BF16


class ModelError(ValueError):
    """A model file that llamir cannot use; the message says what is wrong."""


class Model:
    """One loaded model. Weights stay memory-mapped; nothing is copied at load time.

    A vocab-only model (load_model(path, vocab_only=True)) has `arch` and `hparams` None: it can
    tokenize whatever its architecture, but not build a graph."""

    def __init__(self, path: Path, gguf: GGUFFile, arch: Architecture | None, hparams: HParams | None, vocab,
                 arch_name: str | None = None):
        self.path = path
        self.gguf = gguf
        self.arch = arch
        self.arch_name = arch_name or (hparams.arch if hparams is not None else "")
        self.hparams = hparams
        self.vocab = vocab
        self.tensors: dict[str, GGUFTensor] = gguf.tensors

    @property
    def vocab_only(self) -> bool:
        return self.arch is None

    @property
    def name(self) -> str:
        return self.gguf.metadata.get_str("general.name", self.path.stem)

    @property
    def n_params(self) -> int:
        return sum(int(np.prod(t.shape)) for t in self.tensors.values())

    @property
    def n_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors.values())

    @cached_property
    def tensor_specs(self) -> dict[str, TensorSpec]:
        """The architecture's tensors by GGUF name, in spec order (the one list of them)."""
        if self.arch is None:
            raise ModelError(f"{self.path}: the model was loaded vocab-only; it has no architecture's tensors")
        return {spec.name: spec for spec in self.arch.tensor_specs(self.hparams)}

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> GGUFTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelError(f"{self.path}: tensor {name!r} is missing") from None

    def weight_array(self, name: str) -> np.ndarray:
        """The tensor's storage as the IR expects it (a memmap view; bf16 as uint16 bits)."""
        t = self.tensor(name)
        data = t.data
        if t.dtype == BF16 and data.dtype != np.uint16:
            data = data.view(np.uint16).reshape(t.shape)
        return data

    @property
    def has_encoder(self) -> bool:
        """llama_model_has_encoder: an encoder-decoder (t5), which decodes after an encode."""
        return self.arch is not None and self.arch.has_encoder

    def decoder_start_token(self) -> int:
        """llama_model_decoder_start_token: the token a decoder starts from ({arch}.decoder_start_token_id),
        or -1 when the file sets none (llama.cpp's tools then take the vocab's BOS)."""
        return getattr(self.hparams.extra, "dec_start_token_id", -1) if self.hparams is not None else -1

    def build_graph(self, config: GraphConfig) -> BuiltGraph:
        """The architecture's graph for `config` (symbolic in T, n_kv and n_out), with its input
        specs, memory layouts and layer map."""
        if self.arch is None:
            raise ModelError(f"{self.path}: the model was loaded vocab-only (architecture {self.arch_name!r}); "
                             "load it without vocab_only to build its graph")
        g = GraphContext(self, config)
        self.arch.build(g)
        return g.built()

    def __repr__(self) -> str:
        hp = self.hparams
        if hp is None:
            return f"<Model {self.name!r} arch={self.arch_name} vocab only, n_vocab={self.vocab.n_tokens}>"
        return (f"<Model {self.name!r} arch={hp.arch} n_layer={hp.n_layer} n_embd={hp.n_embd} "
                f"n_vocab={hp.n_vocab}>")


def load_model(path: str | Path, vocab_only: bool = False) -> Model:
    """Open and validate a GGUF model: architecture, hparams, vocab and every tensor's shape.

    Every metadata value is read with the type llama.cpp reads it as (gguf_meta), and the file is
    refused where llama.cpp refuses it (or would abort on it), with a ModelError naming the key or
    tensor. With vocab_only, as in llama.cpp, only the general and tokenizer.* keys are read: any
    architecture loads, and the model can tokenize but not run."""
    import time

    t0 = time.perf_counter()
    path = Path(path)
    try:
        f = GGUFFile(path)
        arch_name = _read_general(f)
    except GGUFError as err:
        raise ModelError(str(err)) from None
    if vocab_only:
        vocab = _load_vocab(f)
        if vocab is None:
            raise ModelError(f"{path}: the model has no vocab (metadata key tokenizer.ggml.model is missing)")
        model = Model(path, f, None, None, vocab, arch_name=arch_name)
        model.t_load_ms = (time.perf_counter() - t0) * 1e3
        return model
    if arch_name not in ARCHS:
        raise ModelError(f"{path}: unknown model architecture {arch_name!r}; llamir supports "
                         f"{', '.join(sorted(ARCHS))} (load_model(path, vocab_only=True) reads the vocab "
                         "of any architecture)")
    arch = ARCHS[arch_name]()
    try:
        hp = load_hparams(f, arch_name)
        arch.load_hparams(f, hp)
    except (GGUFError, ArchError) as err:
        raise ModelError(str(err)) from None
    vocab = _load_vocab(f)
    if vocab is None:   # llama.cpp's vocab loader requires the key
        raise ModelError(f"{path}: required metadata key 'tokenizer.ggml.model' is missing (llama.cpp needs a vocab)")
    hp.n_vocab = vocab.n_tokens   # llama.cpp shapes the tensors by the vocab, not by {arch}.vocab_size
    model = Model(path, f, arch, hp, vocab)
    _check_tensors(model)
    model.t_load_ms = (time.perf_counter() - t0) * 1e3
    return model


def _read_general(f: GGUFFile) -> str:
    """What llama_model_loader and load_hparams read of every file: the architecture (a string; none
    is the unknown architecture ""), the split count, the file type and the name."""
    meta = f.metadata
    arch_name = meta.get_str("general.architecture", "")
    n_split = meta.get_u16("split.count", 0)
    if n_split > 1:
        raise GGUFError(f"{f.path}: split.count = {n_split}: split GGUF files are not supported by llamir")
    meta.get_u32("general.file_type")
    meta.get_str("general.name")
    return arch_name


def _load_vocab(f: GGUFFile):
    if "tokenizer.ggml.model" not in f.metadata:
        return None
    from llamir.frontend.vocab import Vocab

    try:
        return Vocab.from_metadata(f.metadata)
    except ValueError as err:
        raise ModelError(f"{f.path}: bad vocab: {err}") from None


def _check_tensors(model: Model) -> None:
    """Every tensor the architecture needs exists with the shape llama.cpp would create, and the file
    holds no other (llama.cpp counts them: done_getting_tensors)."""
    specs = model.tensor_specs
    _check_no_extra_tensors(model, set(specs))
    for spec in specs.values():
        t = model.tensors.get(spec.name)
        if t is None:
            if spec.required:
                raise ModelError(f"{model.path}: missing tensor {spec.name!r}")
            continue
        if tuple(t.shape) != spec.shape:
            raise ModelError(f"{model.path}: tensor {spec.name!r} has wrong shape {list(t.shape)}; "
                             f"expected {list(spec.shape)} (numpy order; ggml ne "
                             f"{list(reversed(spec.shape))})")


def _check_no_extra_tensors(model: Model, known: set[str]) -> None:
    extra = [name for name in model.tensors if name not in known]
    if not extra:
        return
    arch, name = model.arch, extra[0]
    patterns = [re.escape(p).replace(r"\{il\}", r"\d+") for p in arch.unimplemented_tensors]
    if any(re.fullmatch(p, name) for p in patterns):
        raise ModelError(f"{model.path}: tensor {name!r} is one llama.cpp's {arch.name} loader can read, but "
                         "llamir does not implement it")
    raise ModelError(f"{model.path}: tensor {name!r} is not one the {arch.name} architecture loads; llama.cpp "
                     f"refuses the file (done_getting_tensors: wrong number of tensors; expected "
                     f"{len(model.tensors)}, got {len(model.tensors) - len(extra)})")
