"""`llamir splits MODEL`: where each op of a model would run on a mix of devices, why, and what it costs.

llamir splits model.gguf --device sim:gpu0:mem=8GiB --n-gpu-layers 20 --n-tokens 512
llamir splits model.gguf --device sim:gpu0:ops=all,-soft_max_ext --explain kq_soft_max-3
llamir splits model.gguf --device sim:gpu0 -ngl 10 --format png --out plan.png
llamir splits model.gguf --device sim:gpu0 -ngl 10 --layers 19-21 --format svg --out layers.svg
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from llamir.cli_devices import add_device_args, device_backends, placement_params
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
    return GraphConfig(memory=(kv,), rope=RopeParams.resolve(model.hparams), flash_attn=flash_attn)


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
    from llamir.sched.layers import rows_of
    from llamir.sched.scheduler import Scheduler

    built = model.build_graph(graph_config(model, n_ctx, flash_attn))
    graph = built.graph
    placement = place_model(model, built, devices, params)
    placement.apply(graph)
    sched = Scheduler(placement.backends, placement.buffers(), op_offload=op_offload, n_copies=n_copies)
    reserve = reserve_batches(placement.backends, min(n_ctx, n_ubatch))
    for t in reserve:
        bound = bind_dims(graph, {"T": t, "n_kv": n_ctx, "n_out": t})
        sched.reserve(bound, placement.pins(bound, t))
    placement.check_memory(sched.buffer_sizes())
    bound = bind_dims(graph, {"T": n_tokens, "n_kv": n_ctx, "n_out": n_outputs})
    plan = sched.split_graph(bound, placement.pins(bound, n_tokens))
    plan.rows = rows_of(built.layers.of(bound), model.hparams.n_layer)
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

    from llamir.backends import backend_from_spec
    from llamir.cli import _load
    from llamir.frontend.placement import PlacementError
    from llamir.sched.scheduler import SchedError

    devices = device_backends(args)
    if not devices or not devices[-1].is_cpu:
        devices.append(backend_from_spec("cpu"))
    _check_batch_args(args)
    params = placement_params(args)
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
    if args.layers is not None and args.format not in PICTURE_FORMATS:
        raise _error(f"--layers chooses what a picture shows: give --format {', '.join(PICTURE_FORMATS)}")
    if args.format in PICTURE_FORMATS:
        data = _picture(args.format, args.layers, model, report)
    else:
        data = _render(args.format, model, report, explains, args.nodes)
    if args.out:
        with open(args.out, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
    elif isinstance(data, bytes):  # a PNG
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    else:
        sys.stdout.write(data)
    return 0


PICTURE_FORMATS = ("svg", "png", "dot")


def _picture(fmt: str, layers: str | None, model, report: SplitsReport) -> str | bytes:
    """The layer picture (svg, png), or the node-level graph of --layers (dot, or svg/png by graphviz)."""
    from llamir.sched.draw import plan_to_svg
    from llamir.sched.draw_graph import plan_to_dot
    from llamir.sched.layers import parse_layers, rows_title
    from llamir.sched.render import RenderError, render_dot, svg_to_png

    devices = ", ".join(b.label for b in report.placement.backends)
    title = f"{model.name}: {model.hparams.n_layer} layers on {devices}"
    try:
        if layers is None and fmt != "dot":
            svg = plan_to_svg(report.plan, title=title)
            return svg if fmt == "svg" else svg_to_png(svg)
        rows = None
        if layers is not None:
            try:
                rows = parse_layers(layers, model.hparams.n_layer)
            except ValueError as err:
                raise _error(str(err)) from None
            title += "; " + rows_title(rows)
        dot = plan_to_dot(report.plan, rows, title=title)
        if fmt == "png":
            return render_dot(dot, "png")
        return dot if fmt == "dot" else render_dot(dot, "svg").decode()
    except RenderError as err:
        raise _error(str(err)) from None


def _render(fmt: str, model, report: SplitsReport, explains: dict[str, str], nodes: bool) -> str:
    plan, placement = report.plan, report.placement
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
    add_device_args(p)
    p.add_argument("--n-tokens", type=int, default=1, dest="n_tokens", help="tokens in the planned batch")
    p.add_argument(
        "--n-outputs", type=int, default=1, dest="n_outputs", help="rows of logits the batch returns"
    )
    p.add_argument("--n-ctx", type=int, default=4096, dest="n_ctx")
    p.add_argument("--n-ubatch", type=int, default=512, dest="n_ubatch")
    p.add_argument("--flash-attn", choices=["on", "off"], default="off", dest="flash_attn")
    p.add_argument("--no-op-offload", action="store_true", dest="no_op_offload")
    p.add_argument("--n-copies", type=int, default=1, dest="n_copies", help="pipeline-parallel copies (1-4)")
    p.add_argument(
        "--format",
        choices=["text", "json", *PICTURE_FORMATS],
        default="text",
        help="svg/png: one row per layer, splits as bands, copies with bytes; with --layers (or dot): "
        "the node-level graph, laid out by graphviz",
    )
    p.add_argument(
        "--layers",
        metavar="RANGE",
        help="draw the ops of these layers: 3-5, 4, input, output, or a comma list (28-29,output)",
    )
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
