"""A worker's side of the router's slabs (:mod:`poolserve.service.contract.slab`).

:func:`take` turns an enveloped request into a view of the slab it is in;
:func:`put_reply` writes a REPLY frame's body into the slab's reply area when
it fits and returns the small REPLY frame that says so (an ERROR, or a reply
too large, goes inline as before).
"""

from __future__ import annotations

from poolserve.service.contract import slab
from poolserve.service.contract.framing import HEADER, Payload, flat
from poolserve.service.poolcore.frames import REPLY, TIMINGS, Frame, frame_parts, reply_frame
from poolserve.service.poolcore.stats import Timings


def take(mapper: slab.Mapper, body: Payload) -> tuple[slab.Ref | None, Payload]:
    """(the slab reference, the request) of a body: an envelope's request is a
    read-only view of its slab; any other body is itself (reference None)."""
    if not slab.is_enveloped(body):
        return None, body
    ref, _ = slab.parse(body)
    return ref, mapper.request(ref)


def put_reply(mapper: slab.Mapper, ref: slab.Ref, seq: int, frame: Frame) -> Frame:
    """The frame to send for ``frame``: a REPLY whose body fits the reply area
    is copied there (the one copy of the reply in the worker) and answered by
    reference; anything else is sent as it is."""
    parts = [flat(part) for part in frame_parts(frame)]
    if not parts or len(parts[0]) < HEADER.size + TIMINGS.size:
        return frame
    length, kind, _ = HEADER.unpack_from(parts[0])
    size = length - TIMINGS.size
    if kind != REPLY or size > ref.reply_capacity:
        return frame
    timings = Timings(*TIMINGS.unpack_from(parts[0], HEADER.size))
    area = mapper.view(ref)[ref.reply_at : ref.reply_at + size]
    pos = 0
    for i, part in enumerate(parts):
        chunk = part[HEADER.size + TIMINGS.size :] if i == 0 else part
        area[pos : pos + len(chunk)] = chunk
        pos += len(chunk)
    area.release()
    return reply_frame(seq, timings, slab.reply_ref(size))
