"""mamba (Mamba-1): an attention-free stack of selective state-space blocks over recurrent memory,
as llama.cpp's src/models/mamba.cpp and mamba-base.cpp (build_mamba_layer).

Each block: rms norm, then ssm_in projects to x and the gate z (2 * d_inner); x runs through a
causal 1-D convolution of width d_conv over the cached last d_conv - 1 inputs and the ubatch's
tokens (ssm_conv, + bias, silu); ssm_x projects it to the step size dt (dt_rank), B and C
(d_state each); dt goes up to d_inner through ssm_dt (+ bias); the selective scan (ssm_scan) runs
the state h' = exp(dt A) h + dt B x, y = C h from each sequence's cached state; then y + D x,
gated by silu(z), and ssm_out back to n_embd, added to the residual.
"""

from __future__ import annotations

from dataclasses import dataclass

from llamir.frontend.arch.base import ROPE_NONE, ArchError, Architecture, TensorSpec, register_arch
from llamir.frontend.graph_rs import RSLayout
from llamir.frontend.hparams import ArchHParams
from llamir.ir import dims


@dataclass(frozen=True)
class MambaHParams(ArchHParams):
    """The ssm.* keys (llama_hparams' ssm_*)."""

    d_conv: int = 4        # ssm.conv_kernel
    d_inner: int = 0       # ssm.inner_size
    d_state: int = 16      # ssm.state_size
    dt_rank: int = 0       # ssm.time_step_rank
    dt_b_c_rms: bool = False   # ssm.dt_b_c_rms: rms norms on dt, B and C (FalconMamba)


@register_arch
class Mamba(Architecture):
    name = "mamba"
    rope_type = ROPE_NONE
    has_attention = False
    synth_options = frozenset({"ssm_d_state", "ssm_d_conv", "ssm_dt_rank"})
    synth_defaults = {"ssm_d_state": 16, "ssm_d_conv": 4, "ssm_dt_rank": 8}

    def load_hparams(self, f, hp) -> None:
        """llama_model_mamba::load_arch_hparams: the ssm keys (dt_b_c_rms optional) and the rms eps."""
        load_ssm_hparams(f, hp, dt_b_c_rms=f.metadata.get_bool(f"{hp.arch}.ssm.dt_b_c_rms", False))

    def create_memory(self, hp, causal: bool = True) -> str:
        return "recurrent"

    def recurrent_layout(self, hp, size: int) -> RSLayout:
        return ssm_layout(hp, size, tuple(range(hp.n_layer)))

    def tensor_specs(self, hp):
        e, v = hp.n_embd, hp.n_vocab
        specs = [TensorSpec("token_embd.weight", (v, e)), TensorSpec("output_norm.weight", (e,)),
                 TensorSpec("output.weight", (v, e), required=False, gain=3.0, synth=True)]
        for il in range(hp.n_layer):
            specs += [TensorSpec(f"blk.{il}.attn_norm.weight", (e,))]
            specs += ssm_specs(hp, il, norms=False)   # (llama.cpp's mamba loads no dt/B/C norm weights)
        return specs

    def build(self, g) -> None:
        inp = g.inp_embd()                                                            # [T, E]
        out_ids = g.inp_out_ids()
        for il in g.layers():
            L = g.layer_weights(il)
            cur = g.norm(inp, L.attn_norm, name=("attn_norm", il))
            cur = build_mamba_layer(g, L, il, cur)                                    # [T, E]
            if il == g.hp.n_layer - 1:
                cur, inp = g.b.get_rows(cur, out_ids), g.b.get_rows(inp, out_ids)     # [n_out, E]
            inp = g.cvec(g.b.add(cur, inp), il, name=("l_out", il))
        cur = g.norm(inp, g.weights.output_norm)
        g.finish(cur, g.linear(g.output_weight(), cur))

    # -- synthetic models -------------------------------------------------------------------
    def synth_extra(self, spec) -> MambaHParams:
        return ssm_synth_extra(spec)

    def synth_check(self, spec) -> None:
        if spec.ssm_d_conv < 2:
            raise ValueError(f"ssm_d_conv={spec.ssm_d_conv}: the conv needs a window of at least 2")

    def synth_metadata(self, w, spec) -> None:
        write_ssm_metadata(w, spec)


