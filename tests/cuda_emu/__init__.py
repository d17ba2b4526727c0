"""The project's CUDA kernels (csrc/**/*_cuda.cu) compiled for the CPU and run by an emulator.

`load()` reads the .cu files, rewrites what a host C++ compiler cannot take (launches
`k<<<grid, block, smem, stream>>>(args)`, `__shared__` declarations; see `transform`), compiles
them with the emulated runtime (emu.h, emu.cpp) into build/cuda_emu/<variant>/libffemu.so, then
the torch bindings (bindings.cpp) with torch.utils.cpp_extension, and returns `torch.ops.
fastformer_emu`. Both steps are ninja builds: a second run compiles nothing.

The kernel library is built with UBSan checks (alignment, array bounds, signed overflow, shifts)
whose reports emu.cpp turns into a failed launch: a misaligned 16-byte vector access faults on a
GPU but passes on x86.

FASTFORMER_CUDA_EMU_MUTATION=<name> builds a variant with one textual mutation of a kernel
(`MUTATIONS`, applied to the copy in build/), to show that the tests catch it; csrc/ is never
modified. Each of them fails tests/test_cuda_emu.py, e.g.

    FASTFORMER_CUDA_EMU_MUTATION=row_sum_no_second_sync pytest -q tests/test_cuda_emu.py
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
BUILD = ROOT / "build" / "cuda_emu"
CUDA_INCLUDE = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
SOURCES = ("layer_norm/layer_norm_cuda.cu", "ffn/ffn_cuda.cu", "rng/rng_cuda.cu")
MUTATION_ENV = "FASTFORMER_CUDA_EMU_MUTATION"
OPT = "-O2"  # as fast overall as -O1 here: a little longer to compile, a little faster to run

# name -> (source, text, replacement): test-only breakages of a kernel (each text occurs once).
MUTATIONS: dict[str, tuple[str, str, str]] = {
    # row_sum reads the other warps' slots before they are written.
    "row_sum_no_first_sync": (
        "layer_norm/layer_norm_cuda.cu",
        "  if (threadIdx.x % kWarp == 0) slot[threadIdx.x / kWarp] = v;\n  __syncthreads();\n",
        "  if (threadIdx.x % kWarp == 0) slot[threadIdx.x / kWarp] = v;\n",
    ),
    # The next reduction overwrites slots another warp still reads.
    "row_sum_no_second_sync": (
        "layer_norm/layer_norm_cuda.cu",
        "  __syncthreads();  // the slots are reused by the next reduction\n",
        "\n",
    ),
    # The vector backward adds the row groups' sums without waiting for them.
    "store_partials_no_sync": (
        "layer_norm/layer_norm_cuda.cu",
        "  __syncthreads();  // every row group's sums are in shared memory\n",
        "\n",
    ),
    # The finalize sums one partial row too few.
    "finalize_off_by_one": (
        "layer_norm/layer_norm_cuda.cu",
        "column_sum<kFinalizeRows>(src, parts, cols, out, buf);",
        "column_sum<kFinalizeRows>(src, parts - 1, cols, out, buf);",
    ),
    # A butterfly level fewer: lanes sum only half the warp.
    "warp_sum_short": (
        "layer_norm/layer_norm_cuda.cu",
        "  for (int m = kWarp / 2; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);",
        "  for (int m = kWarp / 4; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);",
    ),
    # The FFN backward drops the dropout scale of the gated up-gradient.
    "ffn_gated_dup_unscaled": (
        "ffn/ffn_cuda.cu",
        "        dup[k] = dm * a;",
        "        dup[k] = d[k] * a;",
    ),
    # The FFN backward reads its column sums before the other row groups wrote them.
    "ffn_backward_no_sync": (
        "ffn/ffn_cuda.cu",
        "  for (int j = 0; j < kAcc; ++j) lanes[threadIdx.y][threadIdx.x * kAcc + j] = acc[j];\n"
        "  __syncthreads();",
        "  for (int j = 0; j < kAcc; ++j) lanes[threadIdx.y][threadIdx.x * kAcc + j] = acc[j];\n",
    ),
    # The forward dropout offsets one column off (a wrong keep-mask in the vector path).
    "ffn_forward_mask_offset": (
        "ffn/ffn_cuda.cu",
        "    dropout_multipliers<VEC>(m, seed, seed_ptr, row * d_ff + col, p, scale);\n"
        "#pragma unroll\n    for (int k = 0; k < VEC; ++k) y[k] *= m[k];",
        "    dropout_multipliers<VEC>(m, seed, seed_ptr, row * d_ff + col + 1, p, scale);\n"
        "#pragma unroll\n    for (int k = 0; k < VEC; ++k) y[k] *= m[k];",
    ),
    # The vector path accepts misaligned pointers (a fault on the GPU).
    "ln_vec_ignores_alignment": (
        "layer_norm/layer_norm_cuda.cu",
        "  const bool vec_ok = aligned16(a.x) && aligned16(a.residual)",
        "  const bool vec_ok = true || aligned16(a.x) && aligned16(a.residual)",
    ),
    # The RNG kernel computes the other scheme.
    "rng_scheme_swapped": (
        "rng/rng_cuda.cu",
        "kElement ? element_uniform(seed, offset) : philox_uniform(seed, offset)",
        "kElement ? philox_uniform(seed, offset) : element_uniform(seed, offset)",
    ),
    # The vector forward perturbs rstd of its second row group (rows per block > 1 only).
    "ln_fwd_vec_rstd_perturbed": (
        "layer_norm/layer_norm_cuda.cu",
        "    each([&](float v) { sum += stat_term<kRms>(v, 1.f); });\n"
        "    const float2 stats = row_stats<kRms>(sum, each, cols, a.eps, RowSlots{red, red2});\n"
        "    const float mean = stats.x, rstd = stats.y;\n",
        "    each([&](float v) { sum += stat_term<kRms>(v, 1.f); });\n"
        "    const float2 stats = row_stats<kRms>(sum, each, cols, a.eps, RowSlots{red, red2});\n"
        "    const float mean = stats.x, rstd = stats.y + (threadIdx.y == 1 ? 1e-3f : 0.f);\n",
    ),
    # The generic backward forgets to zero its partial rows (garbage from at::empty).
    "ln_bwd_any_no_zeroing": (
        "layer_norm/layer_norm_cuda.cu",
        "    if (pw != nullptr) pw[c] = 0.f;\n",
        "\n",
    ),
    # The persistent vector backward strides one block short: some rows run twice.
    "ln_bwd_vec_step": (
        "layer_norm/layer_norm_cuda.cu",
        "                          w_row[i]);\n    }\n  }\n"
        "  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.y;",
        "                          w_row[i]);\n    }\n  }\n"
        "  const int64_t step = static_cast<int64_t>(gridDim.x > 1 ? gridDim.x - 1 : 1) * blockDim.y;",
    ),
    # The block's overflow test looks at its first row group only: an overflowing second row
    # keeps rstd 0 (its output the bias) when the first row is plain.
    "ln_nonfinite_first_row_only": (
        "layer_norm/layer_norm_cuda.cu",
        "for (int y = 0; y < blockDim.y; ++y) *nonfinite",
        "for (int y = 0; y < 1; ++y) *nonfinite",
    ),
    # The vector forward accepts a misaligned bias (a fault on the GPU).
    "ln_fwd_ignores_bias_alignment": (
        "layer_norm/layer_norm_cuda.cu",
        "aligned16(a.bias) && aligned16(a.out)",
        "aligned16(a.out)",
    ),
    # The vector backward accepts a misaligned dy ...
    "ln_bwd_ignores_dy_alignment": (
        "layer_norm/layer_norm_cuda.cu",
        "const bool vec_ok = aligned16(a.dy) && aligned16(a.dpre)",
        "const bool vec_ok = aligned16(a.dpre)",
    ),
    # ... or a misaligned gradient of pre (prenorm).
    "ln_bwd_ignores_dpre_alignment": (
        "layer_norm/layer_norm_cuda.cu",
        "const bool vec_ok = aligned16(a.dy) && aligned16(a.dpre)",
        "const bool vec_ok = aligned16(a.dy)",
    ),
    # The generic backward's dweight sums dy * the uncentred xhat (the stored mean's rounding).
    "ln_bwd_any_dweight_uncentred": (
        "layer_norm/layer_norm_cuda.cu",
        "      if (pw != nullptr) pw[c] += dyv * xc;",
        "      if (pw != nullptr) pw[c] += dyv * (xc + k.shift);",
    ),
    # ... and the vector backward's (float32 rows: kCentre).
    "ln_bwd_vec_dweight_uncentred": (
        "layer_norm/layer_norm_cuda.cu",
        "        dyx[e] = dy[e] * xc;\n      }\n      if (want_w && kCentre)",
        "        dyx[e] = dy[e] * ((x[e] - mean) * rstd);\n      }\n      if (want_w && kCentre)",
    ),
    # ffn_column_sum takes the vector partials kernel for any src.
    "ffn_colsum_ignores_alignment": (
        "ffn/ffn_cuda.cu",
        "if (any && args.cols % kVec == 0 && aligned16(args.src))",
        "if (any && args.cols % kVec == 0)",
    ),
    # The FFN backward takes the vector kernel for a misaligned dg.
    "ffn_bwd_ignores_dg_alignment": (
        "ffn/ffn_cuda.cu",
        "args.d_ff % kVec == 0 && aligned16(args.dg) &&",
        "args.d_ff % kVec == 0 &&",
    ),
    # 1 - s of the tanh GELU's gate from e * s where e^-2u is large: inf * 0 = NaN below -10.
    "ffn_gelu_tanh_gate_swapped": (
        "ffn/ffn_cuda.cu",
        "  return make_float2(s, e > 1.f ? 1.f - s : e * s);",
        "  return make_float2(s, e < 1.f ? 1.f - s : e * s);",
    ),
    # The staged LayerNorm forward reads its slots before its copies have landed.
    "ln_staged_no_wait": (
        "layer_norm/layer_norm_cuda.cu",
        "  if constexpr (kStaged) wait_async_copies<0>();\n",
        "\n",
    ),
    # The staged backward waits for one group too few: its row's copies may still be in flight.
    "ln_bwd_staged_waits_too_little": (
        "layer_norm/layer_norm_cuda.cu",
        "  wait_async_copies<kStages - 1>();\n#pragma unroll\n  for (int i = 0; i < kVecs; ++i) {\n"
        "    const bool valid",
        "  wait_async_copies<kStages>();\n#pragma unroll\n  for (int i = 0; i < kVecs; ++i) {\n"
        "    const bool valid",
    ),
    # The staged backward never closes a group, so no wait lands its copies.
    "ln_bwd_staged_no_commit": (
        "layer_norm/layer_norm_cuda.cu",
        "      copy16_async(stage + (2 * i + 1) * threads, static_cast<const T*>(a.dy) + at);\n"
        "    }\n  }\n  commit_async_copies();\n",
        "      copy16_async(stage + (2 * i + 1) * threads, static_cast<const T*>(a.dy) + at);\n"
        "    }\n  }\n",
    ),
    # The staged forward stages its own row again instead of the block's next one.
    "ln_staged_same_row": (
        "layer_norm/layer_norm_cuda.cu",
        "stage_row<T, kVecs, kFused>(a, row + step, nvec, stage);",
        "stage_row<T, kVecs, kFused>(a, row, nvec, stage);",
    ),
    # The staged backward's buffers do not rotate: the next rows land over the row being read.
    "ln_bwd_staged_one_buffer": (
        "layer_norm/layer_norm_cuda.cu",
        "      ahead[kStages - 1] = fetch_stats<kRms>(a, row + kStages * step);\n"
        "      slot = slot + 1 == kStages ? 0 : slot + 1;\n",
        "      ahead[kStages - 1] = fetch_stats<kRms>(a, row + kStages * step);\n",
    ),
}


# --------------------------------------------------------------------------- source rewriting


def _code_mask(text: str) -> list[bool]:
    """True for the characters of `text` that are code (not comments or literals)."""
    mask = [True] * len(text)
    i, n = 0, len(text)
    while i < n:
        two = text[i : i + 2]
        if two == "//":
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif two == "/*":
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif text[i] in "\"'":
            j = i + 1
            while j < n and text[j] != text[i]:
                j += 2 if text[j] == "\\" else 1
            j += 1
        else:
            i += 1
            continue
        for k in range(i, min(j, n)):
            mask[k] = False
        i = j
    return mask


def _find_code(text: str, token: str, mask: list[bool], start: int = 0) -> int:
    i = text.find(token, start)
    while i >= 0 and not mask[i]:
        i = text.find(token, i + 1)
    return i


def _match_forward(text: str, i: int, open_: str, close: str) -> int:
    """Index just past the bracket closing the one at text[i]."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_:
            depth += 1
        elif text[j] == close:
            depth -= 1
            if depth == 0:
                return j + 1
    raise ValueError(f"unbalanced {open_!r} at offset {i}")


