"""Stop strings on streamed text: the text a client may see now, and where a stop string ends it.

    stops = StopText(["\\n\\n", "END"])
    for piece in tok.decode_stream(request):       # whole characters only (fastpipe.serving.tokenizer)
        out = stops.add(piece)                      # text safe to send now
        send(out)
        if stops.stopped:                           # a stop string was found: it and what follows are dropped
            request.cancel()
            break
    send(stops.finish())                            # the end of the request: what was held back

The text is checked as decoded text, never as tokens: a stop string split over several tokens is found,
and since the pieces come from TextStream (never half a character), a cut never splits one. While the
text ends in a proper prefix of a stop string ("EN" of "END"), that tail is held back: it is sent once
the next piece shows it is not the stop string, or at finish(). The concatenation of add()s and
finish() is the text before the first stop string to appear as the text is made (checked after each
piece, as generation stops there: a longer stop string starting earlier that only later text would
complete does not count), or all of it. The server cuts whole and streamed answers alike, piece by piece.
"""
from __future__ import annotations

from typing import Sequence


class StopText:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.held = ""              # received, not sent: a tail that may begin a stop string
        self.stopped: str | None = None   # the stop string found, once found

    def add(self, piece: str) -> str:
        """The text that may be sent now, `piece` included; "" while held back or once stopped."""
        if self.stopped is not None or not piece:
            return ""
        text = self.held + piece
        if not self.stops:
            self.held = ""
            return text
        # the earliest stop string in the text (a stop string can only start in the new part or in `held`)
        found = min(((i, s) for s in self.stops if (i := text.find(s)) >= 0), default=None)
        if found is not None:
            i, self.stopped = found
            self.held = ""
            return text[:i]
        keep = self._longest_tail_prefix(text)
        out, self.held = text[:len(text) - keep], text[len(text) - keep:]
        return out

    def finish(self) -> str:
        """What was held back (the request ended without completing a stop string)."""
        if self.stopped is not None:
            return ""
        out, self.held = self.held, ""
        return out

    def _longest_tail_prefix(self, text: str) -> int:
        """The length of the longest end of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
