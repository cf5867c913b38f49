"""Block moves between the arena and host rows (kv/transfer.py): a block view sees every layer's K
and V of a block at once, runs of consecutive rows become one copy each, moves larger than the
staging buffer go through it in chunks, and every byte arrives, whatever the order of blocks and
rows."""

from __future__ import annotations

import pytest
import torch

from oxygen_torch.kv import transfer
from oxygen_torch.kv.storage import KVStorage, TorchBacking
from oxygen_torch.kv.transfer import Staging, down, gather, rows_to, runs, scatter, up

MiB = 1 << 20


def storage(layers, heads, dim, dtype, bt=4, nbytes=4 * MiB, page=64 << 10):
    return KVStorage(TorchBacking(nbytes, torch.device("cpu"), page), layers, heads, dim, dtype, bt)


def fill(st, g):
    for c in (*st.k, *st.v):
        c.view(torch.uint8).copy_(torch.randint(0, 256, c.view(torch.uint8).shape, generator=g))


def block_bytes(st, b):
    """Block b's bytes as a host row holds them: layer by layer, K then V."""
    parts = []
    for k, v in zip(st.k, st.v):
        parts += [k[b].reshape(-1).view(torch.uint8), v[b].reshape(-1).view(torch.uint8)]
    return torch.cat(parts)


def test_runs_split_rows_where_they_stop_being_consecutive():
    assert runs([]) == []
    assert runs([4, 5, 6, 9, 3, 4, 10]) == [(0, 4, 3), (3, 9, 1), (4, 3, 2), (6, 10, 1)]
    assert runs([7, 8, 9]) == [(0, 7, 3)]  # one run (compared whole)
    assert runs([0, 2, 1, 3]) == [(0, 0, 1), (1, 2, 1), (2, 1, 1), (3, 3, 1)]  # ends 3 apart


def test_int64_holds_the_ints_as_torch_tensor_does():
    vals = [5, 0, 2**40, 3]
    assert torch.equal(transfer.int64(vals), torch.tensor(vals, dtype=torch.int64))
    empty = transfer.int64([])
    assert empty.dtype == torch.int64 and empty.shape == (0,)


@pytest.mark.parametrize(
    "layers,heads,dim,dtype",
    [(3, 2, 8, torch.float16), (2, 1, 6, torch.float32), (4, 3, 5, torch.float8_e4m3fn)],
)
def test_block_view_is_every_region_of_a_block_in_address_order(layers, heads, dim, dtype):
    st = storage(layers, heads, dim, dtype)
    fill(st, torch.Generator().manual_seed(layers))
    view = st.block_view()
    assert view.shape[:2] == (st.num_blocks, 2 * layers)
    for b in (1, 7, st.num_blocks - 1):
        assert torch.equal(view[b].contiguous().view(torch.uint8).flatten(), block_bytes(st, b))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("chunk_blocks,copy_rows", [(1, 64), (5, 2), (64, 3), (64, 64)])
def test_blocks_go_to_host_rows_and_back_byte_exact(seed, chunk_blocks, copy_rows, monkeypatch):
    """Chunks of the staging buffer and copies cut at COPY_BYTES (rows a copy) in any mix."""
    g = torch.Generator().manual_seed(seed)
    st = storage(3, 2, 8, torch.bfloat16)
    monkeypatch.setattr(transfer, "COPY_BYTES", copy_rows * 2 * 3 * st.block_bytes)
    fill(st, g)
    views = [st.block_view()]
    bb = 2 * 3 * st.block_bytes
    n = 17
    blocks = torch.randperm(st.num_blocks - 1, generator=g)[:n].add(1).tolist()
    want = {b: block_bytes(st, b).clone() for b in blocks}
    rows = sorted(torch.randperm(30, generator=g)[:n].tolist())  # runs and gaps
    rows = rows[5:] + rows[:5]  # not in order either
    host = torch.zeros(30, bb, dtype=torch.uint8)
    stage = Staging(bb, torch.device("cpu"), chunk_blocks * bb)
    down(views, torch.tensor(blocks), host, rows, stage)
    for b, row in zip(blocks, rows):
        assert torch.equal(host[row], want[b])
    fill(st, g)  # overwritten meanwhile
    back = torch.randperm(st.num_blocks - 1, generator=g)[:n].add(1).tolist()  # other blocks
    untouched = [b for b in range(1, st.num_blocks) if b not in back][:4]
    before = {b: block_bytes(st, b).clone() for b in untouched}
    up(views, host, rows, torch.tensor(back), stage)
    for b, b2 in zip(blocks, back):
        assert torch.equal(block_bytes(st, b2), want[b])
    for b in untouched:  # nothing else written
        assert torch.equal(block_bytes(st, b), before[b])


