"""The graph allocator, emulating ggml-alloc (ggml/src/ggml-alloc.c).

DynAllocator is ggml_dyn_tallocr: chunks of free blocks sorted by offset, best fit among the
inner blocks, then the chunk tails (least growth or least slack), aligned sizes, merging on
free. GraphAllocator is ggml_gallocr: one DynAllocator per distinct buffer type, leaves first,
inputs before anything else, liveness by children and views, in-place reuse for the ops ggml
allows, graph outputs never freed. Offsets are virtual; `reserve` returns the peak per buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

MAX_CHUNKS = 16  # GGML_VBUFFER_MAX_CHUNKS
MAX_FREE_BLOCKS = 256
SIZE_MAX_HALF = (1 << 63) - 1


class AllocError(RuntimeError):
    """The allocator ran out of something ggml would abort on; the message says what."""


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class Address:
    chunk: int
    offset: int


@dataclass
class _Chunk:
    blocks: list[list[int]]  # [offset, size], sorted by offset; the last one is the open tail
    max_size: int = 0


class DynAllocator:
    """ggml_dyn_tallocr over one buffer type."""

    def __init__(self, alignment: int, max_chunk_size: int | None = None):
        self.alignment = alignment
        self.max_chunk_size = min(max_chunk_size or SIZE_MAX_HALF, SIZE_MAX_HALF)
        self.chunks: list[_Chunk] = []

    def reset(self) -> None:
        self.chunks = []

    def _new_chunk(self, min_size: int) -> int:
        if len(self.chunks) >= MAX_CHUNKS:
            return -1
        size = SIZE_MAX_HALF if len(self.chunks) == MAX_CHUNKS - 1 else max(min_size, self.max_chunk_size)
        self.chunks.append(_Chunk([[0, size]]))
        return len(self.chunks) - 1

    def alloc(self, size: int) -> Address:
        size = align_up(size, self.alignment)
        best_chunk, best_block = -1, -1
        for c, chunk in enumerate(self.chunks):  # best fit among inner blocks; ties go to the later block
            best_size = None
            for i, (_, bsize) in enumerate(chunk.blocks[:-1]):
                if bsize >= size and (best_size is None or bsize <= best_size):
                    best_chunk, best_block, best_size = c, i, bsize
        if best_block == -1:  # the tails: least growth while all grow, then least slack
            best_reuse = None
            for c, chunk in enumerate(self.chunks):
                if not chunk.blocks:
                    continue
                offset, bsize = chunk.blocks[-1]
                reuse = chunk.max_size - offset - size
                better_reuse = (best_reuse is None or best_reuse < 0) and (
                    best_reuse is None or reuse > best_reuse
                )
                better_fit = reuse >= 0 and best_reuse is not None and reuse < best_reuse
                if bsize >= size and (better_reuse or better_fit):
                    best_chunk, best_block, best_reuse = c, len(chunk.blocks) - 1, reuse
        if best_block == -1:
            best_chunk, best_block = self._new_chunk(size), 0
        if best_chunk == -1:
            raise AllocError(f"graph allocation: failed to reserve {size} bytes (out of chunks)")
        chunk = self.chunks[best_chunk]
        block = chunk.blocks[best_block]
        addr = Address(best_chunk, block[0])
        block[0] += size
        block[1] -= size
        if block[1] == 0:
            del chunk.blocks[best_block]
        chunk.max_size = max(chunk.max_size, addr.offset + size)
        return addr

    def free(self, addr: Address, size: int) -> None:
        size = align_up(size, self.alignment)
        blocks = self.chunks[addr.chunk].blocks
        for i, block in enumerate(blocks):
            if block[0] + block[1] == addr.offset:  # the freed range follows this block
                block[1] += size
                if i + 1 < len(blocks) and block[0] + block[1] == blocks[i + 1][0]:
                    block[1] += blocks[i + 1][1]
                    del blocks[i + 1]
                return
            if addr.offset + size == block[0]:  # ... or precedes it
                block[0] = addr.offset
                block[1] += size
                if i > 0 and blocks[i - 1][0] + blocks[i - 1][1] == block[0]:
                    blocks[i - 1][1] += block[1]
                    del blocks[i]
                return
        if len(blocks) >= MAX_FREE_BLOCKS:
            raise AllocError("graph allocation: out of free blocks")
        pos = 0
        while pos < len(blocks) and blocks[pos][0] < addr.offset:
            pos += 1
        blocks.insert(pos, [addr.offset, size])

    def chunk_sizes(self) -> list[int]:
        return [c.max_size for c in self.chunks]


@dataclass(eq=False)
class ATensor:
    """One tensor as the allocator sees it. `view_src` is the root it aliases; `external` memory
    (weights, KV cache) is never allocated; `dep` marks the scheduler's dependency nodes (ggml's
    GGML_OP_NONE views that only keep their source alive)."""

    name: str
    nbytes: int
    layout: tuple = ()
    srcs: list[ATensor] = field(default_factory=list)
    view_src: ATensor | None = None
    can_inplace: bool = False
    external: bool = False
    is_input: bool = False
    is_output: bool = False
    dep: bool = False
    key: object = None


@dataclass
class _Record:
    n_children: int = 0
    n_views: int = 0
    buffer_id: int = -1
    addr: Address | None = None
    allocated: bool = False


@dataclass
class Allocation:
    """Where every owned tensor went, and each buffer's chunk peaks (bytes)."""

    addresses: dict[int, tuple[int, Address, int]]  # id(ATensor) -> (buffer id, address, size)
    inplace: dict[int, ATensor]  # id(child) -> the parent whose memory it took
    chunk_sizes: list[list[int]]

    def buffer_size(self, buffer_id: int) -> int:
        return sum(self.chunk_sizes[buffer_id])


