"""``quire serve --grpc-port``: the ``quire.v1.Generation`` gRPC service.

``generation.proto`` is the service; its Python stubs are generated when the package is
built (``stubs.py``, run by ``setup.py``'s ``build_grpc_stubs``) and never committed.
``service.py`` answers the calls through the HTTP app's per-model handlers, so a gRPC
request is parsed, checked and sent to the engine exactly as an HTTP one; ``server.py``
runs the ``grpc.aio`` server (health, reflection, TLS) on the API server's event loop.

This module imports nothing: ``setup.py`` loads ``stubs.py`` by path, without torch.
"""