def test_two_storages_are_one_row_main_bytes_then_scales():
    """An fp8 pool's scales live in a second storage: a row is the block's bytes, then its
    scales'; the scatter puts each part back in its own storage."""
    g = torch.Generator().manual_seed(5)
    main, scales = storage(2, 2, 8, torch.float8_e4m3fn), storage(2, 2, 1, torch.float32, bt=1)
    fill(main, g)
    fill(scales, g)
    views = [main.block_view(), scales.block_view()]
    idx = torch.tensor([3, 1, 6])
    got = gather(views, idx)
    for i, b in enumerate(idx.tolist()):
        assert torch.equal(got[i], torch.cat([block_bytes(main, b), block_bytes(scales, b)]))
    host = torch.zeros(4, got.shape[1], dtype=torch.uint8)
    rows_to(host, [2, 3, 0], got)
    scatter(views, torch.tensor([7, 8, 9]), host[[2, 3, 0]])
    for b, b2 in zip(idx.tolist(), (7, 8, 9)):
        assert torch.equal(block_bytes(main, b2), block_bytes(main, b))
        assert torch.equal(block_bytes(scales, b2), block_bytes(scales, b))


def _scattered_and_runs(g, num_blocks: int, n: int) -> tuple[list[int], list[int]]:
    """n distinct blocks and n distinct host rows: a run of 13 consecutive blocks bound for
    consecutive rows first, then scattered ones (no two consecutive in both)."""
    run = 13
    first = int(torch.randint(1, num_blocks - run - 1, (1,), generator=g))
    blocks = list(range(first, first + run))
    rest = [b for b in torch.randperm(num_blocks - 1, generator=g).add(1).tolist()
            if not first <= b <= first + run][: n - run]  # fmt: skip
    spread = torch.randperm(40, generator=g)[: n - run].add(1).tolist()
    rows = list(range(3, 3 + run)) + [r + 3 + run for r in spread]
    return blocks + rest, rows


@pytest.mark.parametrize("programs,spare", [(1, 7), (3, 8), (64, 7)])
@pytest.mark.parametrize("layers,heads,dim,dtype,scales", [
    (3, 2, 8, torch.bfloat16, False), (2, 3, 5, torch.float32, False),
    (2, 2, 8, torch.float8_e4m3fn, True), (1, 1, 3, torch.float8_e4m3fn, False),
])  # fmt: skip
def test_the_mapped_kernel_moves_blocks_as_a_gather_does(
    programs, spare, layers, heads, dim, dtype, scales
):
    """triton_kernels.block_rows (COPIES "mapped"; Triton's interpreter on the host arena): any
    order of blocks and rows, any grid, each view's bytes at its place in the row (an fp8 pool's
    scales after the codes), rows and bytes not named left as they were; up puts them back.
    `spare` bytes after a row's block: 7 makes the kernel move bytes, 8 four-byte words."""
    from oxygen_torch.triton_kernels.block_rows import _word, block_rows

    g = torch.Generator().manual_seed(programs + layers)
    sts = [storage(layers, heads, dim, dtype)]
    if scales:
        sts.append(storage(layers, heads, 1, torch.float32, bt=1))
    for st in sts:
        fill(st, g)
    views = [st.block_view() for st in sts]
    bb = sum(transfer._width(v) for v in views)
    n = 11
    blocks = torch.randperm(sts[0].num_blocks, generator=g)[:n]
    rows = torch.randperm(40, generator=g)[:n]
    host = torch.randint(0, 256, (40, bb + spare), dtype=torch.uint8, generator=g)
    before = host.clone()
    words = torch.uint8 if spare % 2 or bb % 4 else torch.int32
    assert _word(views, host) == words
    block_rows(views, host, blocks, rows, up=False, programs=programs)
    want = gather(views, blocks)
    assert torch.equal(host[rows, :bb], want)
    untouched = [r for r in range(40) if r not in set(rows.tolist())]
    assert torch.equal(host[untouched], before[untouched])
    assert torch.equal(host[:, bb:], before[:, bb:])
    for st in sts:
        fill(st, g)  # overwritten meanwhile
    others = [b for b in range(sts[0].num_blocks) if b not in set(blocks.tolist())]
    kept = gather(views, torch.tensor(others))
    block_rows(views, host, blocks, rows, up=True, programs=programs)
    assert torch.equal(gather(views, blocks), want)
    assert torch.equal(gather(views, torch.tensor(others)), kept)  # not named: untouched


