"""Payloads decoded on first use, for pipelines loaded without checking them (check_payloads=False).

    graphs = LazyGraphs(pipeline, options)    # supertask id -> DecodedGraph, like Checked.graphs
    g = graphs.get(sid)                        # None for a non-fx supertask

One decode per distinct payload text (tensor-parallel replicas share a blob), shared by everything
that asks: validate() puts one in `checked.graphs`, so the fusion pass and binding read the same
decoded graphs. Decoding is data only (fastpipe.payload.decode_payload): nothing from the file runs.
"""
from __future__ import annotations

import threading


class LazyGraphs:
    def __init__(self, pipeline, options=None):
        from fastpipe.options import LoadOptions

        self.p, self.options = pipeline, options or LoadOptions()
        self._by_sid: dict = {}
        self._by_text: dict = {}
        self._lock = threading.Lock()

    def get(self, sid: str, default=None):
        st = self.p.supertasks.get(sid)
        if st is None or st.kind != "fx":
            return default
        return self[sid]

    def __getitem__(self, sid: str):
        with self._lock:
            hit = self._by_sid.get(sid)
            if hit is not None:
                return hit
            from fastpipe.payload import decode_payload
            from fastpipe.validate.sources import payload_text

            text, where = payload_text(self.p, sid, self.options)
            if text not in self._by_text:
                self._by_text[text] = decode_payload(text, where=where)
            self._by_sid[sid] = self._by_text[text]
            return self._by_sid[sid]
