"""Where an adapter's matrices go inside pool pages.

Each matrix is a stack of rows (rank rows of `in_features` for A, of `out_features` for B^T).
Matrices are packed into the adapter's pages in order; a matrix that fits the rest of the current
page goes there, one that fits a whole page starts a new page, and only a matrix larger than a
page is split, between whole rows:

    page 0: [A q L0][B q L0][A v L0][B v L0][A q L1] ... (unused tail)
    page 1: [B q L1] ...

so a row never straddles two pages, and almost every matrix is one contiguous run of memory.
"""

from __future__ import annotations

from dataclasses import dataclass


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
