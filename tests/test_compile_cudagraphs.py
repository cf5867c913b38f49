"""The CUDA-graph runner's bookkeeping (mode="reduce-overhead"), driven on CPU with its stand-in
graph (RerunGraph): a capture records the function, a replay re-runs it on the captured inputs and
writes the captured outputs in place, which is what a real graph does to its buffers. The real
capture runs in test_compile_cuda.py on the GPU."""

from __future__ import annotations

import torch
import torch.nn as nn

from oxygen_torch.compile import cudagraphs
from oxygen_torch.compile.cudagraphs import GraphRunner, RerunGraph, mutated_inputs


def _runner(fn, mutated=frozenset(), static=None, **kw):
    """A runner whose graphs are RerunGraph, the CPU stand-in: a capture records the call, a
    replay re-runs it and writes the captured outputs in place. `graphs` lists them."""
    graphs = []

    def factory():
        graphs.append(RerunGraph())
        return graphs[-1]

    runner = GraphRunner(fn, mutated, factory, device_type="cpu", static=static, **kw)
    return runner, graphs


def _args(graph):
    """The inputs a stand-in graph was captured with."""
    return graph.call[1]


def test_runner_warms_up_captures_then_replays_with_fresh_inputs():
    w = nn.Parameter(torch.randn(4))

    def fn(x, w):
        return (x * w + 1,)

    runner, graphs = _runner(fn)
    x1, x2, x3 = torch.randn(4), torch.randn(4), torch.randn(4)
    out1 = runner(x1, w)  # warm-up: plain call
    assert not graphs
    out2 = runner(x2, w)  # capture + replay
    out3 = runner(x3, w)  # replay
    assert len(graphs) == 1 and graphs[0].replays == 2
    for x, out in ((x1, out1), (x2, out2), (x3, out3)):
        torch.testing.assert_close(out[0], x * w + 1)
    assert _args(graphs[0])[1] is w  # the parameter is used in place, not copied
    assert _args(graphs[0])[0] is not x2  # the activation was copied into a static buffer
    assert out2[0].data_ptr() != graphs[0].outs[0].data_ptr()  # outputs survive the next replay


def test_runner_without_copy_out_hands_back_the_graphs_own_outputs():
    """copy_out=False (the engine's merged decode graphs): a replay returns the graph's output
    tensors themselves, right for this replay's inputs and rewritten by the next replay."""
    w = torch.randn(5)

    def fn(x, w):
        return (x * w - 2,)

    runner, graphs = _runner(fn, copy_out=False)
    xs = [torch.randn(5) for _ in range(4)]
    outs = [runner(x, w) for x in xs]
    torch.testing.assert_close(outs[-1][0], xs[-1] * w - 2)
    assert outs[2][0] is graphs[0].outs[0] and outs[3][0] is outs[2][0]  # not copies
    torch.testing.assert_close(outs[0][0], xs[0] * w - 2)  # the warm-up's own result stays
    runner_copy, _ = _runner(fn)
    runner_copy(xs[0], w)
    b, c = runner_copy(xs[1], w), runner_copy(xs[2], w)
    assert c[0] is not b[0]
    torch.testing.assert_close(b[0], xs[1] * w - 2)  # a copy survives the next replay


def test_runner_copies_back_mutated_inputs_and_keys_on_shape():
    def fn(x, y):
        x.add_(y)
        return (x * 2,)

    runner, graphs = _runner(fn, mutated=frozenset({0}))
    for n in (3, 3, 3, 5, 5):
        x, y = torch.ones(n), torch.full((n,), 2.0)
        out = runner(x, y)
        torch.testing.assert_close(x, torch.full((n,), 3.0))  # the caller sees the mutation
        torch.testing.assert_close(out[0], torch.full((n,), 6.0))
    assert len(graphs) == 2  # one graph per shape signature


def test_runner_drops_oldest_graph_past_the_limit(monkeypatch):
    monkeypatch.setattr(cudagraphs, "MAX_GRAPHS", 2)
    runner, graphs = _runner(lambda x: (x + 1,))
    for n in (1, 1, 2, 2, 3, 3):
        runner(torch.zeros(n))
    assert len(runner.graphs) == 2 and len(graphs) == 3


@torch.library.custom_op("oxygen_test::scatter_rows", mutates_args=("out",))
def _scatter_rows(x: torch.Tensor, out: torch.Tensor, idx: torch.Tensor) -> None:
    out.index_copy_(0, idx, x)


def test_mutated_inputs_follow_views():
    def f(cache, x, idx):
        cache[:, 0].index_copy_(0, idx, x)
        x3 = x[:, None]
        torch.ops.oxygen_test.scatter_rows(x3, cache[None][0], idx)  # written through the schema
        return cache.sum() + x.sum()

    gm = torch.fx.symbolic_trace(f)
    assert mutated_inputs(gm) == frozenset({0})


def test_runner_with_given_static_indices_uses_those_inputs_in_place():
    # Inductor names its static inputs (parameters, marked buffers) by index: plain tensors here
    def fn(x, table):
        return (x * 2 + table[0],)

    runner, graphs = _runner(fn, static=frozenset({1}))
    table = torch.randn(3, 4)
    for _ in range(4):
        x = torch.randn(4)
        (out,) = runner(x, table)
        torch.testing.assert_close(out, x * 2 + table[0])
        table[0] += 1  # the graph reads the table in place: later replays see the new values
    assert len(graphs) == 1 and graphs[0].replays == 3  # warm-up, capture + replay, 2 replays
    assert _args(graphs[0])[1] is table  # used in place, not copied into a buffer
    other = torch.randn(3, 4)  # a static input at a new address: a new signature
    (out,) = runner(torch.ones(4), other)
    torch.testing.assert_close(out, 2 + other[0])


def test_inductor_adapter_takes_boxed_inputs():
    seen = []

    def boxed(args):  # Inductor's calling convention: a list, which the callee clears
        seen.append(len(args))
        a, b = args
        args.clear()
        return (a @ b,)

    run = cudagraphs.inductor_cudagraphify(boxed, [], static_input_idxs=(1,))
    a, b = torch.randn(3, 5), torch.randn(5, 2)
    inputs = [a, b]
    (out,) = run(inputs)
    assert inputs == [] and seen == [2]  # on CPU the runner calls through: no graph
    torch.testing.assert_close(out, a @ b)
