"""Where an adapter's matrices go inside pool pages.

Each matrix is a stack of rows (rank rows of `in_features` for A, of `out_features` for B^T).
Matrices are packed into the adapter's pages in order; a matrix that fits the rest of the current
page goes there, one that fits a whole page starts a new page, and only a matrix larger than a
page is split, between whole rows:

    page 0: [A q L0][B q L0][A v L0][B v L0][A q L1] ... (unused tail)
    page 1: [B q L1] ...

so a row never straddles two pages, and almost every matrix is one contiguous run of memory.

`pack` lays an adapter out so in host memory, once per adapter and off the engine thread:
loading it into the pool is then one copy of whole pages.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Chunk:
    page: int  # index into the adapter's own page list
    offset: int  # element offset inside that page
    first_row: int
    num_rows: int


def plan(shapes: list[tuple[int, int]], page_numel: int) -> tuple[int, list[list[Chunk]]]:
    """shapes: (rows, row_width) per matrix -> (pages needed, chunks of each matrix)."""
    page, used = 0, 0
    placements: list[list[Chunk]] = []
    for rows, width in shapes:
        if width > page_numel:
            raise ValueError(f"a row of {width} elements does not fit a page of {page_numel}")
        size = rows * width
        if size > page_numel - used and size <= page_numel and used:
            page, used = page + 1, 0  # start the matrix on a fresh page rather than split it
        chunks, row = [], 0
        while row < rows:
            fit = min(rows - row, (page_numel - used) // width)
            if fit == 0:
                page, used = page + 1, 0
                continue
            chunks.append(Chunk(page, used, row, fit))
            row += fit
            used += fit * width
        placements.append(chunks)
    return page + (1 if used else 0), placements


Matrix = tuple[str, tuple[int, str]]  # ("a" or "b", (layer, module))


def chunk_rows(page: torch.Tensor, chunk: Chunk, width: int) -> torch.Tensor:
    """[num_rows, width]: a view of the chunk's rows in `page`, the page it lies in (1-D)."""
    return page[chunk.offset : chunk.offset + chunk.num_rows * width].view(chunk.num_rows, width)


@dataclass(frozen=True)
class PageLayout:
    """Where every row of an adapter's matrices lies in its pages: row i of a matrix at element
    `*_within[layer, module, i]` of the adapter's page `*_page[layer, module, i]` (an index into
    the pages it is given when loaded). Depends on the matrices' shapes only, so adapters of one
    shape share one."""

    num_pages: int
    matrices: dict[Matrix, tuple[int, list[Chunk]]]  # (row width, its chunks) of each matrix
    a_page: torch.Tensor  # [num_layers, num_modules, rank] int64
    a_within: torch.Tensor
    b_page: torch.Tensor
    b_within: torch.Tensor
    has_module: torch.Tensor  # [num_layers, num_modules] bool

    @classmethod
    def of(
        cls,
        shapes: list[tuple[Matrix, tuple[int, int]]],
        page_numel: int,
        num_layers: int,
        modules: tuple[str, ...],
    ) -> PageLayout:
        """shapes: (matrix, (rows, row width)) of every matrix, in the order they are packed."""
        num_pages, placements = plan([shape for _, shape in shapes], page_numel)
        rank = shapes[0][1][0]
        # kind -> [page, element within it] of each row: [2, num_layers, num_modules, rank]
        where = {k: torch.zeros(2, num_layers, len(modules), rank, dtype=torch.long) for k in "ab"}
        has_module = torch.zeros(num_layers, len(modules), dtype=torch.bool)
        matrices: dict[Matrix, tuple[int, list[Chunk]]] = {}
        for ((kind, (layer, module)), (_, width)), chunks in zip(shapes, placements, strict=True):
            m = modules.index(module)
            for c in chunks:
                rows = slice(c.first_row, c.first_row + c.num_rows)
                where[kind][0, layer, m, rows] = c.page
                where[kind][1, layer, m, rows] = c.offset + width * torch.arange(c.num_rows)
            matrices[(kind, (layer, module))] = (width, chunks)
            has_module[layer, m] = True
        return cls(
            num_pages=num_pages,
            matrices=matrices,
            a_page=where["a"][0],
            a_within=where["a"][1],
            b_page=where["b"][0],
            b_within=where["b"][1],
            has_module=has_module,
        )


@dataclass(frozen=True)
class PackedAdapter:
    """An adapter's matrices as its pages hold them, in host memory at the pool's dtype."""

    image: torch.Tensor  # [num_pages, page_numel]
    layout: PageLayout

    @property
    def num_pages(self) -> int:
        return self.layout.num_pages

    def views(self) -> dict[Matrix, torch.Tensor]:
        """Each matrix that lies whole in one page, as a view of the image."""
        return {
            name: chunk_rows(self.image[chunks[0].page], chunks[0], width)
            for name, (width, chunks) in self.layout.matrices.items()
            if len(chunks) == 1
        }

    def matrices(self) -> dict[Matrix, torch.Tensor]:
        """Every matrix: a view of the image, or a copy for one split between pages."""
        split = {
            name: torch.cat([chunk_rows(self.image[c.page], c, width) for c in chunks])
            for name, (width, chunks) in self.layout.matrices.items()
            if len(chunks) > 1
        }
        return self.views() | split


Shapes = tuple[tuple[Matrix, tuple[int, int]], ...]


def layout_for(
    a: dict[tuple[int, str], torch.Tensor],
    b: dict[tuple[int, str], torch.Tensor],
    page_numel: int,
    num_layers: int,
    modules: tuple[str, ...],
) -> PageLayout:
    """The PageLayout of an adapter's matrices A [rank, in] and B^T [rank, out] by (layer,
    module): A then B^T of each (layer, module), layer by layer and in the forward pass's order
    of modules, so that the rows one LoRA call reads for a token (q, k and v; gate and up) lie
    together, and so do the calls that follow. One object for every adapter of one shape."""
    keys = sorted(a, key=lambda k: (k[0], modules.index(k[1])))
    shapes = tuple(
        (matrix, tuple(table[k].shape))
        for k in keys
        for matrix, table in ((("a", k), a), (("b", k), b))
    )
    return _layout_of(shapes, page_numel, num_layers, modules)


@functools.lru_cache(maxsize=256)
def _layout_of(shapes: Shapes, page_numel: int, num_layers: int, modules: tuple[str, ...]):
    """Bounded: tenants' adapters may each target other layers."""
    return PageLayout.of(list(shapes), page_numel, num_layers, modules)


def pack(
    matrices: dict[Matrix, torch.Tensor], layout: PageLayout, page_numel: int, dtype: torch.dtype
) -> PackedAdapter:
    """Copy each matrix to its places in a fresh image of the layout's pages."""
    image = torch.zeros(layout.num_pages, page_numel, dtype=dtype)
    for name, (width, chunks) in layout.matrices.items():
        for c in chunks:
            rows = matrices[name][c.first_row : c.first_row + c.num_rows]
            chunk_rows(image[c.page], c, width).copy_(rows)
    return PackedAdapter(image=image, layout=layout)
