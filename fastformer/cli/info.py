"""`python -m fastformer info`: versions, devices, build metadata and each op's backends."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from fastformer.cli import env
from fastformer.cli.cases import OPS
from fastformer.cli.impls import load_op


def op_backends() -> dict[str, Any]:
    """For each op module: importable or not, and for each registered op its backends with
    availability and the reasons a backend is unavailable in this environment."""
    from fastformer.ops import _dispatch

    modules = {}
    for op in OPS:
        _, error = load_op(op)
        modules[op] = {"module": f"fastformer.ops.{op}", "available": error is None, "error": error}
    registered = {}
    for name in sorted(_dispatch.REGISTRY):
        try:
            rows = _dispatch.explain(name, None)
        except Exception as exc:  # a broken reasons() must not hide the other ops
            registered[name] = {"error": f"{type(exc).__name__}: {exc}", "backends": []}
            continue
        backends = [{"name": b, "available": not why, "reasons": list(why)} for b, why in rows]
        default = next((b["name"] for b in backends if b["available"]), None)
        forced = _dispatch.forced_backend(name)
        registered[name] = {"backends": backends, "default": default, "forced": forced}
    return {"modules": modules, "registered": registered}


def ffn_drelu() -> dict[str, Any]:
    """FASTFORMER_FFN_DRELU's mode, and for each visible GPU whether its DRELU epilogue path may
    run there (the bitmask layout check it runs once per device): what a GPU run's info says
    before any test. An error is reported in place of the value it stopped."""
    from fastformer._ext import cuda_kernels_compiled, load_extension
    from fastformer.ops import ffn

    out: dict[str, Any] = {"mode": None, "layout_ok": {}}
    try:
        out["mode"] = ffn.drelu_mode()
    except ValueError as exc:
        out["mode"] = f"invalid: {exc}"
    check = getattr(load_extension(), "ffn_relu_mask_layout_ok", None)
    if check is None or not cuda_kernels_compiled() or not torch.cuda.is_available():
        return out
    for index in range(torch.cuda.device_count()):
        try:
            with torch.cuda.device(index):
                out["layout_ok"][str(index)] = check()
        except Exception as exc:  # a failing check must not hide the rest of info
            out["layout_ok"][str(index)] = f"{type(exc).__name__}: {exc}"
    return out


def collect() -> dict[str, Any]:
    """Everything `info` prints, as a JSON-serialisable dict."""
    return {"environment": env.manifest(), "ops": op_backends(), "ffn_drelu": ffn_drelu()}


def _format(info: dict[str, Any]) -> str:
    e = info["environment"]
    lines = [
        f"fastformer {e['fastformer']} (git {e['git_sha'] or 'unknown'})",
        f"python {e['python']}  torch {e['torch']}  triton {e['triton']}  CUDA {e['cuda']}",
        f"platform {e['platform']}",
        f"cpu {e['cpu']} ({e['cpu_count']} cores, torch threads {e['torch_threads']})",
    ]
    if e["gpus"]:
        lines += [
            f"gpu {g['index']}: {g['name']} (sm {g['capability']}, {g['memory_gib']} GiB)"
            for g in e["gpus"]
        ]
        lines.append(f"driver {e['driver']}  cudnn {e['cudnn']}")
    else:
        lines.append("gpu: none visible")
    lines.append(f"build: {json.dumps(e['build_info'])}")
    match = {True: "yes", False: "NO: rebuild (make build)", None: "cannot tell"}
    lines.append(f"built from the csrc/ of this checkout: {match[e.get('sources_match')]}")
    lines.append(f"CUDA kernels compiled: {e['cuda_kernels_compiled']}")
    if e.get("triton_launches"):
        lines.append(f"attention's Triton launches: {e['triton_launches']}")
    if e.get("fastformer_env"):
        lines.append("settings: " + " ".join(f"{k}={v}" for k, v in e["fastformer_env"].items()))
    if e["extension_error"]:
        lines.append(f"extension error: {e['extension_error']}")
    if "ffn_drelu" in info:
        drelu = info["ffn_drelu"]
        usable = {True: "yes", False: "NO (the kernel path runs)"}
        where = ", ".join(f"cuda:{i} {usable.get(v, v)}" for i, v in drelu["layout_ok"].items())
        lines.append(
            f"ffn relu backward (FASTFORMER_FFN_DRELU): {drelu['mode']}; DRELU epilogue usable: "
            + (where or "no GPU checked")
        )
    lines.append("ops:")
    for op, mod in info["ops"]["modules"].items():
        if not mod["available"]:
            lines.append(f"  {op}: not available ({mod['error']})")
    for name, reg in info["ops"]["registered"].items():
        forced = f", forced {reg['forced']}" if reg.get("forced") else ""
        lines.append(f"  {name} (default backend: {reg.get('default')}{forced})")
        if reg.get("error"):
            lines.append(f"    error: {reg['error']}")
        for b in reg["backends"]:
            state = "available" if b["available"] else "unavailable: " + "; ".join(b["reasons"])
            lines.append(f"    {b['name']}: {state}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the environment (text, or JSON with --json). Always exits 0."""
    info = collect()
    print(json.dumps(info, indent=2) if args.json else _format(info))
    return 0
