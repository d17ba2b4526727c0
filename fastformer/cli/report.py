"""Outputs of `bench`: results.json, report.md, PNG plots, the terminal table, and the
comparison of two runs (`--compare`, `--fail-if-slower`)."""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastformer.cli.errors import UsageError

SCHEMA = 1
FAST = "fastformer"
# What a results.json must hold (checked by the tests and by `load`).
REQUIRED_MANIFEST = (
    "date",
    "fastformer",
    "git_sha",
    "python",
    "torch",
    "triton",
    "cuda",
    "driver",
    "gpu",
    "machine",
    "cpu",
    "cpu_count",
    "build_info",
    "cuda_kernels_compiled",
)
REQUIRED_TOP = ("schema", "manifest", "config", "rooflines", "ops")
REQUIRED_VARIANT = (
    "train_tokens_per_s",
    "infer_tokens_per_s",
    "train_step_ms",
    "infer_ms",
    "peak_memory_bytes",
)


def missing_fields(results: dict[str, Any]) -> list[str]:
    """Names of required fields absent from `results` (empty when complete)."""
    for key in ("config", "manifest"):  # compare() reads them with .get: an AttributeError
        if key in results and not isinstance(results[key], dict):
            raise TypeError(f"{key} is {results[key]!r}, not an object")
    missing = [k for k in REQUIRED_TOP if k not in results]
    missing += [f"manifest.{k}" for k in REQUIRED_MANIFEST if k not in results.get("manifest", {})]
    model = results.get("model")
    if "model" in results and not isinstance(model, dict):  # absent: a --no-model run
        raise TypeError(f"model is {model!r}, not an object")
    if model is not None:
        for key in ("config", "parity", "variants", "tokens_per_batch"):
            if key not in model:
                missing.append(f"model.{key}")
        for name, var in model.get("variants", {}).items():
            if not ({"skipped", "error"} & set(var)):
                missing += [f"model.variants.{name}.{k}" for k in REQUIRED_VARIANT if k not in var]
    for op, data in results.get("ops", {}).items():
        for row in data.get("cases", []):
            for key in ("case", "mode", "impls", "speedup"):
                if key not in row:
                    missing.append(f"ops.{op}.{row.get('case')}.{key}")
    return missing


def is_fastformer_variant(name: str) -> bool:
    """Whether a model variant is built on the swapped model (plain, compiled or graphed)."""
    return name.split("+")[0] == FAST


def fastformer_errors(results: dict[str, Any]) -> list[str]:
    """Every exception fastformer itself raised during the run (model variant or op case)."""
    errors = []
    for name, var in results.get("model", {}).get("variants", {}).items():
        # same_as: the swap error of a variant built on the swapped model, listed once
        if is_fastformer_variant(name) and "error" in var and "same_as" not in var:
            errors.append(f"model {name}: {var['error']}")
    for op, data in results.get("ops", {}).items():
        for row in data["cases"]:
            res = row["impls"].get(FAST, {})
            if "error" in res and "same_as" not in res:  # a derived row's copy: listed once
                errors.append(f"{op} {row['case']} {row['mode']}: {res['error']}")
    return errors


def nothing_measured(results: dict[str, Any]) -> str | None:
    """Why a run timed nothing, or None when it timed something (a run past --max-seconds may
    list every figure as not run)."""
    entries = list((results.get("model") or {}).get("variants", {}).values())
    for data in results.get("ops", {}).values():
        entries += [res for row in data["cases"] for res in row["impls"].values()]
    if any("ms" in e or "train_step_ms" in e for e in entries):
        return None
    if any("not_run" in e or str(e.get("skipped")).startswith("not run") for e in entries):
        return "nothing was measured before --max-seconds: every figure is not run"
    return "nothing was measured: see the report for each figure's reason"


def partial_note(results: dict[str, Any], where: str) -> str | None:
    """A warning that `results` is a run that did not end (killed or interrupted), or None: its
    missing figures were never measured, not dropped."""
    if not results.get("partial"):
        return None
    return (
        f"warning: {where} is a partial run (killed or interrupted before it ended): the "
        "figures it did not reach are missing"
    )


