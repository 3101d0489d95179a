"""The prefill side: PrefillServer (server), its pushes into decodes (pushes) and
the requests it serves through its staging pool (stages)."""
