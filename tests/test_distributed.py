"""Data-parallel training of fastformer modules: DDP (gloo, 2 CPU processes) and FSDP2
(`fully_shard`; gloo on CPU, NCCL on GPU).

Each rank trains on its half of a batch; after the gradient all-reduce every rank must hold the
gradients of single-process training on the whole batch (the loss is a mean over equal
halves, so the averaged gradients are the full-batch ones).
"""

import datetime
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastformer.nn as fnn
from fastformer import reference

E, H, FF, B, S, T = 16, 2, 32, 4, 7, 5
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(device="cpu"):
    torch.manual_seed(0)  # identical weights on every rank and in the single process
    kw = dict(dropout=0.0, batch_first=True, norm_first=True)
    return fnn.Transformer(E, H, 1, 1, FF, **kw).to(device)


def _batch(device="cpu"):
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randn(B, S, E, generator=g), torch.randn(B, T, E, generator=g)
    lengths = torch.tensor([S, 3, S - 1, 2])
    kpm = reference.padding_mask(lengths, S)
    return [t.to(device) for t in (src, tgt, kpm)]


def _loss(model, src, tgt, kpm):
    out = model(src, tgt, src_key_padding_mask=kpm, memory_key_padding_mask=kpm, tgt_is_causal=True)
    return out.square().mean()


def _shard(tensors, rank, world):
    per = B // world
    return [t[rank * per : (rank + 1) * per] for t in tensors]


def _ddp_worker(rank, world, port, path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["FASTFORMER_BACKEND_ATTENTION"] = "torch"
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        model = torch.nn.parallel.DistributedDataParallel(_model())
        _loss(model, *_shard(_batch(), rank, world)).backward()
        grads = {n: p.grad for n, p in model.module.named_parameters()}
        torch.save(grads, f"{path}.{rank}")
    except BaseException:
        dist.destroy_process_group()
        raise
    _leave()


def _leave():
    # Every rank has written its results: leave without tearing gloo down. Its teardown aborted
    # about 1 run in 12 ("terminate called without an active exception", torch 2.11 on CPU),
    # also after a barrier; os._exit skips the C++ destructors where that happens.
    dist.barrier()
    os._exit(0)


def _spawn(fn, world, path, timeout=180.0, extra=()):
    args = (world, _free_port(), path, *extra)
    ctx = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"distributed workers did not finish within {timeout} s")


def _single_process_grads(device="cpu"):
    model = _model(device)
    _loss(model, *_batch(device)).backward()
    return {n: p.grad.cpu() for n, p in model.named_parameters()}


def test_ddp_gloo_matches_single_process(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTFORMER_BACKEND_ATTENTION", "torch")
    path = str(tmp_path / "grads")
    _spawn(_ddp_worker, WORLD, path)
    expected = _single_process_grads()
    for rank in range(WORLD):
        got = torch.load(f"{path}.{rank}")
        assert list(got) == list(expected)
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-5, msg=name)


def _fsdp_worker(rank, world, port, path, device):
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
    else:
        os.environ["FASTFORMER_BACKEND_ATTENTION"] = "torch"
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        model = _model(device)
        for layer in [*model.encoder.layers, *model.decoder.layers]:
            fully_shard(layer)
        fully_shard(model)
        _loss(model, *_shard(_batch(device), rank, world)).backward()
        grads = {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters()}
        if rank == 0:
            torch.save(grads, path)
    except BaseException:
        dist.destroy_process_group()
        raise
    _leave()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_fsdp2_matches_single_process(device, tmp_path, monkeypatch):
    if device == "cpu":
        monkeypatch.setenv("FASTFORMER_BACKEND_ATTENTION", "torch")
    # On one GPU a world of one still shards (and gathers) every parameter.
    world = WORLD if device == "cpu" else min(torch.cuda.device_count(), WORLD)
    path = str(tmp_path / "grads")
    _spawn(_fsdp_worker, world, path, extra=(device,))
    expected = _single_process_grads(device)
    got = torch.load(path)
    assert list(got) == list(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-4, msg=name)


def _sequence_parallel_worker(rank, world, port, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        x = torch.randn(B, 2 * S, E, generator=torch.Generator().manual_seed(2))
        local = x.chunk(world, dim=1)[rank]  # this rank's part of the sequence
        outs = {}
        for name, cls in (("LayerNorm", fnn.LayerNorm), ("RMSNorm", fnn.RMSNorm)):
            torch.manual_seed(0)
            norm = parallelize_module(cls(E), mesh, SequenceParallel())
            outs[name] = norm(local).full_tensor()
        if rank == 0:
            torch.save((x, outs), path)
    except BaseException:
        dist.destroy_process_group()
        raise
    _leave()


def test_sequence_parallel_norms_fall_back_to_torch_nn(tmp_path):
    # SequenceParallel() hands the norms DTensors, for which the ops have no sharding rules
    # ("does not have a sharding strategy registered"): torch.nn's forward runs on them.
    path = str(tmp_path / "outs")
    _spawn(_sequence_parallel_worker, WORLD, path)
    x, outs = torch.load(path)
    for name, cls in (("LayerNorm", torch.nn.LayerNorm), ("RMSNorm", torch.nn.RMSNorm)):
        torch.manual_seed(0)
        torch.testing.assert_close(outs[name], cls(E)(x), msg=name)
