"""The block-table map replay prints under a failure: one row per sequence, the bad entry marked,
the bad block's slots drawn, and the unused slots a failing attention read
(:mod:`pagedkv.cli.replay.reads`)."""

from __future__ import annotations


def block_table_map(tables: dict[int, list[int]], block_size: int, *, seq: int | None = None,
                    position: int | None = None, block: int | None = None, offset: int | None = None,
                    max_entries: int = 24, read: dict[int, list[int]] | None = None, query: bool = False) -> str:
    """An ASCII map of block tables, one row per sequence, with the bad entry marked.

    The entry holding ``position`` of sequence ``seq`` gets ``*``; other entries naming the same
    physical ``block`` (sharing) get ``=``; entries naming a block of ``read`` get ``r``. A last line
    draws the bad block's slots with ``x`` at ``offset`` (``q`` when ``query``: the offset is the failing
    query's own position, not a wrongly read slot), and one line per block of ``read`` draws ``r`` at
    the unused slots the kernel read. Rows longer than ``max_entries`` are cut around the bad entry.

    Args:
        tables: ``{seq: [block ids]}`` (``-1`` padding included as given).
        block_size: slots per block.
        read: ``{block: [offsets]}`` of unused slots whose contents change the failing output
            (:func:`pagedkv.cli.replay.reads.unused_slots_read`).
        query: ``position`` / ``offset`` locate a failing attention query, not a bad slot.

    Returns:
        The map as text (no trailing newline).
    """
    if not tables:
        return "block tables: (none live)"
    read = read or {}
    width = max(len(str(b)) for t in tables.values() for b in (t or [0]))
    bad_entry = position // block_size if position is not None else None
    if block is None and seq in tables and bad_entry is not None and bad_entry < len(tables[seq]):
        block = tables[seq][bad_entry]
    where = f"offset {offset} = slot {block * block_size + offset}" if block is not None and offset is not None else ""
    label = max(len(str(s)) for s in tables)
    rows, marks = [], set()
    for s, table in tables.items():
        cells = []
        for j, b in enumerate(table):
            mark = "*" if (s == seq and j == bad_entry) or (seq is None and b == block) else \
                "=" if block is not None and b == block else "r" if b in read else " "
            marks.add(mark)
            cells.append(f"[{b:>{width}}{mark}]")
        lo = 0
        if len(cells) > max_entries:
            focus = bad_entry if s == seq and bad_entry is not None else 0
            lo = max(0, min(focus - max_entries // 2, len(cells) - max_entries))
            cells = (["..."] if lo else []) + cells[lo:lo + max_entries] + \
                (["..."] if lo + max_entries < len(table) else [])
        located = s == seq and "*" not in "".join(cells)
        rows.append(f"  seq {s:>{label}} | " + " ".join(cells) + ("   < the failing sequence" if located else ""))
    legend = []  # only what the map draws
    if "*" in marks:
        legend.append(("* = the failing query's block" if query else "* = first bad block")
                      + (f", {where}" if where else ""))
    elif seq in tables:
        legend.append("< = the failing sequence, no single block located")
    elif where:
        legend.append(where)
    if "=" in marks:
        legend.append("= = the same block in another table")
    if "r" in marks:
        legend.append("r = a block whose unused slots were read")
    lines = [f"block tables (block_size {block_size}" + "".join(f"; {x}" for x in legend) + "):"] + rows
    glyph = "q" if query else "x"
    if block is not None and offset is not None and block not in read:
        slots = " ".join(glyph if i == offset else "." for i in range(block_size)) if block_size <= 64 else \
            f"... {glyph} at {offset} ..."
        lines.append(f"  block {block}: | {slots} |   ({glyph} = offset {offset}"
                     + (", the failing query's own position)" if query else ")"))
    for b, offsets in read.items():
        here = offset if b == block else None
        cells = ["r" if i in offsets else glyph if i == here else "." for i in range(block_size)]
        slots = " ".join(cells) if block_size <= 64 else f"... r at {offsets[0]}..{offsets[-1]} ..."
        lines.append(f"  block {b}: | {slots} |   (r = an unused slot the kernel read: refilling it changes the "
                     f"output" + (f"; {glyph} = offset {here}, the failing query's own position)" if here is not None
                                  else ")"))
    if block is not None and offset is not None:
        if not any(block in t for t in tables.values()):
            lines.append(f"  block {block} is in no sequence's table: a write touched a slot it does not own")
    return "\n".join(lines)