def load_ssm_hparams(f, hp, dt_b_c_rms: bool) -> None:
    """The Mamba-1 keys of mamba and jamba (ssm.conv_kernel, inner_size, state_size,
    time_step_rank) and the rms eps, into hp.extra."""
    meta, key = f.metadata, f"{hp.arch}.ssm."
    values = {name: meta.get_u32(key + gguf_key, required=True)
              for name, gguf_key in (("d_conv", "conv_kernel"), ("d_inner", "inner_size"),
                                     ("d_state", "state_size"), ("dt_rank", "time_step_rank"))}
    eps = meta.get_f32(f"{hp.arch}.attention.layer_norm_rms_epsilon", required=True)
    if not eps >= 0.0:
        raise ArchError(f"{f.path}: {hp.arch}.attention.layer_norm_rms_epsilon = {eps}: rms_norm needs eps >= 0")
    hp.f_norm_rms_eps = eps
    if values["d_conv"] < 1 or not values["d_state"] or not values["dt_rank"]:
        raise ArchError(f"{f.path}: ssm sizes {values}: d_conv, d_state and dt_rank must be positive")
    if values["d_inner"] != 2 * hp.n_embd:   # llama.cpp's loader: "only an expansion factor of 2"
        raise ArchError(f"{f.path}: {key}inner_size = {values['d_inner']}: only an expansion factor of 2 is "
                        f"supported (2 * n_embd = {2 * hp.n_embd})")
    hp.extra = MambaHParams(**values, dt_b_c_rms=dt_b_c_rms)


def ssm_synth_extra(spec) -> MambaHParams:
    """The ssm hparams of a synthetic model: d_inner = 2 n_embd, as llama.cpp requires."""
    return MambaHParams(d_conv=spec.ssm_d_conv, d_inner=2 * spec.n_embd, d_state=spec.ssm_d_state,
                        dt_rank=spec.ssm_dt_rank)


def write_ssm_metadata(w, spec) -> None:
    """The ssm.* keys of a synthetic model."""
    x = ssm_synth_extra(spec)
    w.add_ssm_conv_kernel(x.d_conv)
    w.add_ssm_inner_size(x.d_inner)
    w.add_ssm_state_size(x.d_state)
    w.add_ssm_time_step_rank(x.dt_rank)


def ssm_layout(hp, size: int, layers: tuple[int, ...]) -> RSLayout:
    """n_embd_r = (d_conv - 1) * d_inner conv columns, n_embd_s = d_state * d_inner scan values."""
    x = hp.extra
    return RSLayout(size=size, n_embd_r=(x.d_conv - 1) * x.d_inner, n_embd_s=x.d_state * x.d_inner, layers=layers,
                    n_layer=hp.n_layer)


def ssm_specs(hp, il: int, norms: bool) -> list[TensorSpec]:
    """A Mamba-1 block's tensors (llama.cpp's load_arch_tensors of mamba and jamba), with the dt, B
    and C rms norms when `norms`."""
    x, e, p = hp.extra, hp.n_embd, f"blk.{il}."
    d_inner, d_state = x.d_inner, x.d_state
    specs = [
        TensorSpec(p + "ssm_in.weight", (2 * d_inner, e)),
        TensorSpec(p + "ssm_conv1d.weight", (d_inner, x.d_conv), init="matrix", storage="f32"),
        TensorSpec(p + "ssm_conv1d.bias", (d_inner,)),
        TensorSpec(p + "ssm_x.weight", (x.dt_rank + 2 * d_state, d_inner)),
        TensorSpec(p + "ssm_dt.weight", (d_inner, x.dt_rank), storage="f32"),   # rows of dt_rank
        TensorSpec(p + "ssm_dt.bias", (d_inner,), init="bias", gain=2.0),
        # A = -exp(A_log) < 0 (convert_hf_to_gguf writes it so), drawn around -1
        TensorSpec(p + "ssm_a", (d_inner, d_state), init="norm", gain=-1.0, storage="f32"),
        TensorSpec(p + "ssm_d", (d_inner,), init="norm"),
        TensorSpec(p + "ssm_out.weight", (e, d_inner)),
    ]
    if norms:
        specs += [TensorSpec(p + f"ssm_{n}_norm.weight", (size,))
                  for n, size in (("dt", x.dt_rank), ("b", d_state), ("c", d_state))]
    return specs


