"""`python -m fastformer info`: versions, devices, build metadata and each op's backends."""

from __future__ import annotations

import argparse
import json
from typing import Any

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


def collect() -> dict[str, Any]:
    """Everything `info` prints, as a JSON-serialisable dict."""
    return {"environment": env.manifest(), "ops": op_backends()}


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
