"""`llamir backends`: every registered backend (built-in and plugin), its devices, whether each
can be used (and why not), and the options its device specs take."""

from __future__ import annotations

import json

from llamir.backends.base import BackendError
from llamir.backends.registry import available_backends, get_registry
from llamir.sched.plan import format_bytes


def describe_backends() -> list[dict]:
    out = []
    for name in available_backends():
        entry: dict = {"name": name, "devices": [], "options": {}}
        try:
            reg = get_registry(name)
            entry["description"] = reg.description
            entry["options"] = {key: opt.help for key, opt in reg.options.items()}
            devices = reg.devices()
        except (BackendError, Exception) as err:  # noqa: BLE001 - a plugin that fails to load is listed as such
            entry["error"] = f"{type(err).__name__}: {err}"
            out.append(entry)
            continue
        for i, dev in enumerate(devices):
            entry["devices"].append({
                "index": i, "name": dev.name, "description": dev.description, "type": dev.type.value,
                "memory_free": dev.memory_free, "memory_total": dev.memory_total,
                "caps": {"async": dev.caps.async_, "events": dev.caps.events, "host_buffer": dev.caps.host_buffer},
                "usable": dev.unusable is None, "why_not": dev.unusable,
            })
        out.append(entry)
    return out


def _text(entries: list[dict]) -> str:
    lines = []
    for e in entries:
        lines.append(f"{e['name']}: {e.get('description', '')}".rstrip())
        if "error" in e:
            lines.append(f"  not usable: the plugin failed to load ({e['error']})")
            continue
        for d in e["devices"]:
            caps = ",".join(k for k, v in d["caps"].items() if v) or "-"
            state = "usable" if d["usable"] else f"not usable: {d['why_not']}"
            lines.append(f"  {e['name']}:{d['index']}  {d['name']:<10} {d['type']:<5} "
                         f"{format_bytes(d['memory_free'])} free of {format_bytes(d['memory_total'])}  "
                         f"caps {caps}  {state}")
            lines.append(f"      {d['description']}")
        if not e["devices"]:
            lines.append("  no devices")
        for key, help_text in e["options"].items():
            lines.append(f"  option {key}=...  {help_text}")
    return "\n".join(lines)


def cmd_backends(args) -> int:
    entries = describe_backends()
    print(json.dumps(entries, indent=2) if args.json else _text(entries))
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("backends", help="list the registered backends, their devices and options")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=cmd_backends)