class GraphAllocator:
    """ggml_gallocr over buffer types given as (alignment, max_size, alloc_size) objects."""

    def __init__(self, bufts: Sequence):
        self.bufts = list(bufts)
        self.allocs: list[DynAllocator] = []
        seen: dict[int, DynAllocator] = {}
        for buft in self.bufts:  # backends with the same buffer type share one allocator
            if id(buft) not in seen:
                seen[id(buft)] = DynAllocator(buft.alignment, buft.max_size)
            self.allocs.append(seen[id(buft)])

    def _alloc_size(self, t: ATensor, buffer_id: int) -> int:
        return self.bufts[buffer_id].alloc_size(t.nbytes)

    def reserve(
        self,
        leafs: Sequence[ATensor],
        leaf_ids: Sequence[int],
        nodes: Sequence[ATensor],
        node_ids: Sequence[int],
    ) -> Allocation:
        """ggml_gallocr_reserve_n: run the allocation on the graph and measure each buffer."""
        for a in {id(a): a for a in self.allocs}.values():
            a.reset()
        self.rec: dict[int, _Record] = {}
        self.addresses: dict[int, tuple[int, Address, int]] = {}
        self.inplace: dict[int, ATensor] = {}
        self._alloc_graph(leafs, leaf_ids, nodes, node_ids)
        sizes = [a.chunk_sizes() for a in self.allocs]
        return Allocation(self.addresses, self.inplace, sizes)

    def _r(self, t: ATensor) -> _Record:
        r = self.rec.get(id(t))
        if r is None:
            r = self.rec[id(t)] = _Record()
        return r

    def _allocate(self, t: ATensor, buffer_id: int) -> None:
        r = self._r(t)
        if t.external or r.allocated or r.addr is not None or t.view_src is not None:
            return
        r.allocated = True
        if t.can_inplace and self._try_inplace(t, r):
            return
        size = self._alloc_size(t, buffer_id)
        r.buffer_id, r.addr = buffer_id, self.allocs[buffer_id].alloc(size)
        self.addresses[id(t)] = (buffer_id, r.addr, size)

    def _try_inplace(self, t: ATensor, r: _Record) -> bool:
        """allocate_node's in-place rule: take the memory of an owned parent of the same layout
        whose only remaining child is `t`. (ggml's branch for view parents never fires: views
        are never owned by the allocator, so it is left out.)"""
        for parent in t.srcs:
            p = self._r(parent)
            if (
                not p.allocated
                or parent.is_output
                or (parent.view_src is not None and parent.view_src.is_output)
            ):
                continue
            if parent.layout != t.layout or p.n_children != 1 or p.n_views != 0:
                continue
            r.buffer_id, r.addr = p.buffer_id, p.addr
            p.allocated = False
            self.addresses[id(t)] = (p.buffer_id, p.addr, self._alloc_size(t, p.buffer_id))
            self.inplace[id(t)] = parent
            self._free_extra(t, parent, p.buffer_id, p.addr)
            return True
        return False

    def _free_extra(self, t: ATensor, parent: ATensor, buffer_id: int, addr: Address) -> None:
        alloc = self.allocs[buffer_id]
        parent_size = align_up(self._alloc_size(parent, buffer_id), alloc.alignment)
        node_size = align_up(self._alloc_size(t, buffer_id), alloc.alignment)
        if parent_size > node_size:
            alloc.free(Address(addr.chunk, addr.offset + node_size), parent_size - node_size)

    def _free(self, t: ATensor) -> None:
        if t.is_output:
            return
        r = self._r(t)
        self.allocs[r.buffer_id].free(r.addr, self._alloc_size(t, r.buffer_id))
        r.allocated = False

    def _alloc_graph(self, leafs, leaf_ids, nodes, node_ids) -> None:
        for leaf, b in zip(leafs, leaf_ids, strict=True):
            self._allocate(leaf, b)
        for node, b in zip(nodes, node_ids, strict=True):  # count children and views; inputs first
            if node.view_src is not None and not node.dep:
                self._r(node.view_src).n_views += 1
            if node.is_input:
                self._allocate(node, b)
            for src in node.srcs:
                self._r(src).n_children += 1
                if src.is_input:
                    self._allocate(src, b)
        for node, b in zip(nodes, node_ids, strict=True):
            for parent in node.srcs:
                self._allocate(parent, b)
            self._allocate(node, b)
            for parent in node.srcs:
                p = self._r(parent)
                p.n_children -= 1
                if p.n_children != 0 or p.n_views != 0:
                    continue
                if parent.view_src is not None:
                    vs = self._r(parent.view_src)
                    vs.n_views -= 1
                    if vs.n_views == 0 and vs.n_children == 0 and vs.allocated:
                        self._free(parent.view_src)
                elif p.allocated:
                    self._free(parent)
