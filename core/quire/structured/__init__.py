"""Structured outputs: a grammar per request that decides which tokens may come next.

- ``params.py``: ``StructuredOutputsParams``, what a request asks for (vLLM's fields:
  ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``).
- ``backend.py``: the small interface a grammar engine implements (``GrammarBackend``:
  check a request's grammar, start a ``Matcher`` for a sequence) and the token bitmask
  applied to a batch's logits.
- ``llguidance_backend.py``: the one engine built in, llguidance.
"""
