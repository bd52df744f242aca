"""The adapter options of run, chat, logits and perplexity, as llama.cpp's common args take them:
`--lora FNAME[:SCALE]` and `--lora-scaled FNAME:SCALE` (each comma-separated and repeatable),
`--control-vector FNAME`, `--control-vector-scaled FNAME:SCALE` and
`--control-vector-layer-range START END` (default: layer 1 to n_layer, as common_init_from_params)."""

from __future__ import annotations

import argparse


class _Files(argparse.Action):
    """Appends each comma-separated (file, scale) of the option to one list, in command-line order (the
    order llama.cpp applies them in)."""

    def __call__(self, parser, namespace, values, option_string=None):
        files = list(getattr(namespace, self.dest, None) or [])
        for item in (i for i in values.split(",") if i):
            files.append(self.const(item, option_string))
        setattr(namespace, self.dest, files)


def add_adapter_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", action=_Files, const=_lora_item, default=[], dest="lora_files",
                   metavar="FNAME[:SCALE]",
                   help="a LoRA adapter, scale 1 unless given (comma-separated for several; repeatable)")
    p.add_argument("--lora-scaled", action=_Files, const=_scaled, default=[], dest="lora_files",
                   metavar="FNAME:SCALE", help="a LoRA adapter with a scale (comma-separated; repeatable)")
    p.add_argument("--control-vector", action=_Files, const=_unscaled, default=[], dest="control_vector_files",
                   metavar="FNAME", help="add a control vector (comma-separated for several; repeatable)")
    p.add_argument("--control-vector-scaled", action=_Files, const=_scaled, default=[],
                   dest="control_vector_files", metavar="FNAME:SCALE", help="add a control vector times SCALE")
    p.add_argument("--control-vector-layer-range", nargs=2, type=int, metavar=("START", "END"),
                   dest="control_vector_layer_range", default=None,
                   help="the layers the control vectors apply to, both inclusive (default: 1 to n_layer)")


def _error(message: str):
    from llamir.cli import CliError

    return CliError(message)


def _scaled(item: str, flag: str) -> tuple[str, float]:
    """FNAME:SCALE, as llama.cpp's --lora-scaled reads it (exactly one colon)."""
    parts = item.split(":")
    if len(parts) != 2:
        raise argparse.ArgumentError(None, f"{flag} format: FNAME:SCALE, got {item!r}")
    try:
        return parts[0], float(parts[1])
    except ValueError:
        raise argparse.ArgumentError(None, f"{flag} {item!r}: the scale {parts[1]!r} is not a number") from None


def _unscaled(item: str, flag: str) -> tuple[str, float]:
    return item, 1.0


def _lora_item(item: str, flag: str) -> tuple[str, float]:
    """FNAME or FNAME:SCALE (a file name may hold a colon: only a number after the last one is a scale)."""
    path, colon, scale = item.rpartition(":")
    if colon:
        try:
            return path, float(scale)
        except ValueError:
            pass
    return item, 1.0


def apply_adapters(ctx, args) -> None:
    """Load the LoRA adapters (once per model: perplexity makes several contexts) and control vectors
    the options name and apply them to `ctx`; CliError for a file llama.cpp would refuse."""
    from llamir.frontend.adapter import AdapterError, load_adapter_lora, load_control_vectors

    loras = getattr(args, "lora_files", [])
    cvecs = getattr(args, "control_vector_files", [])
    try:
        if loras:
            cache = args.__dict__.setdefault("_loaded_loras", {})
            adapters = []
            for path, _ in loras:
                key = (id(ctx.model), path)
                if key not in cache:
                    cache[key] = load_adapter_lora(ctx.model, path)
                adapters.append(cache[key])
            ctx.set_adapters_lora(adapters, [scale for _, scale in loras])
        if cvecs:
            n_embd, data = load_control_vectors(cvecs)
            start, end = args.control_vector_layer_range or (0, 0)
            n_layer = ctx.model.hparams.n_layer
            ctx.set_adapter_cvec(data, n_embd, start if start > 0 else 1, end if end > 0 else n_layer)
    except AdapterError as err:
        raise _error(str(err)) from None


__all__ = ["add_adapter_args", "apply_adapters"]