def test_the_mapped_kernel_refuses_shapes_it_cannot_move_naming_them():
    from oxygen_torch.triton_kernels.block_rows import block_rows

    st = storage(2, 2, 8, torch.float16)
    views = [st.block_view()]
    bb = transfer._width(views[0])
    host = torch.zeros(4, bb, dtype=torch.uint8)
    one = torch.tensor([1])
    with pytest.raises(ValueError, match="2 block ids for 1 rows"):
        block_rows(views, host, torch.tensor([1, 2]), one, False, 4)
    with pytest.raises(ValueError, match="hold no block"):
        block_rows(views, host[:, :-1], one, one, False, 4)
    with pytest.raises(ValueError, match=r"uint8 \[rows, bytes\]"):
        block_rows(views, host.view(torch.int16), one, one, True, 4)
    with pytest.raises(ValueError, match="programs 0 must be at least 1"):
        block_rows(views, host, one, one, True, 0)
    with pytest.raises(ValueError, match="is not a block view"):
        block_rows([views[0].transpose(1, 2)], host, one, one, True, 4)


def test_a_mapped_move_takes_the_small_grid_while_steps_run_and_the_bucket_of_its_size(
    monkeypatch,
):
    """MappedMoves: the grid is MAPPED_PROGRAMS alone, MAPPED_PROGRAMS_BESIDE_STEPS within
    BESIDE_S of a step begun on the device (note_step), the full grid again after; a move of n
    blocks goes in the buffer of the smallest power-of-two bucket from MAPPED_BUCKET holding
    it, [n, ids, rows] padded (the layout a captured graph reads on a GPU; eager here)."""
    from oxygen_torch.triton_kernels import block_rows as br

    launched = []

    def launch(views, host, buf, cap, up, grid):
        launched.append((grid, cap, up, buf.tolist()))

    monkeypatch.setattr(br, "launch", launch)
    monkeypatch.setattr(br, "check", lambda views, host: None)
    monkeypatch.setattr(transfer, "_last_step", {})
    monkeypatch.setattr(transfer, "BESIDE_S", 0.2)
    cpu = torch.device("cpu")
    moves = transfer.MappedMoves([], None, cpu)
    moves.move([5, 9], [3, 0], False)
    transfer.note_step(cpu)
    assert transfer.beside_steps(cpu) and transfer.beside_steps(torch.device("cpu", 0))
    assert not transfer.beside_steps(torch.device("cpu", 1))  # another device's steps
    moves.move(list(range(65)), list(range(100, 165)), True)
    monkeypatch.setattr(transfer, "BESIDE_S", 0.0)  # the step is now older than the window
    assert not transfer.beside_steps(cpu)
    moves.move(list(range(64)), list(range(64)), False)
    moves.move([], [], False)  # nothing: no launch
    bucket, alone, beside = (
        transfer.MAPPED_BUCKET,
        transfer.MAPPED_PROGRAMS,
        transfer.MAPPED_PROGRAMS_BESIDE_STEPS,
    )
    assert [x[:3] for x in launched] == [
        (alone, bucket, False), (beside, 2 * bucket, True), (alone, bucket, False)
    ]  # fmt: skip
    pad = [0] * (bucket - 2)
    assert launched[0][3] == [2, 5, 9, *pad, 3, 0, *pad]
    buf = launched[1][3]
    assert buf[0] == 65 and buf[1:66] == list(range(65)) and buf[129:194] == list(range(100, 165))
    assert moves.counts == {"graphs": 0, "replays": 0, "eager": 3}
    assert beside < alone
    with pytest.raises(ValueError, match="2 blocks for 1 rows"):
        moves.move([1, 2], [1], False)


