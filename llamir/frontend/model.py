"""load_model: a GGUF file as an architecture, hyper-parameters, a vocab and memory-mapped weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from llamir.frontend.arch import ARCHS, ArchError, Architecture
from llamir.frontend.gguf_file import GGUFError, GGUFFile, GGUFTensor
from llamir.frontend.graph_context import GraphConfig, GraphContext
from llamir.frontend.hparams import HParams, load_hparams
from llamir.ir import BF16, Graph


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
        return str(self.gguf.get("general.name", self.path.stem))

    @property
    def n_params(self) -> int:
        return sum(int(np.prod(t.shape)) for t in self.tensors.values())

    @property
    def n_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors.values())

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

    def build_graph(self, config: GraphConfig) -> Graph:
        """The architecture's graph for `config` (symbolic in T, n_kv and n_out)."""
        if self.arch is None:
            raise ModelError(f"{self.path}: the model was loaded vocab-only (architecture {self.arch_name!r}); "
                             "load it without vocab_only to build its graph")
        g = GraphContext(self, config)
        self.arch.build(g)
        return g.b.graph

    def __repr__(self) -> str:
        hp = self.hparams
        if hp is None:
            return f"<Model {self.name!r} arch={self.arch_name} vocab only, n_vocab={self.vocab.n_tokens}>"
        return (f"<Model {self.name!r} arch={hp.arch} n_layer={hp.n_layer} n_embd={hp.n_embd} "
                f"n_vocab={hp.n_vocab}>")


def load_model(path: str | Path, vocab_only: bool = False) -> Model:
    """Open and validate a GGUF model: architecture, hparams, vocab and every tensor's shape.

    With vocab_only, as in llama.cpp, only general.architecture and the tokenizer.* keys are read:
    any architecture loads, and the model can tokenize but not run."""
    import time

    t0 = time.perf_counter()
    path = Path(path)
    try:
        f = GGUFFile(path)
    except GGUFError as err:
        raise ModelError(str(err)) from None
    arch_name = f.get("general.architecture")
    if arch_name is None:
        raise ModelError(f"{path}: metadata key general.architecture is missing")
    if not isinstance(arch_name, str):
        raise ModelError(f"{path}: general.architecture must be a string, got {type(arch_name).__name__}")
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
    vocab = _load_vocab(f)
    try:
        hp = load_hparams(f, arch_name)
        arch.load_hparams(f, hp)
    except (GGUFError, ArchError) as err:
        raise ModelError(str(err)) from None
    if vocab is not None and hp.n_vocab != vocab.n_tokens:
        raise ModelError(f"{path}: {arch_name}.vocab_size = {hp.n_vocab} but the vocab has {vocab.n_tokens} tokens")
    model = Model(path, f, arch, hp, vocab)
    _check_tensors(model)
    model.t_load_ms = (time.perf_counter() - t0) * 1e3
    return model


def _load_vocab(f: GGUFFile):
    if "tokenizer.ggml.model" not in f.metadata:
        return None
    from llamir.frontend.vocab import Vocab

    try:
        return Vocab.from_metadata(f.metadata)
    except ValueError as err:
        raise ModelError(f"{f.path}: bad vocab: {err}") from None


def _check_tensors(model: Model) -> None:
    """Every tensor the architecture needs exists with the shape llama.cpp would create."""
    for spec in model.arch.tensor_specs(model.hparams):
        t = model.tensors.get(spec.name)
        if t is None:
            if spec.required:
                raise ModelError(f"{model.path}: missing tensor {spec.name!r}")
            continue
        if tuple(t.shape) != spec.shape:
            raise ModelError(f"{model.path}: tensor {spec.name!r} has wrong shape {list(t.shape)}; "
                             f"expected {list(spec.shape)} (numpy order; ggml ne "
                             f"{list(reversed(spec.shape))})")
        if t.shape and t.shape[-1] % t.dtype.block_size:
            raise ModelError(f"{model.path}: tensor {spec.name!r} row of {t.shape[-1]} is not a whole number "
                             f"of {t.dtype} blocks")
        expected = int(np.prod(t.shape[:-1], dtype=np.int64)) * t.dtype.row_bytes(t.shape[-1]) if t.shape else 0
        if t.n_bytes != expected:
            raise ModelError(f"{model.path}: tensor {spec.name!r} holds {t.n_bytes} bytes; {t.dtype} "
                             f"{list(t.shape)} needs {expected} (truncated file?)")