def _split_top(text: str) -> list[str]:
    """Split on commas outside (), [] and {} (a launch configuration's expressions)."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def _kernel_start(text: str, end: int) -> int:
    """Start of the kernel expression ending at `end`: a name, maybe qualified, maybe a
    template-id (`ns::k<T, W><<<`)."""
    j = end
    while True:
        if j > 0 and text[j - 1] == ">":  # template arguments: match back to their '<'
            depth = 0
            k = j - 1
            while k >= 0:
                if text[k] == ">":
                    depth += 1
                elif text[k] == "<":
                    depth -= 1
                    if depth == 0:
                        break
                k -= 1
            j = k
        k = j
        while k > 0 and (text[k - 1].isalnum() or text[k - 1] == "_"):
            k -= 1
        if k == j:
            raise ValueError(f"no kernel name before <<< at offset {end}")
        j = k
        if text[j - 2 : j] == "::":
            j -= 2
            continue
        return j


def _rewrite_launches(text: str) -> str:
    """`KERNEL<<<grid, block[, smem[, stream]]>>>(args)` -> `::emu::launch(grid, block, smem,
    KERNEL, args)`; line numbers are kept."""
    out, pos = [], 0
    mask = _code_mask(text)
    while (i := _find_code(text, "<<<", mask, pos)) >= 0:
        start = _kernel_start(text, i)
        close = text.index(">>>", i)
        config = _split_top(text[i + 3 : close])
        if not 2 <= len(config) <= 4:
            raise ValueError(f"launch configuration of {len(config)} expressions: {config}")
        grid, block = config[0], config[1]
        smem = config[2] if len(config) > 2 else "0"
        paren = close + 3
        while text[paren].isspace():
            paren += 1
        if text[paren] != "(":
            raise ValueError(f"no argument list after >>> at offset {close}")
        after = _match_forward(text, paren, "(", ")")
        args = text[paren + 1 : after - 1]
        kernel = text[start:i]
        call = f"::emu::launch({grid}, {block}, {smem}, {kernel}"
        call += f", {args})" if args.strip() else ")"
        call += "\n" * (text.count("\n", start, after) - call.count("\n"))
        out.append(text[pos:start])
        out.append(call)
        pos = after
    out.append(text[pos:])
    return "".join(out)


def _rewrite_shared(text: str) -> str:
    """`extern __shared__ T name[];` -> `T* name = ::emu::dynamic_shared<T>();` and
    `__shared__ T name[A][B];` -> a per-block, NaN-poisoned array from ::emu::block_shared."""
    out, pos = [], 0
    mask = _code_mask(text)
    while (i := _find_code(text, "__shared__", mask, pos)) >= 0:
        end = text.index(";", i)
        decl = " ".join(text[i + len("__shared__") : end].split())
        line_start = text.rfind("\n", 0, i) + 1
        prefix = text[line_start:i]
        is_extern = prefix.rstrip().endswith("extern")
        bracket = decl.find("[")
        head, dims = (decl[:bracket], decl[bracket:]) if bracket >= 0 else (decl, "")
        type_, name = head.rsplit(None, 1)
        if is_extern:
            if dims != "[]":
                raise ValueError(f"extern __shared__ without []: {decl}")
            begin = line_start + prefix.rstrip().rfind("extern")
            repl = f"{type_}* {name} = ::emu::dynamic_shared<{type_}>()"
        else:
            begin = i
            repl = (
                f"static char {name}_emu_key; "
                f"auto& {name} = ::emu::block_shared<{type_}{dims}>(&{name}_emu_key)"
            )
        out.append(text[pos:begin])
        out.append(repl + "\n" * text.count("\n", begin, end))
        pos = end
    out.append(text[pos:])
    return "".join(out)


def _rewrite_kernels(text: str) -> str:
    """First statement of every __global__ function: `::emu::detail::kernel_entry(__PRETTY_FUNCTION__,
    max threads of its __launch_bounds__ or 0)` (names the launch, checks the bound)."""
    out, pos = [], 0
    mask = _code_mask(text)
    while (i := _find_code(text, "__global__", mask, pos)) >= 0:
        brace, semi = _find_code(text, "{", mask, i), _find_code(text, ";", mask, i)
        if semi >= 0 and (brace < 0 or semi < brace):  # a declaration
            out.append(text[pos : semi + 1])
            pos = semi + 1
            continue
        bound = "0"
        lb = text.find("__launch_bounds__", i, brace)
        if lb >= 0:
            open_ = text.index("(", lb)
            bound = _split_top(text[open_ + 1 : _match_forward(text, open_, "(", ")") - 1])[0]
        out.append(text[pos : brace + 1])
        out.append(f" ::emu::detail::kernel_entry(__PRETTY_FUNCTION__, static_cast<int>({bound}));")
        pos = brace + 1
    out.append(text[pos:])
    return "".join(out)


def transform(text: str, path: str) -> str:
    """A .cu file as C++ for the emulator; `#line` keeps __FILE__/__LINE__ those of `path`."""
    body = _rewrite_kernels(_rewrite_shared(_rewrite_launches(text)))
    return f'#include "emu.h"\n#line 1 "{path}"\n{body}'


def mutated_source(rel: str, mutation: str | None) -> str:
    """The text of csrc/<rel>, with `mutation` applied when it targets this file."""
    text = (CSRC / rel).read_text()
    if mutation is not None:
        source, old, new = MUTATIONS[mutation]
        if source == rel:
            if text.count(old) != 1:
                raise ValueError(f"mutation {mutation}: its text occurs {text.count(old)} times")
            text = text.replace(old, new)
    return text


# --------------------------------------------------------------------------- build


def unavailable_reason() -> str | None:
    """Why the emulator cannot be built here, or None."""
    if not sys.platform.startswith("linux"):
        return "the emulator's fibers (ucontext, mmap) need Linux"
    for header in ("cuda_runtime.h", "cuda_fp16.h", "cuda_bf16.h"):
        if not (CUDA_INCLUDE / header).is_file():
            return f"CUDA headers not found ({CUDA_INCLUDE / header}); set CUDA_HOME"
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        return "no C++ compiler (g++)"
    if _ninja() is None:
        return "ninja not found"
    return None


def _ninja() -> str | None:
    found = shutil.which("ninja")
    if found is None:
        try:
            import ninja  # type: ignore[import-not-found]

            found = str(Path(ninja.BIN_DIR) / "ninja")
        except ImportError:
            return None
    return found


def _write_if_changed(path: Path, text: str) -> None:
    # Unchanged files keep their timestamps, so ninja rebuilds nothing.
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _kernel_library(variant: str, mutation: str | None) -> Path:
    out = BUILD / variant
    objs = []
    lines = [
        f"cxx = {os.environ.get('CXX', 'g++')}",
        "cflags = " + " ".join(_kernel_cflags()),
        "rule cxx",
        "  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = CXX $out",
        "rule link",
        "  command = $cxx -shared $in -o $out",
        "  description = LINK $out",
    ]
    for rel in SOURCES:
        name = Path(rel).stem
        src = out / "src" / f"{name}.cpp"
        _write_if_changed(src, transform(mutated_source(rel, mutation), f"csrc/{rel}"))
        lines.append(f"build {name}.o: cxx {src}")
        objs.append(f"{name}.o")
    src = out / "src" / "selftest.cpp"
    _write_if_changed(
        src, transform((HERE / "selftest.cu").read_text(), "tests/cuda_emu/selftest.cu")
    )
    lines.append(f"build selftest.o: cxx {src}")
    objs.append("selftest.o")
    lines.append(f"build emu.o: cxx {HERE / 'emu.cpp'}")
    objs.append("emu.o")
    lines.append(f"build libffemu.so: link {' '.join(objs)}")
    _write_if_changed(out / "build.ninja", "\n".join(lines) + "\n")
    done = subprocess.run([_ninja(), "-C", str(out)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building the CUDA emulator failed:\n{done.stdout[-8000:]}")
    return out / "libffemu.so"


def _kernel_cflags() -> list[str]:
    return [
        "-std=c++20",
        OPT,
        "-g0",
        "-fPIC",
        f"-I{CSRC}",
        f"-I{HERE}",
        f"-I{CUDA_INCLUDE}",
        "-DFASTFORMER_WITH_CUDA",
        # torch's nvcc flags: no implicit half/bf16 conversions or operators.
        "-D__CUDA_NO_HALF_OPERATORS__",
        "-D__CUDA_NO_HALF_CONVERSIONS__",
        "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-D__CUDA_NO_HALF2_OPERATORS__",
        "-fsanitize=alignment,bounds,signed-integer-overflow,shift",
        "-Wno-unknown-pragmas",
        # Strict aliasing stays on: g++ -O2 exploits type-punning UB (it found that load_vec
        # read a local uint4 through a float*, now a memcpy), so the kernels must not have any.
    ]


@dataclass(frozen=True)
class Build:
    """A loaded emulator: its variant ("default" or "mut-<mutation>"), the seconds `load`
    took (build included) and `torch.ops.fastformer_emu`."""

    variant: str
    mutation: str | None
    seconds: float
    ops: object  # torch.ops.fastformer_emu


_loaded: Build | None = None


def load() -> Build:
    """Builds (when needed) and loads the emulator; the variant the environment asks for."""
    global _loaded
    mutation = os.environ.get(MUTATION_ENV) or None
    if mutation is not None and mutation not in MUTATIONS:
        raise ValueError(f"{MUTATION_ENV}={mutation}: not one of {sorted(MUTATIONS)}")
    if _loaded is not None:
        if _loaded.mutation != mutation:
            raise RuntimeError("one emulator variant per process")
        return _loaded
    from torch.utils import cpp_extension

    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    start = time.perf_counter()
    variant = "default" if mutation is None else f"mut-{mutation}"
    (BUILD / variant).mkdir(parents=True, exist_ok=True)
    with open(BUILD / variant / "lock", "w") as lock:  # pytest-xdist workers build once
        fcntl.flock(lock, fcntl.LOCK_EX)
        lib = _kernel_library(variant, mutation)
    tag = hashlib.sha1(variant.encode()).hexdigest()[:8]
    ext_dir = BUILD / variant / "bindings"
    ext_dir.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=f"fastformer_cuda_emu_{tag}",
        sources=[str(HERE / "bindings.cpp")],
        extra_include_paths=[str(CSRC), str(HERE), str(CUDA_INCLUDE)],
        extra_cflags=[OPT, "-std=c++20", "-DFASTFORMER_WITH_CUDA"],
        extra_ldflags=[str(lib), f"-Wl,-rpath,{lib.parent}"],
        build_directory=str(ext_dir),
        is_python_module=False,
        verbose=False,
    )
    _loaded = Build(variant, mutation, time.perf_counter() - start, torch.ops.fastformer_emu)
    return _loaded


ORDERS = {"forward": 0, "reverse": 1, "shuffled": 2}
SMEM_OPTIN_KB = 227  # sm_90's shared memory a block may opt in to


@contextmanager
def device(
    *,
    sms: int = 132,
    blocks_per_sm: int = 0,
    order: str = "forward",
    seed: int = 0,
    smem_optin_kb: int = SMEM_OPTIN_KB,
) -> Iterator[None]:
    """Run the enclosed ops on an emulated device: `sms` SMs, `blocks_per_sm` resident blocks
    (0: from the block's threads and shared memory), fibers of a block scheduled in `order`
    ("shuffled": a permutation drawn from `seed` for every block), `smem_optin_kb` KB of shared
    memory a block may opt in to (sm_90's 227 by default; sm_75 has 64). The launchers cache the
    occupancy and the opt-in grants per device, so each setting gets its own device index
    (what cudaGetDevice reports): `blocks_per_sm`, plus 1000 x `smem_optin_kb` when that is not
    the default."""
    ops = load().ops
    index = blocks_per_sm + (0 if smem_optin_kb == SMEM_OPTIN_KB else 1000 * smem_optin_kb)
    ops.configure(index, sms, blocks_per_sm, ORDERS[order], seed, smem_optin_kb * 1024)
    try:
        yield
    finally:
        ops.configure(0, 132, 0, 0, 0, SMEM_OPTIN_KB * 1024)


# --------------------------------------------------------------------------- launches


@dataclass(frozen=True)
class Launch:
    """One kernel launch of the emulator's log."""

    kernel: str  # unqualified function name, e.g. "ln_fwd_vec_kernel"
    params: dict[str, str]  # template arguments, e.g. {"kVecs": "4", "T": "float"}
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int


_LAUNCH = re.compile(
    r"^(?P<sig>.*) grid=\((?P<grid>[\d,]+)\) block=\((?P<block>[\d,]+)\) smem=(?P<smem>\d+)"
)


def launches() -> list[Launch]:
    """The launches since the last `clear_launches()`, in order."""
    found = []
    for line in load().ops.launch_log().splitlines():
        m = _LAUNCH.match(line)
        if m is None:
            raise ValueError(f"unparsable launch log line: {line}")
        sig = m["sig"]
        name = sig.split("(", 1)[0].rsplit("::", 1)[-1].split()[-1]
        params = {}
        if "[with " in sig:
            for item in sig.rsplit("[with ", 1)[1].rstrip("]").split("; "):
                left, _, value = item.partition(" = ")
                params[left.split()[-1]] = value
        dims = [tuple(int(v) for v in m[k].split(",")) for k in ("grid", "block")]
        found.append(Launch(name, params, dims[0], dims[1], int(m["smem"])))
    return found


def clear_launches() -> None:
    load().ops.clear_launch_log()


# --------------------------------------------------------------------------- layer_norm


class _LayerNormFunction(torch.autograd.Function):
    """Autograd of the emulated layer_norm_fwd / layer_norm_bwd: saves and passes what
    fastformer/ops/layer_norm.py's _save / _grads do. Every op result goes to `record`."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, p, rms, store_pre, seed, record):
        out, pre, mean, rstd = load().ops.layer_norm_fwd(
            x, weight, bias, residual, seed, eps, p, rms, store_pre
        )
        record.extend([out, pre, mean, rstd])
        ctx.fused = residual is not None or p > 0 or store_pre
        ctx.save_for_backward(pre if ctx.fused else x, weight, bias, mean, rstd)
        ctx.p, ctx.rms, ctx.seed, ctx.record = p, rms, seed, record
        ctx.has_residual = residual is not None
        ctx.set_materialize_grads(False)
        return out, pre

    @staticmethod
    def backward(ctx, dout, dpre):
        xin, weight, bias, mean, rstd = ctx.saved_tensors
        need_x, need_w, need_b, need_res = ctx.needs_input_grad[:4]
        if dout is None:
            dout = torch.zeros_like(xin)
        if dpre is not None and dpre.numel() == 0:
            dpre = None
        dx, dres, dweight, dbias = load().ops.layer_norm_bwd(
            dout,
            dpre,
            xin,
            weight,
            bias,
            mean,
            rstd,
            ctx.seed,
            ctx.p,
            ctx.rms,
            ctx.fused,
            ctx.has_residual and need_res,
            weight is not None and need_w,
            bias is not None and need_b,
        )
        ctx.record.extend([dx, dres, dweight, dbias])
        return (
            dx if need_x else None,
            dweight if weight is not None and need_w else None,
            dbias if bias is not None and need_b else None,
            dres if ctx.has_residual and need_res else None,
            *([None] * 6),
        )


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    eps: float = 1e-5,
    dropout_p: float = 0.0,
    rms: bool = False,
    prenorm: bool = False,
    seed: int = 0,
    record: list[torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The emulated CUDA LayerNorm / RMSNorm / dropout+residual LayerNorm of a 2-D `x`, with
    autograd: `out`, or `(out, pre)` when `prenorm`. `record` collects every op output."""
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias, residual)
    )
    store_pre = prenorm or (grad and (residual is not None or dropout_p > 0))
    record = [] if record is None else record
    args = (x, weight, bias, residual, eps, dropout_p, rms, store_pre, seed, record)
    out, pre = _LayerNormFunction.apply(*args)
    return (out, pre) if prenorm else out
