"""Exact-match masking of secret values in log text (issue 38): each occurrence becomes as many `*` as it had bytes.

The mask keeps every byte where it was, so a log read by byte range (`offset`, `X-Next-Offset`) reads the same
positions masked or not. A byte is starred when any occurrence of any value covers it (overlapping ones too), so
whether it is depends only on the `reach` bytes on each side: a range can be masked alone (`read` looks that far past
each end of it), and a stream a chunk at a time (`stream` holds back `reach` bytes until the next chunk shows whether
they begin a value), each coming out exactly as in the masked whole.

Values shorter than `MIN_CHARS` are not masked: a three-letter value would star out every word it is part of, and
tell where it is by doing so. What a job prints in another form (encoded, split across lines) is not found: this is
a net for accidents, not a guarantee.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

MIN_CHARS = 4


class Masker:
    def __init__(self, values: Iterable[str]) -> None:
        self.values = sorted({v.encode() for v in values if isinstance(v, str) and len(v) >= MIN_CHARS})
        self.reach = max((len(v) for v in self.values), default=1) - 1

    def __bool__(self) -> bool:
        return bool(self.values)

    def spans(self, data: bytes) -> list[tuple[int, int]]:
        """Where values occur in `data`, overlapping ones included, merged: [start, end) pairs in order. Whether a
        byte is starred depends only on the `reach` bytes on each side of it, which is what lets a range, or a
        stream's chunk, be masked alone and come out as it does in the whole."""
        found = []
        for value in self.values:
            at = data.find(value)
            while at != -1:
                found.append((at, at + len(value)))
                at = data.find(value, at + 1)
        return _merged(found)

    def mask(self, data: bytes) -> bytes:
        return _starred(data, self.spans(data)) if self.values else data

    def read(self, read: Callable[[int, int], bytes], pos: int, n: int) -> bytes:
        """Bytes [pos, pos + n) of what `read(pos, n)` reads, masked (at most n; fewer at the end)."""
        if not self.values:
            return read(pos, n)
        start = max(0, pos - self.reach)
        wide = read(start, (pos - start) + n + self.reach)
        return self.mask(wide)[pos - start : pos - start + n]

    def stream(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        """The chunks, masked; the same bytes in all, though not cut at the same places. The last `reach` bytes are
        held back, unmasked, with what is known to cover them, until the next chunk shows what they begin."""
        if not self.values:
            yield from chunks
            return
        held = b""
        covered: list[tuple[int, int]] = []  # spans of `held` found while its bytes were in an earlier buffer
        for chunk in chunks:
            data = held + chunk
            spans = _merged(covered + self.spans(data))
            cut = len(data) - self.reach
            if cut <= 0:
                held, covered = data, spans
                continue
            yield _starred(data[:cut], [(a, min(b, cut)) for a, b in spans if a < cut])
            held, covered = data[cut:], [(max(a, cut) - cut, b - cut) for a, b in spans if b > cut]
        if held:
            yield _starred(held, covered)


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _starred(data: bytes, spans: list[tuple[int, int]]) -> bytes:
    if not spans:
        return data
    out, at = [], 0
    for a, b in spans:
        out += [data[at:a], b"*" * (b - a)]
        at = b
    out.append(data[at:])
    return b"".join(out)


NOTHING = Masker(())
