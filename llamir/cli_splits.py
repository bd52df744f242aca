"""`llamir splits MODEL`: where each op of a model would run on a mix of devices, why, and what it costs.

llamir splits model.gguf --device sim:gpu0:mem=8GiB --n-gpu-layers 20 --n-tokens 512
llamir splits model.gguf --device sim:gpu0:ops=all,-soft_max_ext --explain kq_soft_max-3
llamir splits model.gguf --device sim:gpu0 --format svg --out plan.svg
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass

from llamir.sched.plan import format_bytes


@dataclass
class SplitsReport:
    """Everything `llamir splits` shows: placement, the plan for one batch, reserved buffers."""

    placement: object
    plan: object
    compute: dict[str, int]
    reserve_batches: list[int]


def graph_config(model, n_ctx: int, flash_attn: bool):
    """The decoder graph config of a context with an n_ctx-cell f16 KV cache."""
    from llamir.frontend.graph_context import GraphConfig, KVLayout, RopeParams

    kv = KVLayout(kv_size=n_ctx, v_trans=not flash_attn, layers=tuple(range(model.hparams.n_layer)))
    return GraphConfig(kv=kv, rope=RopeParams.resolve(model.hparams), flash_attn=flash_attn)


def plan_model(
    model,
    devices: list,
    params,
    *,
    n_tokens: int,
    n_outputs: int = 1,
    n_ctx: int = 4096,
    n_ubatch: int = 512,
    flash_attn: bool = False,
    op_offload: bool = True,
    n_copies: int = 1,
) -> SplitsReport:
    """Place `model` on `devices` (CPU last), plan one batch of n_tokens, and reserve the
    worst-case graphs (n_ubatch-token prompt, 1-token generation) for the compute buffers."""
    from llamir.frontend.placement import place_model
    from llamir.ir.bind import bind_dims
    from llamir.sched.scheduler import Scheduler

    graph = model.build_graph(graph_config(model, n_ctx, flash_attn))
    placement = place_model(model, graph, devices, params)
    placement.apply(graph)
    sched = Scheduler(placement.backends, placement.buffers(), op_offload=op_offload, n_copies=n_copies)
    reserve = reserve_batches(placement.backends, min(n_ctx, n_ubatch))
    for t in reserve:
        bound = bind_dims(graph, {"T": t, "n_kv": n_ctx, "n_out": t})
        sched.reserve(bound, placement.pins(bound, t))
    placement.check_memory(sched.buffer_sizes())
    bound = bind_dims(graph, {"T": n_tokens, "n_kv": n_ctx, "n_out": n_outputs})
    plan = sched.split_graph(bound, placement.pins(bound, n_tokens))
    return SplitsReport(placement, plan, sched.buffer_sizes(), reserve)


def reserve_batches(backends: list, n_ubatch: int) -> list[int]:
    """llama.cpp reserves the n_ubatch prompt and the 1-token graphs. Where op_offload switches
    at a batch size in between, the largest batch below the switch is measured too, since its
    host buffers can exceed both (llama.cpp would grow them at run time instead)."""
    batches = {n_ubatch, 1}
    for b in backends:
        threshold = getattr(getattr(b, "spec", None), "offload_batch", None)
        if threshold is not None and 1 < threshold <= n_ubatch:
            batches.add(threshold - 1)
    return sorted(batches, reverse=True)


def _params(args):
    from llamir.frontend.placement import PlacementParams

    overrides = []
    for item in args.override_tensor:
        regex, sep, device = item.rpartition("=")
        if not sep or not regex or not device:
            raise _error(f"--override-tensor {item!r}: expected REGEX=DEVICE (e.g. 'blk\\.1\\.ffn_.*=cpu')")
        overrides.append((regex, device))
    try:
        split = tuple(float(x) for x in args.tensor_split.split(",")) if args.tensor_split else ()
    except ValueError:
        raise _error(f"--tensor-split {args.tensor_split!r}: expected comma-separated numbers") from None
    bad = [x for x in split if not (math.isfinite(x) and x >= 0)]
    if bad:
        raise _error(f"--tensor-split {args.tensor_split!r}: every share must be a finite number >= 0, got {bad[0]}")
    return PlacementParams(
        n_gpu_layers=args.n_gpu_layers,
        split_mode=args.split_mode,
        main_gpu=args.main_gpu,
        tensor_split=split,
        overrides=tuple(overrides),
        offload_kqv=not args.no_kv_offload,
    )


def _check_batch_args(args) -> None:
    """The sizes of the planned batch and context, before the model is loaded."""
    for flag, value in (("--n-ctx", args.n_ctx), ("--n-ubatch", args.n_ubatch), ("--n-tokens", args.n_tokens)):
        if value < 1:
            raise _error(f"{flag} must be at least 1, got {value}")
    largest = min(args.n_ctx, args.n_ubatch)
    if args.n_tokens > largest:
        raise _error(f"--n-tokens {args.n_tokens} is more than one ubatch holds (the smaller of --n-ctx "
                     f"{args.n_ctx} and --n-ubatch {args.n_ubatch}): a graph is built for one ubatch")
    if not 0 <= args.n_outputs <= args.n_tokens:
        raise _error(f"--n-outputs must be in 0..{args.n_tokens} (the batch's tokens), got {args.n_outputs}")


def _error(message: str):
    from llamir.cli import CliError

    return CliError(message)


def cmd_splits(args) -> int:
    import re

    from llamir.backends import BackendError, backend_from_spec
    from llamir.cli import _load
    from llamir.frontend.placement import PlacementError
    from llamir.sched.scheduler import SchedError

    try:
        devices = [backend_from_spec(spec) for spec in args.device]
    except (ValueError, BackendError) as err:
        raise _error(str(err)) from None
    if not devices or not devices[-1].is_cpu:
        devices.append(backend_from_spec("cpu"))
    cpus = [d for d in devices if d.is_cpu]
    if len(cpus) > 1 or not devices[-1].is_cpu:
        raise _error("give the CPU at most once, as the last --device")
    _check_batch_args(args)
    params = _params(args)
    try:
        for regex, _ in params.overrides:
            re.compile(regex)
    except re.error as err:
        raise _error(f"--override-tensor: bad regex: {err}") from None
    model = _load(args.model)
    try:
        report = plan_model(
            model,
            devices,
            params,
            n_tokens=args.n_tokens,
            n_outputs=args.n_outputs,
            n_ctx=args.n_ctx,
            n_ubatch=args.n_ubatch,
            flash_attn=args.flash_attn == "on",
            op_offload=not args.no_op_offload,
            n_copies=args.n_copies,
        )
        explains = {name: report.plan.explain(name) for name in args.explain}
    except (PlacementError, SchedError, KeyError) as err:
        raise _error(str(err).strip("'\"")) from None
    text = _render(args.format, model, report, explains, args.nodes)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def _render(fmt: str, model, report: SplitsReport, explains: dict[str, str], nodes: bool) -> str:
    plan, placement = report.plan, report.placement
    if fmt == "svg":
        from llamir.sched.draw import plan_to_svg

        return plan_to_svg(plan)
    if fmt == "json":
        doc = {
            "model": model.name,
            "n_layer": model.hparams.n_layer,
            "devices": [
                {
                    "name": b.label,
                    "type": b.device.type.value,
                    "memory": b.device.memory_total,
                    "description": b.device.description,
                }
                for b in placement.backends
            ],
            "layers": placement.layer_device,
            "output_layer": placement.output_device,
            "weights": {n: {"device": p.device, "reason": p.reason} for n, p in placement.weights.items()},
            "kv_cache": placement.state,
            "memory": {d: {"weights": w, "kv_cache": kv} for d, (w, kv) in placement.memory_use().items()},
            "plan": plan.to_json(),
            "compute_buffers": report.compute,
            "reserve_batches": report.reserve_batches,
            "explain": explains,
        }
        return json.dumps(doc, indent=1) + "\n"
    lines = [
        f"model {model.name}: {model.hparams.n_layer} layers; devices "
        f"{', '.join(_device_label(b) for b in placement.backends)}",
        placement.summary().rstrip(),
        plan.to_text(show_nodes=nodes).rstrip(),
        "compute buffers (reserved for batches of "
        + ", ".join(map(str, report.reserve_batches))
        + " tokens): "
        + ", ".join(f"{d} {format_bytes(n)}" for d, n in report.compute.items()),
    ]
    for text in explains.values():
        lines.append("explain: " + text.rstrip())
    return "\n".join(lines) + "\n"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "splits",
        help="show how a model splits over devices (real or simulated)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n", 1)[1] + _spec_help(),
    )
    p.add_argument("model", nargs="?", help="GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--device",
        action="append",
        default=[],
        metavar="SPEC",
        help="a device in priority order: sim:NAME[:KEY=VALUE]..., null[:NAME], cpu, or a backend name",
    )
    p.add_argument(
        "--n-gpu-layers",
        "-ngl",
        type=int,
        default=-1,
        dest="n_gpu_layers",
        help="layers to offload, the output layer counting as one (default: all)",
    )
    p.add_argument("--n-tokens", type=int, default=1, dest="n_tokens", help="tokens in the planned batch")
    p.add_argument(
        "--n-outputs", type=int, default=1, dest="n_outputs", help="rows of logits the batch returns"
    )
    p.add_argument(
        "--override-tensor",
        "-ot",
        action="append",
        default=[],
        metavar="REGEX=DEVICE",
        dest="override_tensor",
        help="put matching tensors on DEVICE (e.g. 'blk\\.1\\.ffn_.*=cpu')",
    )
    p.add_argument("--split-mode", choices=["none", "layer"], default="layer", dest="split_mode")
    p.add_argument("--main-gpu", type=int, default=0, dest="main_gpu")
    p.add_argument(
        "--tensor-split", default="", dest="tensor_split", help="layer shares per device, e.g. 3,1"
    )
    p.add_argument("--n-ctx", type=int, default=4096, dest="n_ctx")
    p.add_argument("--n-ubatch", type=int, default=512, dest="n_ubatch")
    p.add_argument("--flash-attn", choices=["on", "off"], default="off", dest="flash_attn")
    p.add_argument("--no-op-offload", action="store_true", dest="no_op_offload")
    p.add_argument("--no-kv-offload", action="store_true", dest="no_kv_offload")
    p.add_argument("--n-copies", type=int, default=1, dest="n_copies", help="pipeline-parallel copies (1-4)")
    p.add_argument("--format", choices=["text", "json", "svg"], default="text")
    p.add_argument("--nodes", action="store_true", help="list every op of every split (text format)")
    p.add_argument(
        "--explain",
        action="append",
        default=[],
        metavar="NAME",
        help="why a value (by name or %%index) runs where it does",
    )
    p.add_argument("--out", help="write to this file instead of stdout")
    p.set_defaults(func=cmd_splits)


def _spec_help() -> str:
    from llamir.backends.sim import spec

    return "\n\ndevice specs:\n" + spec.__doc__.split("\n", 2)[2]


def _device_label(b) -> str:
    return b.device.description if b.label in b.device.description else b.label