def build_mamba_layer(g, L, il: int, cur):
    """build_mamba_layer over the ubatch's rs_seqs sequences of rs_seq_tokens tokens each."""
    b, x_hp, rs = g.b, g.hp.extra, g.rs
    ns, nt = rs.n_seqs, rs.n_seq_tokens
    d_conv, d_inner, d_state, dt_rank = x_hp.d_conv, x_hp.d_inner, x_hp.d_state, x_hp.dt_rank
    r_all, s_all = rs.r(il), rs.s(il)
    conv = b.reshape(rs.own(r_all), ns, d_inner, d_conv - 1)                     # [S, d_inner, d_conv-1]
    cur = b.reshape(cur, ns, nt, g.hp.n_embd)                                     # [S, t, E]
    xz = g.linear(L.ssm_in, cur)                                                  # [S, t, 2*d_inner]
    row = 2 * d_inner * 4
    x = b.view(xz, [ns, nt, d_inner], [dims.mul(nt, row), row, 4], 0)               # [S, t, d_inner]
    z = b.view(xz, [ns, nt, d_inner], [dims.mul(nt, row), row, 4], d_inner * 4)
    conv_x = b.concat(conv, b.transpose(x), axis=2)                               # [S, d_inner, d_conv-1+t]
    width = conv_x.shape[2]
    last = b.view(conv_x, [ns, d_inner, d_conv - 1], [dims.mul(width, d_inner * 4), dims.mul(width, 4), 4],
                  dims.mul(nt, 4))                                                # the last d_conv-1 columns
    rs.store(r_all, b.reshape(b.cont(last), ns, (d_conv - 1) * d_inner), name=("conv_state", il))
    x = b.ssm_conv(conv_x, L.ssm_conv1d)                                          # [S, t, d_inner]
    x = b.unary("silu", b.add(x, L.ssm_conv1d_bias))
    x_db = g.linear(L.ssm_x, x)                                                   # [S, t, dt_rank+2*d_state]
    row = (dt_rank + 2 * d_state) * 4
    dt = b.view(x_db, [ns, nt, dt_rank], [dims.mul(nt, row), row, 4], 0)            # [S, t, dt_rank]
    B = b.view(x_db, [ns, nt, 1, d_state], [dims.mul(nt, row), row, d_state * 4, 4], dt_rank * 4)
    C = b.view(x_db, [ns, nt, 1, d_state], [dims.mul(nt, row), row, d_state * 4, 4], (dt_rank + d_state) * 4)
    norms = [L[f"ssm_{n}_norm.weight"] if f"ssm_{n}_norm.weight" in L.names() else None for n in ("dt", "b", "c")]
    if x_hp.dt_b_c_rms or all(w is not None for w in norms):   # FalconMamba, Jamba: rms norms (weights if any)
        dt, B, C = (g.norm(t, w) for t, w in zip((dt, B, C), norms, strict=True))
    else:
        dt = b.cont(dt)
    dt = b.add(g.linear(L.ssm_dt, dt), L.ssm_dt_bias)                             # [S, t, d_inner]
    skip = x
    x = b.reshape(x, ns, nt, d_inner, 1)                                          # [S, t, n_head, head_dim]
    states = b.reshape(s_all, rs.layout.size, d_inner, 1, d_state)                # [size, n_head, 1, d_state]
    y_ssm = b.ssm_scan(states, x, dt, L["ssm_a"], B, C, rs.ids)   # [S*t*d_inner + S*d_inner*d_state]
    last_s = b.view(y_ssm, [ns, d_inner * d_state], [d_inner * d_state * 4, 4], dims.prod([ns, nt, d_inner, 4]))
    rs.store(s_all, last_s, name=("ssm_state", il))
    y = b.view(y_ssm, [ns, nt, d_inner], [dims.mul(nt, d_inner * 4), d_inner * 4, 4], 0)   # [S, t, d_inner]
    y = b.add(y, b.mul(skip, L["ssm_d"]))
    y = b.glu("swiglu", b.cont(z), y)                                            # silu(z) * y
    cur = g.linear(L.ssm_out, y)                                                  # [S, t, E]
    return b.reshape(cur, g.T, g.hp.n_embd)
