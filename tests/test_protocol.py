"""The agent protocol's framing, without a guest: round trips and resynchronisation."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rewind.guest.protocol import MAGIC, Decoder, encode

headers = st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=20)), max_size=4)
frames = st.lists(st.tuples(headers, st.binary(max_size=3000)), min_size=1, max_size=8)


@given(frames, st.integers(min_value=1, max_value=500))
def test_frames_survive_any_split(items, step) -> None:
    wire = b"".join(encode(h, p) for h, p in items)
    dec = Decoder()
    out = []
    for at in range(0, len(wire), step):
        dec.feed(wire[at : at + step])
        while (f := dec.next()) is not None:
            out.append(f)
    assert out == items


@given(st.binary(max_size=2000), frames)
def test_decoder_resynchronises_after_garbage(garbage, items) -> None:
    """A reader that starts mid-stream (its peer died mid-frame) finds the next whole frame."""
    dec = Decoder()
    dec.feed(garbage.replace(MAGIC, b"") + b"".join(encode(h, p) for h, p in items))
    out = []
    while (f := dec.next()) is not None:
        out.append(f)
    assert out[-len(items):] == items


def test_truncated_frame_waits_for_the_rest() -> None:
    wire = encode({"t": "data"}, b"x" * 100)
    dec = Decoder()
    dec.feed(wire[:-1])
    assert dec.next() is None
    dec.feed(wire[-1:])
    assert dec.next() == ({"t": "data"}, b"x" * 100)
