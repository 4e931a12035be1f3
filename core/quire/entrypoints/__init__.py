"""Where users come in: ``llm.py`` (the offline ``LLM``), ``server/`` (``quire serve``:
the OpenAI- and Anthropic-compatible HTTP server), ``cli/`` (the ``quire`` command)."""
