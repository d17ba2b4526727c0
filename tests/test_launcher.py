"""Tests of fastformer.kernels.launcher: direct launches of kernels Triton compiled before.

No GPU runs here: a stand-in driver makes Triton's JIT compile for sm_90, and each compiled
kernel's launcher (the driver's C code) is replaced by a recorder. Every launch that `launch`
makes directly must hand the launcher what Triton's own `JITFunction.run` hands it for the same
call (the same compiled kernel, grid, stream and arguments), and every call Triton would
compile or specialize differently (pointer alignment, integer classes, values of 1, types,
grid, debug mode) must reach a different kernel, as Triton's does. On a GPU, a `cuda` test
compares the bits of attention through both paths.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

_SCRIPT = textwrap.dedent(
    """
    import sys

    import torch
    import triton
    from triton import knobs

    from fastformer.testing import sm90_jit

    RECORDS = []
    sm90_jit(lambda kernel: lambda *call: RECORDS.append((kernel, call)), stream=7)

    from fastformer.kernels import attention as A
    from fastformer.kernels import launcher


    def recorded(run):
        RECORDS.clear()
        run()
        (kernel, call), = RECORDS
        # The launch metadata (argument 6) only feeds launch hooks, which are empty here.
        return kernel, call[:6] + call[7:]


    def same(a, b):
        (ka, ca), (kb, cb) = a, b
        return ka is kb and len(ca) == len(cb) and all(
            x is y or (type(x) is type(y) and not isinstance(x, torch.Tensor) and x == y)
            for x, y in zip(ca, cb)
        )


    captured = {}
    A._launch = lambda kernel, grid, args, meta, *rest, **kw: captured.update(
        {kernel: (grid, args, meta)}
    )
    q = torch.randn(2, 4, 16, 32, dtype=torch.float16)
    A.attention_forward(q, q, q, None, None, 5, 0.1, False, 0.125)
    grid, args, meta = captured["fwd"]
    fn = A.KERNELS["fwd"]
    options = dict(BLOCK_M=32, BLOCK_N=32, USE_TMA=False, QK_TILES=False, WARP_SPEC=False,
                   num_warps=4, num_stages=1)
    options = {k: v for k, v in options.items() if k in fn.arg_names or k.startswith("num_")}
    key = ("fwd", *meta.items())
    seed_at = fn.arg_names.index("seed")
    stride_at = fn.arg_names.index("stride_qh")
    scale_at = fn.arg_names.index("qk_scale")


    def with_arg(i, value, base=args):
        return base[:i] + (value,) + base[i + 1:]


    odd = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view_as(q)  # 2 bytes off 16
    variants = {
        "base": (grid(options), args),
        "other seed": (grid(options), with_arg(seed_at, 123456)),
        "seed past int32": (grid(options), with_arg(seed_at, 2**40)),
        "seed past int64": (grid(options), with_arg(seed_at, 2**63 + 5)),
        "stride 1": (grid(options), with_arg(stride_at, 1)),
        "stride 17": (grid(options), with_arg(stride_at, 17)),
        "scale 1.0": (grid(options), with_arg(scale_at, 1.0)),
        "scale as int 1": (grid(options), with_arg(scale_at, 1)),
        "misaligned output": (grid(options), with_arg(3, odd)),
        "float32 lse as float16": (grid(options), with_arg(4, args[4].half())),
        "other grid": ((grid(options)[0], 2, 5), args),
    }
    jit_calls = []
    plain_run = triton.runtime.JITFunction.run


    def counted(self, *a, **k):
        jit_calls.append(1)
        return plain_run(self, *a, **k)


    triton.runtime.JITFunction.run = counted
    for repeat in range(2):
        for name, (g, a) in variants.items():
            jit = recorded(lambda: fn[g](*a, **meta, **options))
            direct = recorded(lambda: launcher.launch(fn, g, a, key, meta, options))
            assert same(jit, direct), name
        print("pass", repeat, len(jit_calls))
        jit_calls.clear()

    kernels = {name: recorded(lambda: fn[g](*a, **meta, **options))[0]
               for name, (g, a) in variants.items()}
    distinct = len({id(k) for k in kernels.values()})
    print("kernels", distinct, "same as base:", sorted(
        name for name, k in kernels.items() if k is kernels["base"]))

    # With a launch hook, Triton's path: the launcher gets the metadata the hook is called with
    # (the real launcher calls it).
    hook = lambda metadata: None
    knobs.runtime.launch_enter_hook.add(hook)
    RECORDS.clear()
    launcher.launch(fn, *variants["base"], key, meta, options)
    (_, call), = RECORDS
    print("hooked", call[6].get()["name"], hook in call[7].calls)
    knobs.runtime.launch_enter_hook.remove(hook)

    # Debug mode compiles another kernel; the direct path must not keep the old one.
    knobs.runtime.debug = True
    debug = recorded(lambda: launcher.launch(fn, *variants["base"], key, meta, options))
    knobs.runtime.debug = False
    print("debug kernel differs", debug[0] is not kernels["base"])
    """
)


def _run(tmp_path) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.splitlines()


def test_direct_launches_hand_the_launcher_what_triton_does(tmp_path):
    first, second, kernels, hooked, debug = _run(tmp_path)
    # Each call of the first pass asked Triton twice (itself, then the launcher's miss),
    # except where a variant's key was seen before; the second pass asked it only itself.
    n = 11
    assert first.startswith("pass 0 ") and int(first.split()[2]) < 2 * n
    assert second == f"pass 1 {n}"
    # Specializations Triton separates: seed classes, strides of 1 and 17, a scale 1 (an int:
    # a constexpr) from 1.0, alignment, dtype; the same kernel for another seed value, and for another grid.
    assert kernels == "kernels 8 same as base: ['base', 'other grid', 'other seed', 'scale 1.0']"
    assert hooked == "hooked attn_fwd True"
    assert debug == "debug kernel differs True"


def test_direct_launches_are_made_on_tested_tritons_and_can_be_turned_off(monkeypatch):
    import importlib

    import triton

    from fastformer.kernels import launcher

    version = ".".join(triton.__version__.split(".")[:2])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # `info` says the interpreter's
    try:
        for env, expected in (("0", False), ("1", version in launcher.TESTED_TRITON)):
            monkeypatch.setenv("FASTFORMER_TRITON_DIRECT_LAUNCH", env)
            assert importlib.reload(launcher).ENABLED is expected
        assert launcher.status().startswith("direct after a key's first launch")
        monkeypatch.setenv("FASTFORMER_TRITON_DIRECT_LAUNCH", "0")
        assert importlib.reload(launcher).status().endswith("FASTFORMER_TRITON_DIRECT_LAUNCH=0")
        monkeypatch.setattr(triton, "__version__", "99.1.0")
        monkeypatch.delenv("FASTFORMER_TRITON_DIRECT_LAUNCH")
        assert importlib.reload(launcher).ENABLED is False  # an unchecked convention
        assert "Triton 99.1 is not among the versions tested" in launcher.status()
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert "interpreter" in launcher.status()
    finally:
        monkeypatch.undo()
        importlib.reload(launcher)


@pytest.mark.cuda
def test_direct_launches_give_the_bits_of_tritons_own_on_a_gpu(monkeypatch):
    """On a GPU: attention fwd+bwd (dropout, key padding, causal) through direct launches gives
    the bits that Triton's own launch path gives, and every launch of the last call is direct."""
    import triton

    from fastformer.kernels import launcher
    from fastformer.ops import attention

    torch.manual_seed(0)
    q, k, v = (
        torch.randn(2, 4, 200, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    kpm = torch.zeros(2, 200, dtype=torch.bool, device="cuda")
    kpm[1, 150:] = True

    def run(direct: bool):
        monkeypatch.setattr(launcher, "ENABLED", direct)
        torch.manual_seed(1)  # the same dropout seed
        out = attention.scaled_dot_product_attention(
            q, k, v, dropout_p=0.2, is_causal=True, key_padding_mask=kpm
        )
        return (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))

    plain = run(False)  # Triton's own path (it tunes on the first call)
    run(True)  # each launch key's first call asks Triton
    asked = []
    plain_run = triton.runtime.JITFunction.run
    monkeypatch.setattr(
        triton.runtime.JITFunction,
        "run",
        lambda fn, *a, **kw: asked.append(fn) or plain_run(fn, *a, **kw),
    )
    direct = run(True)
    assert asked == []
    for a, b in zip(plain, direct):
        assert torch.equal(a, b)


def test_launch_keys_split_where_triton_specializes(monkeypatch):
    # Triton types an int argument by its range (i32, i64, u64: `mangle_type`) and a scalar by
    # its Python type (1, 1.0 and True are three kernels); a launch key must split wherever it
    # does, or a memoized launch would hand one type's kernel the other's argument.
    from types import SimpleNamespace

    jit = pytest.importorskip("triton.runtime.jit")
    mangle = getattr(jit, "mangle_type", None)
    if mangle is None:
        pytest.skip("this Triton has no triton.runtime.jit.mangle_type")
    from fastformer.kernels import launcher

    ints = [-(2**63), -(2**31) - 1, -(2**31), 0, 5, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1]
    for a in ints:
        for b in ints:
            if mangle(a) != mangle(b):
                assert launcher._int_class(a) != launcher._int_class(b), (a, b)
    device = SimpleNamespace(get_current_device=lambda: 0)
    monkeypatch.setattr(launcher, "driver", SimpleNamespace(active=device))
    # (pointer, specialized scalar, do_not_specialize scalar)
    sig = launcher._Signature(arity=3, pointers=1, classes=(1,))
    x, kernel = torch.zeros(4), object()  # of the kernel, only its id is read

    def key(*scalars):
        return launcher._launch_key(kernel, sig, (x, *scalars), "k")

    values = [1, 1.0, True]
    assert len({mangle(v) for v in values}) == 3
    assert len({key(v, 7) for v in values}) == 3
    assert len({key(7, v) for v in values}) == 3
    assert key(7, 5) == key(7, 6)  # one kernel for every i32 seed
    assert len({key(7, v) for v in ints}) == len({mangle(v) for v in ints})


def test_a_kernel_with_a_pre_run_hook_takes_triton_s_path(monkeypatch):
    # A pre-run hook (Triton's autotuner's reset of outputs, a user's) runs in Triton's run(),
    # which a direct launch skips.
    from triton.runtime.jit import JITFunction

    from fastformer.kernels import launcher

    def kernel(x):  # never compiled: only its hooks are read
        pass

    fn = JITFunction(kernel)
    monkeypatch.setattr(launcher, "ENABLED", True)
    assert launcher._direct_ok(fn)
    fn.add_pre_run_hook(lambda *args, **kwargs: None)
    assert not launcher._direct_ok(fn)