def load(path: Path, option: str = "results file", complete: bool = False) -> dict[str, Any]:
    """A results.json, with a clear error (naming `option`) when it is not one. Its structure
    is checked (what `compare` and the report read); `complete`: every required field too
    (re-rendering a report needs them; a comparison may take an older run's file)."""
    where = f"{option} {str(path)!r}"
    if not path.exists():
        raise UsageError(f"{where} does not exist")
    if not path.is_file():
        raise UsageError(f"{where} is not a file")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or "schema" not in data:
        raise UsageError(f"{where} is not a fastformer bench results.json (schema {SCHEMA})")
    if data["schema"] != SCHEMA:
        raise UsageError(
            f"{where} has results.json schema {data['schema']!r}; this fastformer reads "
            f"schema {SCHEMA}"
        )
    try:
        missing = missing_fields(data)
        figures(data)
        if complete and not missing:  # everything the report and plots read
            markdown(data, [])
            terminal_table(data)
            if "attention" in data["ops"]:
                _tflops_groups(data["ops"]["attention"]["cases"])
    except (AttributeError, KeyError, TypeError, ValueError, OverflowError) as exc:
        raise UsageError(f"{where} is malformed ({type(exc).__name__}: {exc})") from exc
    if not complete:
        missing = [m for m in missing if m.split(".")[0] in ("ops", "model")]
    if missing:
        raise UsageError(f"{where} lacks {', '.join(missing[:8])}")
    return data


def finite(value: Any) -> Any:
    """`value` with its NaN and infinite floats as None: strict JSON (a failed parity's error is
    inf, which json.dumps wrote as Infinity: not JSON, and jq or JSON.parse refuse the file).
    `check --json` and results.json both write it."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


# The files of a run's folder (bench checks that none is a folder before it measures).
RESULTS_JSON, RESULTS_TMP, REPORT_MD = "results.json", "results.json.tmp", "report.md"
TFLOPS_PNG, MODEL_PNG = "attention_tflops.png", "model.png"


def speedup_png(op: str) -> str:
    """The file name of `op`'s speedup plot."""
    return f"speedup_{op}.png"


def output_names(ops: list[str]) -> list[str]:
    """Every file a run of `ops` (and of the model) may write into its folder."""
    return [RESULTS_JSON, RESULTS_TMP, REPORT_MD, *map(speedup_png, ops), TFLOPS_PNG, MODEL_PNG]


def write_json(out_dir: Path, results: dict[str, Any]) -> Path:
    """Write results.json atomically (a partial run leaves a valid file), as strict JSON."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RESULTS_JSON
    tmp = out_dir / RESULTS_TMP
    text = json.dumps(finite(results), indent=2, default=str, allow_nan=False)
    tmp.write_text(text + "\n")
    os.replace(tmp, path)
    return path


def write_all(out_dir: Path, results: dict[str, Any]) -> list[Path]:
    """results.json, report.md and the PNG plots; returns the paths written."""
    paths = [write_json(out_dir, results)]
    pngs = plots(out_dir, results)
    md = out_dir / REPORT_MD
    md.write_text(markdown(results, [p.name for p in pngs]))
    return paths + [md] + pngs


# --------------------------------------------------------------------------- formatting


def _num(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if abs(x) >= 1e5:
        return f"{x:.3g}"
    return f"{x:.{digits}g}"


def _sci(x: float | None) -> str:
    """A parity error or bound; a NaN output's is inf here and null in results.json."""
    if x is None or not math.isfinite(x):
        return "not finite"
    return f"{x:.2e}"


def _impl_cell(res: dict[str, Any]) -> str:
    if "ms" in res:
        return _num(res["ms"])
    if "not_run" in res:
        return "not run"
    return "n/a" if "unsupported" in res else "err"


