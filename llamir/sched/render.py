"""Turn the split pictures into files through the Debian tools that draw them: graphviz's `dot`
lays out DOT text (SVG or PNG), librsvg's `rsvg-convert` rasterizes an SVG to PNG."""

from __future__ import annotations

import shutil
import subprocess

TOOLS = {"dot": "graphviz", "rsvg-convert": "librsvg2-bin"}


class RenderError(RuntimeError):
    """A drawing tool is missing or failed; the message names the Debian package to install."""


def _run(tool: str, args: list[str], data: bytes) -> bytes:
    exe = shutil.which(tool)
    if exe is None:
        package = TOOLS[tool]
        raise RenderError(f"drawing this picture needs `{tool}` from the {package} package, which is not "
                          f"installed: apt-get install {package}")
    proc = subprocess.run([exe, *args], input=data, capture_output=True, timeout=300, check=False)
    if proc.returncode != 0:
        detail = proc.stderr.decode(errors="replace").strip().splitlines()
        raise RenderError(f"{tool} failed (exit {proc.returncode}): {detail[-1] if detail else 'no message'}")
    return proc.stdout


def render_dot(dot_text: str, fmt: str) -> bytes:
    """`dot -T<fmt>` on DOT text: fmt "svg" or "png"."""
    if fmt not in ("svg", "png"):
        raise ValueError(f"render_dot: format {fmt!r} is not svg or png")
    return _run("dot", [f"-T{fmt}"], dot_text.encode())


def svg_to_png(svg_text: str) -> bytes:
    """An SVG document rasterized 1:1 (96 dpi) on a white background."""
    return _run("rsvg-convert", ["--format", "png", "--background-color", "white"], svg_text.encode())
