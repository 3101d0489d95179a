"""The decode side: DecodeClient and its PrefillPeers (client), the handle of a
request in flight (inflight), and the pushes the prefill starts into it (pushes)."""
