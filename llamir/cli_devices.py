"""The device options every command that runs or plans a model takes, as llama.cpp's tools do:
`--device SPEC` (repeatable, priority order), `-ngl/--n-gpu-layers`, `-ot/--override-tensor`,
`--split-mode`, `--main-gpu`, `--tensor-split`, `--no-kv-offload`."""

from __future__ import annotations

import argparse
import math
import re


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", action="append", default=[], metavar="SPEC",
                   help="a device in priority order: NAME[:INDEX][:KEY=VALUE]... (a backend or plugin: "
                        "example, vulkan:0, cuda:1), sim:NAME[:KEY=VALUE]..., null[:NAME]; "
                        "see `llamir backends`")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=-1, dest="n_gpu_layers",
                   help="layers to offload, the output layer counting as one (default: all)")
    p.add_argument("--override-tensor", "-ot", action="append", default=[], metavar="REGEX=DEVICE",
                   dest="override_tensor", help="put matching tensors on DEVICE (e.g. 'blk\\.1\\.ffn_.*=cpu')")
    p.add_argument("--split-mode", choices=["none", "layer"], default="layer", dest="split_mode")
    p.add_argument("--main-gpu", type=int, default=0, dest="main_gpu")
    p.add_argument("--tensor-split", default="", dest="tensor_split", help="layer shares per device, e.g. 3,1")
    p.add_argument("--no-kv-offload", action="store_true", dest="no_kv_offload",
                   help="keep the KV cache in host memory")


def _error(message: str):
    from llamir.cli import CliError

    return CliError(message)


def placement_params(args):
    """The PlacementParams the device options ask for; CliError names a bad option."""
    from llamir.frontend.placement import PlacementParams

    overrides = []
    for item in args.override_tensor:
        regex, sep, device = item.rpartition("=")
        if not sep or not regex or not device:
            raise _error(f"--override-tensor {item!r}: expected REGEX=DEVICE (e.g. 'blk\\.1\\.ffn_.*=cpu')")
        try:
            re.compile(regex)
        except re.error as err:
            raise _error(f"--override-tensor: bad regex: {err}") from None
        overrides.append((regex, device))
    try:
        split = tuple(float(x) for x in args.tensor_split.split(",")) if args.tensor_split else ()
    except ValueError:
        raise _error(f"--tensor-split {args.tensor_split!r}: expected comma-separated numbers") from None
    bad = [x for x in split if not (math.isfinite(x) and x >= 0)]
    if bad:
        raise _error(f"--tensor-split {args.tensor_split!r}: every share must be a finite number >= 0, got {bad[0]}")
    return PlacementParams(n_gpu_layers=args.n_gpu_layers, split_mode=args.split_mode, main_gpu=args.main_gpu,
                           tensor_split=split, overrides=tuple(overrides), offload_kqv=not args.no_kv_offload)


def device_backends(args) -> list:
    """The --device backends in priority order (not the CPU: the command's backend runs there)."""
    from llamir.backends import BackendError, backend_from_spec

    try:
        devices = [backend_from_spec(spec) for spec in args.device]
    except (ValueError, BackendError) as err:
        raise _error(str(err)) from None
    cpus = [d.label for d in devices if d.is_cpu]
    if cpus and (len(cpus) > 1 or not devices[-1].is_cpu):
        raise _error("give the CPU at most once, as the last --device")
    return devices