def test_auto_moves_down_by_the_kernel_beside_steps_on_a_gpu_and_gathers_otherwise(monkeypatch):
    """pool.tier_moves "auto": a move down on a GPU while its steps run goes by the mapped
    kernel; a move up (a step waits for it), a move with no step running and any move on the
    host backend gather; a way named is taken as named, an unknown one is refused."""
    monkeypatch.setattr(transfer, "_last_step", {})
    monkeypatch.setattr(transfer, "BESIDE_S", 3600.0)
    gpu, other, cpu = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    assert transfer.way_of(gpu, up=False) == "gather"  # no step yet
    transfer.note_step(gpu)
    transfer.note_step(cpu)
    assert transfer.way_of(gpu, up=False) == "mapped"
    assert transfer.way_of(gpu, up=True) == "gather"
    assert transfer.way_of(other, up=False) == "gather"  # another GPU's steps
    assert transfer.way_of(cpu, up=False, moves="auto") == "gather"
    for way in ("mapped", "gather"):
        assert transfer.way_of(cpu, up=True, moves=way) == way
        assert transfer.way_of(gpu, up=False, moves=way) == way
    with pytest.raises(ValueError, match="pool.tier_moves: 'engine' is not one of"):
        transfer.way_of(gpu, up=False, moves="engine")


def test_kernel_ways_are_the_directions_way_of_can_send_by_the_mapped_kernel(monkeypatch):
    """transfer.kernel_ways (what warm_up prepares): for each device and pool.tier_moves, the
    directions whose moves way_of sends by the mapped kernel with steps beside them or not; an
    unknown way is refused, naming it."""
    monkeypatch.setattr(transfer, "BESIDE_S", 3600.0)
    for dev in (torch.device("cuda", 0), torch.device("cpu")):
        for way in transfer.TIER_MOVES:
            seen = set()
            for beside in (False, True):
                monkeypatch.setattr(transfer, "_last_step", {})
                if beside:
                    transfer.note_step(dev)
                seen |= {up for up in (False, True) if transfer.way_of(dev, up, way) == "mapped"}
            assert sorted(transfer.kernel_ways(dev, way)) == sorted(seen), (dev, way)
    assert transfer.kernel_ways(torch.device("cuda", 0)) == [False]
    with pytest.raises(ValueError, match="pool.tier_moves: 'both' is not one of"):
        transfer.kernel_ways(torch.device("cuda", 0), "both")


def test_prepare_captures_each_bucket_up_to_the_blocks_once(monkeypatch):
    """MappedMoves.prepare: on a GPU, the graphs of every bucket from MAPPED_BUCKET up to the one
    holding `blocks` for that direction and grid, each captured once (a later prepare or move
    of those keys captures nothing); off a GPU nothing (the kernel runs eagerly there)."""
    from oxygen_torch.triton_kernels import block_rows as br

    monkeypatch.setattr(br, "check", lambda views, host: None)
    cpu = transfer.MappedMoves([], None, torch.device("cpu"))
    assert cpu.prepare(False, 2, 300) == 0 and not cpu._graphs
    moves = transfer.MappedMoves([], None, torch.device("cpu"))
    moves.device = torch.device("cuda")  # (a stand-in: _capture recorded, not run)
    captured = []

    def capture(up, grid, cap):
        captured.append((up, grid, cap))
        return ("graph", "buffer")

    monkeypatch.setattr(moves, "_capture", capture)
    b = transfer.MAPPED_BUCKET
    assert moves.prepare(False, 2, 5 * b) == 4
    assert captured == [(False, 2, b), (False, 2, 2 * b), (False, 2, 4 * b), (False, 2, 8 * b)]
    assert moves.prepare(False, 2, 3 * b) == 0 and moves.prepare(False, 2, 8 * b) == 0
    assert moves.prepare(False, 16, 1) == 1 and moves.prepare(True, 2, b + 1) == 2
    assert captured[4:] == [(False, 16, b), (True, 2, b), (True, 2, 2 * b)]
    assert set(moves._graphs) == set(captured)
