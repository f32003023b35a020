"""Exact-match masking of secret values in log text (issue 38): each occurrence becomes as many `*` as it had bytes.

The mask keeps every byte where it was, so a log read by byte range (`offset`, `X-Next-Offset`) reads the same
positions masked or not, and a range can be masked alone: `read` looks `reach` bytes past each end of it, far enough
to see any value that crosses its edges. A stream is masked the same way (`stream`), holding back `reach` bytes until
the next chunk shows whether they begin a value.

Values shorter than `MIN_CHARS` are not masked: a three-letter value would star out every word it is part of, and
tell where it is by doing so. What a job prints in another form (encoded, split across lines) is not found: this is
a net for accidents, not a guarantee.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

MIN_CHARS = 4


class Masker:
    def __init__(self, values: Iterable[str]) -> None:
        found = {v.encode() for v in values if isinstance(v, str) and len(v) >= MIN_CHARS}
        # The longest first: a value that contains another is starred whole.
        self.values = sorted(found, key=len, reverse=True)
        self.reach = max((len(v) for v in self.values), default=1) - 1

    def __bool__(self) -> bool:
        return bool(self.values)

    def mask(self, data: bytes) -> bytes:
        for value in self.values:
            if value in data:
                data = data.replace(value, b"*" * len(value))
        return data

    def read(self, read: Callable[[int, int], bytes], pos: int, n: int) -> bytes:
        """Bytes [pos, pos + n) of what `read(pos, n)` reads, masked (at most n; fewer at the end)."""
        if not self.values:
            return read(pos, n)
        start = max(0, pos - self.reach)
        wide = read(start, (pos - start) + n + self.reach)
        return self.mask(wide)[pos - start : pos - start + n]

    def stream(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        """The chunks, masked; the same bytes in all, though not cut at the same places."""
        if not self.values:
            yield from chunks
            return
        held = b""
        for chunk in chunks:
            held = self.mask(held + chunk)
            if len(held) > self.reach:
                yield held[: len(held) - self.reach]
                held = held[len(held) - self.reach :]
        if held:
            yield self.mask(held)


NOTHING = Masker(())
