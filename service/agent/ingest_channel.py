"""How the forwarder hands one batch to the control plane: on the group's stream, or by POST.

The stream is a WebSocket kept open from batch to batch (``protocol/ingest.py``): one message,
one answer. When it cannot be opened, the batch is POSTed instead and the stream is tried again
:data:`STREAM_RETRY_S` later: a control plane (or a proxy) without WebSockets still gets every
batch, and a refused handshake (a wrong token, a group beyond ``--max-groups``) gets its reason
from the POST's answer, which carries one. Any other failure on an open stream (it closed, no
answer in time) closes it; the forwarder backs off and sends the same batch again (its events
keep their ids, so a batch that was stored after all is stored once).
"""

from __future__ import annotations

import time
from contextlib import ExitStack

import httpx
from websockets.exceptions import InvalidStatus, WebSocketException
from websockets.sync.client import ClientConnection, connect

from protocol.ingest import IngestBatch, IngestResult, StreamAnswer, ingest_path, ingest_stream_path

STREAM_RETRY_S = 60.0
"""After a refused handshake, batches go by POST this long before the stream is tried again."""

Answer = tuple[int | None, str, IngestResult | None]
"""The status (None: no usable answer), why (for any other status than 2xx), the result (2xx)."""


class IngestChannel:
    def __init__(self, control_plane: str, group: int, token: str, client: httpx.Client, timeout_s: float):
        """``client`` carries the token already (the forwarder's, shared with its registrar)."""
        self.control_plane = control_plane
        self.group = group
        self.token = token
        self.client = client
        self.timeout_s = timeout_s
        self._stream: ClientConnection | None = None
        self._open = ExitStack()
        self._post_until = 0.0

    def send(self, batch: IngestBatch) -> Answer:
        if time.monotonic() >= self._post_until:
            try:
                return self._on_stream(batch)
            except InvalidStatus as err:  # refused, or no stream here: the POST says why
                self._post_until = time.monotonic() + STREAM_RETRY_S
                if err.response.status_code >= 500:
                    return err.response.status_code, f"the stream's handshake got {err.response.status_code}", None
            except (OSError, TimeoutError, WebSocketException, ValueError) as err:  # ValueError: no answer
                self.close()
                return None, str(err) or type(err).__name__, None
        return self._post(batch)

    def _on_stream(self, batch: IngestBatch) -> Answer:
        if self._stream is None:
            url = self.control_plane.replace("http", "ws", 1) + ingest_stream_path(self.group)
            self._stream = self._open.enter_context(connect(
                url, additional_headers={"Authorization": f"Bearer {self.token}"}, open_timeout=self.timeout_s,
                close_timeout=1, max_size=None, compression=None))  # small JSON: deflate costs more than it saves
        self._stream.send(batch.model_dump_json())
        answer = StreamAnswer.model_validate_json(self._stream.recv(timeout=self.timeout_s))
        return answer.status, answer.detail or "", answer.result

    def _post(self, batch: IngestBatch) -> Answer:
        try:
            response = self.client.post(f"{self.control_plane}{ingest_path(self.group)}", json=batch.model_dump(mode="json"))
        except httpx.HTTPError as err:
            return None, str(err) or type(err).__name__, None
        if response.status_code >= 300:
            try:
                detail = str(response.json().get("detail"))
            except (ValueError, AttributeError):
                detail = response.text[:200]
            return response.status_code, detail, None
        try:
            return response.status_code, "", IngestResult.model_validate(response.json())
        except ValueError as err:
            return None, f"an answer that is no ingest result: {err}", None

    def close(self) -> None:
        self._stream = None
        self._open.close()