def _peers(rows: list[dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for row in rows:
        names += [n for n in row["impls"] if n not in names]
    return names


def _rate(res: dict[str, Any]) -> str:
    backend = f" ({res['backend']})" if res.get("backend") else ""
    if "tflops" in res:
        return f"{res['tflops']:.3g} TFLOP/s{backend}"
    if "gbps" in res:
        return f"{res['gbps']:.4g} GB/s{backend}"
    return "-"


def model_lines(model: dict[str, Any]) -> list[str]:
    """Markdown table of the model stage."""
    cfg = model["config"]
    lines = [
        f"Model `{cfg['name']}`: d_model {cfg['d_model']}, {cfg['nhead']} heads, "
        f"{cfg['num_encoder_layers']}+{cfg['num_decoder_layers']} layers, d_ff "
        f"{cfg['dim_feedforward']}, dropout {cfg['dropout']}, shared vocabulary {cfg['vocab']}; "
        f"batch {cfg['batch']} x {cfg['max_len']} tokens per side, "
        f"{model['tokens_per_batch']} real tokens (src + tgt), "
        f"{model['padding_fraction']:.0%} padding, {model['dtype']}.",
    ]
    if "optimizer" in model:  # results of 2026-12-06 on (before: Adam's foreach default)
        lines.append(f"Training step: zero_grad, forward and loss, backward, {model['optimizer']}.")
    lines.append("")
    host = any("train_host_ms" in v for v in model["variants"].values())
    ms = "ms (host)" if host else "ms"
    lines += [
        f"| variant | train tokens/s | train step {ms} | inference tokens/s | inference {ms} "
        "| peak memory MiB | fastformer's speedup: train / inference |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, v in model["variants"].items():
        if "train_tokens_per_s" not in v:
            lines.append(f"| {name} | {v.get('skipped') or v.get('error')} | | | | | |")
            continue
        train, infer = (_num(x) for x in model_speedups(model, name))
        lines.append(
            f"| {name} | {v['train_tokens_per_s']:.0f} | {v['train_step_ms']:.1f}"
            f"{_host(v, 'train_host_ms')} | {v['infer_tokens_per_s']:.0f} | "
            f"{v['infer_ms']:.1f}{_host(v, 'infer_host_ms')} | "
            f"{v['peak_memory_bytes'] / 2**20:.0f} | {train} / {infer} |"
        )
    if host:
        lines += [
            "",
            "(host): milliseconds for the step's Python to return, the GPU idle at its start and "
            "not waited for; near the step time, the host sets the pace, not the GPU.",
        ]
    notes = [(n, v["note"]) for n, v in model["variants"].items() if "note" in v]
    if notes:
        lines += ["", *(f"{name}: {what}." for name, what in notes)]
    par = model["parity"]
    if par.get("passed") is None:
        lines += ["", f"Parity: not checked ({par.get('skipped')})."]
    elif "error" in par:
        lines += ["", f"Parity at dropout 0: **FAIL**: fastformer raised {par['error']}."]
    else:
        verdict = "pass" if par["passed"] else "FAIL"
        worst = par["worst"]
        lines += [
            "",
            f"Parity at dropout 0 (loss and {par['compared'] - 1} gradients vs the reference in "
            f"float64): **{verdict}**; loss error {_sci(par['loss']['error'])} (bound "
            f"{_sci(par['loss']['bound'])}); closest to its bound: {worst['name']} "
            f"{_sci(worst['error'])} / {_sci(worst['bound'])}.",
        ]
        if par.get("relu_inputs_near_zero"):
            lines[-1] += (
                f" {par['relu_inputs_near_zero']} ReLU inputs within rounding of 0 may take "
                "either sign (gradients are measured less what that moves them by)."
            )
        if par.get("relative_floor") is False:
            lines[-1] += (
                " Too many such inputs to bound what they move upstream: the bounds keep the "
                "dtype's absolute floor, a weak check of gradients much smaller than 1."
            )
        lines += [f"- {f}" for f in par["failed"]]
    return lines


def model_speedups(model: dict[str, Any], name: str) -> tuple[float | None, float | None]:
    """fastformer's training and inference tokens/s over variant `name`'s (None where either
    was not measured)."""
    fast, other = model["variants"].get(FAST, {}), model["variants"].get(name, {})
    return tuple(
        fast[key] / other[key] if fast.get(key) and other.get(key) else None
        for key in ("train_tokens_per_s", "infer_tokens_per_s")
    )


def _host(variant: dict[str, Any], key: str) -> str:
    return f" ({variant[key]:.1f})" if key in variant else ""


def _memory_lines(rows: list[dict[str, Any]], peers: list[str]) -> list[str]:
    """Peak memory beyond the inputs (MiB) of each implementation, where it was measured (CUDA)."""
    measured = [r for r in rows if any("peak_memory_bytes" in v for v in r["impls"].values())]
    if not measured:
        return []
    head = ["case", "mode"] + [f"{p} MiB" for p in peers]
    lines = ["", "Peak memory beyond the inputs:", "", "| " + " | ".join(head) + " |"]
    lines.append("|" + "---|" * len(head))
    for row in measured:
        cells = [row["case"], row["mode"]]
        for p in peers:
            peak = row["impls"].get(p, {}).get("peak_memory_bytes")
            cells.append("-" if peak is None else f"{peak / 2**20:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _saved_lines(rows: list[dict[str, Any]], peers: list[str]) -> list[str]:
    """Bytes per token each implementation saves for its backward beyond its inputs."""
    measured = [r for r in rows if any("saved_bytes_per_token" in v for v in r["impls"].values())]
    if not measured:
        return []
    head = ["case"] + peers
    lines = ["", "Saved for the backward beyond the inputs, bytes per token:", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in measured:
        cells = [row["case"]]
        for p in peers:
            saved = row["impls"].get(p, {}).get("saved_bytes_per_token")
            cells.append("-" if saved is None else f"{saved:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def op_lines(op: str, rows: list[dict[str, Any]]) -> list[str]:
    """Markdown table of one op: ms per implementation, fastformer's rate and speedups."""
    peers = _peers(rows)
    others = [p for p in peers if p != FAST]
    head = ["case", "mode"] + [f"{p} ms" for p in peers] + ["fastformer rate (backend)"]
    head += [f"x vs {p}" for p in others] + ["of roofline"]
    fractions = ["fraction_of_roofline"]
    if any("fraction_of_same_size_copy" in row for row in rows):
        fractions.append("fraction_of_same_size_copy")
        head.append("of same-size copy")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["case"], row["mode"]]
        cells += [_impl_cell(row["impls"].get(p, {"unsupported": ""})) for p in peers]
        cells.append(_rate(row["impls"].get(FAST, {})))
        cells += [_num(row["speedup"].get(p), 3) for p in others]
        for key in fractions:
            frac = row.get(key)
            cells.append("-" if frac is None else f"{frac:.0%}")
        lines.append("| " + " | ".join(cells) + " |")
    reasons = {
        f"{p}: {res['unsupported']}"
        for row in rows
        for p, res in row["impls"].items()
        if "unsupported" in res
    }
    errors = {
        f"{p}: {res['error']}" for row in rows for p, res in row["impls"].items() if "error" in res
    }
    not_run = sum("not_run" in res for row in rows for res in row["impls"].values())
    if not_run:
        reasons.add(f"{not_run} measurement(s) not run: past --max-seconds")
    lines += _memory_lines(rows, peers)
    lines += _saved_lines(rows, peers)
    if reasons or errors:
        lines += ["", "Not measured:"] + [f"- {r}" for r in sorted(reasons | errors)]
    return lines


def grid_label(results: dict[str, Any]) -> str:
    """`grid: default (12 cases)`: which per-op grid the run used (quick wins over full) and how
    many op cases it holds. A run recorded before --full existed measured today's full grid."""
    cfg = results["config"]
    kind = "quick" if cfg.get("quick") else "full" if cfg.get("full", True) else "default"
    cases = sum(len({row["case"] for row in data["cases"]}) for data in results["ops"].values())
    return f"grid: {kind} ({cases} case{'' if cases == 1 else 's'})"


def settings_lines(manifest: dict[str, Any]) -> list[str]:
    """The run's FASTFORMER_* settings (they change which kernels run), if any were set."""
    settings = manifest.get("fastformer_env")  # older results.json files have no such key
    if not settings:
        return []
    return ["Settings: " + ", ".join(f"`{k}={v}`" for k, v in settings.items()) + ".", ""]


def interpreted_ops(results: dict[str, Any]) -> list[str]:
    """The ops whose fastformer figures timed Triton's interpreter: with TRITON_INTERPRET=1,
    those that ran (or dispatch by default or force to) a Triton backend."""
    # (terminal_table is also given bare results, without a manifest)
    if not (results.get("manifest") or {}).get("triton_interpret"):
        return []
    ops = {
        op
        for op, data in results["ops"].items()
        if any(row["impls"].get(FAST, {}).get("backend") == "triton" for row in data["cases"])
    }
    if results.get("model"):  # the model stage's rows name no backend: the dispatch's
        registered = (results.get("backends") or {}).get("registered", {})
        ops |= {
            op
            for op, reg in registered.items()
            if (reg.get("forced") or reg.get("default")) == "triton"
        }
    return sorted(ops)


def interpreter_note(results: dict[str, Any]) -> str | None:
    """A warning that fastformer's figures of `interpreted_ops` are the Triton interpreter's
    (a "speedup" of 0.0001 otherwise read as a slow kernel), or None."""
    ops = interpreted_ops(results)
    if not ops:
        return None
    names = ", ".join(ops)
    model = " and the fastformer model's" if results.get("model") else ""
    return (
        f"TRITON_INTERPRET=1: fastformer's Triton kernels ({names}) ran in Triton's "
        f"interpreter, Python on the CPU; fastformer's {names} figures{model} time the "
        "interpreter, not the kernels, and are not a speed measurement (rerun without "
        "TRITON_INTERPRET=1 to measure)"
    )


def markdown(results: dict[str, Any], images: list[str]) -> str:
    """report.md: environment, notes, model table, per-op tables, plots."""
    m, cfg = results["manifest"], results["config"]
    lines = [
        "# fastformer bench",
        "",
        f"{m['date']} - fastformer {m['fastformer']} (git {m['git_sha'] or 'unknown'}) - "
        f"{m['machine'].upper()} machine: {m['gpu'] or m['cpu']}"
        + (f" ({m['cpu_l3_bytes'] >> 20} MiB L3)" if m.get("cpu_l3_bytes") and not m["gpu"] else "")
        + (f", driver {m['driver']}" if m.get("driver") else "")
        + f" - torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}, python {m['python']}",
        "",
        # shell-quoted: a path with a space read as two arguments
        f"Command: `python -m fastformer {shlex.join(cfg.get('argv', ['bench']))}` "
        f"(model {cfg['model'] or 'none'}, ops {', '.join(cfg['ops']) or 'none'}, "
        f"{cfg['dtype']} on {cfg['device']}"
        + (f", {grid_label(results)}" if cfg["ops"] else "")
        + ").",
        "",
    ]
    lines += settings_lines(m)
    interpreted = interpreter_note(results)
    if interpreted:
        lines += [f"> **Triton interpreter.** {interpreted}.", ""]
    if cfg.get("notes"):  # a time limit or an interrupt notes a full-size run too
        title = "Reduced size." if cfg["reduced"] else "Note."
        lines += [f"> **{title}** " + " ".join(n + "." for n in cfg["notes"]), ""]
    roof = results["rooflines"]
    lines += [
        f"Measured in this run: device copy {roof['copy_gbps']:.0f} GB/s, "
        f"{roof['gemm_size']}^3 GEMM {_num(roof['gemm_tflops'])} TFLOP/s ({cfg['dtype']}). "
        '"of roofline" = max(FLOPs / GEMM rate, bytes / copy rate) / fastformer\'s time; '
        '"of same-size copy" = the time of one copy moving the same bytes / fastformer\'s.',
        "",
        "Timing: median after warm-up (CUDA: triton.testing.do_bench / CUDA events; CPU: "
        "time.perf_counter, a case's implementations timed in turns, one call each per round). "
        "Tokens = non-padding source + target tokens. Inference = one "
        "teacher-forced forward pass. Reference dropout uses a precomputed keep-mask (its RNG "
        "is not timed). Attention FLOPs: 4*B*H*S*S*D forward, x0.5 causal, x2.5 backward; "
        "attention's bwd rows are derived, fwd+bwd time less fwd time, per implementation.",
        "",
    ]
    if cfg.get("malloc"):
        lines += [
            f"Memory: {cfg['malloc']}, so that outputs reuse freed pages instead of faulting "
            "in fresh ones on every call (as with jemalloc or tcmalloc preloaded).",
            "",
        ]
    if "model" in results:
        lines += ["## Model", ""] + model_lines(results["model"]) + [""]
    for op, data in results["ops"].items():
        lines += [f"## {op}", ""] + op_lines(op, data["cases"]) + [""]
    tuning = results.get("tuning", {}).get("attention")
    if tuning:
        lines += ["## Attention autotuning", ""] + tuning_lines(tuning) + [""]
    if images:
        lines += ["## Plots", ""] + [f"![{name}]({name})" for name in images] + [""]
    return "\n".join(lines)


def tuning_lines(entries: list[dict[str, Any]]) -> list[str]:
    """One row per autotuned (kernel, key): the config chosen and each candidate's ms."""
    lines = [
        "Config = BLOCK_M x BLOCK_N, warps, stages (qk: dK/dV on query x key tiles; tma: the "
        "loop's tiles, K and V or for dK/dV Q and dO, through TMA descriptors); ms = the "
        "autotuner's median for that config (- = did not fit).",
        "",
        "| kernel | class | D | causal | mask | padding | dropout | seq q / k | dtype | chosen "
        "| candidates ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        times = ", ".join(f"{c}: {_num(ms)}" for c, ms in e.get("ms", {}).items()) or "-"
        lines.append(
            f"| {e['kernel']} | {e['feature_class']} | {e.get('HEAD_D')} | {e.get('IS_CAUSAL')} "
            f"| {e.get('MASK_KIND')} | {e.get('HAS_KPM')} | {e.get('HAS_DROPOUT')} "
            f"| {e['seq_q_bucket']} / {e['seq_k_bucket']} | {e['dtype'].replace('torch.', '')} "
            f"| {e['chosen']} | {times} |"
        )
    return lines


def terminal_table(results: dict[str, Any]) -> str:
    """The summary printed at the end of `bench`."""
    lines = []
    cfg = results["config"]
    interpreted = interpreter_note(results)
    if interpreted:
        lines.append(f"WARNING: {interpreted}")
    lines += ["NOTE: " + n for n in cfg.get("notes", [])]
    model = results.get("model")
    if model:
        lines.append(f"\nmodel {model['config']['name']} ({model['dtype']})")
        lines.append(
            f"{'variant':<20} {'train tok/s':>12} {'infer tok/s':>12} {'peak MiB':>9}"
            "  fastformer x (train / infer)"
        )
        for name, v in model["variants"].items():
            if "train_tokens_per_s" in v:
                train, infer = (_num(x) for x in model_speedups(model, name))
                lines.append(
                    f"{name:<20} {v['train_tokens_per_s']:>12.0f} {v['infer_tokens_per_s']:>12.0f} "
                    f"{v['peak_memory_bytes'] / 2**20:>9.0f}  {train} / {infer}"
                )
            else:
                lines.append(f"{name:<20} {v.get('skipped') or v.get('error')}")
        par = model["parity"]
        verdict = {True: "pass", False: "FAIL", None: "not checked"}[par.get("passed")]
        lines.append(f"parity (loss + gradients, dropout 0): {verdict}")
    for op, data in results["ops"].items():
        rows = data["cases"]
        others = [p for p in _peers(rows) if p != FAST]
        lines.append(f"\n{op}: fastformer ms and speedup (x) over each peer")
        lines.append(f"{'case':<30} {'mode':<8} {'ms':>9}  " + " ".join(f"{p:>13}" for p in others))
        for row in rows:
            ms = row["impls"].get(FAST, {}).get("ms")
            cells = " ".join(f"{_num(row['speedup'].get(p)):>13}" for p in others)
            lines.append(f"{row['case']:<30} {row['mode']:<8} {_num(ms):>9}  {cells}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- plots


def plots(out_dir: Path, results: dict[str, Any]) -> list[Path]:
    """speedup_<op>.png per op, attention_tflops.png, model.png (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for op, data in results["ops"].items():
        paths.append(_speedup_plot(plt, out_dir / speedup_png(op), op, data["cases"]))
    if "attention" in results["ops"]:
        paths.append(_tflops_plot(plt, out_dir / TFLOPS_PNG, results["ops"]["attention"]["cases"]))
    if "model" in results:
        paths.append(_model_plot(plt, out_dir / MODEL_PNG, results["model"]))
    return paths


def _speedup_plot(plt, path: Path, op: str, rows: list[dict[str, Any]]) -> Path:
    others = [p for p in _peers(rows) if p != FAST]
    labels = [f"{r['case']}\n{r['mode']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows) + 2), 4.5))
    width = 0.8 / max(len(others), 1)
    for i, peer in enumerate(others):
        xs = [j + i * width for j in range(len(rows))]
        ys = [_nan(r["speedup"].get(peer)) for r in rows]
        ax.bar(xs, ys, width, label=peer)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ratios = [v for r in rows for v in r["speedup"].values() if v is not None and v > 0]
    if ratios and max(ratios) / min(ratios) > 20:
        ax.set_yscale("log")
    if not ratios:
        ax.text(0.5, 0.5, "fastformer not measured", ha="center", transform=ax.transAxes)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels(labels, rotation=90, fontsize=6)
    ax.set_ylabel("speedup (peer ms / fastformer ms)")
    # two lines: one was cut at the figure's width
    ax.set_title(
        f"{op}: speedup of fastformer over each peer\n(>1: fastformer faster)", fontsize=10
    )
    if others:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _nan(value: float | None) -> float:
    """A figure for matplotlib: null (how results.json writes NaN and inf) as NaN."""
    return float("nan") if value is None else value


def _tflops_groups(rows: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    """The sequence sweeps (no padding, no dropout) by (mode, head dim, causal), each sorted
    by sequence length (`load` calls it to check a --results file's rows)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        p = row["params"]
        if not p["padding"] and not p["dropout_p"]:
            groups.setdefault((row["mode"], p["head_dim"], p["causal"]), []).append(row)
    return {k: sorted(g, key=lambda r: r["params"]["seq"]) for k, g in groups.items()}


def _tflops_plot(plt, path: Path, rows: list[dict[str, Any]]) -> Path:
    """TFLOP/s against sequence length per implementation: one panel per (mode) row and
    (head dim, causal) column, over the sequence sweep (no padding, no dropout)."""
    groups = _tflops_groups(rows)
    # in this order: sorted from a set, bwd and fwd+bwd swapped with PYTHONHASHSEED
    modes = [m for m in ("fwd", "bwd", "fwd+bwd") if any(k[0] == m for k in groups)] or ["fwd"]
    columns = sorted({k[1:] for k in groups}) or [(0, False)]
    fig, axes = plt.subplots(
        len(modes), len(columns), figsize=(4 * len(columns), 3.4 * len(modes)), squeeze=False
    )
    for i, mode in enumerate(modes):
        for j, (dim, causal) in enumerate(columns):
            _tflops_panel(axes[i][j], groups.get((mode, dim, causal), []))
            axes[i][j].set_title(
                f"{mode}, head dim {dim}, {'causal' if causal else 'full'}", fontsize=9
            )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _tflops_panel(ax, group: list[dict[str, Any]]) -> None:
    plotted = False
    for impl in _peers(group):
        pts = [(r["params"]["seq"], r["impls"][impl].get("tflops")) for r in group]
        pts = [(s, t) for s, t in pts if t is not None]
        if pts:
            style = "-" if impl == FAST else "--"
            ax.plot(*zip(*pts), style, marker="o", label=impl)
            plotted = True
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("TFLOP/s")
    if plotted:  # (cases not measured, past --max-seconds, leave a panel without lines)
        ax.legend(fontsize=6)


def _model_plot(plt, path: Path, model: dict[str, Any]) -> Path:
    names = [n for n, v in model["variants"].items() if "train_tokens_per_s" in v]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    for ax, key, title in zip(
        axes, ("train_tokens_per_s", "infer_tokens_per_s"), ("training", "inference")
    ):
        ax.bar(names, [model["variants"][n][key] for n in names])
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{model['config']['name']} model: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- comparison


_MAX_FLOAT = int(sys.float_info.max)


@dataclass(frozen=True)
class Figure:
    """One number of a run: `higher` tells which direction is better; `own` marks fastformer's
    own speed figures (the only ones --fail-if-slower judges)."""

    value: float | None
    unit: str
    higher: bool
    own: bool

    def __post_init__(self) -> None:
        # A results.json with a string figure is malformed (`load` says so up front); null is
        # how it writes a NaN or infinite number (`finite`): no change, as NaN.
        if self.value is None:
            return
        if not isinstance(self.value, (int, float)) or isinstance(self.value, bool):
            raise TypeError(f"a figure in {self.unit} is {self.value!r}, not a number")
        if isinstance(self.value, int) and not -_MAX_FLOAT <= self.value <= _MAX_FLOAT:
            # compare() divides figures: an OverflowError there, after the run
            raise ValueError(f"a figure in {self.unit} is an integer too large for a float")

    @property
    def usable(self) -> bool:
        """Whether it can be compared: a positive, finite number (NaN and null are not)."""
        return _usable(self.value)


def figures(results: dict[str, Any]) -> dict[str, Figure]:
    """Every number of a run, flattened to `key -> Figure`."""
    out: dict[str, Figure] = {}
    model = results.get("model")
    if model:
        for name, v in model["variants"].items():
            # the compiled and graphed swapped models are fastformer's too (GPU, --full)
            own = is_fastformer_variant(name)
            for key, unit, higher in (
                ("train_tokens_per_s", "tok/s", True),
                ("infer_tokens_per_s", "tok/s", True),
                ("peak_memory_bytes", "B", False),
            ):
                if key in v:
                    out[f"model.{name}.{key}"] = Figure(v[key], unit, higher, own and unit != "B")
    for op, data in results.get("ops", {}).items():
        for row in data["cases"]:
            base = f"{op}.{row['case']}.{row['mode']}"
            for impl, res in row["impls"].items():
                if "ms" in res:
                    # a derived time (fwd+bwd - fwd) carries both its terms' noise: printed,
                    # not judged by --fail-if-slower (its two measured terms are)
                    own = impl == FAST and "derived" not in res
                    out[f"{base}.{impl}.ms"] = Figure(res["ms"], "ms", False, own)
                if "saved_bytes_per_token" in res:
                    saved = Figure(res["saved_bytes_per_token"], "B", False, False)
                    out[f"{base}.{impl}.saved_bytes_per_token"] = saved
            for peer, ratio in row["speedup"].items():
                out[f"{base}.speedup_vs_{peer}"] = Figure(ratio, "x", True, False)
    for key in ("copy_gbps", "gemm_tflops"):
        if key in results.get("rooflines", {}):
            unit = "GB/s" if key == "copy_gbps" else "TFLOP/s"
            out[f"rooflines.{key}"] = Figure(results["rooflines"][key], unit, True, False)
    return out


@dataclass(frozen=True)
class Change:
    """A figure present in both runs; `slower_pct` > 0 when the new run is worse: the time it
    takes more, in percent (for a time, `change_pct`; for a rate, the time per unit)."""

    key: str
    old: float
    new: float
    unit: str
    own: bool
    slower_pct: float

    @property
    def change_pct(self) -> float:
        """new / old - 1, in percent (the raw change, whichever way is better)."""
        return (self.new / self.old - 1) * 100 if self.old else math.inf


def compare(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """The change of every figure present in both runs."""
    a, b = figures(old), figures(new)
    changes = []
    for key in sorted(set(a) & set(b)):
        fa, fb = a[key], b[key]
        if not (fa.usable and fb.usable):  # NaN or null too: no change
            continue
        # new time / old time, whichever way "better" points (a rate's time is per unit).
        time_ratio = fa.value / fb.value if fa.higher else fb.value / fa.value
        changes.append(Change(key, fa.value, fb.value, fa.unit, fa.own, (time_ratio - 1) * 100))
    return changes


@dataclass(frozen=True)
class Unpaired:
    """A figure of fastformer's own with a usable value in one run only (`old` or `new`: the
    value of each run, None where it has no such figure, NaN for null); `tried`: whether the
    new run has its case (or model variant) at all, where --ops, --cases or --no-model may
    leave it out."""

    key: str
    old: float | None
    new: float | None
    tried: bool

    @property
    def lost(self) -> bool:
        """Whether the old run's figure has no usable counterpart in a case the new run has
        (not run in time, failed, null): its change is unknown."""
        return _usable(self.old) and self.tried


def _usable(value: float | None) -> bool:
    return value is not None and 0 < value < math.inf


def unpaired(old: dict[str, Any], new: dict[str, Any]) -> list[Unpaired]:
    """fastformer's own figures that `compare` cannot pair: absent from a run, null or 0 in it
    (a case the new run lacks was dropped silently and passed --fail-if-slower)."""
    a, b = figures(old), figures(new)
    tried = _entries(new)
    out = []
    for key in sorted(set(a) | set(b)):
        fa, fb = a.get(key), b.get(key)
        own = any(f.own for f in (fa, fb) if f)
        if own and (fa is not None and fa.usable) != (fb is not None and fb.usable):
            entry = key.rsplit(".", 1)[0]  # the figure's case and implementation
            out.append(Unpaired(key, _value(fa), _value(fb), entry in tried))
    return out


def _entries(run: dict[str, Any]) -> set[str]:
    """Every model variant and every (op, case, mode, implementation) a run has, run or not,
    named as `figures` keys less their last part."""
    out = {f"model.{name}" for name in (run.get("model") or {}).get("variants", {})}
    for op, data in run.get("ops", {}).items():
        for row in data["cases"]:
            out |= {f"{op}.{row['case']}.{row['mode']}.{impl}" for impl in row["impls"]}
    return out


def _value(figure: Figure | None) -> float | None:
    if figure is None:
        return None
    return math.nan if figure.value is None else figure.value


def format_unpaired(items: list[Unpaired]) -> str:
    """The figures `unpaired` found, one line each."""
    lines = [f"compare: {len(items)} fastformer figure(s) in one run only (not compared):"]
    for u in items:
        shown = _shown(u.new) if u.tried or u.new is not None else "not in this run"
        lines.append(f"  {u.key}: old {_shown(u.old)}, new {shown}")
    return "\n".join(lines)


def _shown(value: float | None) -> str:
    if value is None:
        return "missing"
    return "null" if math.isnan(value) else f"{value:.4g}"


# The settings two runs must share for --compare to pair their figures: the figure keys name
# the op, case and implementation only.
_SHARED_SETTINGS = ("model", "dtype", "device", "quick", "full")


def _shared(run: dict[str, Any]) -> dict[str, Any]:
    """The _SHARED_SETTINGS of a run, `full` as measured: --quick wins over --full (a run before
    this rule recorded --quick --full as full)."""
    cfg = {k: (run.get("config") or {}).get(k) for k in _SHARED_SETTINGS}
    if cfg["quick"] is True and cfg["full"] is not None:
        cfg["full"] = False
    return cfg


def incomparable(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """How two runs' settings differ (those both record), and their GPUs: their figures then
    measure different things ([] = comparable)."""
    a, b = _shared(old), _shared(new)
    diffs = [
        f"{k} {a[k]!r} vs {b[k]!r}"
        for k in _SHARED_SETTINGS
        if a.get(k) is not None and b.get(k) is not None and a[k] != b[k]  # None: no model run
    ]
    gpus = [(run.get("manifest") or {}).get("gpu") for run in (old, new)]
    if gpus[0] != gpus[1]:
        diffs.append(f"gpu {gpus[0]!r} vs {gpus[1]!r}")
    # An interpreter run's Triton figures time Python, ~1000x a kernel's (None: not recorded).
    interp = [(run.get("manifest") or {}).get("triton_interpret") for run in (old, new)]
    if None not in interp and interp[0] != interp[1]:
        diffs.append(
            f"triton_interpret {interp[0]} vs {interp[1]}: a run of Triton's interpreter "
            "against one of its kernels"
        )
    return diffs


def regressions(changes: list[Change], pct: float) -> list[Change]:
    """fastformer's own figures that got worse by more than `pct` percent."""
    return [c for c in changes if c.own and c.slower_pct > pct]


def format_changes(changes: list[Change], pct: float | None) -> str:
    """One line per figure: old, new, change; regressions marked when `pct` is given."""
    if not changes:
        return "compare: no figure in common with the old run"
    lines = [f"{'figure':<70} {'old':>11} {'new':>11} {'change':>9}"]
    for c in changes:
        mark = ""
        if pct is not None and c.own and c.slower_pct > pct:
            mark = f"  REGRESSION (>{pct:g}% slower)"
        lines.append(
            f"{c.key:<70} {_num(c.old, 4):>11} {_num(c.new, 4):>11} {c.change_pct:>+8.1f}%{mark}"
        )
    return "\n".join(lines)
