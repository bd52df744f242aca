"""The ggml-alloc emulation: ggml_dyn_tallocr's block choices, and gallocr's liveness and
in-place rules on hand-built graphs whose answers follow from ggml-alloc.c by hand."""

from __future__ import annotations

import pytest

from llamir.sched.alloc import Address, AllocError, ATensor, DynAllocator, GraphAllocator
from llamir.sched.compute_buffers import AllocCheckError, AllocGraph, check_allocation


def test_alignment_and_tail_growth():
    a = DynAllocator(alignment=32)
    assert a.alloc(10) == Address(0, 0)
    assert a.alloc(33) == Address(0, 32)  # 10 -> 32 bytes; 33 -> 64
    assert a.chunk_sizes() == [96]


def test_best_fit_prefers_the_smallest_inner_block_and_later_on_ties():
    a = DynAllocator(alignment=1)
    x, y, z, w = (a.alloc(n) for n in (100, 10, 50, 10))
    a.alloc(5)  # keeps the tail away from w
    a.free(x, 100)
    a.free(z, 50)
    assert a.alloc(40) == Address(0, z.offset)  # 50 fits better than 100
    b = DynAllocator(alignment=1)
    p, _, q, _ = (b.alloc(n) for n in (10, 5, 10, 5))
    b.free(p, 10)
    b.free(q, 10)
    assert b.alloc(10) == Address(0, q.offset)  # two equal blocks: ggml's `<=` takes the later


def test_free_merges_neighbours():
    a = DynAllocator(alignment=1)
    blocks = [a.alloc(10) for _ in range(3)]
    a.alloc(1)
    for b in (blocks[0], blocks[2], blocks[1]):
        a.free(b, 10)
    assert a.chunks[0].blocks[0] == [0, 30]


def test_max_chunk_size_opens_new_chunks():
    a = DynAllocator(alignment=1, max_chunk_size=100)
    assert a.alloc(80) == Address(0, 0)
    assert a.alloc(80) == Address(1, 0)
    assert a.alloc(150) == Address(2, 0)  # a tensor larger than a chunk gets its own
    assert a.chunk_sizes() == [80, 80, 150]


def test_out_of_free_blocks_is_an_error():
    a = DynAllocator(alignment=1)
    addrs = [a.alloc(1) for _ in range(600)]
    with pytest.raises(AllocError, match="out of free blocks"):
        for addr in addrs[:-1:2]:
            a.free(addr, 1)


class Buft:
    alignment, max_size = 16, None

    def alloc_size(self, n):
        return n


def chain(n_nodes: int, size: int = 64, inplace: bool = True):
    """x -> n1 -> n2 -> ... (each node reads the previous one)."""
    x = ATensor("x", size, ("f32", (16,)), is_input=True)
    nodes, prev = [], x
    for i in range(n_nodes):
        t = ATensor(f"n{i}", size, ("f32", (16,)), srcs=[prev], can_inplace=inplace)
        nodes.append(t)
        prev = t
    nodes[-1].is_output = True
    return AllocGraph([x], [0], nodes, [0] * n_nodes, {})


def allocate(ag):
    galloc = GraphAllocator([Buft()])
    allocation = galloc.reserve(ag.leafs, ag.leaf_ids, ag.nodes, ag.node_ids)
    return galloc, allocation


def test_inplace_chain_reuses_one_block_but_not_the_input():
    ag = chain(4)
    galloc, allocation = allocate(ag)
    # n0 can reuse x (owned, one child); every later node reuses its parent
    assert {allocation.addresses[id(t)][1] for t in ag.nodes} == {Address(0, 0)}
    assert allocation.buffer_size(0) == 64
    assert check_allocation(ag, allocation, galloc.allocs) == 5


def test_without_inplace_two_blocks_alternate():
    ag = chain(4, inplace=False)
    galloc, allocation = allocate(ag)
    offsets = [allocation.addresses[id(t)][1].offset for t in ag.nodes]
    assert offsets == [64, 0, 64, 0] and allocation.buffer_size(0) == 128
    check_allocation(ag, allocation, galloc.allocs)


def test_outputs_are_never_freed_or_reused():
    ag = chain(3, inplace=False)
    ag.nodes[0].is_output = True
    galloc, allocation = allocate(ag)
    first = allocation.addresses[id(ag.nodes[0])][1]
    assert all(allocation.addresses[id(t)][1] != first for t in ag.nodes[1:])
    check_allocation(ag, allocation, galloc.allocs)


def test_views_keep_their_source_alive():
    x = ATensor("x", 64, ("f32", (16,)), is_input=True)
    a = ATensor("a", 64, ("f32", (16,)), srcs=[x])
    v = ATensor("v", 64, ("f32", (16,), "view"), srcs=[a], view_src=a)
    b = ATensor("b", 64, ("f32", (16,)), srcs=[x])
    c = ATensor("c", 64, ("f32", (16,)), srcs=[v, b], is_output=True)
    ag = AllocGraph([x], [0], [a, v, b, c], [0, 0, 0, 0], {})
    galloc, allocation = allocate(ag)
    assert allocation.addresses[id(b)][1] != allocation.addresses[id(a)][1]
    check_allocation(ag, allocation, galloc.allocs)


def test_checker_rejects_overlapping_live_tensors():
    ag = chain(3, inplace=False)
    galloc, allocation = allocate(ag)
    b, _, size = allocation.addresses[id(ag.nodes[1])]
    allocation.addresses[id(ag.nodes[1])] = (b, allocation.addresses[id(ag.nodes[0])][1], size)
    with pytest.raises(AllocCheckError, match=r"n0 \[64, 128\) live 0..1 overlaps n1 \[64, 128\) live 1..2"):
        check_allocation(ag, allocation, galloc.allocs)
