"""The OpenAI-compatible HTTP server (`pagedserve serve`): FastAPI routes over
one engine loop thread. Entry point: pagedserve.server.app.serve(args)."""
