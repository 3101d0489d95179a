"""The side channel between a decode and a prefill: frames, the messages, the
handshake, a connection's channel, the prefill's listener, the same-node ready
ring (mailbox) and when release frames go out."""
