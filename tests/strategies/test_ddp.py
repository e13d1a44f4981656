"""``--strategy ddp`` and its reductions in one process: what launches reach slowly."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import leantrain as lt
from leantrain.strategies.ddp import _buckets
from leantrain.strategies.dims import ParallelDims
from leantrain.strategies.registry import strategy_class
from tests.test_batch_norm import one_process_group

CPU = torch.device("cpu")


def test_a_comm_hook_is_registered_again_on_the_fresh_wrapper_after_an_out_of_memory_error():
    """The doctor times DDP's all-reduce through a comm hook; the wrapper made after an out-of-memory
    error must carry it too, or the measurement stops there."""
    with one_process_group("gloo"):
        strategy = strategy_class("ddp")(lt.TrainConfig(strategy="ddp"), CPU, ParallelDims(dp=1))
        strategy.wrap(nn.Linear(2, 2), None)
        calls: list[int] = []

        def counted(state, bucket):
            calls.append(1)
            # Reduced here and returned done: allreduce_hook's callback would run on gloo's thread, which
            # may still hold it when the test ends and the group is destroyed with the interpreter held,
            # a deadlock seen once in `make test`.
            dist.all_reduce(bucket.buffer())
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

        strategy.register_comm_hook(counted)
        first = strategy.module
        strategy.reset_after_out_of_memory()
        assert strategy.module is not first and strategy.module.module is strategy.model
        strategy.module(torch.ones(1, 2)).sum().backward()
        assert calls == [1]


def test_a_plan_holds_one_bucket_per_dtype_of_the_trainable_parameters():
    model = nn.Module()
    model.full = nn.Linear(3, 2)  # 8 fp32 values
    model.bf16 = nn.Parameter(torch.ones(5, dtype=torch.bfloat16))  # one bf16 parameter alone
    model.frozen = nn.Parameter(torch.ones(7), requires_grad=False)  # no gradient: no bucket
    assert sorted((b.numel(), b.dtype) for b in _buckets(model)) == [(5, torch.bfloat16), (8, torch.float32)]


def test_gradients_are_all_reduced_in_one_flat_buffer_per_dtype_each_in_its_own_width(monkeypatch):
    """ddp x tp's reduction over the replicas: bf16 gradients travel as bf16 (half the bytes of fp32),
    and each dtype's values come back divided, into the tensors themselves."""
    import torch.distributed as dist

    from leantrain.strategies.process_group import all_reduce_in_place

    sent: list[tuple[torch.dtype, int]] = []
    all_reduce = dist.all_reduce
    monkeypatch.setattr(
        dist,
        "all_reduce",
        lambda flat, **how: (sent.append((flat.dtype, flat.numel())), all_reduce(flat, **how)),
    )
    grads = [torch.full((3,), 2.0), torch.full((2,), 4.0, dtype=torch.bfloat16), torch.full((4,), 6.0)]
    with one_process_group("gloo"):
        all_reduce_in_place(grads, None, divide_by=2)
    assert sorted(sent, key=str) == [(torch.bfloat16, 2), (torch.float32, 7)]
    assert [g.tolist() for g in grads] == [[1.0] * 3, [2.0] * 2, [3.0] * 4]
    assert grads[1].dtype == torch.bfloat16
