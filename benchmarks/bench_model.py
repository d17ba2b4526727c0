"""The paper's base Transformer: training step (forward + backward + Adam) and inference of
the eager reference, the same weights in torch.nn.Transformer, the model after fastformer.swap,
and torch.compile of the eager model's layers and of the whole model, same weights and
batch as `python -m fastformer bench` (bf16 on the GPU)."""

import copy
import functools

import pytest
import torch

from fastformer.cli import bench as B
from fastformer.cli.cases import model_case

VARIANTS = ["eager", B.TORCH_NN, "fastformer", B.COMPILE_LAYERS, B.COMPILE_WHOLE]


@functools.lru_cache(maxsize=1)
def _setup():
    device, dtype = torch.device("cuda"), torch.bfloat16
    case, _ = model_case("base", device.type)
    src, tgt = B.synthetic_batch(case, device)
    return case, B.build_model(case, device, dtype, case.dropout), src, tgt


def _variant(name):
    case, eager, src, tgt = _setup()
    model = copy.deepcopy(eager)
    if name == "fastformer":
        model, info = B.swapped(eager)
        if model is None:
            pytest.skip(info["error"])
    elif name == B.TORCH_NN:
        model = B.torch_nn_twin(eager)
    loss_fn, forward = model.loss, model
    if name in B.COMPILED:
        loss_fn, forward = B.compiled_model(name, model)
    return model, loss_fn, forward, src, tgt


@pytest.mark.parametrize("variant", VARIANTS)
def test_train_step(benchmark, variant):
    model, loss_fn, _, src, tgt = _variant(variant)
    opt = B.optimizer(model)
    model.train()
    train = B.training_step(loss_fn, opt, src, tgt)

    def step():
        train()
        torch.cuda.synchronize()

    step()  # compilation outside the timed rounds
    benchmark.pedantic(step, rounds=10, warmup_rounds=2, iterations=1)
    tokens = B.real_tokens(src, tgt)
    benchmark.extra_info["tokens_per_s"] = tokens / benchmark.stats.stats.median


@pytest.mark.parametrize("variant", VARIANTS)
def test_inference(benchmark, variant):
    model, _, forward, src, tgt = _variant(variant)
    model.eval()
    tgt_in = torch.cat([torch.full_like(tgt[:, :1], B.BOS), tgt[:, :-1]], dim=1)

    def step():
        with torch.no_grad():
            forward(src, tgt_in)
        torch.cuda.synchronize()

    step()
    benchmark.pedantic(step, rounds=10, warmup_rounds=2, iterations=1)
    tokens = B.real_tokens(src, tgt)
    benchmark.extra_info["tokens_per_s"] = tokens / benchmark.stats.stats.median
