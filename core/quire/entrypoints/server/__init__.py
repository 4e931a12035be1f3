"""The OpenAI-compatible HTTP server behind ``quire serve``.

``async_engine`` runs the engine in its own thread; ``protocol`` turns request bodies into
prompts and ``SamplingParams``; ``responses`` shapes outputs as OpenAI objects; ``errors``
is the error shape; ``app`` wires the routes.
"""
