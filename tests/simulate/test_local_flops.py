"""The FLOPs a simulated rank computes: attention on the CPU kernel a plan runs, and 1/tp of a split layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from leantrain.simulate.fake_world import fake_world
from leantrain.simulate.local_flops import LocalFlops
from leantrain.simulate.propagation import ShapePropagation


def test_attention_on_the_cpu_kernel_counts_its_matrix_products():
    """Bug: the CPU flash kernel (what a plan's fake step runs) has no formula in torch's counter and
    counted 0, a fifth of a Llama 8B's step at 8192 tokens."""
    batch, heads, length, width = 2, 4, 64, 16
    q, k, v = (torch.randn(batch, heads, length, width, requires_grad=True) for _ in range(3))
    fake, propagation = FakeTensorMode(allow_non_fake_inputs=True), ShapePropagation()
    with fake, propagation, LocalFlops(propagation) as counted:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    # Forward: Q K^T and P V; backward (flash): Q K^T again, then dV, dP, dQ, dK. Each 2 b h s^2 d.
    assert counted.flops == 7 * 2 * batch * heads * length * length * width


def test_a_layer_split_over_the_tensor_parallel_group_counts_this_ranks_share():
    with fake_world(2, 0):
        mesh = init_device_mesh("cpu", (2,))
        with FakeTensorMode(allow_non_fake_inputs=True):
            layer = parallelize_module(torch.nn.Linear(8, 16, bias=False), mesh, ColwiseParallel())
            with ShapePropagation() as propagation, LocalFlops(propagation) as counted:
                layer(torch.randn(4, 8))
    assert counted.flops == 2 * 4 * 8 * (16 // 2)  # this rank's 8 of the 16 output features
